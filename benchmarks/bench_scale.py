#!/usr/bin/env python
"""Sampling whose cost follows the draw, not the window: window 0 at 2,000 and 20,000 trajectories.

Two measurements, each in fresh child processes, with auto_save on and off:

- Training step: a `TrajectoryReplayBuffer(sample_window_size=0)` loads a checkpoint of N
  small trajectories (T=4, B=2, the reference fixtures' fields) written the way RLinf writes
  them (one `torch.save` of a dict per trajectory, index and metadata with the reference's
  keys only), samples once, then repeats: add 1 trajectory, sample(256). The eager reference
  path replays the same steps in the same process: per step it draws with the same generator,
  `torch.load`s every drawn trajectory whole (an LRU cache of 5 trajectories, the reference's
  `cache_size`, which also takes each added one), flattens, concatenates and gathers; every
  batch is compared with rbtool's. Goals: rbtool's median step costs the same at both sizes
  (<= 1.5x) and is >= 10x faster than the eager path.
- First sample(256) after load: a fresh process constructs a buffer, loads a checkpoint of
  20,000 trajectories and samples once. Goals: < 2 s when rbtool's own buffer wrote it (its
  auto-save directory), < 5 s when another writer did (the RLinf-style checkpoint above).

Every file is read once before the timed runs, so the page cache is warm (said in the output).
Data is built once under --workdir and reused. Prints one table, or one JSON document with
--json; progress goes to stderr.

    .venv/bin/python benchmarks/bench_scale.py            # 2,000 and 20,000 trajectories
    .venv/bin/python benchmarks/bench_scale.py --quick    # 200 and 2,000, seconds
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench

HERE = Path(__file__).resolve().parent

GOAL_FLAT = 1.5  # median step at the large size / at the small size, at most
GOAL_EAGER = 10.0  # eager step / rbtool step, at least
GOAL_FIRST_OWN_S = 2.0  # first sample after load, checkpoint written by rbtool
GOAL_FIRST_OTHER_S = 5.0  # first sample after load, checkpoint written by another writer
EAGER_CACHE = 5  # the reference buffer's default cache_size
MODES = (True, False)  # auto_save on, off


@dataclass
class Config:
    sizes: list[int]
    first_size: int
    t: int
    b: int
    image: int
    steps: int
    repeats: int
    budget_s: float
    num_chunks: int
    workdir: Path
    quick: bool
    json: bool


def fmt_x(value: float | None) -> str:
    """A ratio; two decimals below 1, where one would round a slow-down to 0.0x."""
    return "n/a" if value is None else (f"{value:.2f}x" if value < 1 else f"{value:,.1f}x")


def parse_args(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="Sizes 200 and 2,000 (seconds).")
    parser.add_argument("--json", action="store_true", help="Print one JSON document instead of the table.")
    parser.add_argument("--workdir", type=Path, default=bench.DEFAULT_WORKDIR, help="Where data is built.")
    parser.add_argument(
        "--sizes", help="Comma-separated trajectory counts for the training step (default 2000,20000)."
    )
    parser.add_argument(
        "--first-size", type=int, help="Trajectories for first sample after load (default 20000)."
    )
    parser.add_argument("--t", type=int, default=4, help="Chunk steps per trajectory (default 4).")
    parser.add_argument("--b", type=int, default=2, help="Parallel environments per trajectory (default 2).")
    parser.add_argument("--image", type=int, default=16, help="Side of the uint8 images (default 16).")
    parser.add_argument("--steps", type=int, help="Timed training steps per run (default 20; quick 5).")
    parser.add_argument(
        "--repeats", type=int, help="Fresh processes per first-sample figure (default 3; quick 2)."
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=120.0,
        help="Seconds after which a figure stops taking more steps or runs (at least 3 steps, 1 run).",
    )
    parser.add_argument("--num-chunks", type=int, default=256, help="Rows per sample() call (default 256).")
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    sizes = (
        [int(s) for s in args.sizes.split(",")] if args.sizes else ([200, 2000] if quick else [2000, 20000])
    )
    first = args.first_size if args.first_size is not None else (2000 if quick else 20000)
    steps = args.steps if args.steps is not None else (5 if quick else 20)
    repeats = args.repeats if args.repeats is not None else (2 if quick else 3)
    if len(sizes) != 2 or min(sizes) < 1 or first < 1 or steps < 1 or repeats < 1:
        parser.error("--sizes takes two counts >= 1; counts and repeats must be >= 1")
    return Config(
        sizes=sorted(sizes),
        first_size=first,
        t=args.t,
        b=args.b,
        image=args.image,
        steps=steps,
        repeats=repeats,
        budget_s=args.budget,
        num_chunks=args.num_chunks,
        workdir=args.workdir.resolve(),
        quick=quick,
        json=bool(args.json),
    )


log = bench.log


# --------------------------------------------------------------------------- data
def trajectory(cfg_t: int, cfg_b: int, image: int, seed: int) -> dict[str, Any]:
    """A trajectory with the reference fixtures' fields; policy version changes every 1,000 ids."""
    return bench.synthetic_trajectory(cfg_t, cfg_b, image, seed, bench.weights_id(seed // 1000))


def file_name(tid: int, weights: str) -> str:
    return f"trajectory_{tid}_{weights}.pt"


def complete(path: Path, n: int) -> bool:
    """True if `path` holds an index of n trajectories whose files all exist."""
    try:
        meta = json.loads((path / "metadata.json").read_text())
        raw = json.loads((path / "trajectory_index.json").read_text())
    except (OSError, ValueError):
        return False
    entries = raw.get("trajectory_index", {})
    names = {p.name for p in path.iterdir()}
    return (
        meta.get("size") == n
        and len(raw.get("trajectory_id_list", [])) == n
        and all(file_name(int(k), e["model_weights_id"]) in names for k, e in entries.items())
    )


def ensure_rlinf(cfg: Config, n: int) -> Path:
    """n trajectories as RLinf writes them: torch.save per file, index and metadata with its keys only."""
    import torch

    final = cfg.workdir / f"rlinf_{n}x{cfg.t}x{cfg.b}_img{cfg.image}"
    if complete(final, n):
        log(f"reusing {final}")
        return final
    bench.remove(final)
    partial = cfg.workdir / f".{final.name}.partial"
    bench.remove(partial)
    partial.mkdir(parents=True)
    log(f"building {final} ({n:,} trajectories written like RLinf's buffer)")
    start = time.perf_counter()
    entries: dict[str, Any] = {}
    for tid in range(n):
        traj = trajectory(cfg.t, cfg.b, cfg.image, tid)
        torch.save(traj, partial / file_name(tid, traj["model_weights_id"]))
        entries[str(tid)] = {
            "num_samples": cfg.t * cfg.b,
            "trajectory_id": tid,
            "max_episode_length": cfg.t,
            "shape": list(traj["prev_logprobs"].shape),
            "model_weights_id": traj["model_weights_id"],
        }
    index = {"trajectory_index": entries, "trajectory_id_list": list(range(n))}
    (partial / "trajectory_index.json").write_text(json.dumps(index))
    meta = {
        "trajectory_format": "pt",
        "size": n,
        "total_samples": n * cfg.t * cfg.b,
        "trajectory_counter": n,
        "seed": bench.SEED,
    }
    (partial / "metadata.json").write_text(json.dumps(meta))
    partial.rename(final)
    log(f"built in {time.perf_counter() - start:.1f} s")
    return final


def writer_digest() -> str:
    """A digest of the rbtool sources in use: what rbtool writes (entry keys, schema) may change with them."""
    import rbtool

    digest = hashlib.sha256()
    for path in sorted(Path(rbtool.__file__).parent.rglob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def ensure_own(cfg: Config, n: int) -> Path:
    """n trajectories in an auto-save directory written by rbtool's TrajectoryReplayBuffer.

    Rebuilt when the rbtool sources differ from the ones that wrote it (a stamp file beside
    it), so that the checkpoint holds what this rbtool writes.
    """
    from rbtool import TrajectoryReplayBuffer

    final = cfg.workdir / f"rbtool_{n}x{cfg.t}x{cfg.b}_img{cfg.image}"
    stamp = final.with_name(final.name + ".writer")
    digest = writer_digest()
    if complete(final, n) and stamp.is_file() and stamp.read_text() == digest:
        log(f"reusing {final}")
        return final
    if final.exists():
        log(f"{final} was written by other rbtool sources: rebuilding it")
    bench.remove(final)
    bench.remove(stamp)
    partial = cfg.workdir / f".{final.name}.partial"
    bench.remove(partial)
    log(f"building {final} ({n:,} trajectories written by rbtool's buffer, auto_save on)")
    start = time.perf_counter()
    buffer = TrajectoryReplayBuffer(
        seed=bench.SEED, sample_window_size=0, auto_save=True, auto_save_path=str(partial)
    )
    try:
        for first in range(0, n, 200):
            buffer.add_trajectories(
                [trajectory(cfg.t, cfg.b, cfg.image, tid) for tid in range(first, min(first + 200, n))]
            )
            buffer.flush()
    finally:
        buffer.close()
    partial.rename(final)
    stamp.write_text(digest)
    log(f"built in {time.perf_counter() - start:.1f} s")
    return final


def warm(path: Path) -> int:
    """Read every file of `path` once so that the timed runs find the page cache warm."""
    total = 0
    for p in path.iterdir():
        if p.is_file():
            with p.open("rb") as handle:
                while chunk := handle.read(1 << 20):
                    total += len(chunk)
    return total


# ------------------------------------------------------------------ eager path
class EagerStepper:
    """The reference buffer's eager path, step by step: load drawn trajectories whole, LRU cache of 5."""

    def __init__(self, ckpt: Path, added: dict[int, Path]) -> None:
        import torch

        meta = json.loads((ckpt / "metadata.json").read_text())
        raw = json.loads((ckpt / "trajectory_index.json").read_text())
        self.ids: list[int] = list(raw["trajectory_id_list"])
        entries = raw["trajectory_index"]
        self.sizes = [int(entries[str(i)]["num_samples"]) for i in self.ids]
        self.paths = {i: ckpt / file_name(i, entries[str(i)]["model_weights_id"]) for i in self.ids}
        self.paths.update(added)
        self.cache: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()
        self.generator = torch.Generator()
        self.generator.manual_seed(int(meta.get("seed", bench.SEED)))
        self.loaded: list[int] = []

    def _remember(self, tid: int, flat: dict[str, Any]) -> None:
        self.cache[tid] = flat
        self.cache.move_to_end(tid)
        while len(self.cache) > EAGER_CACHE:
            self.cache.popitem(last=False)

    def add(self, tid: int, traj: dict[str, Any]) -> None:
        self.ids.append(tid)
        self.sizes.append(int(traj["rewards"].shape[0] * traj["rewards"].shape[1]))
        self._remember(tid, bench.EagerSampler.flatten(traj))

    def sample(self, num_chunks: int) -> dict[str, Any]:
        import torch

        cum = torch.as_tensor(self.sizes, dtype=torch.long).cumsum(0)
        total = int(cum[-1])
        draws = torch.randint(0, total, (min(num_chunks, total),), generator=self.generator)
        positions = torch.bucketize(draws, cum, right=True)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), cum[:-1]])
        local = draws - starts[positions]
        traj_ids = [self.ids[k] for k in positions.tolist()]
        flats, offsets, cursor, loaded = [], {}, 0, 0
        for tid in dict.fromkeys(traj_ids):
            flat = self.cache.get(tid)
            if flat is None:
                flat = bench.EagerSampler.flatten(
                    torch.load(self.paths[tid], map_location="cpu", weights_only=True)
                )
                loaded += 1
            self._remember(tid, flat)
            flats.append(flat)
            offsets[tid] = cursor
            cursor += int(next(iter(bench.flat_tensors(flat).values())).shape[0])
        self.loaded.append(loaded)
        rows = torch.as_tensor([offsets[tid] for tid in traj_ids], dtype=torch.long) + local
        return bench.EagerSampler.take(bench.EagerSampler.concat(flats), rows)


