"""Every reference checkpoint loads as RLinf recorded and every sampled batch is reproduced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, RLINF_DIRS, assert_batches_equal

from rbtool import MissingTrajectoryFilesError, TrajectoryReplayBuffer
from rbtool.ops.checkpoint import load_state

NOSAVE = {"nosave_window2_pt/ckpt", "nosave_window2_pkl/ckpt"}
# Checkpoints that sit directly in the fixtures folder, with batches of several windows and sizes.
FLAT_DIRS = ["seedless_pt", "nested_obs_pt", "pkl_format_switch"]
ALL_DIRS = RLINF_DIRS + FLAT_DIRS


def expected(rel: str) -> dict:
    return json.loads((FIXTURES / f"{rel}.expected.json").read_text())


def consistent(rel: str) -> dict:
    """What the checkpoint means under the spec: RLinf's report, or consistent_view for nosave."""
    exp = expected(rel)
    return exp["consistent_view"] if rel in NOSAVE else exp


def state_of(buffer: TrajectoryReplayBuffer) -> dict:
    return {
        "size": buffer.size,
        "total_samples": buffer.total_samples,
        "trajectory_counter": buffer.trajectory_counter,
        "trajectory_id_list": buffer.trajectory_id_list,
    }


@pytest.mark.parametrize("rel", ALL_DIRS)
def test_full_load_matches_reference(rel: str) -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.load_checkpoint(FIXTURES / rel, strict=rel not in NOSAVE)
    assert state_of(buffer) == consistent(rel)["full_load"]


@pytest.mark.parametrize("rel", ALL_DIRS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_load_matches_reference(rel: str, world_size: int) -> None:
    records = consistent(rel)["distributed_load"][str(world_size)]
    for rank, record in enumerate(records):
        buffer = TrajectoryReplayBuffer(sample_window_size=0)
        buffer.load_checkpoint(
            FIXTURES / rel,
            is_distributed=True,
            local_rank=rank,
            world_size=world_size,
            strict=rel not in NOSAVE,
        )
        assert state_of(buffer) == record
        index, _ = load_state(FIXTURES / rel, world_size=world_size, rank=rank, strict=rel not in NOSAVE)
        assert index.state() == record


@pytest.mark.parametrize("rel", sorted(NOSAVE))
def test_strict_load_refuses_missing_files(rel: str) -> None:
    buffer = TrajectoryReplayBuffer()
    with pytest.raises(MissingTrajectoryFilesError) as info:
        buffer.load_checkpoint(FIXTURES / rel)
    assert info.value.missing_ids == expected(rel)["consistent_view"]["missing_trajectory_ids"] == [0, 1, 2]
    assert "0, 1, 2" in str(info.value) and "\n" not in str(info.value)
    assert buffer.size == 0


def sample_cases() -> list[tuple[str, dict]]:
    return [(rel, s) for rel in ALL_DIRS for s in expected(rel)["samples"]]


@pytest.mark.parametrize(
    ("rel", "case"), sample_cases(), ids=lambda v: v if isinstance(v, str) else v["batch_file"]
)
def test_sampled_batches_are_bit_identical(rel: str, case: dict) -> None:
    import torch

    buffer = TrajectoryReplayBuffer(seed=case["seed"], sample_window_size=case["sample_window_size"])
    buffer.load_checkpoint(FIXTURES / rel, strict=rel not in NOSAVE)
    assert buffer.window_ids() == case["window_ids"]
    batch = buffer.sample(case["num_chunks"])
    reference = torch.load(Path(FIXTURES / rel).parent / case["batch_file"], weights_only=True)
    assert_batches_equal(batch, reference)


@pytest.mark.parametrize(
    ("rel", "case"), sample_cases(), ids=lambda v: v if isinstance(v, str) else v["batch_file"]
)
def test_draws_match_recorded_indices(rel: str, case: dict) -> None:
    import torch

    from rbtool.buffer.sampling import draw_uniform

    buffer = TrajectoryReplayBuffer(sample_window_size=case["sample_window_size"])
    buffer.load_checkpoint(FIXTURES / rel, strict=rel not in NOSAVE)
    window = buffer.window_ids()
    sizes = [buffer._index.entries[i]["num_samples"] for i in window]
    draw = draw_uniform(window, sizes, case["num_chunks"], torch.Generator().manual_seed(case["seed"]))
    assert draw.global_indices.tolist() == case["global_indices"]
    assert draw.trajectory_ids == case["trajectory_ids"]
    assert draw.local_indices.tolist() == case["local_indices"]
