"""`rbtool report`: one self-contained HTML page (it opens offline in headless Chromium and its
images decode), or Markdown with its images beside it."""

from __future__ import annotations

import base64
import html.parser
import io
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES, assert_one_error, make_traj, run, run_json

from rbtool.ops.checkpoint import build_from_files

CHROMIUM = Path("/usr/bin/chromium")
# Anything a page could fetch: a scheme-relative or absolute URL, CSS url(), @import.
EXTERNAL = re.compile(r"(https?:|ftp:|//[\w.-]+\.\w|url\(|@import|<script|<link|<iframe)", re.I)
PLOTS = ["returns", "episode-lengths", "episode-returns", "policy-versions", "draw-spread"]


class Images(html.parser.HTMLParser):
    """Every <img> of a page: (data-name, src)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            named = dict(attrs)
            self.found.append((named.get("data-name") or "", named.get("src") or ""))


def images_of(page: str) -> list[tuple[str, str]]:
    parser = Images()
    parser.feed(page)
    return parser.found


def report(path: Path | str, out: Path, *args: str) -> dict[str, Any]:
    return run_json("report", path, "--out", out, "--sample-draws", "200", "-j", "1", *args)


def test_html_holds_every_section_inline_and_names_no_url(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    doc = report(FIXTURES / "nested_obs_pt", out)
    page = out.read_text()
    assert doc["format"] == "html" and doc["bytes"] == len(page.encode()) and doc["images"] == []
    assert doc["sections"] == ["summary", "fields", "plots", "frames"]
    assert doc["trajectories_shown"] == [0, 2, 3]
    assert EXTERNAL.search(page) is None
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    names = [name for name, _ in images_of(page)]
    assert names == [*PLOTS, "frames-0", "frames-2", "frames-3"]
    from PIL import Image

    for _, src in images_of(page):
        assert src.startswith("data:image/png;base64,")
        Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).verify()
    for words in ("<th>trajectories</th><td>4</td>", "<td>curr_obs.main_images</td>", "total variation"):
        assert words in page


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason="Chromium is not installed at /usr/bin/chromium")
def test_the_page_renders_offline_in_headless_chromium(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    report(FIXTURES / "nested_obs_pt", out)
    # The probe records each image's decoded width into the DOM; the page's own policy allows
    # no script, so the probe's copy allows inline scripts and nothing else more.
    page = out.read_text().replace("default-src 'none'", "default-src 'none'; script-src 'unsafe-inline'")
    probe = (
        "<script>window.addEventListener('load', () => { for (const i of document.images) "
        "i.setAttribute('data-width', String(i.naturalWidth)); "
        "document.body.setAttribute('data-loaded', 'yes'); });</script>"
    )
    copy = tmp_path / "probe.html"
    copy.write_text(page.replace("</body>", probe + "</body>"))
    argv = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--proxy-server=127.0.0.1:9",
        "--virtual-time-budget=5000",
        "--dump-dom",
        copy.as_uri(),
    ]
    dom = subprocess.run(argv, capture_output=True, text=True, timeout=120).stdout
    assert 'data-loaded="yes"' in dom, dom[-2000:]
    widths = [int(w) for w in re.findall(r'data-width="(\d+)"', dom)]
    assert len(widths) == len(PLOTS) + 3 and all(w > 0 for w in widths)

    shot = tmp_path / "shot.png"
    argv = [*argv[:-2], "--window-size=1000,1400", f"--screenshot={shot}", out.as_uri()]
    subprocess.run(argv, capture_output=True, timeout=120, check=True)
    from PIL import Image

    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, plots and frames, not a blank page


def test_markdown_writes_its_images_beside_it(tmp_path: Path) -> None:
    out = tmp_path / "pr" / "ranks.md"
    doc = report(FIXTURES / "ranks", out, "--markdown")
    text = out.read_text()
    assert doc["format"] == "markdown" and doc["trajectories_shown"] == [0, 3, 6]
    written = [Path(p).name for p in doc["images"]]
    assert written == [f"ranks-{n}.png" for n in PLOTS] + [
        "ranks-frames-0.png",
        "ranks-frames-3.png",
        "ranks-frames-6.png",
    ]
    for name in written:
        assert f"]({name})" in text and (out.parent / name).stat().st_size > 0
    assert "| trajectories | 7 |" in text and "| rank directories | 2 |" in text
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([*written, "ranks.md"])


def test_existing_files_need_force_and_nothing_is_written_without_it(tmp_path: Path) -> None:
    out = tmp_path / "r.md"
    (tmp_path / "r-returns.png").write_bytes(b"keep")
    result = run("report", FIXTURES / "nested_obs_pt", "--out", out, "--markdown", "--sample-draws", "10")
    assert_one_error(result, 1)
    assert "r-returns.png" in result.stderr and "--force" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r-returns.png"]
    report(FIXTURES / "nested_obs_pt", out, "--markdown", "--force")
    assert (tmp_path / "r-returns.png").read_bytes() != b"keep"
    again = run("report", FIXTURES / "nested_obs_pt", "--out", out)
    assert_one_error(again, 1)
    inside = run("report", FIXTURES / "nested_obs_pt", "--out", FIXTURES / "nested_obs_pt" / "r.html")
    assert inside.exit_code == 2 and "overlaps the input" in inside.stderr


def test_without_images_or_rewards_the_report_says_so(tmp_path: Path) -> None:
    bare = make_traj(t=4, b=2, seed=1)
    del bare["curr_obs"], bare["next_obs"]
    files = tmp_path / "files"
    files.mkdir()
    torch.save(bare, files / "t0.pt")
    build_from_files([files / "t0.pt"], tmp_path / "ckpt", window=0)
    out = tmp_path / "r.html"
    result = run("report", tmp_path / "ckpt", "--out", out, "--sample-draws", "10", "-j", "1")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(f"wrote {out} (") and "frames of trajectories 0" in result.stdout
    page = out.read_text()
    assert "No trajectory shown has an image field." in page
    assert [n for n, _ in images_of(page)] == PLOTS


def test_a_url_reports_under_its_url(bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(tmp_path / "cache"))
    url = f"{bucket}/ckpt"
    run_json("checkpoint", "save", FIXTURES / "nested_obs_pt", url, "--window", "0")
    doc = report(url, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert doc["path"] == url and f'<div class="path">{url}</div>' in page
    assert doc["trajectories_shown"] == [0, 2, 3]
    assert [n for n, _ in images_of(page)] == [*PLOTS, "frames-0", "frames-2", "frames-3"]


def test_a_missing_extra_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    result = run("report", FIXTURES / "nested_obs_pt", "--out", tmp_path / "r.html", "-j", "1")
    assert_one_error(result, 2)
    assert "Plots need matplotlib" in result.stderr and "pip install 'rbtool[view]'" in result.stderr
    assert list(tmp_path.iterdir()) == []