# ------------------------------------------------------------------- children
def child_step(spec: dict[str, Any]) -> dict[str, Any]:
    """One training-step run (rbtool, then the eager path on the same draws), in this process."""
    import torch

    from rbtool import TrajectoryReplayBuffer

    ckpt, scratch = Path(spec["ckpt"]), Path(spec["scratch"])
    n, t, b, image, chunks = spec["n"], spec["t"], spec["b"], spec["image"], spec["num_chunks"]
    # The trajectories the steps add, with the ids the buffer will give them (ids continue from n).
    added_dir = scratch / "added"
    added_dir.mkdir(parents=True)
    new = [trajectory(t, b, image, n + k) for k in range(spec["steps"])]
    added = {n + k: added_dir / file_name(n + k, traj["model_weights_id"]) for k, traj in enumerate(new)}
    for (_, path), traj in zip(added.items(), new, strict=True):
        torch.save(traj, path)

    auto_save = spec["auto_save"]
    buffer = TrajectoryReplayBuffer(
        seed=bench.SEED,
        sample_window_size=0,
        auto_save=auto_save,
        auto_save_path=str(scratch / "autosave") if auto_save else "",
    )
    start = time.perf_counter()
    buffer.load_checkpoint(ckpt)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    ours = [buffer.sample(chunks)]
    first_s = time.perf_counter() - start
    step_s: list[float] = []
    began = time.perf_counter()
    for traj in new:
        start = time.perf_counter()
        buffer.add_trajectories([traj])
        ours.append(buffer.sample(chunks))
        step_s.append(time.perf_counter() - start)
        if len(step_s) >= 3 and time.perf_counter() - began > spec["budget_s"]:
            break
    buffer.close()

    eager = EagerStepper(ckpt, added)
    equal = bench.same_batch(ours[0], eager.sample(chunks))
    eager_s: list[float] = []
    for k in range(len(step_s)):
        start = time.perf_counter()
        eager.add(n + k, new[k])
        batch = eager.sample(chunks)
        eager_s.append(time.perf_counter() - start)
        equal = equal and bench.same_batch(ours[k + 1], batch)
    return {
        "load_s": load_s,
        "first_sample_s": first_s,
        "step_s": step_s,
        "eager_step_s": eager_s,
        "eager_files_loaded": bench.median([float(x) for x in eager.loaded[1:]]),
        "batches_equal": equal,
    }


