"""`rbtool verify --deep` against `cat files | sha256sum`, side by side in one run.

The deep pass reads every byte of every trajectory file, hashes it and loads it safely; the
floor for that on a machine is reading and hashing the same bytes, which `cat | sha256sum`
measures. The goal (issue 9: deep passes on all cores) is within 1.5x of that floor. The
script times, interleaved and as medians, `cat | sha256sum`, one process reading and hashing
with hashlib (OpenSSL, often faster than coreutils), and `verify --deep` with `--jobs 1` and
`--jobs N` (N = the cores, at least 2), and prints each against the first two and the
speed-up from 1 to N jobs. Data is bench.py's checkpoint (built once, reused), page cache
warm for every run.

With `--tiny [N]` it measures files per second instead, on a checkpoint of N (default 20,000)
one-transition trajectories (T=1, B=1, ~7 KB .pt files written by torch.save, an index as the
reference implementation writes it; built once under --workdir, reused): `verify --deep` with
the default jobs and with `--jobs 1`, each a fresh process, start-up included. Goal: at least
5,000 files/s with the default jobs.

    .venv/bin/python benchmarks/bench_deep.py            # ~2.3 GiB checkpoint
    .venv/bin/python benchmarks/bench_deep.py --quick    # small checkpoint, seconds
    .venv/bin/python benchmarks/bench_deep.py --tiny     # 20,000 tiny files
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
TINY_GOAL = 5000  # files/s verify --deep checks on one-transition trajectories, default jobs
TINY_DEFAULT = 20_000
PER_VERSION = 1000  # tiny trajectories per policy version (model_weights_id)


def ensure_tiny(workdir: Path, n: int) -> Path:
    """A checkpoint of `n` one-transition trajectories (T=1, B=1, ~6 KB .pt files written by
    torch.save) with an index as the reference implementation writes it; built once, reused."""
    import torch

    final = workdir / f"tiny_{n}"
    if (final / "metadata.json").is_file():
        bench.log(f"reusing {final}")
        return final
    partial = workdir / f".tiny_{n}.partial"
    bench.remove(partial)
    partial.mkdir(parents=True)
    bench.log(f"building {final} ({n} one-transition trajectories)")
    entries: dict[str, Any] = {}
    for tid in range(n):
        weights = bench.weights_id(tid // PER_VERSION)
        traj = bench.synthetic_trajectory(1, 1, 16, tid, weights)
        torch.save(traj, partial / f"trajectory_{tid}_{weights}.pt")
        entries[str(tid)] = {
            "num_samples": 1,
            "trajectory_id": tid,
            "max_episode_length": 1,
            "shape": [1, 1, 7],
            "model_weights_id": weights,
        }
    index = {"trajectory_index": entries, "trajectory_id_list": list(range(n))}
    (partial / "trajectory_index.json").write_text(json.dumps(index))
    metadata = {
        "trajectory_format": "pt",
        "size": n,
        "total_samples": n,
        "trajectory_counter": n,
        "seed": 1234,
    }
    (partial / "metadata.json").write_text(json.dumps(metadata))
    partial.rename(final)
    return final


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


def split_tiny(args: list[str]) -> tuple[int | None, list[str]]:
    """(N of `--tiny [N]`, or None without it; the other arguments)."""
    if "--tiny" not in args:
        return None, args
    at = args.index("--tiny")
    if at + 1 < len(args) and args[at + 1].isdigit():
        n, rest = int(args[at + 1]), args[:at] + args[at + 2 :]
    else:
        n, rest = TINY_DEFAULT, args[:at] + args[at + 1 :]
    if n < 1:
        raise SystemExit(f"--tiny takes a number of files >= 1, got {n}")
    return n, rest


def tiny_main(n: int, cfg: bench.Config, as_json: bool) -> int:
    """Files per second of `verify --deep` on `n` one-transition trajectories."""
    ckpt = ensure_tiny(cfg.workdir, n)
    files = sorted(ckpt.glob("trajectory_*_*.pt"))
    size = sum(f.stat().st_size for f in files)
    cores = len(os.sched_getaffinity(0))
    rbtool = [*bench.rbtool_argv(), "verify", str(ckpt), "--deep"]
    timed(rbtool)  # warm the page cache (and the interpreter's files)
    keys = ("default_jobs", "jobs_1")
    argv = {"default_jobs": rbtool, "jobs_1": [*rbtool, "--jobs", "1"]}
    runs: dict[str, list[float]] = {k: [] for k in keys}
    load_before = os.getloadavg()
    for _ in range(cfg.repeats):  # interleaved, so a noisy moment hits both alike
        for key in keys:
            runs[key].append(timed(argv[key]))
    load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in runs.items()}
    rate = {k: len(files) / med[k] for k in keys}
    doc: dict[str, Any] = {
        **document_head(ckpt, files, size, cores, cfg.repeats, runs, med),
        "files_per_second": rate,
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "goal_files_per_second": TINY_GOAL,
        "met": rate["default_jobs"] >= TINY_GOAL,
    }
    if as_json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"verify --deep on {ckpt} ({len(files)} one-transition files, {size / 2**20:.0f} MiB), "
        f"medians of {cfg.repeats}, a fresh process each (start-up included):"
    )
    labels = {"default_jobs": f"default jobs ({cores} cores)", "jobs_1": "--jobs 1"}
    for key in keys:
        print(f"  {labels[key]:<24} {med[key]:7.2f} s  {rate[key]:8.0f} files/s")
    print(
        f"  goal: >= {TINY_GOAL} files/s with the default jobs: {'met' if doc['met'] else 'NOT met'} "
        f"({rate['default_jobs']:.0f} files/s); load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after"
    )
    return 0


def document_head(
    ckpt: Path, files: list[Path], size: int, cores: int, repeats: int, runs: Any, med: Any
) -> dict[str, Any]:
    """The keys both documents (the image checkpoint's and the tiny one's) begin with."""
    return {
        "checkpoint": str(ckpt),
        "files": len(files),
        "bytes": size,
        "cores": cores,
        "repeats": repeats,
        "runs_seconds": runs,
        "median_seconds": med,
    }


def main(argv: list[str] | None = None) -> int:
    as_json, args = bench.split_json_flag(argv)
    tiny, args = split_tiny(args)
    cfg = bench.parse_args(args)
    if tiny is not None:
        return tiny_main(tiny, cfg, as_json)
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
        **document_head(ckpt, files, size, cores, cfg.repeats, runs, med),
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
