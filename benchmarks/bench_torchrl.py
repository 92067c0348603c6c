#!/usr/bin/env python
"""Steady-state sample(256): rbtool against TorchRL's LazyMemmapStorage + RandomSampler, in one run.

Both hold the same rows: bench.py's image checkpoint (200 trajectories of T=50, B=10 with two
64x64x3 uint8 image fields, 2.3 GiB; built once under --workdir and reused). rbtool loads it
with `TrajectoryReplayBuffer(sample_window_size=0)`; TorchRL gets every trajectory flattened
to rows (done-like fields without their bootstrap rows, exactly the fields rbtool's batches
hold) in a `TensorDictReplayBuffer` over a `LazyMemmapStorage` on disk under --workdir,
sampled by `RandomSampler`. The two are called in alternation (a noisy moment hits both
alike) after a warm-up; each figure is the median call. Each one's batch throughput is also
given as a fraction of this machine's memory-copy speed. The goal: rbtool >= 1.5x faster.

torchrl is an optional benchmark dependency (`pip install -e '.[bench]'`); without it the
script says so and exits 0. Prints one table, or one JSON document with --json.

    .venv/bin/python benchmarks/bench_torchrl.py            # 2.3 GiB checkpoint
    .venv/bin/python benchmarks/bench_torchrl.py --quick    # small checkpoint
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench

HERE = Path(__file__).resolve().parent

GOAL = 1.5  # TorchRL's median sample() time / rbtool's, at least
INSTALL_HINT = "pip install -e '.[bench]' (torchrl and tensordict)"


def fmt_x(value: float | None) -> str:
    """A ratio; two decimals below 1, where one would round a slow-down to 0.0x."""
    return "n/a" if value is None else (f"{value:.2f}x" if value < 1 else f"{value:,.1f}x")


def torchrl_versions() -> dict[str, str] | str:
    """The installed torchrl and tensordict versions, or why they cannot be used."""
    try:
        import tensordict
        import torchrl
        from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer  # noqa: F401
        from torchrl.data.replay_buffers.samplers import RandomSampler  # noqa: F401
    except ImportError as exc:
        return f"torchrl is not available ({exc}); install it with {INSTALL_HINT}"
    except Exception as exc:  # an installed torchrl built for another torch fails at import
        return f"torchrl does not load with this torch ({type(exc).__name__}: {exc})"
    import torch

    # torchrl logs to stdout; stdout carries only the result here
    for handler in logging.getLogger("torchrl").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
    return {"torch": torch.__version__, "torchrl": torchrl.__version__, "tensordict": tensordict.__version__}


def build_torchrl(ckpt: Path, store: Path, num_chunks: int) -> tuple[Any, int]:
    """A TensorDictReplayBuffer over a LazyMemmapStorage at `store` holding every row of `ckpt`."""
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
    from torchrl.data.replay_buffers.samplers import RandomSampler

    raw = json.loads((ckpt / "trajectory_index.json").read_text())
    meta = json.loads((ckpt / "metadata.json").read_text())
    entries = raw["trajectory_index"]
    ids = raw["trajectory_id_list"]
    rows = sum(int(entries[str(i)]["num_samples"]) for i in ids)
    bench.remove(store)
    store.parent.mkdir(parents=True, exist_ok=True)
    buffer = TensorDictReplayBuffer(
        storage=LazyMemmapStorage(rows, scratch_dir=store, auto_cleanup=False),
        sampler=RandomSampler(),
        batch_size=num_chunks,
    )
    fmt = meta.get("trajectory_format", "pt")
    for tid in ids:
        path = ckpt / f"trajectory_{tid}_{entries[str(tid)]['model_weights_id']}.{fmt}"
        flat = bench.EagerSampler.flatten(torch.load(path, map_location="cpu", weights_only=True))
        n = int(next(iter(bench.flat_tensors(flat).values())).shape[0])
        buffer.extend(TensorDict(flat, batch_size=[n]))
    return buffer, rows


def leaves(batch: Any) -> dict[str, Any]:
    """Tensor leaves of a rbtool batch (dict) or a TensorDict, by dotted name; TorchRL's `index` aside."""
    if isinstance(batch, dict):
        return bench.flat_tensors(batch)
    return {
        ".".join(key if isinstance(key, tuple) else (key,)): batch.get(key)
        for key in batch.keys(include_nested=True, leaves_only=True)
        if key != "index"
    }


def nbytes(tensors: dict[str, Any]) -> int:
    return sum(int(t.numel() * t.element_size()) for t in tensors.values())


