#!/usr/bin/env python
"""Buffers of tiny trajectories: N one-transition files ([1, 1, ...] tensors), rbtool against TorchRL.

RLinf's RLT algorithm stores one transition per trajectory, so a real buffer holds 10^5-10^6
tiny files. For each size (default 20,000 and 1,000,000) the script builds, once, a checkpoint
of N such files written the way RLinf writes them (one `torch.save` per file, index and
metadata with RLinf's keys only; no recorded schema), then measures in fresh processes:

- rbtool: `TrajectoryReplayBuffer(sample_window_size=0)` + `load_checkpoint`: the load (the
  median of `--loads` fresh processes, one after another: single loads of a million files
  on a shared two-core machine spread over 8.3-13.7 s, once 26 s), the first `--first-calls`
  `sample(256)` calls of the last (first, median, sum; the first call is the first sample
  after a foreign load), then `--calls` steady calls;
- TorchRL: `ReplayBuffer(storage=LazyTensorStorage(N), sampler=RandomSampler(),
  batch_size=256)` extended with the same transitions flattened the way rbtool's batches hold
  them (the file reads are timed apart from the extend and from sampling), the same first
  calls and the same steady calls.

The parent asks each process in turn for one steady `sample()` (a noisy moment hits both
alike; each times its own call); minor page faults are counted inside each call and each
process's peak RSS is split into anonymous memory and mapped files. At 1,000,000 the CLI
commands (stats, stats --index-only, verify --deep, doctor, ingest, reshard) run as fresh
processes, each capped at --budget seconds. Prints one table, or one JSON document with
--json; progress goes to stderr.

    .venv/bin/python benchmarks/bench_tiny.py               # 20,000 and 1,000,000 (builds ~8 GB once)
    .venv/bin/python benchmarks/bench_tiny.py --quick       # 2,000, no CLI figures
    .venv/bin/python benchmarks/bench_tiny.py --sizes 1000000 --build-only   # only build the data
    .venv/bin/python benchmarks/bench_tiny.py --sizes 1000000 --no-cli --no-torchrl   # rbtool's side
    .venv/bin/python benchmarks/bench_tiny.py --sizes 1000000 --cli-only --commands stats,ingest
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench
import bench_torchrl
import numpy as np

GOAL_STEADY = 1.0  # TorchRL's steady median / rbtool's, at least
GOAL_FIRST_CALLS = 2.0  # rbtool's median over the first calls / TorchRL's steady median, at most
GOAL_FIRST_SAMPLE_S = 1.0  # first sample after a foreign load, under
GOAL_LOAD_SMALL_S = 1.0  # load_checkpoint up to 20,000 trajectories, at most
GOAL_LOAD_LARGE_S = 10.0  # load_checkpoint above 20,000 (judged at 1,000,000), at most
LOAD_SMALL_LIMIT = 20_000
CLI_SIZE = 1_000_000  # the CLI figures are taken by default at sizes of at least this
FILE_DISK_BYTES = 8 << 10  # a 6.4 kB file takes two 4 KiB blocks
TORCHRL_CHUNK = 10_000  # files loaded, flattened and extended at a time (bounds the loading memory)
PROGRESS_EVERY_S = 10.0
STAGING = ".staging"  # inside the .partial directory while it is built

log = bench.log
fmt_x = bench_torchrl.fmt_x


@dataclass
class Config:
    sizes: list[int]
    calls: int
    first_calls: int
    num_chunks: int
    budget_s: float
    cli: bool | None  # None: at sizes >= CLI_SIZE
    jobs: int
    build_only: bool
    commands: list[str] | None  # CLI figures taken (None: all of CLI_COMMANDS)
    no_torchrl: bool  # rbtool's side only
    cli_only: bool  # only the CLI figures, at every size
    workdir: Path
    quick: bool
    json: bool
    loads: int = 3  # fresh processes timing rbtool's load; the judged figure is their median


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def parse_args(argv: list[str]) -> Config:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="Size 2,000 only, no CLI figures.")
    parser.add_argument("--json", action="store_true", help="Print one JSON document instead of the table.")
    parser.add_argument("--workdir", type=Path, default=bench.DEFAULT_WORKDIR, help="Where data is built.")
    parser.add_argument("--sizes", help="Comma-separated trajectory counts (default 20000,1000000).")
    parser.add_argument("--calls", type=int, help="Steady sample() calls per side, in turn (default 50).")
    parser.add_argument(
        "--first-calls", type=int, default=200, help="sample() calls right after the load (default 200)."
    )
    parser.add_argument("--num-chunks", type=int, default=256, help="Rows per sample() call (default 256).")
    parser.add_argument(
        "--loads",
        type=int,
        help="Fresh processes that time rbtool's load, one after another; the load figure is their "
        "median (default 3; 1 with --quick).",
    )
    parser.add_argument(
        "--budget", type=float, default=900.0, help="Seconds a CLI command may take (default 900)."
    )
    parser.add_argument(
        "--cli",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Take the CLI figures at the largest size (default: only at sizes of 1,000,000 or more).",
    )
    parser.add_argument(
        "--jobs", type=int, default=usable_cores(), help="Processes that build the data (default: cores)."
    )
    parser.add_argument("--build-only", action="store_true", help="Build the data sets and exit.")
    parser.add_argument(
        "--commands",
        help=f"Comma-separated CLI figures to take (default all: {', '.join(c[0] for c in CLI_COMMANDS)}).",
    )
    parser.add_argument(
        "--no-torchrl", action="store_true", help="rbtool's side only (no TorchRL process, no ratios)."
    )
    parser.add_argument(
        "--cli-only",
        action="store_true",
        help="Only the CLI figures, at every size (no sampling, no TorchRL).",
    )
    args = parser.parse_args(argv)
    commands = None
    if args.commands:
        commands = [c.strip() for c in args.commands.split(",") if c.strip()]
        unknown = sorted(set(commands) - {c[0] for c in CLI_COMMANDS})
        if unknown:
            parser.error(f"--commands: unknown {', '.join(unknown)}")
    quick = bool(args.quick)
    if args.sizes:
        try:
            sizes = sorted({int(s.replace("_", "")) for s in args.sizes.split(",")})
        except ValueError:
            parser.error(f"--sizes takes comma-separated counts, got {args.sizes!r}")
    else:
        sizes = [2000] if quick else [20_000, 1_000_000]
    calls = args.calls if args.calls is not None else (20 if quick else 50)
    loads = args.loads if args.loads is not None else (1 if quick else 3)
    if min(sizes) < 1 or min(calls, args.first_calls, args.num_chunks, args.jobs, loads) < 1:
        parser.error("sizes, --calls, --first-calls, --num-chunks, --jobs and --loads must be >= 1")
    return Config(
        sizes=sizes,
        calls=calls,
        first_calls=args.first_calls,
        num_chunks=args.num_chunks,
        budget_s=args.budget,
        cli=False if quick and args.cli is None else args.cli,
        jobs=args.jobs,
        build_only=bool(args.build_only),
        commands=commands,
        cli_only=bool(args.cli_only),
        no_torchrl=bool(args.no_torchrl),
        workdir=args.workdir.resolve(),
        quick=quick,
        json=bool(args.json),
        loads=loads,
    )


# --------------------------------------------------------------------------- data
def file_name(tid: int) -> str:
    return f"trajectory_{tid}_{bench.weights_id(tid // 1000)}.pt"


def write_files(job: tuple[str, list[int]]) -> int:
    """Pool task: torch.save one one-transition trajectory per id, each published by a rename.

    Each file is written under its own name in a staging folder (torch.save names the archive's
    root after the file, as RLinf's files have it) and renamed into place when whole.
    """
    import torch

    torch.set_num_threads(1)
    directory, tids = Path(job[0]), job[1]
    staging = directory / STAGING
    for tid in tids:
        traj = bench.synthetic_trajectory(1, 1, 16, tid, bench.weights_id(tid // 1000))
        torch.save(traj, staging / file_name(tid))
        os.replace(staging / file_name(tid), directory / file_name(tid))
    return len(tids)


def trajectory_files(path: Path) -> set[str]:
    with os.scandir(path) as entries:
        return {e.name for e in entries if e.name.startswith("trajectory_") and e.name.endswith(".pt")}


def complete(path: Path, n: int) -> bool:
    """True if `path` holds the index and metadata of n trajectories and n trajectory files."""
    try:
        meta = json.loads((path / "metadata.json").read_text())
        raw = json.loads((path / "trajectory_index.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        meta.get("size") == n
        and len(raw.get("trajectory_id_list", [])) == n
        and len(trajectory_files(path)) == n
    )


def ensure_tiny(cfg: Config, n: int) -> tuple[Path, dict[str, Any]]:
    """tiny_<n>/: n one-transition trajectories as RLinf writes them; (path, how it was obtained).

    Files are written into a hidden .partial directory by a pool of --jobs processes, each
    file renamed into place when whole; an interrupted build resumes from the files there.
    """
    final = cfg.workdir / f"tiny_{n}"
    if complete(final, n):
        log(f"reusing {final}")
        return final, {"reused": True, "build_s": None, "files_written": 0}
    bench.remove(final)
    partial = cfg.workdir / f".{final.name}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    present = trajectory_files(partial)
    bench.remove(partial / STAGING)  # files an interrupted build left half written
    (partial / STAGING).mkdir()
    todo = [tid for tid in range(n) if file_name(tid) not in present]
    need = len(todo) * FILE_DISK_BYTES + n * 200  # files, index and metadata
    free = shutil.disk_usage(partial).free
    if need > free * 0.95:
        raise SystemExit(
            f"not enough free disk space to build {final}: it needs about {bench.fmt_bytes(need)} "
            f"more, {bench.fmt_bytes(free)} is free under {cfg.workdir}. Free some space, pass "
            "--workdir on a larger file system, or choose smaller --sizes."
        )
    resumed = f", resuming: {len(present):,} files already there" if present else ""
    log(
        f"building {final}: {n:,} one-transition files, {cfg.jobs} processes, "
        f"about {bench.fmt_bytes(need)} of {bench.fmt_bytes(free)} free{resumed}"
    )
    start = last = time.perf_counter()
    done = 0
    chunk = 500
    jobs = [(str(partial), todo[i : i + chunk]) for i in range(0, len(todo), chunk)]
    with multiprocessing.get_context("fork").Pool(cfg.jobs) as pool:
        for count in pool.imap_unordered(write_files, jobs):
            done += count
            now = time.perf_counter()
            if now - last >= PROGRESS_EVERY_S or done == len(todo):
                rate = done / (now - start)
                eta = (len(todo) - done) / rate if rate else 0.0
                log(f"  {done:,}/{len(todo):,} files, {rate:,.0f} files/s, {eta:,.0f} s left")
                last = now
    entries = {
        str(tid): {
            "num_samples": 1,
            "trajectory_id": tid,
            "max_episode_length": 1,
            "shape": [1, 1, 7],
            "model_weights_id": bench.weights_id(tid // 1000),
        }
        for tid in range(n)
    }
    index = {"trajectory_index": entries, "trajectory_id_list": list(range(n))}
    (partial / "trajectory_index.json").write_text(json.dumps(index))
    meta = {"trajectory_format": "pt", "size": n, "total_samples": n, "trajectory_counter": n, "seed": 1234}
    (partial / "metadata.json").write_text(json.dumps(meta))
    (partial / STAGING).rmdir()
    partial.rename(final)
    build_s = time.perf_counter() - start
    log(f"built {final} in {build_s:.1f} s")
    return final, {"reused": False, "build_s": build_s, "files_written": len(todo)}


def available_memory() -> int:
    """Memory the system can give without swapping: MemAvailable (free memory and the page
    cache it may drop), or the free pages where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def warm(path: Path, n: int) -> str:
    """Read every file once when the data fits easily in memory, so the page cache is warm."""
    size = n * FILE_DISK_BYTES
    if size > available_memory() // 2:
        return "not warmed (larger than half the available memory)"
    log(f"warming the page cache: reading {n:,} files of {path.name}")
    for name in os.listdir(path):
        with open(path / name, "rb") as handle:
            while handle.read(1 << 20):
                pass
    return "warm"


# ------------------------------------------------------------------- workers
def timed_calls(sample: Any, count: int) -> tuple[Any, list[float], list[int]]:
    """`count` calls of sample(): the first batch, each call's seconds and minor page faults."""
    times, faults, first = [], [], None
    for _ in range(count):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        batch = sample()
        times.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        if first is None:
            first = batch
    return first, times, faults


def calls_summary(times: list[float], faults: list[int]) -> dict[str, Any]:
    return {
        "count": len(times),
        "first_s": times[0],
        "median_s": bench.median(times),
        "sum_s": float(sum(times)),
        "minor_faults_per_call": bench.median([float(f) for f in faults]),
    }


def load_torchrl(ckpt: Path, num_chunks: int) -> tuple[Any, dict[str, Any]]:
    """A ReplayBuffer over LazyTensorStorage(N) holding every transition of `ckpt`, flattened as
    rbtool's batches hold them; the file reads are timed apart from the flatten + extend."""
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers.samplers import RandomSampler

    raw = json.loads((ckpt / "trajectory_index.json").read_text())
    entries, ids = raw["trajectory_index"], raw["trajectory_id_list"]
    rows = sum(int(entries[str(i)]["num_samples"]) for i in ids)
    buffer = ReplayBuffer(storage=LazyTensorStorage(rows), sampler=RandomSampler(), batch_size=num_chunks)
    read_s = build_s = 0.0
    last = time.perf_counter()
    for first in range(0, len(ids), TORCHRL_CHUNK):
        start = time.perf_counter()
        trajs = [
            torch.load(ckpt / file_name(tid), map_location="cpu", weights_only=True)
            for tid in ids[first : first + TORCHRL_CHUNK]
        ]
        read_s += time.perf_counter() - start
        start = time.perf_counter()
        flat = bench.EagerSampler.concat([bench.EagerSampler.flatten(t) for t in trajs])
        count = int(next(iter(bench.flat_tensors(flat).values())).shape[0])
        buffer.extend(TensorDict(flat, batch_size=[count]))
        build_s += time.perf_counter() - start
        if time.perf_counter() - last >= PROGRESS_EVERY_S:
            log(f"  torchrl: {first + len(trajs):,}/{len(ids):,} files loaded and extended")
            last = time.perf_counter()
    return buffer, {"rows": rows, "files": len(ids), "read_s": read_s, "build_s": build_s}


def worker(kind: str, ckpt: Path, num_chunks: int, first_calls: int) -> int:
    """One side in its own process: load, the first calls, then answers `sample` (its own time
    and minor faults for one call) and `memory` on stdout, one JSON line each."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what libraries print does not mix with the answers
    sys.stdout = sys.stderr
    ready: dict[str, Any] = {}
    if kind == "torchrl":
        if not isinstance(bench_torchrl.torchrl_versions(), dict):
            return 1
        buffer, info = load_torchrl(ckpt, num_chunks)
        ready.update(info)

        def sample() -> Any:
            return buffer.sample()
    else:
        from rbtool import TrajectoryReplayBuffer

        start = time.perf_counter()
        ours = TrajectoryReplayBuffer(seed=bench.SEED, sample_window_size=0)
        constructed = time.perf_counter()
        ours.load_checkpoint(ckpt)
        ready.update(construct_s=constructed - start, load_s=time.perf_counter() - constructed)

        def sample() -> Any:
            return ours.sample(num_chunks)

    batch, times, faults = timed_calls(sample, first_calls)
    ready["first_calls"] = calls_summary(times, faults)
    ready["memory_after_first_calls"] = bench_torchrl.memory_now()
    tensors = bench_torchrl.leaves(batch)
    ready["fields"] = {k: [str(v.dtype), list(v.shape[1:])] for k, v in tensors.items()}
    ready["batch_rows"] = int(next(iter(tensors.values())).shape[0]) if tensors else 0
    ready["batch_bytes"] = bench_torchrl.nbytes(tensors)
    del batch, tensors
    channel.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        command = line.strip()
        if command == "sample":
            _, seconds, minflt = timed_calls(sample, 1)
            channel.write(json.dumps([seconds[0], minflt[0]]) + "\n")
        elif command == "memory":
            channel.write(json.dumps(bench_torchrl.memory_now()) + "\n")
        else:
            break
    return 0


class Worker(bench_torchrl.Worker):
    """A worker process of this script and its command channel (OMP threads sleep when idle)."""

    def __init__(self, kind: str, ckpt: Path, cfg: Config) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--ckpt", str(ckpt)]
        argv += ["--num-chunks", str(cfg.num_chunks), "--first-calls", str(cfg.first_calls)]
        self.kind = kind
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )
        self.ready = None


def batch_copy_s(nbytes: int) -> float:
    """Median time of one numpy copy of `nbytes` bytes (the batch's size), after a warm-up."""
    src = np.ones(max(1, nbytes), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(51):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return float(statistics.median(times))


# ------------------------------------------------------------------ measurements
def measure_sampling(
    ckpt: Path, n: int, cfg: Config, torchrl_ok: bool, memcpy: dict[str, Any]
) -> dict[str, Any]:
    """Both sides in their own processes: load and first calls one after the other (each alone),
    then the steady calls in turn."""
    loads: list[float] = []
    for run in range(1, cfg.loads):  # loads alone first; the last one stays for the calls
        log(f"{n:,}: rbtool load_checkpoint in a fresh process ({run} of {cfg.loads})")
        alone = Worker("rbtool", ckpt, replace(cfg, first_calls=1))
        try:
            loads.append(float(alone.answer()["load_s"]))
        finally:
            alone.close()
    log(f"{n:,}: rbtool load_checkpoint + {cfg.first_calls} x sample({cfg.num_chunks}) in a fresh process")
    workers: dict[str, Worker] = {}
    torchrl_error = None
    try:
        workers["rbtool"] = Worker("rbtool", ckpt, cfg)
        workers["rbtool"].ready = workers["rbtool"].answer()
        loads.append(float(workers["rbtool"].ready["load_s"]))
        if torchrl_ok:
            log(f"{n:,}: torchrl read + extend, {cfg.first_calls} x sample({cfg.num_chunks}), fresh process")
            workers["torchrl"] = Worker("torchrl", ckpt, cfg)
            try:
                workers["torchrl"].ready = workers["torchrl"].answer()
            except RuntimeError as exc:  # e.g. out of memory at 1M: rbtool's figures still count
                log(f"{n:,}: {exc}")
                torchrl_error = str(exc)
                workers.pop("torchrl").close()
        log(f"{n:,}: {cfg.calls} steady calls each, {', '.join(workers)} in turn")
        times: dict[str, list[float]] = {name: [] for name in workers}
        faults: dict[str, list[int]] = {name: [] for name in workers}
        for _ in range(cfg.calls):
            for name, w in workers.items():
                seconds, minflt = w.ask("sample")
                times[name].append(float(seconds))
                faults[name].append(int(minflt))
        memory = {name: w.ask("memory") for name, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()

    sides: dict[str, Any] = {}
    for name, w in workers.items():
        ready = dict(w.ready or {})
        steady = calls_summary(times[name], faults[name])
        sides[name] = {
            **{k: v for k, v in ready.items() if k != "fields"},
            "steady_s": steady["median_s"],
            "steady_minor_faults_per_call": steady["minor_faults_per_call"],
            **memory[name],
        }
    rb = sides["rbtool"]
    rb["load_runs_s"] = loads
    rb["load_s"] = float(statistics.median(loads))  # the judged figure
    trl = sides.get("torchrl")
    nbytes = rb["batch_bytes"]
    result: dict[str, Any] = {
        "trajectories": n,
        "checkpoint": str(ckpt),
        "rbtool": rb,
        "torchrl": trl,
        "torchrl_error": torchrl_error,
        "same_fields": None
        if trl is None
        else workers["rbtool"].ready["fields"] == workers["torchrl"].ready["fields"],
        "fields": workers["rbtool"].ready["fields"],
        "batch_bytes": nbytes,
        "memcpy_floor_s": nbytes / memcpy["bytes_per_s"],
        "batch_copy_s": batch_copy_s(nbytes),
        "first_sample_after_load": {
            "load_s": rb["load_s"],
            "first_sample_s": rb["first_calls"]["first_s"],
            "load_and_sample_s": rb["load_s"] + rb["first_calls"]["first_s"],
        },
        "steady_ratio": None if trl is None else bench.ratio(trl["steady_s"], rb["steady_s"]),
        "first_calls_ratio": None
        if trl is None or trl["steady_s"] <= 0
        else rb["first_calls"]["median_s"] / trl["steady_s"],
    }
    return result


CLI_COMMANDS: list[tuple[str, tuple[str, ...], list[str], bool]] = [
    # name, command path, arguments after DIR (OUT is replaced), whether it writes OUT
    ("stats", ("stats",), [], False),
    ("stats_index_only", ("stats",), ["--index-only"], False),
    ("verify_deep", ("verify",), ["--deep"], False),
    ("doctor", ("doctor",), [], False),
    ("ingest", ("ingest",), ["--buffer", "OUT"], True),
    ("reshard", ("reshard",), ["--world-size", "4", "--out", "OUT"], True),
]


def measure_cli(ckpt: Path, n: int, cfg: Config) -> dict[str, Any]:
    """Each command as a fresh process through bench.py's launcher, capped at --budget seconds."""
    out = cfg.workdir / f".tiny-cli-out-{os.getpid()}"
    timeout = shutil.which("timeout")
    result: dict[str, Any] = {}
    for name, path, extra, writes in CLI_COMMANDS:
        if cfg.commands is not None and name not in cfg.commands:
            continue
        options = bench.cli_options(*path)
        needed = {a for a in extra if a.startswith("--")}
        if options is None or not needed <= options:
            reason = (
                "command missing"
                if options is None
                else f"option {' '.join(sorted(needed - options))} missing"
            )
            result[name] = {**bench.missing(reason), "files_per_s": None, "budget_s": cfg.budget_s}
            continue
        argv = [*bench.rbtool_argv(), *path, str(ckpt), *[str(out) if a == "OUT" else a for a in extra]]
        cap = [timeout, "-k", "10", f"{cfg.budget_s:g}"] if timeout else []
        log(f"{n:,}: rbtool {' '.join(argv[len(bench.rbtool_argv()) :])} (budget {cfg.budget_s:g} s)")
        bench.remove(out)
        if writes:
            os.sync()  # one run's write-back does not slow the next
        try:
            run = bench.run_child([*cap, *argv])
        finally:
            bench.remove(out)
        timed_out = bool(cap) and run.exit_code in (124, 137, -9)
        status = "not finished" if timed_out else ("crashed" if bench.crashed(run) else "ok")
        result[name] = {
            "status": status,
            "argv": argv[len(bench.rbtool_argv()) :],
            "wall_s": run.wall_s,
            "files_per_s": None if timed_out else n / run.wall_s,
            "peak_rss_bytes": run.peak_rss_bytes,
            "exit_code": run.exit_code,
            "stderr_tail": f"not finished in {cfg.budget_s:g} s" if timed_out else run.stderr_tail,
            "budget_s": cfg.budget_s,
        }
    return result


# -------------------------------------------------------------------------- goals
def goals(doc: dict[str, Any]) -> list[bench.Goal]:
    found: list[bench.Goal] = []
    for key, s in doc["sizes"].items():
        n = s["trajectories"]
        if s.get("cli_only"):
            continue

        def goal(name: str, target: str, value: float | None, ok: bool, key: str = key) -> None:
            found.append(bench.Goal(f"{name}_{key}", target, value, None if value is None else ok))

        steady = s["steady_ratio"]
        goal(
            "torchrl_over_rbtool_steady",
            f">= {GOAL_STEADY:g}x",
            steady,
            steady is not None and steady >= GOAL_STEADY and bool(s["same_fields"]),
        )
        first = s["first_calls_ratio"]
        goal(
            "rbtool_first_calls_over_torchrl_steady",
            f"<= {GOAL_FIRST_CALLS:g}x",
            first,
            first is not None and first <= GOAL_FIRST_CALLS,
        )
        bound = GOAL_LOAD_SMALL_S if n <= LOAD_SMALL_LIMIT else GOAL_LOAD_LARGE_S
        load = s["rbtool"]["load_s"]
        goal("rbtool_load_s", f"<= {bound:g} s", load, load <= bound)
        fs = s["first_sample_after_load"]["first_sample_s"]
        goal("first_sample_after_load_s", f"< {GOAL_FIRST_SAMPLE_S:g} s", fs, fs < GOAL_FIRST_SAMPLE_S)
    return found


# -------------------------------------------------------------------------- output
def load_cell(rb: dict[str, Any]) -> str:
    """The judged load (the median of the fresh processes' loads) and their range."""
    runs = rb.get("load_runs_s") or [rb["load_s"]]
    fmt_s = bench.fmt_s
    if len(runs) == 1:
        return fmt_s(rb["load_s"])
    return f"{fmt_s(rb['load_s'])} (median of {len(runs)}: {fmt_s(min(runs))}-{fmt_s(max(runs))})"


def rss_cell(side: dict[str, Any]) -> str:
    fmt_b = bench.fmt_bytes
    return (
        f"{fmt_b(side['peak_rss_bytes'])} ({fmt_b(side['rss_anon_bytes'])} + {fmt_b(side['rss_file_bytes'])})"
    )


def render(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    fmt_s, fmt_b, fmt_met = bench.fmt_s, bench.fmt_bytes, bench.fmt_met
    cfg = doc["config"]
    met = {g["name"]: g for g in doc["goals"]}
    console = Console(width=max(170, shutil.get_terminal_size((170, 40)).columns))
    v = doc["versions"]
    console.print(
        f"one-transition trajectories ([1, 1, ...], 16x16x3 images) written like RLinf; "
        f"sample({cfg['num_chunks']}); first {cfg['first_calls']} calls after the load, then the "
        f"median of {cfg['calls']} steady calls each, in turn, one process per side; "
        f"memcpy {fmt_b(doc['memcpy']['bytes_per_s'])}/s"
        + (f"; torch {v['torch']}, torchrl {v['torchrl']}, tensordict {v['tensordict']}" if v else ""),
        highlight=False,
        markup=False,
    )
    if doc["torchrl_skipped"]:
        console.print(f"TorchRL comparison skipped: {doc['torchrl_skipped']}", highlight=False, markup=False)
    table = Table(title="tiny trajectories (medians; ratios as named)")
    for column in ("figure", "rbtool", "TorchRL", "ratio", "goal", "met"):
        table.add_column(column, justify="right" if column == "ratio" else "left")

    def judged(name: str) -> tuple[str, str]:
        g = met[name]
        return g["target"], fmt_met(g["met"])

    for key, s in doc["sizes"].items():
        n = f"{s['trajectories']:,}"
        build = doc["data"][key]
        made = "reused" if build["reused"] else f"built in {build['build_s']:.1f} s"
        table.add_row(f"[bold]{n} trajectories[/bold] ({s['page_cache']}; data {made})", "", "", "", "", "")
        if s.get("cli_only"):
            cli_rows(table, s)
            continue
        rb, trl = s["rbtool"], s["torchrl"] or {}
        if s["torchrl_error"]:
            table.add_row("  TorchRL side FAILED", "", s["torchrl_error"][:100], "", "", "")
        table.add_row(
            "  load_checkpoint / TorchRL: read files + extend",
            load_cell(rb),
            f"{fmt_s(trl.get('read_s'))} + {fmt_s(trl.get('build_s'))}" if trl else "n/a",
            "",
            *judged(f"rbtool_load_s_{key}"),
        )
        f = s["first_sample_after_load"]
        table.add_row(
            "  first sample after a foreign load (fresh process)",
            f"{fmt_s(f['first_sample_s'])} (load + first {fmt_s(f['load_and_sample_s'])})",
            "",
            "",
            *judged(f"first_sample_after_load_s_{key}"),
        )
        fc, tfc = rb["first_calls"], trl.get("first_calls")
        table.add_row(
            f"  first {fc['count']} calls: first / median / sum",
            f"{fmt_s(fc['first_s'])} / {fmt_s(fc['median_s'])} / {fmt_s(fc['sum_s'])}",
            f"{fmt_s(tfc['first_s'])} / {fmt_s(tfc['median_s'])} / {fmt_s(tfc['sum_s'])}" if tfc else "n/a",
            fmt_x(s["first_calls_ratio"]) + " (rbtool / TorchRL steady)",
            *judged(f"rbtool_first_calls_over_torchrl_steady_{key}"),
        )
        target, ok = judged(f"torchrl_over_rbtool_steady_{key}")
        fields = "" if s["same_fields"] is not False else " FIELDS DIFFER"
        table.add_row(
            "  steady sample(), in turn",
            fmt_s(rb["steady_s"]),
            fmt_s(trl.get("steady_s")) if trl else "n/a",
            fmt_x(s["steady_ratio"]) + " (TorchRL / rbtool)",
            target,
            ok + fields,
        )
        table.add_row(
            "  minor page faults per call: first calls / steady",
            f"{fc['minor_faults_per_call']:,.0f} / {rb['steady_minor_faults_per_call']:,.0f}",
            f"{tfc['minor_faults_per_call']:,.0f} / {trl['steady_minor_faults_per_call']:,.0f}"
            if tfc
            else "n/a",
            "",
            "",
            "",
        )
        table.add_row(
            "  batch: bytes; memcpy floor / one copy of its bytes",
            f"{fmt_b(s['batch_bytes'])}; {fmt_s(s['memcpy_floor_s'])} / {fmt_s(s['batch_copy_s'])}",
            fmt_b(trl.get("batch_bytes")) if trl else "n/a",
            "",
            "",
            "same fields" if s["same_fields"] else ("" if s["same_fields"] is None else "FIELDS DIFFER"),
        )
        table.add_row(
            "  peak RSS (anon + file at the end)",
            rss_cell(rb),
            rss_cell(trl) if trl else "n/a",
            "",
            "",
            "",
        )
        cli_rows(table, s)
    console.print(table)
    if cfg["quick"]:
        console.print("quick mode: the goals are set for 20,000 / 1,000,000 trajectories", highlight=False)


def cli_rows(table: Any, s: dict[str, Any]) -> None:
    """One row per CLI figure of a size (and its last stderr line)."""
    fmt_b, fmt_s = bench.fmt_bytes, bench.fmt_s
    for name, c in (s["cli"] or {}).items():
        if c["status"] == "missing":
            cell = f"n/a ({c['reason']})"
        else:
            cell = f"{fmt_s(c['wall_s'])}, peak {fmt_b(c['peak_rss_bytes'])}, exit {c['exit_code']}"
            if c["files_per_s"] is not None:
                cell += f", {c['files_per_s']:,.0f} files/s"
            if c["status"] != "ok":
                cell += f" {c['status'].upper()}"
        shown = [
            {s["checkpoint"]: "DIR"}.get(a, "OUT" if ".tiny-cli-out-" in a else a)
            for a in c["argv"] or [name]
        ]
        table.add_row(f"  rbtool {' '.join(shown)}", cell, "", "", "", "")
        if c.get("stderr_tail"):
            table.add_row("    last stderr line", str(c["stderr_tail"])[:100], "", "", "", "")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--worker"]:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", choices=["rbtool", "torchrl"])
        parser.add_argument("--ckpt", type=Path)
        parser.add_argument("--num-chunks", type=int)
        parser.add_argument("--first-calls", type=int)
        w = parser.parse_args(args)
        return worker(w.worker, w.ckpt, w.num_chunks, w.first_calls)
    cfg = parse_args(args)
    started = time.perf_counter()
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {}
    ckpts: dict[int, Path] = {}
    for n in cfg.sizes:
        ckpts[n], data[str(n)] = ensure_tiny(cfg, n)
        data[str(n)]["path"] = str(ckpts[n])
    if cfg.build_only:
        log(f"built: {', '.join(str(p) for p in ckpts.values())}")
        return 0
    versions = bench_torchrl.torchrl_versions()
    skipped = None if isinstance(versions, dict) else versions
    if cfg.no_torchrl:
        skipped = "--no-torchrl"
    if skipped:
        log(f"TorchRL comparison skipped: {skipped}")
    memcpy = bench.memcpy_speed(5)
    cli_at = (
        {cfg.sizes[-1]}
        if cfg.cli
        else (set() if cfg.cli is False else {n for n in cfg.sizes if n >= CLI_SIZE})
    )
    sizes: dict[str, Any] = {}
    for n in cfg.sizes:
        if cfg.cli_only:
            sizes[str(n)] = {"trajectories": n, "checkpoint": str(ckpts[n]), "cli_only": True}
            sizes[str(n)]["page_cache"] = warm(ckpts[n], n)
            sizes[str(n)]["cli"] = measure_cli(ckpts[n], n, cfg)
            continue
        page_cache = warm(ckpts[n], n)
        sizes[str(n)] = measure_sampling(ckpts[n], n, cfg, skipped is None, memcpy)
        sizes[str(n)]["page_cache"] = page_cache
        sizes[str(n)]["cli"] = measure_cli(ckpts[n], n, cfg) if n in cli_at else None
    doc: dict[str, Any] = {
        "config": {
            "sizes": cfg.sizes,
            "calls": cfg.calls,
            "first_calls": cfg.first_calls,
            "loads": cfg.loads,
            "num_chunks": cfg.num_chunks,
            "budget_s": cfg.budget_s,
            "cli_sizes": sorted(cli_at),
            "jobs": cfg.jobs,
            "quick": cfg.quick,
            "workdir": str(cfg.workdir),
        },
        "versions": versions if isinstance(versions, dict) else None,
        "torchrl_skipped": skipped,
        "memcpy": memcpy,
        "data": data,
        "sizes": sizes,
    }
    doc["goals"] = [asdict(g) for g in goals(doc)]
    doc["elapsed_s"] = time.perf_counter() - started
    if cfg.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        render(doc)
    log(f"done in {doc['elapsed_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
