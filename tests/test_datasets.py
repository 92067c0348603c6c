"""RLinf's training datasets (rbtool.buffer.dataset): the same batches as RLinf's, a quiet wait,
a clean close, and DataLoaders over loaded checkpoints with a seed per worker and rank.

RLinf is not installed here: its batches are built from twin buffers (same trajectories, same
seeds) by its rule, `torch.cat` of `sample(batch_size // 2)` from each over the keys both hold.
"""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_batches_equal, make_traj, run

from rbtool import (
    PreloadReplayBufferDataset,
    ReplayBufferDataset,
    TrajectoryReplayBuffer,
    replay_buffer_collate_fn,
    seed_workers,
)
from rbtool.buffer.dataset import JOIN_TIMEOUT, STOP_CHECK, derive_seed
from rbtool.errors import DroppedKeysWarning, UsageError

pytestmark = [
    pytest.mark.filterwarnings("ignore::rbtool.errors.DroppedKeysWarning"),
    pytest.mark.filterwarnings("ignore:sampled batches leave out"),
]


def rlinf_concat(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """RLinf's concat_batch, as its source reads: over `first`'s keys, tensors and dicts only."""
    out: dict[str, Any] = {}
    for key, value in first.items():
        if key not in second:
            continue
        if isinstance(value, torch.Tensor):
            out[key] = torch.cat([value, second[key]], dim=0)
        elif isinstance(value, dict):
            out[key] = rlinf_concat(value, second[key])
    return out


def replay_trajs(n: int = 4) -> list[dict[str, Any]]:
    """Online trajectories: a wrist camera the demos lack; rewards say which trajectory a row is from."""
    trajs = []
    for i in range(n):
        traj = make_traj(t=3 + i % 2, b=2, seed=i, rewards=torch.full((3 + i % 2, 2, 1), float(i)))
        g = torch.Generator().manual_seed(50 + i)
        wrist = torch.randint(0, 255, (3 + i % 2, 2, 4, 4, 3), generator=g, dtype=torch.uint8)
        traj["curr_obs"]["wrist_images"] = wrist
        trajs.append(traj)
    return trajs


def demo_trajs(n: int = 3) -> list[dict[str, Any]]:
    """Demonstrations: no prev_values, no forward_inputs, and a next_obs field of their own."""
    trajs = []
    for i in range(n):
        traj = make_traj(t=5, b=1, seed=100 + i, rewards=torch.full((5, 1, 1), 100.0 + i))
        del traj["prev_values"], traj["forward_inputs"]
        traj["next_obs"]["extra_state"] = torch.randn(5, 1, 2, generator=torch.Generator().manual_seed(i))
        trajs.append(traj)
    return trajs


def make_buffer(trajs: list[dict[str, Any]], seed: int) -> TrajectoryReplayBuffer:
    buffer = TrajectoryReplayBuffer(seed=seed, sample_window_size=0)
    buffer.add_trajectories(trajs)
    return buffer


def twins(seed: int = 5) -> tuple[TrajectoryReplayBuffer, TrajectoryReplayBuffer]:
    return make_buffer(replay_trajs(), seed), make_buffer(demo_trajs(), seed + 1)


# ------------------------------------------------------------------------------- RLinf's batches
def test_replay_and_demo_batches_are_rlinfs_concat_and_each_dropped_key_warns_once() -> None:
    replay, demo = twins()
    replay_twin, demo_twin = twins()
    dataset = ReplayBufferDataset(replay, demo, 10, 1, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iterator = iter(dataset)
        for _ in range(6):
            batch = next(iterator)
            expected = rlinf_concat(replay_twin.sample(5), demo_twin.sample(5))
            assert_batches_equal(batch, expected)
    assert batch["rewards"].shape == (10, 1) and batch["curr_obs"]["main_images"].shape == (10, 4, 4, 3)
    assert batch["rewards"][:5].lt(100).all() and batch["rewards"][5:].ge(100).all()
    assert "forward_inputs" not in batch and "prev_values" not in batch
    assert "wrist_images" not in batch["curr_obs"] and "extra_state" not in batch["next_obs"]
    dropped = sorted(
        str(w.message).split("'")[1] for w in caught if issubclass(w.category, DroppedKeysWarning)
    )
    # one warning per key over six batches, for keys missing on either side
    assert dropped == ["curr_obs.wrist_images", "forward_inputs", "next_obs.extra_state", "prev_values"]


def test_without_demo_a_batch_is_one_replay_sample() -> None:
    replay, twin = make_buffer(replay_trajs(), 3), make_buffer(replay_trajs(), 3)
    iterator = iter(ReplayBufferDataset(replay, None, 7, 2, 0, unused="ignored"))
    for _ in range(4):
        assert_batches_equal(next(iterator), twin.sample(7))


def test_an_odd_batch_size_gives_two_halves_rounded_down() -> None:
    replay, demo = twins()
    batch = next(iter(ReplayBufferDataset(replay, demo, 9, 1, 1)))
    assert batch["actions"].shape[0] == 8


def test_the_prefetching_dataset_yields_the_plain_datasets_sequence() -> None:
    plain = ReplayBufferDataset(*twins(), 8, 1, 1)
    preload = PreloadReplayBufferDataset(*twins(), 8, 1, 1, prefetch_size=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedKeysWarning)
        expected = [b for b, _ in zip(plain, range(12), strict=False)]
        got = [b for b, _ in zip(preload, range(12), strict=False)]
    preload.close()
    for a, b in zip(got, expected, strict=True):
        assert_batches_equal(a, b)
    assert preload.sample_thread is not None and not preload.sample_thread.is_alive()


def test_rlinfs_attributes_and_collate() -> None:
    replay, demo = twins()
    dataset = PreloadReplayBufferDataset(replay, demo, 4, 2, 3)
    assert (dataset.replay_buffer, dataset.demo_buffer) == (replay, demo)
    assert (dataset.batch_size, dataset.min_replay_buffer_size, dataset.min_demo_buffer_size) == (4, 2, 3)
    assert dataset.prefetch_size == 5 and dataset.preload_queue.maxsize == 5 and dataset.sample_thread is None
    assert replay_buffer_collate_fn([{"a": 1}]) == {"a": 1}
    with pytest.raises(ValueError, match="prefetch_size"):
        PreloadReplayBufferDataset(replay, demo, 4, 2, 3, prefetch_size=0)
    dataset.close()  # never iterated: nothing to stop, nothing raised


def test_a_key_that_is_a_tensor_on_one_side_and_a_dict_on_the_other_is_an_error() -> None:
    from rbtool.buffer.dataset import concat_batch

    left = {"obs": {"a": torch.zeros(2, 1)}, "x": torch.zeros(2, 1)}
    right = {"obs": torch.zeros(2, 3), "x": torch.ones(1, 1)}
    with pytest.raises(UsageError, match="'obs' is a dict in the replay batch and a tensor in the demo"):
        concat_batch(left, right, lambda path, side: None)
    seen: list[tuple[str, str]] = []
    out = concat_batch(
        {"x": torch.zeros(2, 1), "n": 3}, {"x": torch.ones(1, 1), "y": {}}, lambda *a: seen.append(a)
    )
    assert out["x"].tolist() == [[0.0], [0.0], [1.0]] and list(out) == ["x"]
    assert seen == [("y", "replay")]


# ---------------------------------------------------------------------------- waiting and waking
def thread_cpu(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class Consumer:
    """next() of an iterator on a thread of its own: what it got, or what it raised."""

    def __init__(self, iterator: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.ended = False

        def run() -> None:
            try:
                self.result = next(iterator)
            except StopIteration:
                self.ended = True
            except BaseException as error:
                self.error = error

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join(10)
        assert not self.thread.is_alive()


def test_wait_until_ready_wakes_on_add_and_times_out() -> None:
    buffer = TrajectoryReplayBuffer(seed=1)
    assert buffer.wait_until_ready(1, timeout=0.05) is False
    assert buffer.wait_until_ready(0, timeout=0) is True
    threading.Timer(0.1, buffer.add_trajectories, [[make_traj()]]).start()
    assert buffer.wait_until_ready(1, timeout=30) is True
    buffer.add_trajectories([make_traj()])
    assert buffer.wait_until_ready(2, timeout=30) is True  # ready already: no wait
    clearing = threading.Timer(0.1, buffer.clear)
    clearing.start()
    assert buffer.wait_until_ready(5, timeout=0.5) is False
    clearing.join()
    assert len(buffer) == 0
    closing = threading.Timer(0.1, buffer.close)
    closing.start()
    start = time.monotonic()
    assert buffer.wait_until_ready(5, timeout=30) is False  # close() wakes the waiter, not ready
    assert time.monotonic() - start < 10
    closing.join()


@pytest.mark.parametrize("kind", [ReplayBufferDataset, PreloadReplayBufferDataset])
def test_a_dataset_waits_without_spinning_and_wakes_on_the_add_that_makes_it_ready(kind: Any) -> None:
    replay, twin = TrajectoryReplayBuffer(seed=9), TrajectoryReplayBuffer(seed=9)
    dataset = kind(replay, None, 6, 2, 0)
    consumer = Consumer(iter(dataset))
    time.sleep(0.1)  # the iterator is waiting now
    thread = consumer.thread if kind is ReplayBufferDataset else dataset.sample_thread
    before = thread_cpu(thread)
    time.sleep(0.5)
    # a spin would take most of the 0.5 s; a sleeper wakes 1/STOP_CHECK times a second
    assert thread_cpu(thread) - before < 0.1
    assert consumer.thread.is_alive() and consumer.result is None
    replay.add_trajectories([make_traj(seed=1)])
    time.sleep(0.05)
    assert consumer.result is None  # one trajectory of the two it waits for
    replay.add_trajectories([make_traj(seed=2)])
    consumer.join()
    twin.add_trajectories([make_traj(seed=1), make_traj(seed=2)])
    assert_batches_equal(consumer.result, twin.sample(6))
    dataset.close()


class ForeignBuffer:
    """A buffer with RLinf's surface only (no wait_until_ready): is_ready and sample."""

    def __init__(self) -> None:
        self.checks = 0
        self.size = 0
        self.random_generator = torch.Generator()

    def is_ready(self, min_size: int) -> bool:
        self.checks += 1
        return self.size >= min_size

    def sample(self, num_chunks: int) -> dict[str, Any]:
        return {"x": torch.rand(num_chunks, 1, generator=self.random_generator)}


def test_a_foreign_buffer_is_polled_with_backoff_not_spun() -> None:
    foreign = ForeignBuffer()
    consumer = Consumer(iter(ReplayBufferDataset(foreign, None, 3, 1, 0)))
    time.sleep(0.6)
    # backoff from 1 ms to STOP_CHECK: about a dozen checks in 0.6 s, where a spin makes millions
    assert 3 < foreign.checks < 60
    foreign.size = 1
    consumer.join()
    assert consumer.result["x"].shape == (3, 1)


def test_a_demo_buffer_not_ready_is_waited_for_too() -> None:
    replay, demo = make_buffer(replay_trajs(), 1), TrajectoryReplayBuffer(seed=2)
    dataset = ReplayBufferDataset(replay, demo, 4, 1, 2)
    consumer = Consumer(iter(dataset))
    time.sleep(0.2)
    assert consumer.thread.is_alive()
    demo.add_trajectories(demo_trajs(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DroppedKeysWarning)
        consumer.join()
    assert consumer.result["actions"].shape[0] == 4


# --------------------------------------------------------------------------------------- closing
@pytest.mark.parametrize("kind", [ReplayBufferDataset, PreloadReplayBufferDataset])
def test_close_ends_a_waiting_iterator_quietly(kind: Any) -> None:
    dataset = kind(TrajectoryReplayBuffer(seed=1), None, 4, 1, 0)
    consumer = Consumer(iter(dataset))
    time.sleep(0.1)
    start = time.monotonic()
    dataset.close()  # no "Sampling thread failed" on a normal close
    if kind is PreloadReplayBufferDataset:
        # close() joins the thread for at most JOIN_TIMEOUT: it has ended when close() returns
        assert JOIN_TIMEOUT <= 1 and not dataset.sample_thread.is_alive()
    consumer.thread.join(5)
    assert not consumer.thread.is_alive() and consumer.ended and consumer.error is None
    assert time.monotonic() - start < 5
    assert list(iter(dataset)) == []  # a closed dataset yields nothing


def test_close_stops_a_thread_blocked_on_a_full_queue() -> None:
    dataset = PreloadReplayBufferDataset(make_buffer(replay_trajs(), 1), None, 4, 1, 0, prefetch_size=2)
    iterator = iter(dataset)
    next(iterator)
    deadline = time.monotonic() + 10
    while not dataset.preload_queue.full() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dataset.preload_queue.full()
    dataset.close()
    assert not dataset.sample_thread.is_alive() and dataset.preload_queue.empty()
    with pytest.raises(StopIteration):
        next(iterator)


class FailingBuffer(ForeignBuffer):
    """Samples `good` batches, then fails once `fail` is set."""

    def __init__(self, good: int) -> None:
        super().__init__()
        self.size = 1
        self.good = good
        self.fail = threading.Event()
        if good == 0:
            self.fail.set()

    def sample(self, num_chunks: int) -> dict[str, Any]:
        if self.good == 0:
            self.fail.wait(30)
            raise OSError("disk gone")
        self.good -= 1
        return super().sample(num_chunks)


def test_an_error_in_the_prefetch_thread_reaches_the_next_next_and_close_does_not_repeat_it() -> None:
    failing = FailingBuffer(good=2)
    dataset = PreloadReplayBufferDataset(failing, None, 3, 1, 0, prefetch_size=4)
    iterator = iter(dataset)
    first = next(iterator)
    assert first["x"].shape == (3, 1)
    failing.fail.set()
    dataset.sample_thread.join(10)  # the thread ended by failing, one good batch still queued
    assert not dataset.sample_thread.is_alive()
    with pytest.raises(RuntimeError, match="Sampling thread failed") as raised:
        next(iterator)
    assert isinstance(raised.value.__cause__, OSError)
    dataset.close()  # the consumer saw the error already


def test_close_raises_a_sampling_error_the_consumer_has_not_seen_chained() -> None:
    dataset = PreloadReplayBufferDataset(FailingBuffer(good=0), None, 3, 1, 0)
    consumer = Consumer(iter(dataset))
    consumer.join()  # woken by the failure, not left waiting
    assert isinstance(consumer.error, RuntimeError) and isinstance(consumer.error.__cause__, OSError)
    failing = FailingBuffer(good=1)
    again = PreloadReplayBufferDataset(failing, None, 3, 1, 0)
    next(iter(again))  # the one good batch; the thread fails on the next sample
    failing.fail.set()
    again.sample_thread.join(10)
    with pytest.raises(RuntimeError, match="Sampling thread failed") as raised:
        again.close()
    assert isinstance(raised.value.__cause__, OSError)
    again.close()  # reported once


def test_a_dataset_dropped_with_its_iterators_is_collected_and_stops_its_thread() -> None:
    import gc

    dataset = PreloadReplayBufferDataset(make_buffer(replay_trajs(), 1), None, 4, 1, 0)
    iterator = iter(dataset)
    next(iterator)
    thread = dataset.sample_thread
    assert thread is not None
    del dataset, iterator
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


# ----------------------------------------------------------------------------------------- seeds
def test_derived_seeds_differ_per_rank_worker_and_buffer_and_are_stable() -> None:
    seeds = {derive_seed(7, r, w, s) for r in range(4) for w in range(4) for s in range(2)}
    assert len(seeds) == 32 and all(0 <= s < 2**63 for s in seeds)
    assert derive_seed(7, 1, 0) != derive_seed(7, 0, 1)
    assert derive_seed(7, 2, 3, 1) == derive_seed(7, 2, 3, 1)
    with pytest.raises(ValueError, match="rank"):
        derive_seed(7, -1)
    with pytest.raises(ValueError, match="base_seed"):
        seed_workers(1.5)  # type: ignore[arg-type]


def test_reseed_seeds_replay_and_demo_apart() -> None:
    replay, demo = twins()
    dataset = ReplayBufferDataset(replay, demo, 4, 1, 1)
    dataset.reseed(11, rank=2, worker_id=1)
    assert replay.random_generator.initial_seed() == derive_seed(11, 2, 1, 0)
    assert demo.random_generator.initial_seed() == derive_seed(11, 2, 1, 1)


def seeded_twin(trajs: list[dict[str, Any]], base: int, rank: int, worker: int) -> TrajectoryReplayBuffer:
    twin = make_buffer(trajs, 0)
    twin.random_generator.manual_seed(derive_seed(base, rank, worker))
    return twin


def loader_batches(dataset: Any, n: int, **kwargs: Any) -> list[dict[str, Any]]:
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=1, collate_fn=replay_buffer_collate_fn, **kwargs)
    iterator = iter(loader)
    try:
        return [next(iterator) for _ in range(n)]
    finally:
        del iterator


def test_each_dataloader_worker_draws_its_own_reproducible_stream() -> None:
    trajs = replay_trajs()
    dataset = ReplayBufferDataset(make_buffer(trajs, 0), None, 6, 1, 0)
    options: dict[str, Any] = {"num_workers": 2, "multiprocessing_context": "fork"}
    first = loader_batches(dataset, 4, worker_init_fn=seed_workers(7, rank=1), **options)
    again = loader_batches(dataset, 4, worker_init_fn=seed_workers(7, rank=1), **options)
    other_rank = loader_batches(dataset, 2, worker_init_fn=seed_workers(7, rank=0), **options)
    for a, b in zip(first, again, strict=True):
        assert_batches_equal(a, b)
    # DataLoader takes batches from its workers in turn: 0, 1, 0, 1
    workers = [seeded_twin(trajs, 7, 1, w) for w in range(2)]
    for i, batch in enumerate(first):
        assert_batches_equal(batch, workers[i % 2].sample(6))
    assert not torch.equal(first[0]["actions"], first[1]["actions"])
    assert not torch.equal(first[0]["actions"], other_rank[0]["actions"])
    # no workers: reseed in the process gives worker 0's stream
    dataset.reseed(7, rank=1)
    assert_batches_equal(loader_batches(dataset, 1)[0], first[0])


# ------------------------------------------------------------------ training from a checkpoint
def saved_checkpoint(root: Path, n: int = 6) -> Path:
    buffer = TrajectoryReplayBuffer(seed=3, sample_window_size=0)
    buffer.add_trajectories(
        [make_traj(t=3, b=2, seed=i, rewards=torch.full((3, 2, 1), float(i))) for i in range(n)]
    )
    buffer.save_checkpoint(root / "ckpt")
    buffer.close()
    return root / "ckpt"


@pytest.mark.parametrize("how", ["is_distributed", "rank_dir"])
def test_a_dataloader_over_one_rank_of_a_rank_tree(tmp_path: Path, how: str) -> None:
    ckpt = saved_checkpoint(tmp_path)
    rank, world = 1, 2
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    if how == "rank_dir":
        result = run("shard", ckpt, "--world-size", world, "--out", tmp_path / "tree")
        assert result.exit_code == 0, result.stderr
        buffer.load_checkpoint(tmp_path / "tree" / f"rank_{rank}")
    else:
        buffer.load_checkpoint(ckpt, is_distributed=True, local_rank=rank, world_size=world)
    assert buffer.trajectory_id_list == [3, 4, 5]
    dataset = PreloadReplayBufferDataset(buffer, None, 8, 1, 0)
    first = loader_batches(
        dataset, 3, num_workers=2, worker_init_fn=seed_workers(5, rank), multiprocessing_context="fork"
    )
    dataset.close()
    twins = []
    for worker in range(2):
        twin = TrajectoryReplayBuffer(sample_window_size=0)
        twin.load_checkpoint(ckpt, is_distributed=True, local_rank=rank, world_size=world)
        twin.random_generator.manual_seed(derive_seed(5, rank, worker))
        twins.append(twin)
    for i, batch in enumerate(first):
        assert set(batch["rewards"].flatten().tolist()) <= {3.0, 4.0, 5.0}  # this rank's block only
        assert_batches_equal(batch, twins[i % 2].sample(8))


def lerobot_shaped(t: int, seed: int) -> dict[str, Any]:
    """An online trajectory with the fields an imported LeRobot episode has, and one it has not."""
    g = torch.Generator().manual_seed(seed)
    obs = {
        "states": torch.randn(t, 1, 3, generator=g),
        "main_images": torch.randint(0, 255, (t, 1, 6, 5, 3), generator=g, dtype=torch.uint8),
    }
    return {
        "model_weights_id": "online",
        "actions": torch.randn(t, 1, 2, generator=g),
        "rewards": torch.full((t, 1, 1), -1.0),
        "dones": torch.zeros(t + 1, 1, 1, dtype=torch.bool),
        "prev_logprobs": torch.randn(t, 1, 2, generator=g),
        "curr_obs": obs,
        "next_obs": {k: v.clone() for k, v in obs.items()},
    }


def test_a_demo_buffer_imported_from_lerobot_mixed_with_an_online_buffer(tmp_path: Path) -> None:
    from test_lerobot import build_v30

    build_v30(tmp_path / "ds", [3, 5, 4])
    result = run("import", "lerobot", tmp_path / "ds", "--buffer", tmp_path / "demo")
    assert result.exit_code == 0, result.stderr
    demo, demo_twin = (TrajectoryReplayBuffer(sample_window_size=0) for _ in range(2))
    for b in (demo, demo_twin):
        b.load_checkpoint(tmp_path / "demo")
    online, online_twin = (TrajectoryReplayBuffer(seed=4, sample_window_size=0) for _ in range(2))
    dataset = ReplayBufferDataset(online, demo, 8, 2, 3)
    consumer = Consumer(iter(dataset))  # waits: the online buffer starts empty
    time.sleep(0.1)
    assert consumer.thread.is_alive()
    trajs = [lerobot_shaped(4, seed) for seed in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        online.add_trajectories(trajs)  # grows online: now ready
        consumer.join()
    online_twin.add_trajectories(trajs)
    batch = consumer.result
    assert_batches_equal(batch, rlinf_concat(online_twin.sample(4), demo_twin.sample(4)))
    assert batch["rewards"][:4].eq(-1).all() and batch["rewards"][4:].ge(0).all()
    assert batch["curr_obs"]["main_images"].shape == (8, 6, 5, 3)
    assert "prev_logprobs" not in batch
    assert any(
        "prev_logprobs" in str(w.message) for w in caught if issubclass(w.category, DroppedKeysWarning)
    )
    dataset.close()
    assert STOP_CHECK <= 1


# --------------------------------------------------------------- RLinf's recorded batches
RECORDED = ["seedless_pt", "nested_obs_pt", "pkl_format_switch"]


def recorded_sample(name: str, window: int, num_chunks: int) -> dict[str, Any]:
    """The batch RLinf's own buffer returned for its first sample(num_chunks) after loading the
    fixture with seed 1234 and this window (fixtures/rlinf/<name>.expected.json)."""
    import json

    from conftest import FIXTURES

    record = json.loads((FIXTURES / f"{name}.expected.json").read_text())
    (entry,) = [
        s
        for s in record["samples"]
        if (s["seed"], s["sample_window_size"], s["num_chunks"]) == (1234, window, num_chunks)
    ]
    batch: dict[str, Any] = torch.load(FIXTURES / entry["batch_file"], weights_only=True)
    return batch


def loaded_fixture(name: str, window: int) -> TrajectoryReplayBuffer:
    from conftest import FIXTURES

    buffer = TrajectoryReplayBuffer(seed=1234, sample_window_size=window)
    buffer.load_checkpoint(FIXTURES / name)
    return buffer


@pytest.mark.parametrize("kind", [ReplayBufferDataset, PreloadReplayBufferDataset])
@pytest.mark.parametrize(("window", "half"), [(0, 8), (2, 6)])
@pytest.mark.parametrize(("replay", "demo"), [RECORDED[:2], RECORDED[1:], RECORDED[::-2]])
def test_the_first_batch_over_rlinf_checkpoints_is_rlinfs_concat_of_its_recorded_samples(
    kind: Any, window: int, half: int, replay: str, demo: str
) -> None:
    """Not twins of rbtool's own buffers: the halves are the batches RLinf's buffer sampled from
    these checkpoints (same seed, window and size), joined by RLinf's concat_batch."""
    dataset = kind(loaded_fixture(replay, window), loaded_fixture(demo, window), 2 * half, 1, 1)
    batch = next(iter(dataset))
    dataset.close()
    expected = rlinf_concat(recorded_sample(replay, window, half), recorded_sample(demo, window, half))
    assert_batches_equal(batch, expected)
    assert batch["actions"].shape[0] == 2 * half
    alone = ReplayBufferDataset(loaded_fixture(replay, window), None, half, 1, 0)
    assert_batches_equal(next(iter(alone)), recorded_sample(replay, window, half))


def test_a_dataloader_over_a_loaded_checkpoint_mixed_with_a_lerobot_demo_buffer(tmp_path: Path) -> None:
    """Replay from a saved checkpoint, demonstrations from `rbtool import lerobot`, two workers:
    worker w's batch is RLinf's concat of the replay half drawn with derive_seed(base, rank, w, 0)
    and the demo half drawn with derive_seed(base, rank, w, 1)."""
    from test_lerobot import build_v30

    build_v30(tmp_path / "ds", [3, 5, 4])
    result = run("import", "lerobot", tmp_path / "ds", "--buffer", tmp_path / "demo")
    assert result.exit_code == 0, result.stderr
    ckpt = tmp_path / "online"
    online = TrajectoryReplayBuffer(seed=4, sample_window_size=0)
    online.add_trajectories([lerobot_shaped(4, seed) for seed in range(3)])
    online.save_checkpoint(ckpt)
    online.close()

    def loaded(path: Path) -> TrajectoryReplayBuffer:
        buffer = TrajectoryReplayBuffer(sample_window_size=0)
        buffer.load_checkpoint(path)
        return buffer

    base, rank = 21, 1
    dataset = PreloadReplayBufferDataset(loaded(ckpt), loaded(tmp_path / "demo"), 8, 1, 1)
    options: dict[str, Any] = {"num_workers": 2, "multiprocessing_context": "fork"}
    got = loader_batches(dataset, 4, worker_init_fn=seed_workers(base, rank), **options)
    dataset.close()
    twins = []
    for worker in range(2):
        replay, demo = loaded(ckpt), loaded(tmp_path / "demo")
        replay.random_generator.manual_seed(derive_seed(base, rank, worker, 0))
        demo.random_generator.manual_seed(derive_seed(base, rank, worker, 1))
        twins.append((replay, demo))
    for i, batch in enumerate(got):
        replay, demo = twins[i % 2]
        assert_batches_equal(batch, rlinf_concat(replay.sample(4), demo.sample(4)))
        assert batch["rewards"][:4].eq(-1).all() and batch["rewards"][4:].ge(0).all()
    assert not torch.equal(got[0]["actions"], got[1]["actions"])