def measure(cfg: bench.Config, calls: int) -> dict[str, Any]:
    from rbtool import TrajectoryReplayBuffer

    ckpt = bench.ensure_checkpoint(cfg)
    versions = torchrl_versions()
    doc: dict[str, Any] = {
        "checkpoint": str(ckpt),
        "checkpoint_bytes": bench.dir_bytes(ckpt),
        "num_chunks": cfg.num_chunks,
        "calls": calls,
        "versions": versions if isinstance(versions, dict) else None,
        "skipped": None if isinstance(versions, dict) else versions,
    }
    doc["memcpy"] = bench.memcpy_speed(cfg.repeats)
    if not isinstance(versions, dict):
        doc.update(rbtool_s=None, torchrl_s=None, ratio=None, met=None)
        return doc

    store = cfg.workdir / f"torchrl_{ckpt.name}"
    bench.log(f"torchrl: LazyMemmapStorage under {store} (rebuilt: every row of {ckpt.name})")
    started = time.perf_counter()
    trl, rows = build_torchrl(ckpt, store, cfg.num_chunks)
    doc["torchrl_build_s"] = time.perf_counter() - started
    doc["rows"] = rows
    doc["torchrl_storage_bytes"] = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())

    ours = TrajectoryReplayBuffer(seed=bench.SEED, sample_window_size=0)
    ours.load_checkpoint(ckpt)
    ours_batch, trl_batch = ours.sample(cfg.num_chunks), trl.sample()  # warm-up
    ours_leaves, trl_leaves = leaves(ours_batch), leaves(trl_batch)
    # same names, dtypes and per-row shapes (a checkpoint smaller than the request gives rbtool
    # fewer rows: it clamps to the window, TorchRL draws with replacement)
    doc["same_fields"] = ours_leaves.keys() == trl_leaves.keys() and all(
        ours_leaves[k].dtype == trl_leaves[k].dtype and ours_leaves[k].shape[1:] == trl_leaves[k].shape[1:]
        for k in ours_leaves
    )
    bench.log(f"sampling: {calls} calls each, rbtool and TorchRL in alternation, sample({cfg.num_chunks})")
    ours_times, trl_times = [], []
    for _ in range(calls):
        start = time.perf_counter()
        ours.sample(cfg.num_chunks)
        ours_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        trl.sample()
        trl_times.append(time.perf_counter() - start)
    ours.close()
    del trl
    bench.remove(store)

    rb_s, trl_s = bench.median(ours_times), bench.median(trl_times)
    bandwidth = doc["memcpy"]["bytes_per_s"]
    doc.update(
        rbtool_s=rb_s,
        torchrl_s=trl_s,
        ratio=bench.ratio(trl_s, rb_s),
        rbtool_batch_bytes=nbytes(ours_leaves),
        torchrl_batch_bytes=nbytes(trl_leaves),
        rbtool_memcpy_fraction=nbytes(ours_leaves) / rb_s / bandwidth,
        torchrl_memcpy_fraction=nbytes(trl_leaves) / trl_s / bandwidth,
    )
    doc["met"] = doc["ratio"] is not None and doc["ratio"] >= GOAL and doc["same_fields"]
    return doc


def render(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    fmt_s, fmt_b = bench.fmt_s, bench.fmt_bytes
    console = Console(width=max(150, shutil.get_terminal_size((150, 40)).columns))
    mem = doc["memcpy"]["bytes_per_s"]
    console.print(
        f"checkpoint {doc['checkpoint']} ({fmt_b(doc['checkpoint_bytes'])}); sample({doc['num_chunks']}), "
        f"median of {doc['calls']} calls each, in alternation, page cache warm; memcpy {fmt_b(mem)}/s",
        highlight=False,
        markup=False,
    )
    if doc["skipped"]:
        console.print(f"TorchRL comparison skipped: {doc['skipped']}", highlight=False, markup=False)
        return
    v = doc["versions"]
    console.print(
        f"torch {v['torch']}, torchrl {v['torchrl']}, tensordict {v['tensordict']}; "
        f"{doc['rows']:,} rows in LazyMemmapStorage ({fmt_b(doc['torchrl_storage_bytes'])}, "
        f"built in {doc['torchrl_build_s']:.1f} s)",
        highlight=False,
        markup=False,
    )
    table = Table(title="steady-state sample (medians; ratio = TorchRL / rbtool)")
    for column in ("figure", "rbtool", "TorchRL", "ratio", "goal", "met"):
        table.add_column(column, justify="right" if column == "ratio" else "left")
    table.add_row(
        f"sample({doc['num_chunks']}), window 0",
        fmt_s(doc["rbtool_s"]),
        fmt_s(doc["torchrl_s"]),
        fmt_x(doc["ratio"]),
        f">= {GOAL:g}x",
        bench.fmt_met(doc["met"]) + ("" if doc["same_fields"] else " FIELDS DIFFER"),
    )
    table.add_row(
        "  batch throughput / memcpy",
        f"{fmt_b(doc['rbtool_batch_bytes'] / doc['rbtool_s'])}/s ({doc['rbtool_memcpy_fraction']:.1%})",
        f"{fmt_b(doc['torchrl_batch_bytes'] / doc['torchrl_s'])}/s ({doc['torchrl_memcpy_fraction']:.1%})",
        "",
        "",
        "",
    )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON document instead of the table.")
    parser.add_argument("--calls", type=int, help="Timed sample() calls each (default 50; quick 10).")
    mine, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    cfg = bench.parse_args(rest)  # --quick, --workdir, --trajectories, --t, --b, --image, --num-chunks, ...
    calls = mine.calls if mine.calls is not None else (10 if cfg.quick else 50)
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    doc = measure(cfg, max(1, calls))
    if doc["skipped"]:
        bench.log(f"TorchRL comparison skipped: {doc['skipped']}")
    if mine.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        render(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
