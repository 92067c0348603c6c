"""`rbtool doctor` against `rbtool verify --deep` on the same checkpoint, side by side in one run.

doctor reads every trajectory file once, as verify --deep does, and then looks at the data
(every check on). Its goal (issue 22) is at most 2x the time of verify --deep. The script
times both, interleaved, as medians, with `--jobs N` (N = the cores, at least 2), and prints
the ratio. Data is bench.py's checkpoint (built once, reused), page cache warm for every run.
bench.py's trajectories are random, so doctor has findings (done flags, pairing) and exits 1;
both exit statuses are accepted, and the report's work is the same either way.

    .venv/bin/python benchmarks/bench_doctor.py            # ~2.3 GiB checkpoint
    .venv/bin/python benchmarks/bench_doctor.py --quick    # small checkpoint, seconds
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

GOAL = 2.0  # doctor at most this many times verify --deep


def timed(argv: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode not in (0, 1) or b"Traceback" in done.stderr:
        raise SystemExit(f"{argv[:3]} failed: {done.stderr.decode(errors='replace')[-400:]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    as_json, args = bench.split_json_flag(argv)
    cfg = bench.parse_args(args)
    ckpt, files, size = bench.checkpoint_files(cfg)
    cores = len(os.sched_getaffinity(0))
    jobs = str(max(2, cores))
    commands = {
        "verify_deep": [*bench.rbtool_argv(), "verify", str(ckpt), "--deep", "--jobs", jobs],
        "doctor": [*bench.rbtool_argv(), "doctor", str(ckpt), "--jobs", jobs],
    }
    timed(commands["verify_deep"])  # warm the page cache
    runs: dict[str, list[float]] = {k: [] for k in commands}
    for _ in range(cfg.repeats):  # interleaved, so a noisy moment hits both alike
        for key, command in commands.items():
            runs[key].append(timed(command))
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = med["doctor"] / med["verify_deep"]
    doc: dict[str, Any] = {
        "checkpoint": str(ckpt),
        "files": len(files),
        "bytes": size,
        "cores": cores,
        "jobs": int(jobs),
        "repeats": cfg.repeats,
        "runs_seconds": runs,
        "median_seconds": med,
        "doctor_vs_verify_deep": ratio,
        "goal": GOAL,
        "met": ratio <= GOAL,
    }
    if as_json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"doctor and verify --deep on {ckpt} ({len(files)} files, {size / 2**30:.2f} GiB), "
        f"medians of {cfg.repeats}:"
    )
    for key, label in (("verify_deep", f"verify --deep --jobs {jobs}"), ("doctor", f"doctor --jobs {jobs}")):
        print(f"  {label:<26} {med[key]:7.2f} s  {size / med[key] / 1e6:8.0f} MB/s")
    print(
        f"  goal: doctor within {GOAL}x of verify --deep: {'met' if doc['met'] else 'NOT met'} ({ratio:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
