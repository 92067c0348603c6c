"""Differential checks against recorded RLinf behaviour: operation sequences that RLinf's own
TrajectoryReplayBuffer ran (fixtures/rlinf/sequences, recorded by its record.py) replayed on
rbtool's, step by step: the window each sample drew from, the drawn indices, the batches,
get_stats() and what a save writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FIXTURES, assert_batches_equal

from rbtool import TrajectoryReplayBuffer, read_index

SEQUENCES = FIXTURES / "sequences"
RECORD = json.loads((SEQUENCES / "sequences.expected.json").read_text())


def decode(arg: Any) -> Any:
    """A recorded argument as RLinf was given it (numpy integers and 0-d tensors kept)."""
    if isinstance(arg, dict) and "numpy" in arg:
        return np.dtype(arg["numpy"]).type(arg["value"])
    if isinstance(arg, dict) and "tensor" in arg:
        return torch.tensor(arg["value"], dtype=getattr(torch, arg["tensor"]))
    return arg


def inputs() -> list[dict[str, Any]]:
    return [torch.load(SEQUENCES / rel, weights_only=True) for rel in RECORD["inputs"]]


@pytest.mark.parametrize("name", list(RECORD["sequences"]))
def test_rbtool_replays_what_rlinf_did(name: str, tmp_path: Path) -> None:
    seq = RECORD["sequences"][name]
    trajs = inputs()
    ctor = dict(seq["constructor"])
    if ctor.get("auto_save"):
        ctor["auto_save_path"] = str(tmp_path / "auto")
    with TrajectoryReplayBuffer(**ctor) as buffer:
        for n, step in enumerate(seq["steps"]):
            where = f"{name} step {n} ({step['op']})"
            arg = decode(step.get("arg"))
            if step["op"] == "add":
                buffer.add_trajectories([trajs[i] for i in arg])
            elif step["op"] == "window":
                buffer.sample_window_size = arg
            elif step["op"] == "stats":
                assert buffer.get_stats() == step["result"], where
            elif step["op"] in ("sample", "sample_chunks"):
                assert buffer.window_ids() == step["window_ids"], where
                state = buffer.random_generator.get_state()
                if step["op"] == "sample":
                    draw, batch = buffer.sample_with_draw(arg)
                    assert draw.global_indices.tolist() == step["global_indices"], where
                else:
                    batch = buffer.sample_chunks(arg)
                assert (not torch.equal(state, buffer.random_generator.get_state())) == step["drew"], where
                if "batch_file" in step:
                    expected = torch.load(SEQUENCES / step["batch_file"], weights_only=True)
                    assert_batches_equal(batch, expected, f"{where}: ")
                else:
                    assert batch == step["batch"], where
            elif step["op"] == "save":
                out = tmp_path / "ckpt"
                buffer.save_checkpoint(out)
                files = sorted(p.name for p in out.iterdir() if p.suffix in (".pt", ".pkl"))
                assert files == step["files"], where
                # RLinf's index lists every id ever added (SPEC §9); rbtool's what it saved
                saved = [int(f.split("_")[1]) for f in step["files"]]
                assert read_index(out).id_list == saved, where
            elif step["op"] == "clear_cache":
                buffer.clear_cache()
            else:
                raise AssertionError(f"unknown op {step['op']}")
