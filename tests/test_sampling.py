"""The sampler against an eager reference: load whole, flatten, concatenate, index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import assert_batches_equal, make_traj

from rbtool import TrajectoryReplayBuffer, read_index
from rbtool.buffer.sampling import draw_uniform
from rbtool.buffer.storage import FileRows, shared_schema
from rbtool.files import trajfile


def eager_flatten(traj: dict[str, Any], t: int) -> dict[tuple[str, ...], Any]:
    """The reference implementation's flattening, written plainly (SPEC §3 step 5)."""
    import torch

    flat: dict[tuple[str, ...], Any] = {}
    nested = []
    for key, value in traj.items():
        if isinstance(value, dict):
            nested.append(key)
        elif isinstance(value, torch.Tensor) and value.dim() >= 2:
            extra = value.shape[0] - t if key in ("dones", "terminations", "truncations") else 0
            if extra > 0:
                value = value.reshape(extra, t // extra + 1, *value.shape[1:])[:, 1:].reshape(
                    t, *value.shape[1:]
                )
            flat[(key,)] = value.reshape(-1, *value.shape[2:])
    order = {"curr_obs": 0, "next_obs": 1, "forward_inputs": 2}
    for key in sorted(nested, key=lambda k: order.get(k, 3)):
        for sub, value in traj[key].items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                flat[(key, sub)] = value.reshape(-1, *value.shape[2:])
    return flat


def eager_sample(ckpt: Path, window: int, num_chunks: int, seed: int) -> dict[str, Any]:
    import torch

    from rbtool.buffer.storage import nest
    from rbtool.files.index import window_of

    index = read_index(ckpt)
    ids = window_of(index.id_list, window)
    flats = [
        eager_flatten(trajfile.load(ckpt / index.file_name(i)), index.entries[i]["shape"][0]) for i in ids
    ]
    schema = shared_schema([{p: (v.dtype, tuple(v.shape[1:])) for p, v in f.items()} for f in flats])
    draw = draw_uniform(
        ids, [index.entries[i]["num_samples"] for i in ids], num_chunks, torch.Generator().manual_seed(seed)
    )
    whole = {p: torch.cat([f[p] for f in flats]) for p in schema}
    starts = torch.tensor([0] + [index.entries[i]["num_samples"] for i in ids]).cumsum(0)
    rows = starts[draw.positions] + draw.local_indices
    return nest({p: v[rows] for p, v in whole.items()})


def build(path: Path, fmt: str, trajs: list[dict[str, Any]]) -> Path:
    buffer = TrajectoryReplayBuffer(sample_window_size=0, trajectory_format=fmt)
    buffer.add_trajectories(trajs)
    buffer.save_checkpoint(path)
    return path


@pytest.mark.parametrize("fmt", ["pt", "pkl"])
@pytest.mark.parametrize("window", [0, 1, 3])
def test_sampler_equals_eager_reference(tmp_path: Path, fmt: str, window: int) -> None:
    import torch

    trajs = [
        make_traj(t=4, b=2, seed=1, image=32),  # 3 KB image rows: read from the file row by row
        make_traj(t=6, b=3, seed=2, image=32, extra_rows=2),  # two epochs of bootstrap rows
        make_traj(t=3, b=1, seed=3, image=32, extra_rows=0),
        make_traj(t=5, b=2, seed=4, image=32, big=torch.randn(5, 2, 40, 30)),  # only in one
    ]
    ckpt = build(tmp_path / "c", fmt, trajs)
    buffer = TrajectoryReplayBuffer(seed=99, sample_window_size=window, extra_fields=True)
    buffer.load_checkpoint(ckpt)  # reseeds with the checkpoint's seed, 1234
    assert_batches_equal(buffer.sample(37), eager_sample(ckpt, window, 37, 1234))


def test_file_rows_path_is_used_and_stays_small(tmp_path: Path) -> None:
    trajs = [make_traj(t=8, b=4, seed=i, image=48) for i in range(3)]
    ckpt = build(tmp_path / "c", "pt", trajs)
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.load_checkpoint(ckpt)
    batch = buffer.sample(50)
    view = buffer._view(0)
    assert isinstance(view.fields[("curr_obs", "main_images")].rows, FileRows)
    assert_batches_equal(batch, eager_sample(ckpt, 0, 50, 1234))


def test_a_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    from rbtool import TrajectoryFileError

    ckpt = build(tmp_path / "c", "pt", [make_traj(t=8, b=4, image=48)])
    path = ckpt / read_index(ckpt).file_name(0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.load_checkpoint(ckpt)
    with pytest.raises(TrajectoryFileError, match=path.name):
        buffer.sample(8)
