"""`rbtool sample`: load a checkpoint into a buffer, draw one batch, show it, optionally save it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from rbtool.cli._consoles import note, out
from rbtool.cli._json import bound, print_json
from rbtool.cli._options import (
    DirArg,
    DryRunOpt,
    KOpt,
    Report,
    SeedOpt,
    StorageOpt,
    Strategy,
    StrategyOpt,
    StrictOpt,
    TemperatureOpt,
    WindowOpt,
    refuse_k_without_topk,
)
from rbtool.cli._output import Column, Fitted, count, printable, side_by_side, size
from rbtool.cli._places import is_url, local_path_arg, reading, refuse_overlap
from rbtool.cli._progress import progress_bar, show_progress
from rbtool.cli._window import DEFAULT_WINDOW, window_line
from rbtool.cli._writing import dry_run_note

SHOWN_DRAWS = 16  # draws listed one per row in the human view
SIDE_BY_SIDE_WIDTH = 110  # fields and draws tables side by side from this terminal width on


def field_rows(batch: dict[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    """[{field, dtype, shape}] for every tensor of a (nested) batch, in batch order."""
    rows: list[dict[str, Any]] = []
    for key, value in batch.items():
        if isinstance(value, dict):
            rows += field_rows(value, f"{prefix}{key}.")
        else:
            rows.append(
                {
                    "field": prefix + key,
                    "dtype": str(value.dtype).removeprefix("torch."),
                    "shape": list(value.shape),
                }
            )
    return rows


def sample(
    path: DirArg,
    num_chunks: Annotated[
        int, typer.Option("--num-chunks", min=1, help="Rows to draw (clamped to the window).")
    ],
    window: WindowOpt = DEFAULT_WINDOW,
    strategy: StrategyOpt = Strategy.uniform,
    k: KOpt = None,
    temperature: TemperatureOpt = 1.0,
    seed: SeedOpt = None,
    strict: StrictOpt = True,
    all_fields: Annotated[
        bool,
        typer.Option(
            "--all-fields",
            help="Also sample the fields RLinf's sampler leaves out (top-level keys outside its "
            "Trajectory fields, dicts nested deeper).",
        ),
    ] = False,
    out_path: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Save the batch here with torch.save (written atomically; missing parents are created).",
            parser=local_path_arg,
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace the --out file if it exists.")] = False,
    dry_run: DryRunOpt = False,
    output: Report = Report(),
    storage_option: StorageOpt = None,
) -> None:
    """Load a checkpoint into a TrajectoryReplayBuffer and draw one batch from its window.

    Shows each field's shape and dtype and which trajectory and row every batch row came
    from; with --out, saves the batch (a dict of [num_chunks, ...] tensors).
    """
    refuse_k_without_topk(strategy, k)
    if out_path is not None:
        if not is_url(path):  # the batch never goes into the checkpoint
            refuse_overlap(out_path, [local_path_arg(path)], "--out")
    else:
        for flag, given in (("--force", force), ("--dry-run", dry_run)):
            if given:
                raise typer.BadParameter("applies only with --out (nothing else writes)", param_hint=flag)

    from rbtool.files.fsutil import check_file_target
    from rbtool.ops.sample import PHASES, phase_count, sample_checkpoint

    if out_path is not None:
        check_file_target(out_path, overwrite=force)  # before anything is read

    # The phases are counted; the files the first sample reads (headers of the window's files,
    # when no schema is recorded) are counted as they are read.
    with (
        reading(path, storage_option, data=False) as place,
        progress_bar(PHASES[0], phase_count(out_path is not None), show_progress(output.json)) as advance,
    ):
        drawn = sample_checkpoint(
            place.local,
            num_chunks,
            window=window,
            strategy=strategy.value,
            k=k,
            temperature=temperature,
            seed=seed,
            strict=strict,
            extra_fields=all_fields,
            out=out_path,
            overwrite=force,
            dry_run=dry_run,
            mirror=place.mirror,
            progress=advance,
        )

    index, window_ids, draw = drawn.index, drawn.window_ids, drawn.draw
    tids = draw.trajectory_ids
    rows = draw.local_indices.tolist()
    widths = [index.entries[t]["shape"][1] for t in tids]
    window_samples = sum(index.entries[t]["num_samples"] for t in window_ids)
    # top-k among more samples than the window holds is top-k among all of them: say so
    k_used = None if k is None else min(k, window_samples)
    if k is not None and k_used is not None and k_used < k:
        note(
            f"--k {k} is more than the window's {count(window_samples, 'sample')}: "
            f"top-k draws among all {window_samples} (k {k_used})"
        )
    doc = {
        "path": place.show(),
        "seed": drawn.seed,
        "window": window,
        "window_trajectories": len(window_ids),
        "window_samples": window_samples,
        "missing_ids": drawn.missing_ids,
        "all_fields": all_fields,
        "strategy": strategy.value,
        "k": k,
        "k_used": k_used,
        "temperature": temperature if strategy is Strategy.topk else None,
        "requested_chunks": num_chunks,
        "num_chunks": len(rows),
        "draws": {
            "trajectory_id": tids,
            "row": rows,
            "t": [r // w for r, w in zip(rows, widths, strict=True)],
            "b": [r % w for r, w in zip(rows, widths, strict=True)],
            "global_index": draw.global_indices.tolist(),
        },
        "fields": field_rows(drawn.batch),
        "out": None if out_path is None else str(out_path),
        "out_bytes": drawn.out_bytes,
        "dry_run": dry_run,
        "fetched": None
        if place.mirror is None
        else {"objects": place.mirror.fetched, "bytes": place.mirror.fetched_bytes},
    }
    if output.json:
        bound(doc, "missing_ids", output.limit)
        print_json(doc, output.pretty)
    else:
        render({**doc, "window_ids": window_ids, "listed_ids": index.id_list})


def render(doc: dict[str, Any]) -> None:
    """The human view: what was drawn from where, the batch's fields, and the saved file."""
    how = doc["strategy"] if doc["strategy"] == "uniform" else f"topk k={doc['k']} T={doc['temperature']:g}"
    window = "all" if doc["window"] == 0 else f"last {doc['window']}"
    out.print(
        Text.assemble(
            (count(doc["num_chunks"], "chunk"), "bold"),
            f" ({how}) from {printable(doc['path'])}  ·  window {window}: "
            f"{count(doc['window_trajectories'], 'trajectory', 'trajectories')}, "
            f"{count(doc['window_samples'], 'sample')}  ·  seed {doc['seed']}",
        )
    )
    if doc["num_chunks"] < doc["requested_chunks"]:
        out.print(Text(f"clamped from {doc['requested_chunks']} to the window's samples", style="yellow"))
    out.print(window_line(doc["window"], doc["window_ids"], doc["listed_ids"]), markup=False)
    if doc["missing_ids"]:
        missing = count(len(doc["missing_ids"]), "trajectory", "trajectories")
        out.print(Text(f"left out {missing} whose files are missing", style="yellow"))

    field_rows = [[r["field"], r["dtype"], str(r["shape"])] for r in doc["fields"]]  # plain text
    fields = Fitted([Column("field"), Column("dtype"), Column("shape")], field_rows)
    d = doc["draws"]
    draw_rows = [
        [str(i), str(d["trajectory_id"][i]), str(d["row"][i]), str(d["t"][i]), str(d["b"][i])]
        for i in range(min(SHOWN_DRAWS, doc["num_chunks"]))
    ]
    if doc["num_chunks"] > SHOWN_DRAWS:
        draw_rows.append(["…", f"{doc['num_chunks'] - SHOWN_DRAWS} more", "", "", ""])
    columns = [Column(name, right=True) for name in ("#", "trajectory", "row", "t", "b")]
    draws = Fitted(columns, draw_rows)
    if not out.piped and out.width >= SIDE_BY_SIDE_WIDTH:
        out.print(side_by_side(fields, draws))
    else:
        out.print(fields)
        out.print(draws)

    counts: dict[int, int] = {}
    for tid in d["trajectory_id"]:
        counts[tid] = counts.get(tid, 0) + 1
    per_traj = ", ".join(f"{tid}: {n}" for tid, n in sorted(counts.items()))
    out.print(f"draws per trajectory: {per_traj}")
    if doc["fetched"] is not None:
        fetched = doc["fetched"]
        out.print(f"fetched {count(fetched['objects'], 'object')} ({size(fetched['bytes'])})", markup=False)
    if doc["out"] is not None and doc["dry_run"]:
        dry_run_note(doc["out"], size(doc["out_bytes"]))
    elif doc["out"] is not None:
        out.print(f"wrote {doc['out']} ({size(doc['out_bytes'])})")