def child_first(spec: dict[str, Any]) -> dict[str, Any]:
    """A fresh process: construct, load_checkpoint, one sample."""
    from rbtool import TrajectoryReplayBuffer

    scratch = Path(spec["scratch"])
    started = time.perf_counter()
    buffer = TrajectoryReplayBuffer(
        seed=bench.SEED,
        sample_window_size=0,
        auto_save=spec["auto_save"],
        auto_save_path=str(scratch / "autosave") if spec["auto_save"] else "",
    )
    constructed = time.perf_counter()
    buffer.load_checkpoint(spec["ckpt"])
    loaded = time.perf_counter()
    buffer.sample(spec["num_chunks"])
    sampled = time.perf_counter()
    buffer.close()
    return {
        "construct_s": constructed - started,
        "load_s": loaded - constructed,
        "first_sample_s": sampled - loaded,
        "load_and_sample_s": sampled - constructed,
    }


def run_child(kind: str, spec: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """Run child_<kind>(spec) in a fresh interpreter, in a scratch directory removed afterwards."""
    scratch = cfg.workdir / f".scale-scratch-{os.getpid()}"
    bench.remove(scratch)
    scratch.mkdir(parents=True)
    spec = {**spec, "scratch": str(scratch)}
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, __file__, f"--child-{kind}", json.dumps(spec)],
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        bench.remove(scratch)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        log(f"{kind} run failed (exit {done.returncode}): {tail}")
        return {"error": tail, "exit_code": done.returncode, "wall_s": wall}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


