"""Training from a remote checkpoint (s3://, the real S3 servers of conftest): a DataLoader over
ReplayBufferDataset on a buffer loaded from a verified local copy, or sampled by byte ranges.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import assert_batches_equal, run_json
from test_datasets import loader_batches, saved_checkpoint

from rbtool import (
    PreloadReplayBufferDataset,
    ReplayBufferDataset,
    TrajectoryReplayBuffer,
    remote,
    seed_workers,
)
from rbtool.buffer.dataset import derive_seed


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(tmp_path / "cache"))


def local_twin(ckpt: Path, seed: int, **load: Any) -> TrajectoryReplayBuffer:
    twin = TrajectoryReplayBuffer(sample_window_size=0)
    twin.load_checkpoint(ckpt, **load)
    twin.random_generator.manual_seed(seed)
    return twin


def test_a_dataloader_over_a_remote_checkpoint_copied_into_the_cache(bucket: str, tmp_path: Path) -> None:
    ckpt = saved_checkpoint(tmp_path)
    url = f"{bucket}/ckpt"
    run_json("checkpoint", "save", ckpt, url, "--window", "0")
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    with remote.data_mirror(url) as local:  # every object fetched, each checked against the marker
        buffer.load_checkpoint(local)
    # the loaded window's files stay open: the buffer samples after the mirror is released
    dataset = PreloadReplayBufferDataset(buffer, None, 8, 1, 0)
    options: dict[str, Any] = {"num_workers": 2, "multiprocessing_context": "fork"}
    got = loader_batches(dataset, 4, worker_init_fn=seed_workers(3, rank=0), **options)
    dataset.close()
    twins = [local_twin(ckpt, derive_seed(3, 0, w)) for w in range(2)]
    for i, batch in enumerate(got):
        assert_batches_equal(batch, twins[i % 2].sample(8))


def test_one_rank_of_a_remote_checkpoint_sampled_by_byte_ranges(bucket: str, tmp_path: Path) -> None:
    from rbtool.files.dirs import open_view
    from rbtool.remote.ranges import RangeReads

    ckpt = saved_checkpoint(tmp_path, n=8)
    url = f"{bucket}/ckpt"
    run_json("checkpoint", "save", ckpt, url, "--window", "0")
    with remote.index_mirror(url) as mirror:
        view = open_view(mirror.path)
        buffer = TrajectoryReplayBuffer(sample_window_size=0)
        buffer.load_checkpoint(view, is_distributed=True, local_rank=1, world_size=2)
        dataset = ReplayBufferDataset(RangeReads(buffer, mirror, view), None, 6, 1, 0)
        dataset.reseed(9, rank=1)
        got = loader_batches(dataset, 3)
        # only rank 1's drawn objects were fetched (these small files whole), not the checkpoint
        assert 0 < mirror.fetched <= 4
    twin = local_twin(ckpt, derive_seed(9, 1, 0), is_distributed=True, local_rank=1, world_size=2)
    for batch in got:
        assert set(batch["rewards"].flatten().tolist()) <= {4.0, 5.0, 6.0, 7.0}
        assert_batches_equal(batch, twin.sample(6))
