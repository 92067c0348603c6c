"""SIGKILL `rbtool ingest` and `rbtool checkpoint save` at random moments: nothing half-written survives.

After every kill the buffer directory verifies without errors (notices allowed), every trajectory
the ingest reported as added is there and identical to its source, and a checkpoint exists
under the target name either whole and valid or not at all. Kills are aimed at the write
phase: an ingest is watched until a seeded random number of its trajectory files have appeared
in the buffer, then killed at once (so the kill lands between publishes whatever the machine's
load); a save is watched until its staging directory appears, then killed after a seeded random
delay within the write time that a first, uninterrupted run took.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import make_traj, tree_digest

from rbtool.files import trajfile
from rbtool.files.index import Index, read_index, window_of, write_index
from rbtool.format import is_checkpoint_dir, trajectory_file_name
from rbtool.ops.verify import verify_checkpoint

SEED = 20251130
ADDED = re.compile(r"^added trajectory ids (\d+)(?:-(\d+))?$")
TRAJECTORY_NAME = re.compile(r"^\.?trajectory_\d+_")  # a trajectory file, or its hidden temporary
INGEST_KILLS = 16  # two buffers, eight kills each (each run pays for importing torch)
SAVE_KILLS = 42  # two sequences of 21 (save never imports torch: cheap to repeat)


@dataclass
class Run:
    """One spawned command: its stderr lines with arrival times, and whether it was killed."""

    lines: list[tuple[float, str]] = field(default_factory=list)  # (seconds after the spawn, line)
    killed: bool = False
    returncode: int | None = None
    started: float = 0.0  # seconds after the spawn when it began writing


def spawn_and_kill(
    argv: list[str], delay: float | None, started: Callable[[], bool] = lambda: True
) -> tuple[Run, float]:
    """Run `python -m rbtool ARGV` and SIGKILL it `delay` seconds after `started()` turns true.

    `started` is polled until the command begins writing, so that kills land in the write phase
    whatever the machine's load; with `delay=None` the command runs to the end. Returns the run
    and how long the command ran after it started writing.
    """
    run = Run()
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rbtool", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            run.lines.append((time.monotonic() - start, line.rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    while proc.poll() is None and not started():
        time.sleep(0.0005)
    writing = time.monotonic()
    if delay is not None:
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    run.returncode = proc.wait(timeout=120)
    run.killed = run.returncode == -signal.SIGKILL  # not if it exited just before the signal
    ran = time.monotonic() - writing
    reader.join(timeout=30)
    run.started = writing - start
    return run, ran


def reported_ids(run: Run) -> list[int]:
    """Ids from the `added trajectory ids A-B` lines (each printed after its batch was published)."""
    ids: list[int] = []
    for _, line in run.lines:
        match = ADDED.match(line)
        if match:
            first = int(match.group(1))
            ids.extend(range(first, int(match.group(2) or first) + 1))
    return ids


def assert_valid(directory: Path) -> None:
    report = verify_checkpoint(directory)
    errors = [(p.code, p.message) for p in report.problems if p.severity == "error"]
    assert not errors, errors


def assert_same_trajectory(a: Any, b: Any) -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same_trajectory(a[key], b[key])
    else:
        assert a == b


# ----------------------------------------------------------------------- ingest
def make_sources(directory: Path, n: int, seed: int) -> list[Path]:
    """n small trajectories, alternately .pt and .pkl, so that an ingest both links and converts."""
    import torch

    directory.mkdir(parents=True)
    paths = []
    for i in range(n):
        traj = make_traj(t=2, b=1, seed=seed + i, image=2, model_weights_id=f"v{i % 3}")
        if i % 2:
            path = directory / f"s{i:04d}.pkl"
            path.write_bytes(trajfile.to_bytes(traj, "pkl"))
        else:
            path = directory / f"s{i:04d}.pt"
            torch.save(traj, path)
        paths.append(path)
    return paths


def counter_of(buffer: Path) -> int:
    return read_index(buffer).trajectory_counter if buffer.is_dir() and is_checkpoint_dir(buffer) else 0


def check_ingest_kill(buffer: Path, sources: list[Path], start: int, run: Run) -> None:
    """The buffer is valid and holds every reported trajectory, identical to its source."""
    assert_valid(buffer)
    ids = reported_ids(run)
    assert ids == list(range(start, start + len(ids))), ids
    index = read_index(buffer)
    listed = set(index.id_list)
    for tid in ids:
        assert tid in listed, f"trajectory {tid} was reported added but is not listed"
        stored = buffer / index.file_name(tid)
        source = sources[tid - start]
        if stored.suffix == source.suffix:
            assert stored.read_bytes() == source.read_bytes()
        else:
            assert_same_trajectory(trajfile.load(stored), trajfile.load(source))


def ingest_sequence(root: Path, fmt: str, seed: int) -> tuple[int, int]:
    """A first full ingest (timing its write phase), then killed ingests until INGEST_KILLS // 2."""
    from rbtool import ingest

    rng = random.Random(seed)
    sources = make_sources(root / "sources", 80, seed)
    buffer = root / "buffer"
    # every run adds all the sources again, so each run has a full write phase to be killed in
    argv = ["ingest", *map(str, sources), "--buffer", str(buffer), "--format", fmt, "--allow-duplicates"]

    def files_placed(before: set[str], count: int) -> Callable[[], bool]:
        """True once `count` new trajectory files (or their hidden temporaries) are in the buffer."""

        def started() -> bool:
            names = os.listdir(buffer) if buffer.is_dir() else []
            return sum(1 for n in names if TRAJECTORY_NAME.match(n) and n not in before) >= count

        return started

    full, _ = spawn_and_kill(argv, None, files_placed(set(), 1))
    assert full.returncode == 0, full.lines
    check_ingest_kill(buffer, sources, 0, full)

    kills = midway = attempts = 0
    while kills < INGEST_KILLS // 2 and attempts < 3 * INGEST_KILLS:
        attempts += 1
        start = counter_of(buffer)
        before = set(os.listdir(buffer))
        # the first batch is published after 64 files: kills land before, around and after it
        placed = files_placed(before, rng.randint(1, len(sources) - 8))
        run, _ = spawn_and_kill(argv, rng.uniform(0, 0.002), placed)
        kills += run.killed
        midway += run.killed and len(reported_ids(run)) < len(sources)
        check_ingest_kill(buffer, sources, start, run)

    # an uninterrupted ingest (in-process: no second torch import) resumes cleanly after all that
    start = counter_of(buffer)
    result = ingest(sources, buffer, allow_duplicates=True)
    assert result.added_ids == list(range(start, start + len(sources)))
    assert ingest(sources, buffer).duplicates == len(sources)  # all there: nothing added
    report = verify_checkpoint(buffer, deep=True)
    assert report.ok and not [p for p in report.problems if p.code == "uncommitted_file"]
    return kills, midway


