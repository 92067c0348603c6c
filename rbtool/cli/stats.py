"""`rbtool stats`: index, schema, data statistics and draw spread of a checkpoint, on one screen."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from rbtool.cli._common import (
    AllOpt,
    DirArg,
    JobsOpt,
    JsonlOpt,
    JsonOpt,
    KOpt,
    PrettyOpt,
    SeedOpt,
    StorageOpt,
    Strategy,
    StrategyOpt,
    TemperatureOpt,
    WindowOpt,
    bound,
    head,
    id_ranges,
    insert_after,
    left_out,
    out,
    print_json,
    print_jsonl,
    progress_bar,
    reading,
    refuse_k_without_topk,
    refuse_output_mix,
    show_progress,
    summary_limit,
)

SPARK = "▁▂▃▄▅▆▇█"
EIGHTHS = " ▏▎▍▌▋▊▉█"
HEAD_ROWS = 5  # a long table shows its first and last HEAD_ROWS rows
MISSING_SHOWN = 10  # missing ids named on the files line
BAR_WIDTH = 20
SPARK_WIDTH = 48  # sparklines over many trajectories are bucketed to this many characters
PIPED_WIDTH = 140  # tables written to a file or pipe get this width rather than being cut at 80


# ------------------------------------------------------------------ small plots
def view_console() -> Console:
    """stdout at a terminal; written to a file or pipe, a console wide enough not to cut columns."""
    if out.is_terminal:
        return out
    return Console(highlight=False, soft_wrap=True, width=max(out.width, PIPED_WIDTH))


def sparkline(counts: list[float]) -> str:
    """One character per value, height by value; zero stays blank so gaps show."""
    top = max(counts, default=0)
    if top <= 0:
        return " " * len(counts)
    return "".join(" " if c <= 0 else SPARK[min(7, int(c / top * 7.999))] for c in counts)


def bucketed(values: list[float], width: int = SPARK_WIDTH) -> list[float]:
    """Sum consecutive values into at most `width` buckets (for a sparkline over many trajectories)."""
    if len(values) <= width:
        return values
    size = -(-len(values) // width)
    return [sum(values[i : i + size]) for i in range(0, len(values), size)]


def bar(value: float, top: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar in eighths of a character, `width` long at `top`."""
    if top <= 0 or value <= 0:
        return ""
    eighths = round(value / top * width * 8)
    return "█" * (eighths // 8) + (EIGHTHS[eighths % 8] if eighths % 8 else "")


def num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def size(n: int | None) -> str:
    if n is None or n < 0:
        return "-"
    step = 1024.0
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < step or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= step  # type: ignore[assignment]
    return f"{n} B"


def short(text: str, width: int = 13) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def shown_positions(n: int, every: bool = False) -> list[int | None]:
    """Row positions for a long table: the first and last HEAD_ROWS, None marking the gap (all with every)."""
    if every or n <= 2 * HEAD_ROWS + 2:
        return list(range(n))
    return [*range(HEAD_ROWS), None, *range(n - HEAD_ROWS, n)]


def compact_table(*columns: str, right: tuple[str, ...] = ()) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1))
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left", no_wrap=True)
    return table


def dist_row(label: str, doc: dict[str, Any]) -> list[str | Text]:
    """count, mean, std, min, max and a histogram sparkline of a summary."""
    hist = doc["histogram"]
    line = sparkline(hist["counts"])
    if hist["edges"]:
        line = f"{num(hist['edges'][0])} {line} {num(hist['edges'][-1])}"
    return [
        label,
        str(doc["count"]),
        num(doc["mean"]),
        num(doc["std"]),
        num(doc["min"]),
        num(doc["max"]),
        line,
    ]


