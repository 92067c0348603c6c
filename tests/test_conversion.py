"""rbtool.ops.conversion: every file rewritten in the other format, one at a time, rank trees kept."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from conftest import FIXTURES, assert_batches_equal, tree_digest

from rbtool import TrajectoryReplayBuffer, read_index
from rbtool.errors import MissingTrajectoryFilesError, OutputExistsError, UsageError
from rbtool.format import METADATA_FILE
from rbtool.ops.conversion import convert
from rbtool.ops.resharding import reshard
from rbtool.ops.verify import verify

AUTOSAVE = FIXTURES / "autosave_pt" / "autosave"


def batch(path: Path) -> dict:
    buffer = TrajectoryReplayBuffer(seed=3, sample_window_size=0)
    buffer.load_checkpoint(path)
    out = buffer.sample(16)
    buffer.close()
    return out


@pytest.mark.parametrize("jobs", [1, 4])
def test_pt_to_pkl_and_back(tmp_path: Path, jobs: int) -> None:
    before = tree_digest(AUTOSAVE)
    source = read_index(AUTOSAVE)
    result = convert(AUTOSAVE, tmp_path / "pkl", "pkl", jobs=jobs)
    assert result.jobs == jobs and result.report.written == 5 and result.report.linked == 0
    pkl = read_index(tmp_path / "pkl")
    assert pkl.trajectory_format == "pkl" and pkl.state() == source.state()
    for i in pkl.id_list:
        assert (tmp_path / "pkl" / pkl.file_name(i)).suffix == ".pkl"
        assert pkl.entries[i].get("uuid") == source.entries[i].get("uuid")
        assert pkl.entries[i]["file_bytes"] == (tmp_path / "pkl" / pkl.file_name(i)).stat().st_size
        assert len(pkl.entries[i]["sha256"]) == 64
    assert verify(tmp_path / "pkl", deep=True).ok
    assert_batches_equal(batch(tmp_path / "pkl"), batch(AUTOSAVE))
    convert(tmp_path / "pkl", tmp_path / "pt", "pt", jobs=jobs)
    assert_batches_equal(batch(tmp_path / "pt"), batch(AUTOSAVE))
    assert tree_digest(AUTOSAVE) == before


def test_the_same_format_links(tmp_path: Path) -> None:
    result = convert(AUTOSAVE, tmp_path / "same", "pt")
    assert result.report.linked + result.report.copied == 5 and result.report.written == 0


def test_a_rank_tree_keeps_its_layout(tmp_path: Path) -> None:
    reshard(FIXTURES / "ranks", 3, tmp_path / "tree")
    result = convert(tmp_path / "tree", tmp_path / "pkl", "pkl", jobs=2)
    assert [rel for rel, _ in result.checkpoints] == ["rank_0", "rank_1", "rank_2"]
    for r in range(3):
        a, b = tmp_path / "tree" / f"rank_{r}", tmp_path / "pkl" / f"rank_{r}"
        assert read_index(b).state() == read_index(a).state()
        meta_a, meta_b = (orjson.loads((d / METADATA_FILE).read_bytes()) for d in (a, b))
        assert meta_b["shard"] == meta_a["shard"]  # the layout it was written for travels along
        assert (b / "merge_map.json").read_bytes() == (a / "merge_map.json").read_bytes()
    assert verify(tmp_path / "pkl", deep=True).ok


def test_refusals_write_nothing(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        convert(AUTOSAVE, tmp_path / "o", "json")
    with pytest.raises(UsageError):
        convert(AUTOSAVE, tmp_path / "o", "pkl", jobs=0)
    with pytest.raises(MissingTrajectoryFilesError):
        convert(FIXTURES / "nosave_window2_pt" / "ckpt", tmp_path / "o", "pkl")
    assert list(tmp_path.iterdir()) == []
    kept = convert(FIXTURES / "nosave_window2_pt" / "ckpt", tmp_path / "o", "pkl", strict=False)
    assert kept.checkpoints[0][1].id_list == [3, 4]
    with pytest.raises(OutputExistsError):
        convert(AUTOSAVE, tmp_path / "o", "pkl")
    assert read_index(tmp_path / "o").id_list == [3, 4]
