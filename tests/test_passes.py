"""rbtool.passes.pool: a per-file function on worker processes, as a single process would run it.

Results in list order, the first error in list order, largest tasks first, a bounded number
of tasks in flight, progress in the calling process, Ctrl-C and dead workers handled.
The deep passes built on it (verify, stats, repair, convert) are compared across job
counts here and in their own test files.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, RLINF_DIRS, make_traj

from rbtool.errors import RbtoolError, TrajectoryFileError, UsageError
from rbtool.passes import pool as passes
from rbtool.passes.pool import Throughput, check_jobs, default_jobs, run_pass

DEEP_FIXTURES = [*RLINF_DIRS, "ranks"]


# Worker functions live at module level: tasks are sent to other processes by reference.
def square(n: int) -> int:
    return n * n


def pid_of(_: int) -> int:
    return os.getpid()


def fail_on_odd(n: int) -> int:
    if n % 2:
        raise TrajectoryFileError(f"task {n}: odd")
    return n


def die_on_three(n: int) -> int:
    if n == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return n


def nap(n: int) -> int:
    if n >= 2:
        time.sleep(120)  # only ends early if its worker is stopped
    return n


def no_children_left() -> bool:
    for child in multiprocessing.active_children():
        child.join(timeout=10)
    return not multiprocessing.active_children()


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_results_come_in_task_order_with_one_progress_call_each(jobs: int) -> None:
    tasks = list(range(23))
    calls: list[int] = []
    weights = [(7 * i) % 11 for i in tasks]  # start order differs from list order
    assert run_pass(square, tasks, jobs=jobs, weights=weights, progress=calls.append) == [
        n * n for n in tasks
    ]
    assert calls == [1] * len(tasks)
    assert run_pass(square, [], jobs=jobs) == []


@pytest.mark.parametrize("jobs", [1, 2])
def test_progress_counts_the_units_of_the_tasks_done(jobs: int) -> None:
    tasks = list(range(200))  # chunks of several tasks on workers
    seen: list[int] = []
    assert run_pass(square, tasks, jobs=jobs, progress=seen.append, units=lambda n: n % 5) == [
        n * n for n in tasks
    ]
    assert sum(seen) == sum(n % 5 for n in tasks) and len(seen) < len(tasks) + 1


def test_one_job_or_one_task_runs_in_this_process_and_more_on_workers() -> None:
    me = os.getpid()
    assert set(run_pass(pid_of, [0, 1, 2], jobs=1)) == {me}
    assert run_pass(pid_of, [0], jobs=4) == [me]
    workers = set(run_pass(pid_of, list(range(8)), jobs=2))
    assert me not in workers and 1 <= len(workers) <= 2
    assert no_children_left()


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_error_raised_is_the_first_in_list_order(jobs: int) -> None:
    # the biggest tasks start first: 9 and 7 fail before 1 and 3 even start
    tasks = [0, 2, 1, 4, 3, 6, 7, 9]
    with pytest.raises(TrajectoryFileError, match=r"^task 1: odd$"):
        run_pass(fail_on_odd, tasks, jobs=jobs, weights=tasks)
    assert no_children_left()


def test_largest_tasks_start_first_and_at_most_two_chunks_per_worker_are_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[int] = []
    chunks: list[int] = []
    in_flight: list[int] = []
    completed = 0
    real_submit = ProcessPoolExecutor.submit

    def submit(self: ProcessPoolExecutor, fn: Any, *args: Any) -> Any:
        if fn is not passes._ready:  # (each worker's first, empty task: the pool is up)
            started.extend(args[1])
            chunks.append(len(args[1]))
        return real_submit(self, fn, *args)

    def progress(n: int) -> None:
        nonlocal completed
        in_flight.append(len(chunks) - completed)
        completed += 1

    monkeypatch.setattr(ProcessPoolExecutor, "submit", submit)
    tasks = list(range(40))
    weights = [(13 * i) % 40 for i in tasks]  # a permutation of 0..39
    assert run_pass(square, tasks, jobs=2, weights=weights, progress=progress) == [n * n for n in tasks]
    assert [weights[t] for t in started] == sorted(weights, reverse=True)
    assert max(in_flight) <= 2 * passes.IN_FLIGHT_PER_WORKER


def test_many_small_tasks_go_in_chunks_and_a_heavy_one_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    chunks: list[list[int]] = []
    real_submit = ProcessPoolExecutor.submit

    def submit(self: ProcessPoolExecutor, fn: Any, *args: Any) -> Any:
        if fn is not passes._ready:
            chunks.append(list(args[1]))
        return real_submit(self, fn, *args)

    monkeypatch.setattr(ProcessPoolExecutor, "submit", submit)
    tasks = list(range(2000))
    weights = [passes.CHUNK_WEIGHT + 1 if t == 7 else 10 for t in tasks]
    calls: list[int] = []
    assert run_pass(square, tasks, jobs=2, weights=weights, progress=calls.append) == [t * t for t in tasks]
    assert chunks[0] == [7] and sum(calls) == len(tasks)
    assert max(map(len, chunks)) == passes.CHUNK_TASKS and len(chunks) < len(tasks) // 10
    assert sorted(t for c in chunks for t in c) == tasks


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_first_error_in_list_order_wins_inside_chunks(jobs: int) -> None:
    tasks = [0, 2] * 200 + [5, 4, 3]  # chunks of many tasks
    with pytest.raises(TrajectoryFileError, match=r"^task 5: odd$"):
        run_pass(fail_on_odd, tasks, jobs=jobs)
    with pytest.raises(TrajectoryFileError, match=r"^task 5: odd$"):  # 3 starts first, fails first
        run_pass(fail_on_odd, tasks, jobs=jobs, weights=[1 if t == 3 else 0 for t in tasks])
    assert no_children_left()


def test_a_worker_that_dies_is_one_line_error_not_a_hang() -> None:
    with pytest.raises(RbtoolError) as caught:
        run_pass(die_on_three, list(range(8)), jobs=2, describe=lambda n: f"file-{n}")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("file-") and "worker process" in message
    assert no_children_left()


def test_ctrl_c_stops_the_workers() -> None:
    def interrupt(_: int) -> None:
        raise KeyboardInterrupt

    threads = set(threading.enumerate())  # an earlier test's client may have left one running
    with pytest.raises(KeyboardInterrupt):
        run_pass(square, list(range(50)), jobs=2, progress=interrupt)
    assert no_children_left()
    # workers busy with long tasks are ended, not waited for
    with pytest.raises(KeyboardInterrupt):
        run_pass(nap, list(range(6)), jobs=2, weights=[1, 1, 0, 0, 0, 0], progress=interrupt)
    assert no_children_left() and set(threading.enumerate()) <= threads


def test_with_another_thread_running_workers_come_from_a_fork_server() -> None:
    # alone, a process forks its workers (asked in a fresh process: an earlier test's S3
    # client may have left its event-loop thread running in this one)
    alone = "from rbtool.passes import pool as passes; print(passes._context(()).get_start_method())"
    assert subprocess.run([sys.executable, "-c", alone], capture_output=True, text=True).stdout == "fork\n"
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert passes._context(()).get_start_method() == "forkserver"
        assert run_pass(square, list(range(6)), jobs=2) == [n * n for n in range(6)]
    finally:
        stop.set()
        thread.join()


def test_jobs_are_checked_and_default_to_the_usable_cores() -> None:
    assert default_jobs() == len(os.sched_getaffinity(0)) == check_jobs(None)
    assert check_jobs(3) == 3
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(UsageError, match="jobs must be an integer >= 1"):
            check_jobs(bad)
    with pytest.raises(UsageError):
        run_pass(square, [1, 2], jobs=0)
    with pytest.raises(UsageError, match="1 weights for 2 tasks"):
        run_pass(square, [1, 2], jobs=2, weights=[1])


def test_throughput_in_json() -> None:
    assert Throughput(2, 1000, 0.5).as_json() == {
        "jobs": 2,
        "bytes_read": 1000,
        "seconds": 0.5,
        "bytes_per_second": 2000,
    }
    assert Throughput(1).as_json()["bytes_per_second"] is None


# ---------------------------------------------------------------- the deep passes
@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    """An rbtool checkpoint of trajectories of several sizes (so big files start out of list
    order), with a truncated file, an altered one, NaN rewards, a missing file and a stray."""
    import torch

    from rbtool import TrajectoryReplayBuffer

    buffer = TrajectoryReplayBuffer(seed=7)
    buffer.add_trajectories([make_traj(t=2 + (5 * i) % 9, b=2, seed=i, image=8) for i in range(12)])
    ckpt = tmp_path / "ckpt"
    buffer.save_checkpoint(ckpt)
    buffer.close()
    files = {int(p.name.split("_")[1]): p for p in ckpt.glob("trajectory_*_*.pt")}
    files[2].write_bytes(files[2].read_bytes()[:300])  # unreadable
    data = bytearray(files[5].read_bytes())
    data[len(data) // 2] ^= 0xFF  # altered: hash (and zip CRC) no longer match
    files[5].write_bytes(bytes(data))
    traj = torch.load(files[8], weights_only=True)
    traj["rewards"] = traj["rewards"] / 0
    torch.save(traj, files[8])  # NaN/Inf, and a hash that no longer matches
    files[10].unlink()
    (ckpt / "trajectory_99_x.pt").write_bytes(b"stray")
    return ckpt


def problems_of(report: Any) -> list[dict[str, Any]]:
    return [p.as_json() for c in report.checkpoints for p in c.problems]


@pytest.mark.parametrize("rel", DEEP_FIXTURES)
def test_verify_deep_is_the_same_on_one_and_two_jobs_on_the_fixtures(rel: str) -> None:
    from rbtool.ops.verify import verify

    one, two = (verify(FIXTURES / rel, deep=True, jobs=j) for j in (1, 2))
    assert problems_of(two) == problems_of(one) and two.bytes_read == one.bytes_read > 0
    assert (one.jobs, two.jobs) == (1, 2)


def test_verify_deep_is_the_same_on_one_and_two_jobs_on_a_damaged_checkpoint(damaged: Path) -> None:
    from rbtool.ops.verify import verify

    one, two = (verify(damaged, deep=True, jobs=j) for j in (1, 2))
    found = problems_of(one)
    assert problems_of(two) == found
    codes = {p["code"] for p in found}
    assert {"file_unreadable", "hash_mismatch", "non_finite", "file_missing", "uncommitted_file"} <= codes
    assert problems_of(verify(damaged, deep=True, jobs=5)) == found


@pytest.mark.parametrize(
    "rel", ["autosave_pt/autosave", "varying_shapes_pt/ckpt", "nosave_window2_pkl/ckpt", "ranks"]
)
def test_stats_data_is_the_same_on_one_and_two_jobs(rel: str) -> None:
    from rbtool.ops.stats import DrawRequest, collect_stats

    draws = DrawRequest(500, "topk", k=8)
    one, two = (collect_stats(FIXTURES / rel, draws=draws, jobs=j) for j in (1, 2))
    for doc in (one, two):
        for key in ("seconds", "bytes_per_second", "jobs"):
            doc["data"].pop(key)
    assert one == two and one["data"]["trajectories_read"] > 0


def test_stats_stops_at_the_first_bad_file_in_list_order_on_any_jobs(damaged: Path) -> None:
    from rbtool.ops.stats import collect_stats

    errors = []
    for jobs in (1, 2):
        with pytest.raises(TrajectoryFileError) as caught:
            collect_stats(damaged, jobs=jobs)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and "trajectory_2_" in errors[0]


def test_repair_is_the_same_on_one_and_two_jobs(damaged: Path, tmp_path: Path) -> None:
    from rbtool.files.index import read_index
    from rbtool.ops.repair import repair

    results = [repair(damaged, tmp_path / f"out{j}", jobs=j) for j in (1, 2)]
    docs = []
    for result, j in zip(results, (1, 2), strict=True):
        doc = result.as_json()
        assert doc["jobs"] == j and doc["bytes_read"] > 0
        for key in ("out", "seconds", "bytes_per_second", "jobs"):
            doc.pop(key)
        for ckpt in doc["checkpoints"]:
            ckpt.pop("out")
        docs.append(doc)
    assert docs[0] == docs[1]
    dropped = [d["trajectory_id"] for d in docs[0]["checkpoints"][0]["dropped"]]
    assert dropped == [2, 5, 8, 10]
    first, second = (read_index(tmp_path / f"out{j}") for j in (1, 2))
    assert first.id_list == second.id_list and first.entries == second.entries


def without_hashes(entries: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {tid: {k: v for k, v in e.items() if k != "sha256"} for tid, e in entries.items()}


def assert_same_trajectory(a: Any, b: Any) -> None:
    import torch

    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same_trajectory(a[key], b[key])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def test_convert_is_the_same_on_one_and_two_jobs(tmp_path: Path) -> None:
    from rbtool.files import trajfile
    from rbtool.files.index import read_index
    from rbtool.ops.conversion import convert

    for j in (1, 2):
        result = convert(FIXTURES / "ranks", tmp_path / f"pkl{j}", "pkl", jobs=j)
        assert result.jobs == j and result.report.written == 7 and result.throughput.bytes_read > 0
        convert(tmp_path / f"pkl{j}", tmp_path / f"pt{j}", "pt", jobs=j)
    for rank in ("rank_0", "rank_1"):
        for fmt in ("pkl", "pt"):
            a, b = (read_index(tmp_path / f"{fmt}{j}" / rank) for j in (1, 2))
            # a pickled tensor's bytes differ from one save to the next (torch's serialization
            # id), on one job as on two: the hashes are compared by the contents they cover
            assert a.id_list == b.id_list and without_hashes(a.entries) == without_hashes(b.entries)
            for tid in a.id_list:
                files = [tmp_path / f"{fmt}{j}" / rank / a.file_name(tid) for j in (1, 2)]
                assert_same_trajectory(*(trajfile.load(f) for f in files))
                for f, index in zip(files, (a, b), strict=True):
                    assert trajfile.sha256_file(f) == index.entries[tid]["sha256"]


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_pass_timer_leaves_out_the_start_up_of_its_workers(
    jobs: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Throughput is what the reading costs: a module that takes a second to import (as torch
    takes in a new process) and the workers' start are not counted in the pass's seconds."""
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(1.0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.delitem(sys.modules, "slow_to_import", raising=False)
    timer, wall = passes.Timer(), time.perf_counter()
    assert run_pass(abs, [-1, -2, -3], jobs=jobs, preload=["slow_to_import"]) == [1, 2, 3]
    wall = time.perf_counter() - wall
    assert wall >= 1.0 and timer.elapsed() < wall - 0.9  # the import's second left out
