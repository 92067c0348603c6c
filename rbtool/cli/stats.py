"""`rbtool stats`: index, schema, data statistics and draw spread of a checkpoint, on one screen."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Annotated, Any

import typer
from rich.text import Text

from rbtool.cli._consoles import out
from rbtool.cli._errors import print_error
from rbtool.cli._json import bound, insert_after, print_json, print_jsonl
from rbtool.cli._options import (
    KOpt,
    Lines,
    Pass,
    PathsArg,
    SeedOpt,
    StorageOpt,
    Strategy,
    StrategyOpt,
    TemperatureOpt,
    WideOpt,
    WindowOpt,
    refuse_k_without_topk,
)
from rbtool.cli._output import (
    Column,
    Fitted,
    count,
    head,
    id_ranges,
    id_runs,
    left_out,
    number,
    printable,
    size,
    unique_prefixes,
)
from rbtool.cli._places import reading
from rbtool.cli._progress import progress_bar, show_progress
from rbtool.cli._window import DEFAULT_WINDOW, window_line

SPARK = "▁▂▃▄▅▆▇█"
EIGHTHS = " ▏▎▍▌▋▊▉█"
HEAD_ROWS = 5  # a long table shows its first and last HEAD_ROWS rows
MISSING_SHOWN = 10  # missing ids named on the files line
BAR_WIDTH = 20
SPARK_WIDTH = 48  # sparklines over many trajectories are bucketed to this many characters
HEADER_RUNS = 4  # id runs named on the header line


# ------------------------------------------------------------------ small plots
def sparkline(counts: list[float]) -> str:
    """One character per value, height by value; zero stays blank so gaps show."""
    top = max(counts, default=0)
    if top <= 0:
        return " " * len(counts)
    return "".join(" " if c <= 0 else SPARK[min(7, int(c / top * 7.999))] for c in counts)


def bucketed(values: list[float]) -> list[float]:
    """Sum consecutive values into at most SPARK_WIDTH buckets (for a sparkline over many trajectories)."""
    if len(values) <= SPARK_WIDTH:
        return list(values)
    import numpy as np

    size = -(-len(values) // SPARK_WIDTH)
    flat = np.asarray(values, dtype=np.float64)
    return np.add.reduceat(flat, np.arange(0, len(flat), size)).tolist()  # type: ignore[no-any-return]


def bar(value: float, top: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar in eighths of a character, `width` long at `top`."""
    if top <= 0 or value <= 0:
        return ""
    eighths = round(value / top * width * 8)
    return "█" * (eighths // 8) + (EIGHTHS[eighths % 8] if eighths % 8 else "")


def num(value: float | None) -> str:
    return number(value)


def shown_positions(n: int, every: bool = False) -> list[int | None]:
    """Row positions for a long table: the first and last HEAD_ROWS, None marking the gap (all with every)."""
    if every or n <= 2 * HEAD_ROWS + 2:
        return list(range(n))
    return [*range(HEAD_ROWS), None, *range(n - HEAD_ROWS, n)]


def dist_row(label: str, doc: dict[str, Any]) -> list[str | Text]:
    """count, mean, std, min, max and a histogram sparkline of a summary."""
    hist = doc["histogram"]
    line = sparkline(hist["counts"])
    if hist["edges"]:
        line = f"{num(hist['edges'][0])} {line} {num(hist['edges'][-1])}"
    return [
        label,
        f"{doc['count']}",
        num(doc["mean"]),
        num(doc["std"]),
        num(doc["min"]),
        num(doc["max"]),
        line,
    ]


# ------------------------------------------------------------------ the command
def stats(
    paths: PathsArg,
    window: WindowOpt = DEFAULT_WINDOW,
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
    passes: Pass = Pass(),
    wide: WideOpt = False,
    output: Lines = Lines(),
    storage_option: StorageOpt = None,
) -> None:
    """Show checkpoints or buffer directories: index, trajectories, field schema, data statistics.

    Data statistics (rewards, episodes from done-like fields, policy versions) read only
    those fields. Missing trajectory files are listed, not refused. --sample-draws shows how
    N draws of a strategy spread over the window's trajectories against the expected shares.
    Long lists are summarised unless --all; --jsonl streams one object per trajectory. With
    several paths, each is shown in turn and the exit status is 1 if any could not be read.
    """
    if sample_draws is None:
        if strategy is not Strategy.uniform or k is not None or seed is not None:
            raise typer.BadParameter("--strategy, --k and --seed apply only with --sample-draws")
    else:
        refuse_k_without_topk(strategy, k)
        if output.jsonl:
            raise typer.BadParameter("--jsonl lists the trajectories only", param_hint="--sample-draws")

    from rbtool.errors import RbtoolError, UsageError
    from rbtool.ops.stats import DrawRequest, collect_stats

    draws = None
    if sample_draws is not None:
        draws = DrawRequest(sample_draws, strategy.value, k, temperature, seed)
    enabled = show_progress(output.json or output.jsonl) and not index_only

    from rbtool.passes.journal import input_journal

    @contextmanager
    def one(path: str) -> Iterator[dict[str, Any]]:
        """The statistics of `path`, named as given (a URL, not the local mirror they were read from)."""
        with reading(path, storage_option, data=not index_only, enabled=enabled, stream=True) as place:
            with progress_bar("reading the index", None, enabled) as advance:  # gone before the report
                doc = collect_stats(
                    place.local,
                    window=window,
                    index_only=index_only,
                    bins=bins,
                    draws=draws,
                    progress=advance,
                    jobs=passes.jobs,
                    # one journal per input: with several paths, each its own subdirectory of DIR
                    journal=passes.journal if len(paths) == 1 else input_journal(passes.journal, path),
                    as_json=False,  # numpy columns and lazy file names: cut or streamed below
                    read_data=not output.jsonl,  # JSON Lines list the trajectories, not the data statistics
                )
            if "path" in doc:
                doc["path"] = place.show(doc["path"])
            if doc.get("rank_dirs"):
                doc["rank_dirs"] = [place.show(d) for d in doc["rank_dirs"]]
            yield doc

    if len(paths) == 1:  # one path: exactly the output (and errors) of a single checkpoint
        with one(paths[0]) as doc:
            if output.jsonl:
                print_jsonl(trajectory_rows(doc["trajectories"], doc["path"]))
            elif output.json:
                print_json(summarised(doc, output.limit), output.pretty)
            else:
                render(doc, every=output.all_items, wide=wide)
        return

    documents: list[dict[str, Any]] = []
    failed = shown = 0
    for path in paths:
        with ExitStack() as stack:
            try:
                doc = stack.enter_context(one(path))
            except UsageError:
                raise
            except RbtoolError as exc:
                failed += 1
                print_error(str(exc))
                documents.append({"path": str(path), "error": str(exc)})
                continue
            if output.jsonl:
                print_jsonl(trajectory_rows(doc["trajectories"], doc["path"]))
            elif output.json:
                documents.append(summarised(doc, output.limit))
            else:
                if shown:
                    out.print()  # a blank line between sections
                render(doc, every=output.all_items, wide=wide)
                shown += 1
    if output.json:
        print_json({"ok": not failed, "paths": documents}, output.pretty)
    if failed:
        if not output.json and not output.jsonl:
            print_error(f"{failed} of {len(paths)} paths could not be read")
        raise typer.Exit(1)


ROW_BLOCK = 65536  # JSON Lines rows are built from the columns this many at a time


def trajectory_rows(columns: dict[str, Any], path: str) -> Iterator[dict[str, Any]]:
    """One dict per listed trajectory: `path`, then the keys of the `trajectories` columns, block by block."""
    keys = list(columns)
    n = len(columns["id"])
    for start in range(0, n, ROW_BLOCK):
        stop = min(n, start + ROW_BLOCK)
        block = []
        for key in keys:
            col = columns[key]
            part = [None] * (stop - start) if col is None else col[start:stop]
            block.append(part.tolist() if hasattr(part, "tolist") else part)
        yield from ({"path": path, **dict(zip(keys, row, strict=True))} for row in zip(*block, strict=True))


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
    bound(files, "not_files", limit)
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
def render(doc: dict[str, Any], every: bool = False, wide: bool = False) -> None:
    """Everything on one screen: header lines, then the tables.

    Long tables show their first and last rows; `every` (--all) shows every row. At a
    terminal, tables leave out columns that do not fit (`wide` keeps them) and
    model_weights_ids are shortened to unique prefixes; piped, everything is whole.
    """
    idx, files, win = doc["index"], doc["files"], doc["window"]
    ids = id_runs(doc["trajectories"]["id"], HEADER_RUNS)
    seed = "no seed" if idx["seed"] is None else f"seed {idx['seed']}"
    out.print(
        Text.assemble(
            (printable(doc["path"]), "bold"),
            f"  {idx['trajectory_format']}  {seed}  ·  "
            f"{count(idx['size'], 'trajectory', 'trajectories')}, "
            f"{count(idx['total_samples'], 'sample')}  ·  "
            f"ids {ids}  ·  counter {idx['trajectory_counter']}  ·  "
            f"{count(idx['model_weights_ids'], 'model_weights_id')}",
        )
    )
    if doc.get("renumbered"):
        from rbtool.files.dirs import RENUMBERED_NOTE

        out.print(RENUMBERED_NOTE, style="yellow", markup=False, highlight=False)
    if files["checked"]:
        line = Text(f"files: {files['present']} present, {size(files['bytes'])}")
        if files["missing"]:
            limit = None if every else MISSING_SHOWN
            line.append(
                f"  {files['missing']} missing (ids {id_runs(files['missing_ids'], limit)}): "
                "left out of the window",
                "yellow",
            )
        odd = files.get("not_files") or []
        if odd:
            what = ", ".join(f"id {o['trajectory_id']} is {o['is']}" for o in head(odd, MISSING_SHOWN))
            more = f" ... {left_out(odd, MISSING_SHOWN)} more" if left_out(odd, MISSING_SHOWN) else ""
            line.append(f"  {len(odd)} not a regular file ({what}{more}): left out of the window", "yellow")
        out.print(line)
    else:
        out.print(f"files: not opened (--index-only); recorded sizes {size(files['bytes'])}")
    import numpy as np

    rows = doc["trajectories"]
    every_id = np.asarray(rows["id"], dtype=np.int64)
    listed = every_id if rows["exists"] is None else every_id[np.asarray(rows["exists"], dtype=bool)]
    kept = every_id[np.asarray(rows["in_window"], dtype=bool)]
    out.print(window_line(win["requested"], kept, listed), markup=False)
    lo, hi = win["probability_min"], win["probability_max"]
    held = (
        f"window: {count(win['trajectories'], 'trajectory', 'trajectories')}, "
        f"{count(win['samples'], 'sample')}"
    )
    if lo is not None:
        spread = f"{num(lo)} each" if lo == hi else f"{num(lo)} to {num(hi)} per trajectory"
        held += f", p(draw) {spread}"
    out.print(held)
    if idx["size"] == 0:
        return

    whole = wide or out.piped
    names = {} if whole else unique_prefixes(g["model_weights_id"] for g in doc["model_weights"])
    out.print(trajectory_table(doc, every, names, wide))
    if doc["schema"]:
        out.print(schema_table(doc["schema"], wide))
    data = doc["data"]
    if data is not None and data["trajectories_read"]:
        out.print(data_table(data, wide))
        if doc.get("journal") is not None:
            from rbtool.passes.journal import journal_note

            out.print(journal_note(doc["journal"]), markup=False)
        out.print(episode_line(data))
        version_line(data)
        if data.get("doctor_hints"):
            out.print(
                f"run rbtool doctor: {', '.join(data['doctor_hints'])} (it names the trajectories, "
                "fields and steps)",
                style="yellow",
                markup=False,
                highlight=False,
            )
    out.print(weights_table(doc, every, wide))
    if doc["draws"] is not None:
        draws_view(doc["draws"], every, wide)


def trajectory_table(
    doc: dict[str, Any], every: bool = False, names: dict[str, str] | None = None, wide: bool = False
) -> Fitted:
    """One row per trajectory (first and last rows of a long list); `names` shortens model_weights_ids."""
    rows = doc["trajectories"]
    names = names or {}
    columns = [
        Column("id", right=True),
        Column("TxB", drop=1),
        Column("samples", right=True),
        Column("model_weights_id"),
        Column("file", right=True, drop=2),
        Column("p(draw)", right=True),
        Column("", drop=3),
    ]
    import numpy as np

    probs = rows["draw_probability"]
    top = float(np.max(probs)) if len(probs) else 0.0
    cells: list[list[str | Text]] = []
    odd = {o["trajectory_id"]: o["is"] for o in doc["files"].get("not_files") or []}
    for pos in shown_positions(len(rows["id"]), every):
        if pos is None:
            cells.append(["…", "", f"{len(rows['id']) - 2 * HEAD_ROWS} more", "", "", "", ""])
            continue
        exists = rows["exists"]
        state = (
            size(rows["file_bytes"][pos])
            if exists is None or exists[pos]
            else Text(odd.get(int(rows["id"][pos]), "missing"), style="red")
        )
        weights_id = rows["model_weights_id"][pos]
        cells.append(
            [
                str(rows["id"][pos]),
                f"{rows['T'][pos]}x{rows['B'][pos]}",
                f"{rows['num_samples'][pos]}",
                names.get(weights_id, weights_id) or "(empty)",
                state,
                num(probs[pos]) if rows["in_window"][pos] else "-",
                bar(probs[pos], top, 10),
            ]
        )
    caption = None
    if len(rows["id"]) > 2 * HEAD_ROWS + 2:
        caption = f"p(draw) over the list: {sparkline(bucketed(probs))}"
    return Fitted(columns, cells, caption=caption, wide=wide)


def schema_table(schema: list[dict[str, Any]], wide: bool = False) -> Fitted:
    """Field, dtype, per-sample shape, extra rows (only when some field has them), trajectories, bytes."""
    extra_rows = any(any(row["extra_rows"]) for row in schema)
    columns = [
        Column("field"),
        Column("dtype"),
        Column("per sample"),
        *([Column("extra rows", drop=2)] if extra_rows else []),
        Column("trajectories", right=True, drop=1),
        Column("size", right=True),
    ]
    cells: list[list[str | Text]] = []
    for row in schema:
        shape = "(1-dim, not sampled)" if row["per_sample_shape"] is None else str(row["per_sample_shape"])
        rows_text = ",".join(map(str, row["extra_rows"])) if any(row["extra_rows"]) else ""
        extra = [rows_text] if extra_rows else []
        name = Text(printable(row["field"]), style="" if row["sampled"] else "dim")
        cells.append([name, row["dtype"], shape, *extra, f"{row['trajectories']}", size(row["bytes"])])
    caption = None
    if not all(row["sampled"] for row in schema):
        caption = "dim: not in sampled batches (missing from some window trajectory, or fewer than 2 dims)"
    return Fitted(columns, cells, caption=caption, wide=wide)


def data_table(data: dict[str, Any], wide: bool = False) -> Fitted:
    """Count, mean, std, min, max and a histogram of rewards, episodes and staleness."""
    columns = [
        Column(""),
        *(Column(name, right=True) for name in ("count", "mean", "std", "min", "max")),
        Column("histogram", drop=1),
    ]
    cells: list[list[str | Text]] = []
    if data["rewards"] is not None:
        cells.append(dist_row("reward", data["rewards"]))
    episodes = data["episodes"]
    if episodes is not None:
        cells.append(dist_row("episode length", episodes["length"]))
        cells.append(dist_row("episode return", episodes["return"]))
    versions = data["versions"]
    if versions is not None:
        cells.append(dist_row("staleness", versions["staleness_summary"]))
    caption = (
        f"read {count(data['trajectories_read'], 'trajectory', 'trajectories')}, "
        f"{size(data['bytes_read'])} of rewards, done-like fields and versions"
        + f" in {data['seconds']:.2f} s ({count(data['jobs'], 'job')})"
        + (f" ({size(data['pkl_bytes_read'])} of whole .pkl files)" if data["pkl_bytes_read"] else "")
    )
    return Fitted(columns, cells, caption=caption, wide=wide)


def episode_line(data: dict[str, Any]) -> str:
    e = data["episodes"]
    if e is None:
        return "episodes: no done-like field"
    return (
        f"episodes: {e['finished']} finished ({e['terminated']} terminated, "
        f"{e['truncated']} truncated, "
        f"{e['other']} other), {e['open']} open at a trajectory's end, "
        f"{e['partial_start']} began before their trajectory"
    )


def version_line(data: dict[str, Any]) -> None:
    v = data["versions"]
    if v is None:
        return
    spread = "  ".join(f"{num(x['version'])}: {x['samples']}" for x in v["values"][:8])
    more = " ..." if len(v["values"]) > 8 else ""
    out.print(f"versions (samples): {spread}{more}  ·  newest {num(v['newest'])}")


def group_ids(doc: dict[str, Any], wanted: set[str]) -> dict[str, list[int]]:
    """The ids of each model_weights_id in `wanted`, in list order (one pass over the columns)."""
    rows = doc["trajectories"]
    found: dict[str, list[int]] = {name: [] for name in wanted}
    if not wanted:
        return found
    for tid, name in zip(rows["id"], rows["model_weights_id"], strict=True):
        if name in found:
            found[name].append(int(tid))
    return found


def weights_table(doc: dict[str, Any], every: bool = False, wide: bool = False) -> Fitted:
    """One row per model_weights_id: trajectories, samples, samples in the window, and its id runs."""
    groups = doc["model_weights"]
    columns = [
        Column("model_weights_id"),
        Column("trajectories", right=True),
        Column("samples", right=True),
        Column("in window", right=True, drop=1),
        Column("ids", wrap=True),
    ]
    positions = shown_positions(len(groups), every)
    # A group whose ids fill first..last is one run; the others need their ids looked up.
    gaps = {
        groups[p]["model_weights_id"]
        for p in positions
        if p is not None and groups[p]["trajectories"] != groups[p]["last_id"] - groups[p]["first_id"] + 1
    }
    ids = group_ids(doc, gaps)
    cells: list[list[str | Text]] = []
    for pos in positions:
        if pos is None:
            cells.append([f"… {len(groups) - 2 * HEAD_ROWS} more", "", "", "", ""])
            continue
        g = groups[pos]
        name = g["model_weights_id"]
        if name in ids:
            runs = id_runs(ids[name], HEADER_RUNS)
        else:
            runs = str(g["first_id"]) if g["first_id"] == g["last_id"] else f"{g['first_id']}-{g['last_id']}"
        counts = [f"{g['trajectories']}", f"{g['samples']}", f"{g['window_samples']}"]
        cells.append([name or "(empty)", *counts, runs])
    return Fitted(columns, cells, wide=wide)


def draws_view(d: dict[str, Any], every: bool = False, wide: bool = False) -> None:
    how = d["strategy"] if d["strategy"] == "uniform" else f"topk k={d['k']} T={num(d['temperature'])}"
    c = d["concentration"]
    out.print(
        Text.assemble(
            (f"{count(d['n'], 'draw')} ({how}, seed {d['seed']})", "bold"),
            f" over {count(d['window_samples'], 'sample')}, {count(d['candidates'], 'candidate')}, "
            f"{d['distinct_samples_drawn']} distinct drawn  ·  total variation {num(d['total_variation'])}",
        )
    )
    rows = d["trajectories"]
    columns = [
        Column("id", right=True),
        Column("draws", right=True),
        Column("observed", right=True),
        Column("expected", right=True),
        Column("observed | expected", drop=1),
    ]
    top = max([*rows["observed"], *rows["expected"]], default=0.0)
    cells: list[list[str | Text]] = []
    for pos in shown_positions(len(rows["id"]), every):
        if pos is None:
            cells.append(["…", f"{len(rows['id']) - 2 * HEAD_ROWS} more", "", "", ""])
            continue
        obs, exp = rows["observed"][pos], rows["expected"][pos]
        plot = Text(bar(obs, top).ljust(BAR_WIDTH), style="cyan") + Text(" " + bar(exp, top), style="dim")
        cells.append([str(rows["id"][pos]), f"{rows['draws'][pos]}", num(obs), num(exp), plot])
    caption = None
    if len(rows["id"]) > 2 * HEAD_ROWS + 2:
        caption = f"draws per trajectory: {sparkline(bucketed([float(x) for x in rows['draws']]))}"
    out.print(Fitted(columns, cells, caption=caption, wide=wide))
    flag = Text("CONCENTRATED", style="red") if c["concentrated"] else Text("spread")
    out.print(
        Text.assemble(
            flag,
            f": half the draws on {count(c['samples_holding_half_of_draws'], 'sample')} (expected "
            f"{c['samples_holding_half_of_probability']}); flagged below {num(c['threshold_samples'])} "
            f"(5% of the window's samples)",
        )
    )