# ------------------------------------------------------------------ measurements
def mode_name(auto_save: bool) -> str:
    return "auto_save_on" if auto_save else "auto_save_off"


def measure_steps(cfg: Config, ckpts: dict[int, Path]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for auto_save in MODES:
        per_size: dict[str, Any] = {}
        for n in cfg.sizes:
            log(f"training step: {n:,} trajectories, {mode_name(auto_save)}, up to {cfg.steps} steps")
            spec = {
                "ckpt": str(ckpts[n]),
                "n": n,
                "t": cfg.t,
                "b": cfg.b,
                "image": cfg.image,
                "num_chunks": cfg.num_chunks,
                "steps": cfg.steps,
                "budget_s": cfg.budget_s,
                "auto_save": auto_save,
            }
            run = run_child("step", spec, cfg)
            if "error" in run:
                per_size[str(n)] = {"trajectories": n, "error": run["error"], "rbtool_step_s": None}
                continue
            rb, eager = bench.median(run["step_s"]), bench.median(run["eager_step_s"])
            per_size[str(n)] = {
                "trajectories": n,
                "steps": len(run["step_s"]),
                "load_s": run["load_s"],
                "first_sample_s": run["first_sample_s"],
                "rbtool_step_s": rb,
                "eager_step_s": eager,
                "ratio": bench.ratio(eager, rb),
                "eager_files_loaded": run["eager_files_loaded"],
                "batches_equal": run["batches_equal"],
            }
        small, large = (per_size[str(n)]["rbtool_step_s"] for n in cfg.sizes)
        out[mode_name(auto_save)] = {
            "sizes": per_size,
            "growth": None if small is None or large is None else large / small,
        }
    return out


def measure_first(cfg: Config, ckpts: dict[str, Path]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for writer, ckpt in ckpts.items():
        for auto_save in MODES:
            log(f"first sample after load: {writer}-written, {mode_name(auto_save)}, {cfg.repeats} processes")
            spec = {"ckpt": str(ckpt), "num_chunks": cfg.num_chunks, "auto_save": auto_save}
            runs: list[dict[str, Any]] = []
            began = time.perf_counter()
            for _ in range(cfg.repeats):
                runs.append(run_child("first", spec, cfg))
                if "error" in runs[-1] or time.perf_counter() - began > cfg.budget_s:
                    break
            key = f"{writer}_{mode_name(auto_save)}"
            good = [r for r in runs if "error" not in r]
            if not good:
                out[key] = {"writer": writer, "auto_save": auto_save, "error": runs[-1]["error"]}
                out[key].update(dict.fromkeys(("first_sample_s", "load_s", "load_and_sample_s")))
                continue
            out[key] = {
                "writer": writer,
                "auto_save": auto_save,
                "trajectories": cfg.first_size,
                "runs": len(good),
                "first_sample_s": bench.median([r["first_sample_s"] for r in good]),
                "load_s": bench.median([r["load_s"] for r in good]),
                "load_and_sample_s": bench.median([r["load_and_sample_s"] for r in good]),
                "first_run_first_sample_s": good[0]["first_sample_s"],
            }
    return out


# -------------------------------------------------------------------------- goals
@dataclass
class Goal:
    name: str
    target: str
    value: float | None
    met: bool | None


def goals(doc: dict[str, Any], cfg: Config) -> list[Goal]:
    found: list[Goal] = []
    for auto_save in MODES:
        mode = mode_name(auto_save)
        steps = doc["training_step"][mode]
        growth = steps["growth"]
        found.append(
            Goal(
                f"step_growth_{mode}", f"<= {GOAL_FLAT:g}x", growth, None if growth is None else growth <= 1.5
            )
        )
        for n in cfg.sizes:
            r = steps["sizes"][str(n)].get("ratio")
            equal = steps["sizes"][str(n)].get("batches_equal")
            met = None if r is None else (r >= GOAL_EAGER and bool(equal))
            found.append(Goal(f"step_vs_eager_{n}_{mode}", f">= {GOAL_EAGER:g}x", r, met))
        for writer, bound in (("rbtool", GOAL_FIRST_OWN_S), ("other", GOAL_FIRST_OTHER_S)):
            value = doc["first_sample"][f"{writer}_{mode}"]["first_sample_s"]
            found.append(
                Goal(
                    f"first_sample_{writer}_{mode}",
                    f"< {bound:g} s",
                    value,
                    None if value is None else value < bound,
                )
            )
    return found


# -------------------------------------------------------------------------- output
def render(doc: dict[str, Any], cfg: Config) -> None:
    from rich.console import Console
    from rich.table import Table

    fmt_s, fmt_met = bench.fmt_s, bench.fmt_met
    met = {g["name"]: g for g in doc["goals"]}
    table = Table(title="window 0 at scale (medians; ratio = eager / rbtool)")
    for column in ("figure", "rbtool", "baseline", "ratio", "goal", "met"):
        table.add_column(column, justify="right" if column == "ratio" else "left")
    for auto_save in MODES:
        mode = mode_name(auto_save)
        label = mode.replace("_", " ").replace("auto save", "auto_save")
        steps = doc["training_step"][mode]
        for n in cfg.sizes:
            s = steps["sizes"][str(n)]
            if s.get("error"):
                table.add_row(
                    f"step (add 1, sample({cfg.num_chunks})), {n:,} traj., {label}",
                    "FAILED",
                    s["error"][:60],
                    "",
                    "",
                    "NO",
                )
                continue
            g = met[f"step_vs_eager_{n}_{mode}"]
            table.add_row(
                f"step (add 1, sample({cfg.num_chunks})), {n:,} traj., {label}",
                f"{fmt_s(s['rbtool_step_s'])} ({s['steps']} steps)",
                f"eager {fmt_s(s['eager_step_s'])} ({s['eager_files_loaded']:.0f} files)",
                fmt_x(s["ratio"]),
                g["target"],
                fmt_met(g["met"]) + ("" if s["batches_equal"] else " BATCHES DIFFER"),
            )
            table.add_row(
                "  in that process: load_checkpoint / first sample",
                f"{fmt_s(s['load_s'])} / {fmt_s(s['first_sample_s'])}",
                "",
                "",
                "",
                "",
            )
        g = met[f"step_growth_{mode}"]
        table.add_row(
            f"step at {cfg.sizes[1]:,} / at {cfg.sizes[0]:,}, {label}",
            fmt_x(steps["growth"]),
            "",
            "",
            g["target"],
            fmt_met(g["met"]),
        )
    for auto_save in MODES:
        mode = mode_name(auto_save)
        label = mode.replace("_", " ").replace("auto save", "auto_save")
        for writer, who in (("rbtool", "rbtool-written"), ("other", "other writer")):
            f = doc["first_sample"][f"{writer}_{mode}"]
            g = met[f"first_sample_{writer}_{mode}"]
            if f.get("error"):
                table.add_row(
                    f"first sample after load, {cfg.first_size:,} {who}, {label}",
                    "FAILED",
                    f["error"][:60],
                    "",
                    g["target"],
                    "NO",
                )
                continue
            table.add_row(
                f"first sample({cfg.num_chunks}) after load, {cfg.first_size:,} {who}, {label}",
                fmt_s(f["first_sample_s"]),
                f"load {fmt_s(f['load_s'])}; both {fmt_s(f['load_and_sample_s'])}",
                "",
                g["target"],
                fmt_met(g["met"]),
            )
    console = Console(width=max(150, shutil.get_terminal_size((150, 40)).columns))
    console.print(
        f"trajectories T={cfg.t}, B={cfg.b}, {cfg.image}x{cfg.image}x3 images; window 0\n"
        f"page cache warm (every file read before the timed runs); a fresh process per run; "
        f"first sample: median of up to {cfg.repeats} processes"
        + ("\nquick mode: the goals are set for 2,000 / 20,000 trajectories" if cfg.quick else ""),
        highlight=False,
        markup=False,
    )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("--child-step", "--child-first"):
        child = child_step if args[0] == "--child-step" else child_first
        print(json.dumps(child(json.loads(args[1]))))
        return 0
    cfg = parse_args(args)
    started = time.perf_counter()
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    rlinf = {n: ensure_rlinf(cfg, n) for n in sorted({*cfg.sizes, cfg.first_size})}
    own = ensure_own(cfg, cfg.first_size)
    warmed = sum(warm(p) for p in [*rlinf.values(), own])
    log(f"page cache warmed: {warmed / 2**20:.0f} MiB read")
    doc: dict[str, Any] = {
        "config": {
            "sizes": cfg.sizes,
            "first_size": cfg.first_size,
            "t": cfg.t,
            "b": cfg.b,
            "image": cfg.image,
            "steps": cfg.steps,
            "repeats": cfg.repeats,
            "budget_s": cfg.budget_s,
            "num_chunks": cfg.num_chunks,
            "quick": cfg.quick,
            "workdir": str(cfg.workdir),
            "page_cache": "warm",
            "checkpoints": {"rlinf": {str(n): str(p) for n, p in rlinf.items()}, "rbtool": str(own)},
        },
        "training_step": measure_steps(cfg, {n: rlinf[n] for n in cfg.sizes}),
        "first_sample": measure_first(cfg, {"rbtool": own, "other": rlinf[cfg.first_size]}),
    }
    doc["goals"] = [asdict(g) for g in goals(doc, cfg)]
    doc["elapsed_s"] = time.perf_counter() - started
    if cfg.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        render(doc, cfg)
    log(f"done in {doc['elapsed_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