# ------------------------------------------------------------------ the command
def stats(
    path: DirArg,
    window: WindowOpt = 0,
    index_only: Annotated[
        bool,
        typer.Option("--index-only", help="Read only the two JSON files (no trajectory file is opened)."),
    ] = False,
    bins: Annotated[int, typer.Option("--bins", min=1, max=1000, help="Histogram bins.")] = 16,
    sample_draws: Annotated[
        int | None,
        typer.Option(
            "--sample-draws", min=1, help="Simulate N draws and compare their spread to the expected one."
        ),
    ] = None,
    strategy: StrategyOpt = Strategy.uniform,
    k: KOpt = None,
    temperature: TemperatureOpt = 1.0,
    seed: SeedOpt = None,
    jobs: JobsOpt = None,
    all_items: AllOpt = False,
    json: JsonOpt = False,
    pretty: PrettyOpt = False,
    jsonl: JsonlOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Show a checkpoint or buffer directory: index, trajectories, field schema, data statistics.

    Data statistics (rewards, episodes from done-like fields, policy versions) read only
    those fields. Missing trajectory files are listed, not refused. --sample-draws shows how
    N draws of a strategy spread over the window's trajectories against the expected shares.
    Long lists are summarised unless --all; --jsonl streams one object per trajectory.
    """
    refuse_output_mix(json, jsonl, pretty)
    if sample_draws is None:
        if strategy is not Strategy.uniform or k is not None or seed is not None:
            raise typer.BadParameter("--strategy, --k and --seed apply only with --sample-draws")
    else:
        refuse_k_without_topk(strategy, k)
        if jsonl:
            raise typer.BadParameter("--jsonl lists the trajectories only", param_hint="--sample-draws")

    from rbtool.stats import DrawRequest, collect_stats

    draws = None
    if sample_draws is not None:
        draws = DrawRequest(sample_draws, strategy.value, k, temperature, seed)
    enabled = show_progress(json or jsonl) and not index_only
    with (
        reading(path, storage_option, data=not index_only, enabled=enabled) as place,
        progress_bar("reading the index", None, enabled) as advance,
    ):
        doc = collect_stats(
            place.local,
            window=window,
            index_only=index_only,
            bins=bins,
            draws=draws,
            progress=advance,
            jobs=jobs,
            as_json=False,  # numpy columns and lazy file names: cut or streamed below
            read_data=not jsonl,  # JSON Lines list the trajectories, not the data statistics
        )
        if "path" in doc:  # named as given (a URL, not the local mirror)
            doc["path"] = place.show(doc["path"])
        if doc.get("rank_dirs"):
            doc["rank_dirs"] = [place.show(d) for d in doc["rank_dirs"]]
        if jsonl:
            print_jsonl(trajectory_rows(doc["trajectories"]))
        elif json:
            print_json(summarised(doc, summary_limit(all_items)), pretty)
        else:
            render(doc, view_console(), every=all_items)


ROW_BLOCK = 65536  # JSON Lines rows are built from the columns this many at a time


def trajectory_rows(columns: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """One dict per listed trajectory (the keys of the `trajectories` columns), block by block."""
    keys = list(columns)
    n = len(columns["id"])
    for start in range(0, n, ROW_BLOCK):
        stop = min(n, start + ROW_BLOCK)
        block = []
        for key in keys:
            col = columns[key]
            part = [None] * (stop - start) if col is None else col[start:stop]
            block.append(part.tolist() if hasattr(part, "tolist") else part)
        yield from (dict(zip(keys, row, strict=True)) for row in zip(*block, strict=True))


def summarised(doc: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """The --json document: every list that grows with the index cut to `limit` items (None: all).

    A cut list says how many items it leaves out: `<key>_left_out` beside it, or `left_out`
    in a table of aligned columns; id lists also get their runs of consecutive ids.
    """
    doc = dict(doc)
    index = doc["index"] = dict(doc["index"])
    runs = id_ranges(doc["trajectories"]["id"])
    insert_after(
        index, "id_max", {"id_ranges": head(runs, limit), "id_ranges_left_out": left_out(runs, limit)}
    )
    files = doc["files"] = dict(doc["files"])
    bound(files, "missing_ids", limit, ranges="missing_id_ranges")
    doc["trajectories"] = table_head(doc["trajectories"], limit)
    bound(doc, "model_weights", limit)
    data = doc["data"]
    if data is not None and data["versions"] is not None:
        data = doc["data"] = dict(data)
        versions = data["versions"] = dict(data["versions"])
        bound(versions, "values", limit)
        bound(versions, "staleness", limit)
    if doc["draws"] is not None:
        draws = doc["draws"] = dict(doc["draws"])
        draws["trajectories"] = table_head(draws["trajectories"], limit)
    return doc


def table_head(columns: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """Aligned columns cut to their first `limit` rows, with `left_out` the rows not listed."""
    n = len(columns["id"])
    cut = {key: None if col is None else head(col, limit) for key, col in columns.items()}
    cut["left_out"] = left_out(range(n), limit)
    return cut


# ------------------------------------------------------------------ human view
def render(doc: dict[str, Any], con: Console, every: bool = False) -> None:
    """Everything on one screen: header lines, then tables side by side where they fit.

    Long tables show their first and last rows; `every` (--all) shows every row.
    """
    idx, files, win = doc["index"], doc["files"], doc["window"]
    ids = "-" if idx["id_min"] is None else f"{idx['id_min']}..{idx['id_max']}"
    con.print(
        f"[bold]{doc['path']}[/bold]  {idx['trajectory_format']}  seed {idx['seed']}  ·  "
        f"{idx['size']} trajectories, {idx['total_samples']} samples  ·  ids {ids}  ·  "
        f"counter {idx['trajectory_counter']}  ·  {idx['model_weights_ids']} model_weights_id"
    )
    if files["checked"]:
        line = f"files: {files['present']} present, {size(files['bytes'])}"
        if files["missing"]:
            limit = None if every else MISSING_SHOWN
            shown = ", ".join(map(str, head(files["missing_ids"], limit)))
            hidden = left_out(files["missing_ids"], limit)
            more = f" ... {hidden} more" if hidden else ""
            line += (
                f"  [yellow]{files['missing']} missing (ids {shown}{more}): left out of the window[/yellow]"
            )
        con.print(line)
    else:
        con.print(f"files: not opened (--index-only); recorded sizes {size(files['bytes'])}")
    which = "all" if win["requested"] == 0 else f"last {win['requested']}"
    lo, hi = win["probability_min"], win["probability_max"]
    line = f"window {which}: {win['trajectories']} trajectories, {win['samples']} samples"
    if lo is not None:
        line += f", p(draw) {num(lo)} each" if lo == hi else f", p(draw) {num(lo)}..{num(hi)} per trajectory"
    con.print(line)
    if idx["size"] == 0:
        return

    con.print(trajectory_table(doc, every))
    if doc["schema"]:
        con.print(schema_table(doc["schema"]))
    data = doc["data"]
    if data is not None and data["trajectories_read"]:
        con.print(data_table(data))
        con.print(episode_line(data))
        version_line(data, con)
    con.print(weights_table(doc["model_weights"], every))
    if doc["draws"] is not None:
        draws_view(doc["draws"], con, every)


def trajectory_table(doc: dict[str, Any], every: bool = False) -> Table:
    rows = doc["trajectories"]
    table = compact_table(
        "id", "TxB", "samples", "model_weights_id", "file", "p(draw)", "", right=("id", "samples")
    )
    probs = rows["draw_probability"]
    top = max(probs, default=0.0)
    for pos in shown_positions(len(rows["id"]), every):
        if pos is None:
            table.add_row("…", "", f"{len(rows['id']) - 2 * HEAD_ROWS} more", "", "", "", "")
            continue
        exists = rows["exists"]
        state = size(rows["file_bytes"][pos]) if exists is None or exists[pos] else "[red]missing[/red]"
        table.add_row(
            str(rows["id"][pos]),
            f"{rows['T'][pos]}x{rows['B'][pos]}",
            str(rows["num_samples"][pos]),
            short(rows["model_weights_id"][pos]),
            state,
            f"{probs[pos]:.3f}" if rows["in_window"][pos] else "-",
            bar(probs[pos], top, 10),
        )
    if len(rows["id"]) > 2 * HEAD_ROWS + 2:
        table.caption = f"p(draw) over the list: {sparkline(bucketed(probs))}"
    return table


def schema_table(schema: list[dict[str, Any]]) -> Table:
    table = compact_table(
        "field", "dtype", "per sample", "extra rows", "trajectories", "bytes", right=("bytes",)
    )
    for row in schema:
        shape = "(1-dim, not sampled)" if row["per_sample_shape"] is None else str(row["per_sample_shape"])
        extra = ",".join(map(str, row["extra_rows"])) if any(row["extra_rows"]) else ""
        name = row["field"] if row["sampled"] else f"[dim]{row['field']}[/dim]"
        table.add_row(name, row["dtype"], shape, extra, str(row["trajectories"]), size(row["bytes"]))
    if not all(row["sampled"] for row in schema):
        table.caption = (
            "dim: not in sampled batches (missing from some window trajectory, or fewer than 2 dims)"
        )
    return table


def data_table(data: dict[str, Any]) -> Table:
    table = compact_table(
        "", "count", "mean", "std", "min", "max", "histogram", right=("count", "mean", "std", "min", "max")
    )
    if data["rewards"] is not None:
        table.add_row(*dist_row("reward", data["rewards"]))
    episodes = data["episodes"]
    if episodes is not None:
        table.add_row(*dist_row("episode length", episodes["length"]))
        table.add_row(*dist_row("episode return", episodes["return"]))
    versions = data["versions"]
    if versions is not None:
        table.add_row(*dist_row("staleness", versions["staleness_summary"]))
    table.caption = (
        f"read {data['trajectories_read']} trajectories, {size(data['bytes_read'])} of rewards, "
        "done-like fields and versions"
        + f" in {data['seconds']:.2f} s ({data['jobs']} job{'s' if data['jobs'] != 1 else ''})"
        + (f" ({size(data['pkl_bytes_read'])} of whole .pkl files)" if data["pkl_bytes_read"] else "")
    )
    return table


def episode_line(data: dict[str, Any]) -> str:
    e = data["episodes"]
    if e is None:
        return "episodes: no done-like field"
    return (
        f"episodes: {e['finished']} finished ({e['terminated']} terminated, {e['truncated']} truncated, "
        f"{e['other']} other), {e['open']} open at a trajectory's end, "
        f"{e['partial_start']} began before their trajectory"
    )


def version_line(data: dict[str, Any], con: Console) -> None:
    v = data["versions"]
    if v is None:
        return
    spread = "  ".join(f"{num(x['version'])}: {x['samples']}" for x in v["values"][:8])
    more = " ..." if len(v["values"]) > 8 else ""
    con.print(f"versions (samples): {spread}{more}  ·  newest {num(v['newest'])}")


def weights_table(groups: list[dict[str, Any]], every: bool = False) -> Table:
    table = compact_table(
        "model_weights_id",
        "trajectories",
        "samples",
        "in window",
        "ids",
        right=("trajectories", "samples", "in window"),
    )
    for pos in shown_positions(len(groups), every):
        if pos is None:
            table.add_row(f"… {len(groups) - 2 * HEAD_ROWS} more", "", "", "", "")
            continue
        g = groups[pos]
        table.add_row(
            g["model_weights_id"] or "(empty)",
            str(g["trajectories"]),
            str(g["samples"]),
            str(g["window_samples"]),
            f"{g['first_id']}..{g['last_id']}",
        )
    return table


def draws_view(d: dict[str, Any], con: Console, every: bool = False) -> None:
    how = d["strategy"] if d["strategy"] == "uniform" else f"topk k={d['k']} T={num(d['temperature'])}"
    c = d["concentration"]
    con.print(
        f"[bold]{d['n']} draws ({how}, seed {d['seed']})[/bold] over {d['window_samples']} samples, "
        f"{d['candidates']} candidates, {d['distinct_samples_drawn']} distinct drawn  ·  "
        f"total variation {d['total_variation']:.4f}"
    )
    rows = d["trajectories"]
    table = compact_table("id", "draws", "observed", "expected", "observed | expected", right=("id", "draws"))
    top = max([*rows["observed"], *rows["expected"]], default=0.0)
    for pos in shown_positions(len(rows["id"]), every):
        if pos is None:
            table.add_row("…", f"{len(rows['id']) - 2 * HEAD_ROWS} more", "", "", "")
            continue
        obs, exp = rows["observed"][pos], rows["expected"][pos]
        plot = Text(bar(obs, top).ljust(BAR_WIDTH), style="cyan") + Text(" " + bar(exp, top), style="dim")
        table.add_row(str(rows["id"][pos]), str(rows["draws"][pos]), f"{obs:.3f}", f"{exp:.3f}", plot)
    if len(rows["id"]) > 2 * HEAD_ROWS + 2:
        table.caption = f"draws per trajectory: {sparkline(bucketed([float(x) for x in rows['draws']]))}"
    con.print(table)
    flag = "[red]CONCENTRATED[/red]" if c["concentrated"] else "spread"
    con.print(
        f"{flag}: half the draws on {c['samples_holding_half_of_draws']} samples (expected "
        f"{c['samples_holding_half_of_probability']}); flagged below {num(c['threshold_samples'])} "
        f"(5% of the window's samples)"
    )
