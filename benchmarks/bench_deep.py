"""`rbtool verify --deep` against `cat files | sha256sum`, side by side in one run.

The deep pass reads every byte of every trajectory file, hashes it and loads it safely; the
floor for that on a machine is reading and hashing the same bytes, which `cat | sha256sum`
measures. The goal (issue 9: deep passes on all cores) is within 1.5x of that floor. The
script times, interleaved and as medians, `cat | sha256sum`, one process reading and hashing
with hashlib (OpenSSL, often faster than coreutils), and `verify --deep` with `--jobs 1` and
`--jobs N` (N = the cores, at least 2), and prints each against the first two and the
speed-up from 1 to N jobs. Data is bench.py's checkpoint (built once, reused), page cache
warm for every run.

    .venv/bin/python benchmarks/bench_deep.py            # ~2.3 GiB checkpoint
    .venv/bin/python benchmarks/bench_deep.py --quick    # small checkpoint, seconds
"""

from __future__ import annotations

import hashlib
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


def hash_floor(files: list[Path]) -> float:
    """Read every file once and hash it with hashlib (OpenSSL), in this process: one core's floor."""
    started = time.perf_counter()
    for name in files:
        with open(name, "rb") as handle:
            hashlib.sha256(handle.read()).hexdigest()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    as_json, args = bench.split_json_flag(argv)
    cfg = bench.parse_args(args)
    ckpt, files, size = bench.checkpoint_files(cfg)
    cores = len(os.sched_getaffinity(0))
    many = max(2, cores)
    rbtool = [*bench.rbtool_argv(), "verify", str(ckpt), "--deep"]
    listing = ckpt / ".files"
    listing.write_text("\0".join(map(str, files)))
    baseline_cmd = [f"xargs -0 cat < {listing} | sha256sum"]
    timed(baseline_cmd, shell=True)  # warm the page cache
    keys = ("sha256sum", "hashlib", "jobs_1", f"jobs_{many}")
    runs: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(cfg.repeats):  # interleaved, so a noisy moment hits every variant alike
        runs["sha256sum"].append(timed(baseline_cmd, shell=True))
        runs["hashlib"].append(hash_floor(files))
        runs["jobs_1"].append(timed([*rbtool, "--jobs", "1"]))
        runs[f"jobs_{many}"].append(timed([*rbtool, "--jobs", str(many)]))
    listing.unlink()
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = {k: med[k] / med["sha256sum"] for k in ("jobs_1", f"jobs_{many}")}
    doc: dict[str, Any] = {
        "checkpoint": str(ckpt),
        "files": len(files),
        "bytes": size,
        "cores": cores,
        "repeats": cfg.repeats,
        "runs_seconds": runs,
        "median_seconds": med,
        "throughput_bytes_per_second": {k: size / v for k, v in med.items()},
        # time of verify --deep over time of cat | sha256sum: <= GOAL meets the goal
        "verify_vs_sha256sum": ratio,
        "verify_vs_hashlib": {k: med[k] / med["hashlib"] for k in ("jobs_1", f"jobs_{many}")},
        "speedup_1_to_n_jobs": med["jobs_1"] / med[f"jobs_{many}"],
        "goal": GOAL,
        "met": ratio[f"jobs_{many}"] <= GOAL,
    }
    if as_json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"verify --deep on {ckpt} ({len(files)} files, {size / 2**30:.2f} GiB), medians of {cfg.repeats}:")
    labels = {
        "sha256sum": "cat | sha256sum",
        "hashlib": "read + hashlib, 1 process",
        "jobs_1": "verify --deep --jobs 1",
        f"jobs_{many}": f"verify --deep --jobs {many}",
    }
    for key in keys:
        line = f"  {labels[key]:<27} {med[key]:7.2f} s  {size / med[key] / 1e6:8.0f} MB/s"
        if key in ratio:
            vs_hashlib = doc["verify_vs_hashlib"][key]
            line += f"  {ratio[key]:5.2f}x the time of cat | sha256sum, {vs_hashlib:5.2f}x hashlib's"
        print(line)
    print(
        f"  goal: verify --deep --jobs {many} within {GOAL}x of cat | sha256sum: "
        f"{'met' if doc['met'] else 'NOT met'} ({ratio[f'jobs_{many}']:.2f}x); "
        f"1 -> {many} jobs: {doc['speedup_1_to_n_jobs']:.2f}x faster"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