def test_killed_ingests_leave_a_valid_buffer_with_every_reported_trajectory(tmp_path: Path) -> None:
    jobs: list[Callable[[], tuple[int, int]]] = [
        lambda: ingest_sequence(tmp_path / "pt", "pt", SEED),
        lambda: ingest_sequence(tmp_path / "pkl", "pkl", SEED + 1),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = [f.result() for f in [pool.submit(job) for job in jobs]]
    kills = sum(k for k, _ in results)
    midway = sum(m for _, m in results)
    print(f"ingest: {kills} kills, {midway} of them before the last batch was published")
    assert kills >= INGEST_KILLS
    assert midway >= INGEST_KILLS // 2  # aimed between publishes; a slow poll lets a few land after


# ------------------------------------------------------------------ checkpoint save
def make_buffer(directory: Path, n: int) -> Index:
    """A buffer directory of n trajectory files, written directly (hard links to a few distinct files)."""
    import torch

    directory.mkdir(parents=True)
    protos = []
    for v in range(4):
        path = directory / f".proto_{v}.pt"
        torch.save(make_traj(t=2, b=1, seed=v, image=2, model_weights_id=f"v{v}"), path)
        protos.append(path)
    index = Index(trajectory_format="pt")
    for i in range(n):
        v = i % len(protos)
        os.link(protos[v], directory / trajectory_file_name(i, f"v{v}", "pt"))
        index.entries[i] = {
            "num_samples": 2,
            "trajectory_id": i,
            "max_episode_length": 2,
            "shape": [2, 1, 7],
            "model_weights_id": f"v{v}",
        }
        index.id_list.append(i)
    index.trajectory_counter = n
    write_index(directory, index)
    for path in protos:
        path.unlink()
    return index


def check_target(target: Path, expected: dict[str, Any]) -> bool:
    """A checkpoint under the target name is whole and valid; returns whether one exists."""
    if not target.exists():
        return False
    assert_valid(target)
    index = read_index(target)
    assert index.state() == expected
    files = sorted(p.name for p in target.iterdir() if not p.name.startswith("."))
    assert files == sorted(
        [*(index.file_name(i) for i in index.id_list), "metadata.json", "trajectory_index.json"]
    )
    return True


def save_sequence(buffer: Path, index: Index, root: Path, seed: int) -> tuple[int, int]:
    """Killed saves until SAVE_KILLS // 2: fresh targets, and one target replaced with --force."""
    rng = random.Random(seed)
    root.mkdir()

    def staging_of(target: Path) -> Callable[[], bool]:
        """True once the save has created its hidden staging directory beside the target."""
        mark = f".{target.name}.rbtool-staging-"
        return lambda: any(name.startswith(mark) for name in os.listdir(root))

    timing = root / "timing"
    full, write_time = spawn_and_kill(
        ["checkpoint", "save", str(buffer), str(timing)], None, staging_of(timing)
    )
    assert full.returncode == 0, full.lines
    shutil.rmtree(timing)
    kills = existing = attempts = 0
    while kills < SAVE_KILLS // 2 and attempts < 3 * SAVE_KILLS:
        attempts += 1
        window = rng.choice([0, 200, 1000])
        expected = index.subset(window_of(index.id_list, window)).state()
        reuse = attempts % 3 == 0
        target = root / ("replaced" if reuse else f"ckpt_{attempts}")
        if reuse and target.exists() and read_index(target).state() != expected:
            shutil.rmtree(target)  # --force replaces it; compare against this run's window only
        argv = [
            "checkpoint",
            "save",
            str(buffer),
            str(target),
            "--window",
            str(window),
            "--mode",
            "auto-save",
        ]
        run, _ = spawn_and_kill(
            [*argv, *(["--force"] if reuse else [])], rng.uniform(0, 1.1 * write_time), staging_of(target)
        )
        kills += run.killed
        assert run.killed or run.returncode == 0, run.lines
        existing += check_target(target, expected)
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
        assert all(".rbtool-staging-" in n or ".rbtool-old-" in n for n in leftovers), leftovers
    return kills, existing


def test_killed_saves_leave_the_whole_checkpoint_or_nothing(tmp_path: Path) -> None:
    buffer = tmp_path / "buffer"
    index = make_buffer(buffer, 600)
    before = tree_digest(buffer)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(save_sequence, buffer, index, tmp_path / f"saves_{n}", SEED + n) for n in range(2)
        ]
        results = [f.result() for f in futures]
    kills = sum(k for k, _ in results)
    existing = sum(e for _, e in results)
    print(f"checkpoint save: {kills} kills; {existing} targets found whole after a run")
    assert kills >= SAVE_KILLS
    assert existing >= 1  # some runs got as far as publishing
    assert tree_digest(buffer) == before  # the buffer directory is only read


@pytest.mark.parametrize("name", ["ingest", "checkpoint"])
def test_commands_under_test_exist(name: str) -> None:
    """The crash tests drive these commands by name: fail clearly if one disappears."""
    result = subprocess.run([sys.executable, "-m", "rbtool", name, "--help"], capture_output=True, timeout=60)
    assert result.returncode == 0
