"""`rbtool verify --deep` over 1 and 2 torchrun ranks, side by side in one run.

The same deep pass (bench.py's checkpoint, page cache warm) is timed, interleaved and as
medians, as a plain process (no torchrun), under `torchrun --standalone --nproc_per_node=1`
and under `--nproc_per_node=2` (each rank with its default share of the cores, so every
variant uses the whole machine), and the script prints the 1-rank / 2-rank ratio. On one
node the ranks share its cores: the ratio shows what spreading costs or gains there (rank
start-up, the gloo rendezvous, gathering the results), not what K nodes would give. Every
variant's report is checked to be the same (apart from timings) before a figure is shown.

    .venv/bin/python benchmarks/bench_ranks.py            # bench.py's ~2.3 GiB checkpoint
    .venv/bin/python benchmarks/bench_ranks.py --quick    # small checkpoint, seconds
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench

TORCHRUN = Path(sys.executable).with_name("torchrun")
UNTIMED = ("seconds", "bytes_per_second", "jobs")


def timed(argv: list[str]) -> tuple[float, dict[str, Any]]:
    """Wall time of a run and its report without the keys that differ between runs."""
    torchrun_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in torchrun_vars}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{argv[:6]} failed: {done.stderr[-600:]}")
    doc = json.loads(done.stdout)
    for key in UNTIMED:
        doc.pop(key, None)
    return elapsed, doc


def main(argv: list[str] | None = None) -> int:
    as_json, args = bench.split_json_flag(argv)
    cfg = bench.parse_args(args)
    if not TORCHRUN.exists():
        raise SystemExit(f"{TORCHRUN}: torchrun is not installed next to this Python")
    ckpt, files, size = bench.checkpoint_files(cfg)
    command = ["-m", "rbtool", "verify", str(ckpt), "--deep", "--json"]
    variants = {
        "process": [sys.executable, *command],
        "ranks_1": [str(TORCHRUN), "--standalone", "--nproc_per_node=1", *command],
        "ranks_2": [str(TORCHRUN), "--standalone", "--nproc_per_node=2", *command],
    }
    _, reference = timed(variants["process"])  # warm-up: the page cache, and the report to match
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(cfg.repeats):  # interleaved, so a noisy moment hits every variant alike
        for key, argv_ in variants.items():
            elapsed, doc = timed(argv_)
            if doc != reference:  # every run's report is one process's
                raise SystemExit(f"{argv_[:4]}: the report differs from one process's")
            runs[key].append(elapsed)
    med = {k: statistics.median(v) for k, v in runs.items()}
    doc: dict[str, Any] = {
        "checkpoint": str(ckpt),
        "files": len(files),
        "bytes": size,
        "cores": len(os.sched_getaffinity(0)),
        "repeats": cfg.repeats,
        "runs_seconds": runs,
        "median_seconds": med,
        "throughput_bytes_per_second": {k: size / v for k, v in med.items()},
        # > 1: two ranks finish the pass sooner than one
        "speedup_1_to_2_ranks": med["ranks_1"] / med["ranks_2"],
        "torchrun_overhead_1_rank": med["ranks_1"] / med["process"],
        "same_report": True,
    }
    if as_json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"verify --deep on {ckpt} ({len(files)} files, {size / 2**30:.2f} GiB), medians of {cfg.repeats}:")
    labels = {
        "process": "one process (no torchrun)",
        "ranks_1": "torchrun, 1 rank",
        "ranks_2": "torchrun, 2 ranks",
    }
    for key, label in labels.items():
        print(f"  {label:<27} {med[key]:7.2f} s  {size / med[key] / 1e6:8.0f} MB/s")
    print(
        f"  1 -> 2 ranks: {doc['speedup_1_to_2_ranks']:.2f}x faster; torchrun with 1 rank takes "
        f"{doc['torchrun_overhead_1_rank']:.2f}x one process's time; reports identical"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
