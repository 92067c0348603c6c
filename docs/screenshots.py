"""Regenerate the screenshots in docs/images/ from a bundled fixture, one function per page.

    python docs/screenshots.py            # every page
    python docs/screenshots.py report     # one page

Each page is written with rbtool from fixtures/rlinf/ and photographed by headless Chromium
(/usr/bin/chromium, or $CHROMIUM) with the network blocked, so a screenshot shows exactly what
a reader opening the file offline sees. Needs rbtool[view].
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
FIXTURE = "fixtures/rlinf/nested_obs_pt"  # relative to ROOT, as the page shows it
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def rbtool(*args: str | Path) -> None:
    """Run the command line of this checkout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", "rbtool", *map(str, args)],
        check=True,
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )


def photograph(url: str, out: Path, width: int, height: int) -> None:
    """A screenshot of `url` by headless Chromium, offline (names resolve nowhere, no proxy answers)
    but for 127.0.0.1."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                # offline but for 127.0.0.1, where `rbtool view` serves
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                "--proxy-server=127.0.0.1:9",
                "--proxy-bypass-list=127.0.0.1",
                f"--window-size={width},{height}",
                "--virtual-time-budget=5000",
                f"--screenshot={out}",
                url,
            ],
            check=True,
            capture_output=True,
        )
    print(f"wrote {out.relative_to(ROOT)}")


def report(work: Path) -> None:
    """docs/images/report.png: `rbtool report` of the nested-observation fixture."""
    page = work / "report.html"
    rbtool("report", FIXTURE, "--out", page, "--sample-draws", "2000", "-j", "1", "-q")
    photograph(page.as_uri(), IMAGES / "report.png", 1100, 2500)


VIEW_FIXTURE = "fixtures/rlinf/varying_shapes_pt/ckpt"  # trajectory 5 is T=5, B=2, two cameras


def view(work: Path) -> None:
    """docs/images/viewer.png: `rbtool view` at trajectory 5 of the varying-shapes fixture.

    The viewer runs as a user starts it (`--no-open --port 0`, the URL read from what it
    prints) and is stopped with Ctrl-C once photographed.
    """
    import signal

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [sys.executable, "-m", "rbtool", "view", VIEW_FIXTURE, "--no-open", "--port", "0", "-q"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        url = server.stdout.readline().strip()  # type: ignore[union-attr]
        if not url.startswith("http://127.0.0.1:"):
            raise SystemExit(f"rbtool view printed no URL (got {url!r})")
        photograph(url + "#/t/5", IMAGES / "viewer.png", 1280, 860)
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=30)


# The pages, in the order they are made: name -> function writing docs/images/<name>.png.
PAGES: dict[str, Callable[[Path], None]] = {"report": report, "view": view}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("pages", nargs="*", metavar="PAGE", help=f"one of {', '.join(PAGES)} (default: all)")
    chosen = parser.parse_args().pages or list(PAGES)
    unknown = [name for name in chosen if name not in PAGES]
    if unknown:
        parser.error(f"unknown page {unknown[0]!r}; choose from {', '.join(PAGES)}")
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for name in chosen:
            PAGES[name](Path(work))


if __name__ == "__main__":
    main()
