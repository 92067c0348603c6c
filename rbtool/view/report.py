"""A checkpoint's report: one self-contained HTML file, or Markdown with PNG files beside it.

The report is the stats document (`ops.stats.collect_stats`, with simulated uniform draws)
put for people: a summary table, the fields, plots (returns per trajectory, episode lengths
and returns, policy versions, draw spread) and a few frames of the first, middle and last
trajectories. The HTML holds everything inline (style, and images as data: URIs; no script,
no font, nothing fetched), so it opens the same as a CI artifact, offline, or attached to a
pull request. The Markdown names its images as files beside it (`<stem>-<section>.png`).
Every file is checked before anything is written, then written atomically, the page last.
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import UsageError
from rbtool.view.frames import Checkpoint
from rbtool.view.plots import bar_plot, histogram_plot, line_plot, spread_plot
from rbtool.view.render import contact_sheet, png_bytes, scale_for, sheet_steps

DRAWS = 10_000  # uniform draws simulated for the draw spread
RETURNS_MAX = 500  # trajectories whose returns are read (evenly spaced past this)
SHOWN_FRAMES = 6  # frames per trajectory shown
FRAME_SIDE = 96  # shown frames scaled up to at least this on their long side
# What the page may load: its inline style and data: images, nothing else (no script, no fetch).
POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; color: #222; margin: 2em auto; max-width: 1100px;
       padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.path { color: #555; font-family: ui-monospace, monospace; word-break: break-all; }
table { border-collapse: collapse; margin: 0.5em 0; } td, th { padding: 2px 10px; text-align: left; }
tr:nth-child(even) { background: #f3f5f8; } th { border-bottom: 1px solid #ccc; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.plots { display: flex; flex-wrap: wrap; gap: 12px; } .plots figure { margin: 0; }
figcaption { color: #555; font-size: 12px; } img { max-width: 100%; }
"""


@dataclass
class Section:
    """One part of the report: a title, rows of a table, or images (name -> PNG bytes)."""

    key: str
    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)
    header: tuple[str, ...] = ()
    table: list[tuple[str, ...]] = field(default_factory=list)
    images: list[tuple[str, str, bytes]] = field(default_factory=list)  # (name, caption, png)
    note: str = ""


@dataclass
class ReportResult:
    """What a report wrote."""

    out: str
    format: str  # html or markdown
    bytes: int  # the page's bytes (images beside a Markdown page not counted)
    sections: list[str]
    images: list[str]  # image files written beside a Markdown page
    trajectories_shown: list[int]

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def summary_rows(doc: dict[str, Any], shown_path: str) -> list[tuple[str, str]]:
    """The summary table: what the index, the files, the window and the data say."""
    index, files, window = doc["index"], doc.get("files") or {}, doc["window"]
    rows = [
        ("checkpoint", shown_path),
        ("trajectory format", _num(index.get("trajectory_format"))),
        ("trajectories", _num(index.get("size"))),
        ("samples", _num(index.get("total_samples"))),
        ("id range", f"{_num(index.get('id_min'))}..{_num(index.get('id_max'))}"),
        ("trajectory counter", _num(index.get("trajectory_counter"))),
        ("seed", _num(index.get("seed"))),
        ("model_weights_ids", _num(index.get("model_weights_ids"))),
    ]
    if doc.get("rank_dirs"):
        rows.append(("rank directories", str(len(doc["rank_dirs"]))))
    if files:
        rows.append(("files", f"{files.get('present')} present, {files.get('missing')} missing"))
        rows.append(("file bytes", _num(files.get("bytes"))))
    kept = f"{window.get('trajectories')} trajectories, {window.get('samples')} samples"
    requested = window.get("requested")
    rows.append(("window", f"the last {requested}: {kept}" if requested else f"all: {kept}"))
    data = doc.get("data") or {}
    rewards = data.get("rewards") or {}
    if rewards.get("count"):
        rows.append(
            (
                "rewards",
                f"mean {_num(rewards.get('mean'))}, std {_num(rewards.get('std'))}, "
                f"min {_num(rewards.get('min'))}, max {_num(rewards.get('max'))}",
            )
        )
    episodes = data.get("episodes") or {}
    if episodes:
        rows.append(
            (
                "episodes",
                f"{episodes.get('finished')} finished ({episodes.get('terminated')} terminated, "
                f"{episodes.get('truncated')} truncated), {episodes.get('open')} open at the end",
            )
        )
        length, ret = episodes.get("length") or {}, episodes.get("return") or {}
        if length.get("count"):
            rows.append(("episode length", f"mean {_num(length.get('mean'))}, max {_num(length.get('max'))}"))
        if ret.get("count"):
            rows.append(("episode return", f"mean {_num(ret.get('mean'))}, std {_num(ret.get('std'))}"))
    versions = data.get("versions") or {}
    if versions.get("samples"):
        stale = versions.get("staleness_summary") or {}
        rows.append(
            ("newest version", f"{_num(versions.get('newest'))} (mean staleness {_num(stale.get('mean'))})")
        )
    draws = doc.get("draws") or {}
    if draws:
        rows.append(
            (
                "draw spread",
                f"{draws.get('n')} uniform draws, total variation {_num(draws.get('total_variation'))}",
            )
        )
    return rows


