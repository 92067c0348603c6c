#!/usr/bin/env python
"""Steady-state sample(256): rbtool against TorchRL's LazyMemmapStorage + RandomSampler, in one run.

Both hold the same rows: bench.py's image checkpoint (200 trajectories of T=50, B=10 with two
64x64x3 uint8 image fields, 2.3 GiB; built once under --workdir and reused). rbtool loads it
with `TrajectoryReplayBuffer(sample_window_size=0)`, in four settings, each in its own
process: the default (the window's rows held in memory, read at load), `hold_rows_budget=0`
(large rows read with pread when drawn), `map_rows=True` (the files mapped side by side, one
index_select per field) and `map_rows=True, map_rows_budget=512 MiB`. TorchRL gets every
trajectory flattened to rows (done-like fields without their bootstrap rows, exactly the
fields rbtool's batches hold) in a `TensorDictReplayBuffer` over a `LazyMemmapStorage` on disk
under --workdir, sampled by `RandomSampler`, in a fifth process. The parent asks each process
for one sample() in turn (a noisy moment hits all alike; each times its own call) after a
warm-up; each figure is the median call. Each one's batch throughput is given as a fraction of
this machine's memory-copy speed, with the minor page faults taken inside the call (median),
and each process's peak RSS is split into anonymous memory and mapped file pages (page
cache). The goals, on the default: rbtool >= 2x faster than TorchRL, and within 3x of a
memcpy of the batch's bytes (from memory out of the cache, measured here too).

torchrl is an optional benchmark dependency (`pip install -e '.[bench]'`); without it the
script says so and exits 0. Prints one table, or one JSON document with --json.

    .venv/bin/python benchmarks/bench_torchrl.py            # 2.3 GiB checkpoint
    .venv/bin/python benchmarks/bench_torchrl.py --quick    # small checkpoint
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench

HERE = Path(__file__).resolve().parent

GOAL = 2.0  # TorchRL's median sample() time / rbtool's default, at least
MEMCPY_GOAL = 3.0  # rbtool's default median sample() / a copy of the batch's bytes, at most
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


# rbtool's settings, each measured in its own process: name -> TrajectoryReplayBuffer keywords.
# The goal is judged on GOAL_SETTING.
BUDGET = 512 << 20
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "rows_from_files": {"hold_rows_budget": 0},
    "map_rows": {"map_rows": True},
    "map_rows_budget": {"map_rows": True, "map_rows_budget": BUDGET},
}
GOAL_SETTING = "default"
FLOOR = "memcpy"  # the process that copies the batch's bytes, asked in turn like the samplers
WARMUP = 5  # sample() calls before timing (the first one maps or opens every file)


def memory_now() -> dict[str, int | None]:
    """This process's peak RSS and its resident anonymous / file-backed memory, from /proc."""
    found: dict[str, int | None] = {"VmHWM": None, "RssAnon": None, "RssFile": None}
    try:
        with open("/proc/self/status") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in found:
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return {
        "peak_rss_bytes": found["VmHWM"],
        "rss_anon_bytes": found["RssAnon"],
        "rss_file_bytes": found["RssFile"],
    }


