"""`rbtool diff`: what differs between two checkpoints or rank trees (exit 1 when anything does)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from rbtool.cli._consoles import err, out
from rbtool.cli._json import bound, print_json
from rbtool.cli._options import (
    SUMMARY_ITEMS,
    Report,
    StorageOpt,
    StrictOpt,
)
from rbtool.cli._output import Column, Fitted, count, format_ids
from rbtool.cli._places import reading
from rbtool.cli._progress import progress_bar, show_progress


def diff(
    a_arg: Annotated[
        str, typer.Argument(metavar="A", help="A checkpoint or a folder of rank_* checkpoints (or a URL).")
    ],
    b_arg: Annotated[
        str, typer.Argument(metavar="B", help="The checkpoint or rank tree to compare with A (or a URL).")
    ],
    deep: Annotated[
        bool,
        typer.Option(
            "--deep", help="Compare trajectory contents (every tensor and field), not hashes or sizes."
        ),
    ] = False,
    strict: StrictOpt = True,
    output: Report = Report(),
    storage_option: StorageOpt = None,
) -> None:
    """Compare A and B: metadata, entries added/removed/changed, files, schema. Exit 0 equal, 1 not."""
    with (
        reading(a_arg, storage_option, data=True, enabled=show_progress(output.json)) as place_a,
        reading(b_arg, storage_option, data=True, enabled=show_progress(output.json)) as place_b,
    ):
        a, b = place_a.local, place_b.local
        from rbtool.ops import compare

        with progress_bar("comparing", None, show_progress(output.json)) as advance:
            result = compare.diff(a, b, deep=deep, strict=strict, progress=advance)
        doc = result.as_json()
        doc["a"], doc["b"] = place_a.show(doc["a"]), place_b.show(doc["b"])
        if output.json:
            shown = dict(doc)
            limit = output.limit
            for key in ("added", "removed", "changed"):
                bound(shown, key, limit)
            print_json(shown, output.pretty)
        else:
            render(doc, None if output.all_items else SUMMARY_ITEMS)
        if doc["files_unchecked"] and not deep:
            n = doc["files_unchecked"]
            is_, was = ("is", "was") if n == 1 else ("are", "were")
            err.print(
                f"Warning: {count(n, 'file')} {is_} in different formats and {was} not compared; "
                "pass --deep to compare their contents",
                markup=False,
                highlight=False,
            )
        if not doc["equal"]:
            raise typer.Exit(1)


def _layout_text(item: dict[str, Any]) -> str:
    if item["key"] == "file_bytes":
        held = "holds" if item["files"] == 1 else "hold"
        return f"{count(item['files'], 'file')} in the same format {held} the same content in other bytes"
    if item["key"] == "rank_directories":
        shown = [
            "one directory" if n is None else count(n, "rank directory", "rank directories")
            for n in (item["a"], item["b"])
        ]
        return f"{shown[0]} vs {shown[1]}"
    return f"{item['key']} {item['a']} vs {item['b']}"


def notes(doc: dict[str, Any]) -> list[str]:
    """What was not compared, and how A and B differ in layout only (lines under the verdict)."""
    lines = []
    if doc["layout"]:
        lines.append("layout (not a difference): " + "; ".join(_layout_text(item) for item in doc["layout"]))
    n = doc["contents_not_compared"]
    if n:
        lines.append(
            f"contents not compared: {count(n, 'file')} (equal recorded hashes, sizes checked); "
            "--deep compares them"
        )
    return lines


def render(doc: dict[str, Any], limit: int | None = SUMMARY_ITEMS) -> None:
    """The human view: a verdict, then a table of what differs (the first `limit` id runs and changes),
    then what was not compared and what differs in layout only."""
    from rich.text import Text

    how = "by content" if doc["deep"] else "by size, then recorded hash or bytes"
    if doc["verdict"] == "equal":
        unchanged = count(doc["unchanged"], "trajectory", "trajectories")
        out.print(Text(f"equal ({how}): {doc['a']} and {doc['b']}, {unchanged}"))
        for line in notes(doc):
            out.print(Text(line))
        return
    if doc["verdict"] == "unchecked":
        out.print(
            Text.assemble(
                ("not shown equal", "bold"),
                f" ({how}): {doc['a']} and {doc['b']}: no difference found, but "
                f"{count(doc['files_unchecked'], 'file')} in different formats not compared",
            )
        )
        for line in notes(doc):
            out.print(Text(line))
        return
    out.print(Text.assemble(("differ", "bold"), f" ({how}): {doc['a']} -> {doc['b']}"))
    rows: list[list[str | Text]] = []

    def add(*cells: str) -> None:
        rows.append([Text(c) for c in cells])

    for m in doc["metadata"]:
        add(f"metadata {m['key']}", str(m["a"]), str(m["b"]))
    if doc["removed"]:
        add(f"removed ({len(doc['removed'])})", format_ids(doc["removed"], limit), "")
    if doc["added"]:
        add(f"added ({len(doc['added'])})", "", format_ids(doc["added"], limit))
    if doc["order_changed"]:
        add("list order", "differs", "")
    shown = doc["changed"] if limit is None else doc["changed"][:limit]
    for c in shown:
        what = ", ".join(c["fields"] + ([c["file"]] if c["file"] else []))
        add(f"changed {c['trajectory_id']}", what, c["detail"] or "")
    if len(doc["changed"]) > len(shown):
        add(f"... {len(doc['changed']) - len(shown)} more changed", "", "")
    schema = doc["schema"]
    for f in schema["removed"]:
        add(f"field {f['field']}", f"{f['dtype']} {f['shape']}", "(absent)")
    for f in schema["added"]:
        add(f"field {f['field']}", "(absent)", f"{f['dtype']} {f['shape']}")
    for f in schema["changed"]:
        add(
            f"field {f['field']}",
            f"{f['a']['dtype']} {f['a']['shape']}",
            f"{f['b']['dtype']} {f['b']['shape']}",
        )
    out.print(Fitted([Column("what"), Column("A", wrap=True), Column("B", wrap=True)], rows))
    out.print(f"{count(doc['unchanged'], 'trajectory', 'trajectories')} unchanged")
    for line in notes(doc):
        out.print(Text(line))