def _returns(opened: Checkpoint) -> tuple[list[int], list[float]]:
    entries = opened.entries()
    if len(entries) > RETURNS_MAX:
        picks = sorted({round(i * (len(entries) - 1) / (RETURNS_MAX - 1)) for i in range(RETURNS_MAX)})
        entries = [entries[i] for i in picks]
    ids, values = [], []
    for entry in entries:
        got = opened.summary(entry.tid).returns
        if got:
            ids.append(entry.tid)
            values.append(sum(got) / len(got))
    return ids, values


def shown_trajectories(opened: Checkpoint) -> list[int]:
    """The first, middle and last trajectories (fewer when there are fewer)."""
    ids = [e.tid for e in opened.entries()]
    if not ids:
        return []
    return sorted({ids[0], ids[len(ids) // 2], ids[-1]}, key=ids.index)


def frames_section(opened: Checkpoint) -> Section:
    """A few frames (env 0, the first camera) of the first, middle and last trajectories."""
    section = Section("frames", "Frames")
    for tid in shown_trajectories(opened):
        cams = opened.cameras(tid)
        if not cams:
            continue
        cam = cams[0]
        entry = opened.entry(tid)
        steps = sheet_steps(entry.t, SHOWN_FRAMES)
        sheet = contact_sheet(
            opened.frames(tid, 0, cam.field, steps), steps, opened.series(tid, 0), scale_for(cam, FRAME_SIDE)
        )
        section.images.append((f"frames-{tid}", f"trajectory {tid}, env 0, {cam.field}", png_bytes(sheet)))
    if not section.images:
        section.note = "No trajectory shown has an image field."
    return section


def sections(doc: dict[str, Any], opened: Checkpoint, shown_path: str) -> list[Section]:
    """Every section of the report, in order; plots only where the data has them."""
    out = [Section("summary", "Summary", rows=summary_rows(doc, shown_path))]
    if doc.get("schema"):
        out.append(
            Section(
                "fields",
                "Fields",
                header=("field", "dtype", "per-sample shape", "trajectories"),
                table=[
                    (f["field"], f["dtype"], str(f["per_sample_shape"]), str(f["trajectories"]))
                    for f in doc["schema"]
                ],
            )
        )
    plots = Section("plots", "Plots")
    ids, values = _returns(opened)
    if ids:
        plots.images.append(
            (
                "returns",
                "return per trajectory (mean over env columns)",
                line_plot(ids, values, "returns per trajectory", "trajectory id", "return"),
            )
        )
    data = doc.get("data") or {}
    episodes = data.get("episodes") or {}
    for key, name, title in (
        ("length", "episode-lengths", "episode lengths"),
        ("return", "episode-returns", "episode returns"),
    ):
        part = episodes.get(key) or {}
        hist = part.get("histogram")
        if part.get("count") and hist:
            plots.images.append((name, title, histogram_plot(hist["edges"], hist["counts"], title, key)))
    versions = (data.get("versions") or {}).get("values") or []
    if versions:
        plots.images.append(
            (
                "policy-versions",
                "samples per policy version",
                bar_plot(
                    [_num(v["version"]) for v in versions],
                    [v["samples"] for v in versions],
                    "policy versions",
                    "version",
                    "samples",
                ),
            )
        )
    draws = doc.get("draws") or {}
    spread = draws.get("trajectories") or {}
    if spread.get("id"):
        plots.images.append(
            (
                "draw-spread",
                f"{draws.get('n')} uniform draws over the window",
                spread_plot(spread["id"], spread["observed"], spread["expected"]),
            )
        )
    if not plots.images:
        plots.note = "Nothing to plot: the trajectories have no rewards, episodes or versions."
    out.append(plots)
    out.append(frames_section(opened))
    return out


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def to_html(parts: Sequence[Section], shown_path: str) -> str:
    """One page with everything inline: no script, no external reference."""
    esc = html.escape
    lines = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{POLICY}">',
        f"<title>rbtool report: {esc(shown_path)}</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>Replay-buffer checkpoint report</h1>",
        f'<div class="path">{esc(shown_path)}</div>',
    ]
    for part in parts:
        lines.append(f'<section id="{esc(part.key)}"><h2>{esc(part.title)}</h2>')
        if part.rows:
            lines.append("<table>")
            lines += [f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in part.rows]
            lines.append("</table>")
        if part.table:
            lines.append("<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in part.header) + "</tr>")
            lines += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in part.table]
            lines.append("</table>")
        if part.images:
            lines.append('<div class="plots">')
            for name, text, png in part.images:
                lines.append(
                    f'<figure><img alt="{esc(text)}" data-name="{esc(name)}" src="{_data_uri(png)}">'
                    f"<figcaption>{esc(text)}</figcaption></figure>"
                )
            lines.append("</div>")
        if part.note:
            lines.append(f"<p>{esc(part.note)}</p>")
        lines.append("</section>")
    lines.append("</body></html>")
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(parts: Sequence[Section], shown_path: str, image_name: Any) -> str:
    """The same report as Markdown; `image_name(name)` is the file an image is written to."""
    lines = ["# Replay-buffer checkpoint report", "", f"`{shown_path}`", ""]
    for part in parts:
        lines += [f"## {part.title}", ""]
        if part.rows:
            lines += ["| | |", "|---|---|", *(f"| {_md(k)} | {_md(v)} |" for k, v in part.rows), ""]
        if part.table:
            lines.append("| " + " | ".join(part.header) + " |")
            lines.append("|" + "---|" * len(part.header))
            lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in part.table]
            lines.append("")
        for name, text, _ in part.images:
            lines += [f"![{_md(text)}]({image_name(name)})", ""]
        if part.note:
            lines += [part.note, ""]
    return "\n".join(lines)


def write_report(
    local: Path,
    out: Path,
    *,
    shown_path: str | None = None,
    markdown: bool = False,
    overwrite: bool = False,
    window: int = 0,
    draws: int = DRAWS,
    jobs: int | None = None,
) -> ReportResult:
    """Write the report of the checkpoint or rank tree at `local` to `out` (see the module docstring).

    `shown_path` names the checkpoint on the page (a URL it was read from; default `local`).
    """
    from rbtool.files.fsutil import check_file_target, make_parents, write_bytes_atomic
    from rbtool.ops.stats import DrawRequest, collect_stats
    from rbtool.view.extras import require_pil, require_pyplot
    from rbtool.view.frames import open_checkpoint

    if draws < 1:
        raise UsageError(f"draws must be >= 1, got {draws}")
    require_pil()  # a missing extra said before anything is read
    require_pyplot()
    shown = shown_path or str(local)
    check_file_target(out, overwrite=overwrite)
    doc = collect_stats(local, window=window, draws=DrawRequest(draws, "uniform", None, 1.0, None), jobs=jobs)
    with open_checkpoint(local) as opened:
        parts = sections(doc, opened, shown)
        trajectories = shown_trajectories(opened)
    images: dict[Path, bytes] = {}
    if markdown:
        stem = out.name[: -len(out.suffix)] if out.suffix else out.name

        def image_name(name: str) -> str:
            return f"{stem}-{name}.png"

        for part in parts:
            for name, _, png in part.images:
                images[out.parent / image_name(name)] = png
        page = to_markdown(parts, shown, image_name)
    else:
        page = to_html(parts, shown)
    for path in images:  # every target checked before anything is written
        check_file_target(path, overwrite=overwrite)
    make_parents(out)
    for path, png in images.items():
        write_bytes_atomic(path, png)
    data = page.encode("utf-8")
    write_bytes_atomic(out, data)
    return ReportResult(
        os.fspath(out),
        "markdown" if markdown else "html",
        len(data),
        [p.key for p in parts],
        [os.fspath(p) for p in images],
        trajectories,
    )
