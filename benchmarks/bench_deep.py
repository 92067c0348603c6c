"""`rbtool verify --deep` against `cat files | sha256sum`, side by side in one run.

The deep pass reads every byte of every trajectory file, hashes it and loads it safely; the
floor for that on a machine is reading and hashing the same bytes, which `cat | sha256sum`
measures. The goal (issue: deep passes on all cores) is within 1.5x of that floor, and
the script also prints the speed-up from 1 to N threads. Data is bench.py's checkpoint
(built once, reused), page cache warm for every run.

    .venv/bin/python benchmarks/bench_deep.py            # ~2.3 GiB checkpoint
    .venv/bin/python benchmarks/bench_deep.py --quick    # small checkpoint, seconds
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

GOAL = 1.5  # verify --deep at most this many times `cat | sha256sum`


def timed(argv: list[str], *, shell: bool = False) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        argv if not shell else " ".join(argv), shell=shell, capture_output=True, check=False
    )
    elapsed = time.perf_counter() - started
    if done.returncode not in (0,):
        raise SystemExit(f"{argv[:3]} failed: {done.stderr.decode(errors='replace')[-400:]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    cfg = bench.parse_args(args)
    ckpt = bench.ensure_checkpoint(cfg)
    files = sorted(str(p) for p in ckpt.glob("trajectory_*_*.pt"))
    size = sum(os.path.getsize(f) for f in files)
    cores = len(os.sched_getaffinity(0))
    rbtool = [*bench.rbtool_argv(), "verify", str(ckpt), "--deep"]
    listing = ckpt / ".files"
    listing.write_text("\0".join(files))
    baseline_cmd = [f"xargs -0 cat < {listing} | sha256sum"]
    timed(baseline_cmd, shell=True)  # warm the page cache
    runs: dict[str, list[float]] = {"sha256sum": [], "jobs_1": [], f"jobs_{cores}": []}
    for _ in range(cfg.repeats):  # interleaved, so a noisy moment hits every variant alike
        runs["sha256sum"].append(timed(baseline_cmd, shell=True))
        runs["jobs_1"].append(timed([*rbtool, "--jobs", "1"]))
        runs[f"jobs_{cores}"].append(timed([*rbtool, "--jobs", str(cores)]))
    listing.unlink()
    med = {k: statistics.median(v) for k, v in runs.items()}
    doc: dict[str, Any] = {
        "checkpoint": str(ckpt),
        "files": len(files),
        "bytes": size,
        "cores": cores,
        "repeats": cfg.repeats,
        "median_seconds": med,
        "throughput_bytes_per_second": {k: size / v for k, v in med.items()},
        "verify_vs_sha256sum": med[f"jobs_{cores}"] / med["sha256sum"],
        "speedup_1_to_n_jobs": med["jobs_1"] / med[f"jobs_{cores}"],
        "goal": GOAL,
        "met": med[f"jobs_{cores}"] / med["sha256sum"] <= GOAL,
    }
    if as_json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"verify --deep on {ckpt} ({len(files)} files, {size / 2**30:.2f} GiB), medians of {cfg.repeats}:")
    for key, seconds in med.items():
        print(f"  {key:<12} {seconds:7.2f} s  {size / seconds / 1e6:8.0f} MB/s")
    print(
        f"  verify --deep --jobs {cores} / cat|sha256sum = {doc['verify_vs_sha256sum']:.2f}x "
        f"(goal <= {GOAL}x: {'met' if doc['met'] else 'NOT met'}); "
        f"1 -> {cores} jobs: {doc['speedup_1_to_n_jobs']:.2f}x faster"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
