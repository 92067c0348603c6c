"""filtering: a valid checkpoint of the trajectories that match; filter then diff lists the dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, make_traj, tree_digest

from rbtool import read_index
from rbtool.errors import CheckpointError, UsageError
from rbtool.ops.checkpoint import build_from_files
from rbtool.ops.compare import diff
from rbtool.ops.filtering import Criteria, filter_checkpoint
from rbtool.ops.verify import verify

RANKS = FIXTURES / "ranks"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """Eight trajectories: versions 0,1,2,0,1,2,0,1; policies a/b alternating; T*B growing."""
    files = tmp_path / "files"
    files.mkdir()
    paths = []
    for i in range(8):
        paths.append(files / f"t{i}.pt")
        traj = make_traj(t=1 + i, b=1, seed=i, image=1, model_weights_id="ab"[i % 2])
        torch.save(traj, paths[-1])
    out = tmp_path / "ckpt"
    build_from_files(paths, out, window=0, seed=5)
    return out


def kept(source: Path, tmp: Path, **criteria: object) -> list[int]:
    result = filter_checkpoint(source, tmp / "out", Criteria(**criteria), dry_run=True)  # type: ignore[arg-type]
    return result.index.id_list


def test_each_criterion(ckpt: Path, tmp_path: Path) -> None:
    assert kept(ckpt, tmp_path) == list(range(8))
    assert kept(ckpt, tmp_path, model_weights_ids=["a"]) == [0, 2, 4, 6]
    assert kept(ckpt, tmp_path, model_weights_ids=["a", "b"]) == list(range(8))
    assert kept(ckpt, tmp_path, min_version=1) == [1, 2, 4, 5, 7]
    assert kept(ckpt, tmp_path, max_version=0) == [0, 3, 6]
    assert kept(ckpt, tmp_path, min_version=1, max_version=1) == [1, 4, 7]
    assert kept(ckpt, tmp_path, max_staleness=0) == [2, 5]  # newest version is 2
    assert kept(ckpt, tmp_path, max_staleness=1) == [1, 2, 4, 5, 7]
    assert kept(ckpt, tmp_path, min_id=2, max_id=4) == [2, 3, 4]
    assert kept(ckpt, tmp_path, min_samples=6) == [5, 6, 7]
    assert kept(ckpt, tmp_path, last=3) == [5, 6, 7]
    assert kept(ckpt, tmp_path, last=0) == []
    # --last applies after the other criteria
    assert kept(ckpt, tmp_path, model_weights_ids=["b"], last=2) == [5, 7]
    assert not (tmp_path / "out").exists()


def test_output_is_a_valid_checkpoint_with_recomputed_counts(ckpt: Path, tmp_path: Path) -> None:
    before = tree_digest(ckpt)
    source = read_index(ckpt)
    out = tmp_path / "out"
    result = filter_checkpoint(ckpt, out, Criteria(model_weights_ids=["b"]))
    index = read_index(out)
    assert index.id_list == [1, 3, 5, 7] and result.dropped == [0, 2, 4, 6]
    assert index.size == 4 and index.total_samples == sum(
        source.entries[i]["num_samples"] for i in [1, 3, 5, 7]
    )
    assert index.trajectory_counter == source.trajectory_counter and index.seed == 5
    assert result.report.linked + result.report.copied == 4 and result.report.written == 0
    for i in index.id_list:
        assert (out / index.file_name(i)).read_bytes() == (ckpt / source.file_name(i)).read_bytes()
    assert verify(out, deep=True).ok
    assert tree_digest(ckpt) == before


def test_filter_then_diff_lists_exactly_what_was_dropped(ckpt: Path, tmp_path: Path) -> None:
    for n, criteria in enumerate(
        [Criteria(max_staleness=1), Criteria(min_samples=4, last=2), Criteria(model_weights_ids=["zzz"])]
    ):
        out = tmp_path / f"out{n}"
        result = filter_checkpoint(ckpt, out, criteria)
        for deep in (False, True):
            d = diff(ckpt, out, deep=deep)
            assert d.removed == result.dropped and d.added == [] and d.changed == []
            assert d.unchanged == len(result.index.id_list) and not d.order_changed
            assert {m["key"] for m in d.metadata} <= {"size", "total_samples"}
            assert d.equal == (not result.dropped)


def test_a_rank_tree_filters_by_merged_ids(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = filter_checkpoint(RANKS, out, Criteria(min_version=1))
    assert result.view.renumbered
    assert read_index(out).id_list == result.index.id_list
    assert verify(out, deep=True).ok
    d = diff(RANKS, out)
    assert d.removed == result.dropped and d.changed == []


def test_version_criteria_need_a_versions_field(tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    traj = make_traj(t=2, b=1, image=1)
    del traj["versions"]
    torch.save(traj, files / "t.pt")
    build_from_files([files / "t.pt"], tmp_path / "ckpt", window=0)
    with pytest.raises(CheckpointError, match="no versions field"):
        filter_checkpoint(tmp_path / "ckpt", tmp_path / "out", Criteria(max_version=3))
    assert not (tmp_path / "out").exists()
    assert kept(tmp_path / "ckpt", tmp_path, last=1) == [0]  # index criteria never read the field


def test_contradictory_criteria_are_usage_errors(ckpt: Path, tmp_path: Path) -> None:
    for criteria in (Criteria(min_id=3, max_id=2), Criteria(min_version=2, max_version=1), Criteria(last=-1)):
        with pytest.raises(UsageError):
            filter_checkpoint(ckpt, tmp_path / "out", criteria)
    assert not (tmp_path / "out").exists()
