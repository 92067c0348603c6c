"""The whole stats document of a directory: its index, schema, data and draw parts put together."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np

from rbtool.errors import NeedsTrajectoryFilesError, UsageError
from rbtool.files.dirs import checkpoint_dirs, open_view
from rbtool.files.index import DEFAULT_SEED, Index, read_index
from rbtool.ops.stats.data import data_report
from rbtool.ops.stats.draws import DrawRequest, draws_report
from rbtool.ops.stats.index import IndexHeader, LazyColumn, file_sizes, index_report, index_table, read_table
from rbtool.ops.stats.summary import DEFAULT_BINS
from rbtool.passes.journal import open_journal
from rbtool.passes.pool import check_jobs
from rbtool.progress import Progress, start_phase


def collect_stats(
    path: str | Path,
    *,
    window: int = 0,
    index_only: bool = False,
    bins: int = DEFAULT_BINS,
    draws: DrawRequest | None = None,
    progress: Progress | None = None,
    as_json: bool = True,
    read_data: bool = True,
    jobs: int | None = None,
    journal: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """The whole stats document of a checkpoint or buffer directory.

    `as_json=False` gives the per-trajectory columns as numpy arrays and file names as a
    LazyColumn: a view that shows a few rows need not build a million-item list per column.
    `read_data=False` looks at file sizes but opens no trajectory file (`schema` and `data`
    stay None), for a listing of the trajectories alone.

    Missing trajectory files are reported, not refused. With `index_only`, only the JSON
    files are read (no torch import unless draws are asked for), and top-k draws, which
    need rewards, are refused. The data part reads files on `jobs` worker processes
    (default: the cores this process may use), shared among the ranks under torchrun; with
    `journal` (a directory) each file read is recorded there and a rerun takes the recorded
    results of unchanged files (rbtool.passes.journal).
    """
    if jobs is not None:
        check_jobs(jobs)
    if bins < 1:
        raise UsageError(f"bins must be >= 1, got {bins}")
    if draws is not None and index_only and draws.strategy == "topk":
        raise NeedsTrajectoryFilesError("top-k draws need rewards from the trajectory files")
    directory = Path(path)
    index: Index | None = None
    sizes: np.ndarray | None = None
    dirs = checkpoint_dirs(directory)
    # a rank tree reads as the merge of its ranks (SPEC §4), each file from its own rank
    view = open_view(directory, check_files=False) if dirs != [directory] else None
    if index_only and view is None:
        header, table = read_table(directory)
    else:
        index = read_index(directory) if view is None else view.index
        header, table = IndexHeader.of(index), index_table(index)
    file_of: Callable[[int], Path] = (
        view.file_of if view is not None else (lambda tid: directory / cast(Index, index).file_name(tid))
    )
    if not index_only:
        assert index is not None
        start_phase(progress, index.size, "looking at trajectory files")
        sizes = file_sizes(file_of, index, progress, directory if view is None else None)
    doc: dict[str, Any] = {
        "path": str(directory),
        "rank_dirs": [str(d) for d in dirs] if view is not None else [],
        "renumbered": view is not None and view.renumbered,
        "index_only": index_only,
    }
    report, in_window = index_report(header, table, window, sizes, as_json)
    if view is not None:  # a rank tree's files live in its rank directories
        ids, file_of_id = view.index.id_list, view.file_of
        if as_json:
            report["trajectories"]["file"] = [str(file_of_id(i).relative_to(directory)) for i in ids]
        else:
            report["trajectories"]["file"] = LazyColumn(
                len(ids), lambda pos: str(file_of_id(ids[pos]).relative_to(directory))
            )
    doc.update(report)
    doc["schema"] = doc["data"] = doc["journal"] = None
    scores: dict[int, np.ndarray] | None = None
    if index is not None and sizes is not None and read_data:
        opened = open_journal(journal, {"command": "stats", "input": str(directory.absolute())})
        exists = sizes >= 0
        start_phase(progress, int(exists.sum()), "reading trajectories")
        doc["schema"], doc["data"], scores = data_report(
            file_of,
            index,
            table,
            exists,
            in_window,
            bins,
            progress,
            jobs,
            sizes,
            opened,
        )
        doc["journal"] = None if opened is None else opened.counts()
    doc["draws"] = None
    if draws is not None:
        seed = (
            draws.seed
            if draws.seed is not None
            else (header.seed if header.seed is not None else DEFAULT_SEED)
        )
        doc["draws"] = draws_report(
            table.ids[in_window].tolist(), table.num_samples[in_window].tolist(), draws, seed, scores
        )
    return doc