def worker(kind: str, ckpt: Path, store: Path, num_chunks: int, copy_bytes: int = 0) -> int:
    """One side of the comparison in its own process: answers `sample` (its own time for one
    call) and `memory` on its stdout, one JSON line each; everything else goes to stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what libraries print does not mix with the answers
    sys.stdout = sys.stderr
    ready: dict[str, Any] = {}
    if kind == FLOOR:  # the floor: a copy of the batch's bytes, asked in turn like the samplers
        import numpy as np

        span = max(512 << 20, 4 * copy_bytes)
        source = np.ones(span, dtype=np.uint8)  # pages touched: no fault is timed
        target = np.ones(copy_bytes, dtype=np.uint8)
        turn = [0]

        def sample() -> Any:
            turn[0] += 1  # each copy from a part of the source not read since long ago
            at = (turn[0] * 7 % (span // copy_bytes)) * copy_bytes
            np.copyto(target, source[at : at + copy_bytes])
            return {}

    elif kind == "torchrl":
        if not isinstance(torchrl_versions(), dict):
            return 1
        started = time.perf_counter()
        buffer, rows = build_torchrl(ckpt, store, num_chunks)
        ready.update(build_s=time.perf_counter() - started, rows=rows)
        ready["storage_bytes"] = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())

        def sample() -> Any:
            return buffer.sample()
    else:
        from rbtool import TrajectoryReplayBuffer

        ours = TrajectoryReplayBuffer(seed=bench.SEED, sample_window_size=0, **SETTINGS[kind])
        started = time.perf_counter()
        ours.load_checkpoint(ckpt)
        ready["load_s"] = time.perf_counter() - started

        def sample() -> Any:
            return ours.sample(num_chunks)

    first = time.perf_counter()
    batch = sample()
    ready["first_sample_s"] = time.perf_counter() - first
    for _ in range(WARMUP - 1):
        sample()
    tensors = leaves(batch)
    ready["fields"] = {k: [str(v.dtype), list(v.shape[1:])] for k, v in tensors.items()}
    ready["batch_bytes"] = nbytes(tensors) if kind != FLOOR else copy_bytes
    channel.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        command = line.strip()
        if command == "sample":
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            sample()
            seconds = time.perf_counter() - start
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            channel.write(json.dumps([seconds, faults]) + "\n")
        elif command == "memory":
            channel.write(json.dumps(memory_now()) + "\n")
        else:
            break
    return 0


class Worker:
    """A worker process and its command channel."""

    def __init__(self, kind: str, ckpt: Path, store: Path, num_chunks: int, copy_bytes: int = 0) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--ckpt", str(ckpt)]
        argv += ["--store", str(store), "--num-chunks", str(num_chunks), "--copy-bytes", str(copy_bytes)]
        self.kind = kind
        # idle workers wait on their pipe: their OpenMP threads must sleep, not spin, while
        # another process samples (spinning threads of four processes would share two cores)
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env
        )
        self.ready: dict[str, Any] | None = None

    def answer(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.kind} worker exited (status {self.proc.wait()}); see stderr above")
        return json.loads(line)

    def ask(self, command: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        return self.answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
        self.proc.wait(timeout=120)


def measure(cfg: bench.Config, calls: int) -> dict[str, Any]:
    ckpt = bench.ensure_checkpoint(cfg)
    versions = torchrl_versions()
    doc: dict[str, Any] = {
        "checkpoint": str(ckpt),
        "checkpoint_bytes": bench.dir_bytes(ckpt),
        "num_chunks": cfg.num_chunks,
        "calls": calls,
        "versions": versions if isinstance(versions, dict) else None,
        "skipped": None if isinstance(versions, dict) else versions,
        "goal_setting": GOAL_SETTING,
        "settings": {name: dict(kw) for name, kw in SETTINGS.items()},
    }
    doc["memcpy"] = bench.memcpy_speed(cfg.repeats)
    if not isinstance(versions, dict):
        doc.update(rbtool_s=None, torchrl_s=None, ratio=None, met=None, met_torchrl=None, met_memcpy=None)
        return doc

    store = cfg.workdir / f"torchrl_{ckpt.name}"
    bench.log(f"torchrl: LazyMemmapStorage under {store} (rebuilt: every row of {ckpt.name})")
    workers = {"torchrl": Worker("torchrl", ckpt, store, cfg.num_chunks)}
    try:
        workers["torchrl"].ready = workers["torchrl"].answer()  # built before rbtool's pages are read
        for name in SETTINGS:
            workers[name] = Worker(name, ckpt, store, cfg.num_chunks)
            workers[name].ready = workers[name].answer()
        copy_bytes = int(workers[GOAL_SETTING].ready["batch_bytes"])  # type: ignore[index]
        workers[FLOOR] = Worker(FLOOR, ckpt, store, cfg.num_chunks, copy_bytes)
        workers[FLOOR].ready = workers[FLOOR].answer()
        bench.log(f"sampling: {calls} calls each, {', '.join(workers)} in turn, sample({cfg.num_chunks})")
        times: dict[str, list[float]] = {name: [] for name in workers}
        faults: dict[str, list[float]] = {name: [] for name in workers}
        for _ in range(calls):
            for name, w in workers.items():
                seconds, minflt = w.ask("sample")
                times[name].append(float(seconds))
                faults[name].append(float(minflt))
        memory = {name: w.ask("memory") for name, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
        bench.remove(store)

    ready = {name: w.ready or {} for name, w in workers.items()}
    trl = ready["torchrl"]
    doc.update(rows=trl["rows"], torchrl_build_s=trl["build_s"], torchrl_storage_bytes=trl["storage_bytes"])
    bandwidth = doc["memcpy"]["bytes_per_s"]
    sides: dict[str, dict[str, Any]] = {}
    for name in workers:
        seconds = bench.median(times[name])
        sides[name] = {
            "median_s": seconds,
            "first_sample_s": ready[name]["first_sample_s"],
            **({"load_s": ready[name]["load_s"]} if "load_s" in ready[name] else {}),
            "batch_bytes": ready[name]["batch_bytes"],
            "memcpy_fraction": ready[name]["batch_bytes"] / seconds / bandwidth,
            # page faults taken inside the call (fresh batch memory, pages mapped on first touch)
            "minor_faults_per_call": bench.median(faults[name]),
            **memory[name],
        }
    doc["sides"] = sides
    doc["batch_memcpy"] = bench.batch_memcpy(ready[GOAL_SETTING]["batch_bytes"])
    # same names, dtypes and per-row shapes (a checkpoint smaller than the request gives rbtool
    # fewer rows: it clamps to the window, TorchRL draws with replacement)
    doc["same_fields"] = all(ready[name]["fields"] == trl["fields"] for name in SETTINGS)
    ours = sides[GOAL_SETTING]
    doc.update(
        rbtool_s=ours["median_s"],
        torchrl_s=sides["torchrl"]["median_s"],
        ratio=bench.ratio(sides["torchrl"]["median_s"], ours["median_s"]),
        rbtool_default_s=sides["default"]["median_s"],
        default_ratio=bench.ratio(sides["torchrl"]["median_s"], sides["default"]["median_s"]),
        rbtool_batch_bytes=ours["batch_bytes"],
        torchrl_batch_bytes=sides["torchrl"]["batch_bytes"],
        rbtool_memcpy_fraction=ours["memcpy_fraction"],
        torchrl_memcpy_fraction=sides["torchrl"]["memcpy_fraction"],
        vs_memcpy=ours["median_s"] / sides[FLOOR]["median_s"],
        vs_memcpy_cold=ours["median_s"] / doc["batch_memcpy"]["cold_s"],
        vs_memcpy_hot=ours["median_s"] / doc["batch_memcpy"]["hot_s"],
    )
    doc["met_torchrl"] = doc["ratio"] is not None and doc["ratio"] >= GOAL and doc["same_fields"]
    doc["met_memcpy"] = doc["vs_memcpy"] <= MEMCPY_GOAL
    doc["met"] = doc["met_torchrl"] and doc["met_memcpy"]
    return doc


def setting_label(name: str) -> str:
    kw = SETTINGS[name]
    if not kw:
        return "rbtool, default (window held in memory)"
    if kw == {"hold_rows_budget": 0}:
        return "rbtool, hold_rows_budget=0 (rows read with pread)"
    parts = [f"{k}={bench.fmt_bytes(v) if k == 'map_rows_budget' else v}" for k, v in kw.items()]
    return "rbtool, " + ", ".join(parts)


def render(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    fmt_s, fmt_b = bench.fmt_s, bench.fmt_bytes
    console = Console(width=max(170, shutil.get_terminal_size((170, 40)).columns))
    mem = doc["memcpy"]["bytes_per_s"]
    console.print(
        f"checkpoint {doc['checkpoint']} ({fmt_b(doc['checkpoint_bytes'])}); sample({doc['num_chunks']}), "
        f"median of {doc['calls']} calls each, in turn, one process each, page cache warm; "
        f"memcpy {fmt_b(mem)}/s",
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
    sides = doc["sides"]
    trl_s = sides["torchrl"]["median_s"]
    table = Table(title="steady-state sample, window 0 (medians; ratio = TorchRL / this row)")
    columns = ("process", "sample()", "ratio", "goal", "met", "throughput / memcpy", "faults / call")
    columns += ("first call", "peak RSS")
    for column in (*columns, "anon + file at the end"):
        table.add_column(column, justify="right" if column in ("ratio", "sample()") else "left")
    for name, side in sides.items():
        if name == FLOOR:
            label = "memcpy of the batch's bytes (the floor)"
        else:
            label = "TorchRL LazyMemmapStorage" if name == "torchrl" else setting_label(name)
        is_goal = name == GOAL_SETTING
        ratio = bench.ratio(trl_s, side["median_s"]) if name != "torchrl" else None
        met = (
            bench.fmt_met(doc["met_torchrl"]) + ("" if doc["same_fields"] else " FIELDS DIFFER")
            if is_goal
            else ""
        )
        throughput = side["batch_bytes"] / side["median_s"]
        table.add_row(
            label + (" (goal)" if is_goal else ""),
            fmt_s(side["median_s"]),
            fmt_x(ratio) if ratio is not None else "",
            f">= {GOAL:g}x" if is_goal else "",
            met,
            f"{fmt_b(throughput)}/s ({side['memcpy_fraction']:.1%})",
            f"{side['minor_faults_per_call']:,.0f}",
            fmt_s(side["first_sample_s"]) + (f" (load {fmt_s(side['load_s'])})" if "load_s" in side else ""),
            fmt_b(side["peak_rss_bytes"]),
            f"{fmt_b(side['rss_anon_bytes'])} + {fmt_b(side['rss_file_bytes'])}",
        )
    console.print(table)
    copy = doc["batch_memcpy"]
    console.print(
        f"the default's sample() is {doc['vs_memcpy']:.2f}x a memcpy of the batch's {fmt_b(copy['bytes'])} "
        f"asked in turn like the samplers (its own process, a source not read since long ago; goal <= "
        f"{MEMCPY_GOAL:g}x: {bench.fmt_met(doc['met_memcpy'])}); copied back to back in this process: "
        f"{fmt_s(copy['cold_s'])} from memory out of the cache ({doc['vs_memcpy_cold']:.2f}x), "
        f"{fmt_s(copy['hot_s'])} in the cache ({doc['vs_memcpy_hot']:.2f}x)",
        highlight=False,
        markup=False,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON document instead of the table.")
    parser.add_argument("--calls", type=int, help="Timed sample() calls each (default 50; quick 10).")
    parser.add_argument("--worker", choices=["torchrl", FLOOR, *SETTINGS], help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--copy-bytes", type=int, default=0, help=argparse.SUPPRESS)
    mine, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if mine.worker:
        num_chunks = bench.parse_args(rest).num_chunks
        return worker(mine.worker, mine.ckpt, mine.store, num_chunks, mine.copy_bytes)
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
