"""rbtool.ops.repair: a consistent checkpoint from what is really there; the source never changes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import FIXTURES, RLINF_DIRS, make_traj, tree_digest

from rbtool import TrajectoryReplayBuffer, load_state
from rbtool.errors import CheckpointError, UsageError
from rbtool.files.index import read_index
from rbtool.format import ENTRY_KEYS
from rbtool.ops.repair import plan_repair, repair
from rbtool.ops.verify import verify, verify_checkpoint

NOSAVE = [rel for rel in RLINF_DIRS if "nosave_window2" in rel]
CLEAN = [rel for rel in RLINF_DIRS if rel not in NOSAVE]
BASE = "autosave_pt/autosave"


def file_of(ckpt: Path, tid: int) -> Path:
    (path,) = ckpt.glob(f"trajectory_{tid}_*")
    return path


def core(entries: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The entry keys the reference implementation writes (rbtool adds uuid/file_bytes/sha256)."""
    return {i: {k: e[k] for k in ENTRY_KEYS} for i, e in entries.items()}


def repaired(src: Path, out: Path, **kwargs: Any) -> Any:
    """Repair `src` into `out`, checking that the source is untouched and the output verifies."""
    before = tree_digest(src)
    result = repair(src, out, **kwargs)
    assert tree_digest(src) == before
    report = verify(out, deep=True)
    assert report.ok, [(p.code, p.message) for c in report.checkpoints for p in c.problems]
    assert not [p.name for p in out.parent.iterdir() if "rbtool-staging" in p.name]
    return result


# ---------------------------------------------------------------- fixtures
@pytest.mark.parametrize("rel", NOSAVE)
def test_nosave_fixtures_repair_to_their_consistent_view(rlinf_copy: Any, tmp_path: Path, rel: str) -> None:
    src = rlinf_copy(rel)
    view = json.loads((FIXTURES / f"{rel}.expected.json").read_text())["consistent_view"]
    out = tmp_path / "repaired"
    result = repaired(src, out)

    (ckpt,) = result.checkpoints
    assert [(d["trajectory_id"], d["reason"]) for d in ckpt.dropped] == [
        (i, "file missing") for i in (0, 1, 2)
    ]
    assert not ckpt.rebuilt_index and not ckpt.rebuilt_metadata and ckpt.ignored == []
    assert read_index(out).state() == view["full_load"]
    assert load_state(out)[0].state() == view["full_load"]
    for ws, ranks in view["distributed_load"].items():
        for rank, want in enumerate(ranks):
            assert load_state(out, world_size=int(ws), rank=rank)[0].state() == want
            buffer = TrajectoryReplayBuffer(seed=1234)
            buffer.load_checkpoint(str(out), is_distributed=True, local_rank=rank, world_size=int(ws))
            got = {
                "size": buffer.size,
                "total_samples": buffer.total_samples,
                "trajectory_counter": buffer.trajectory_counter,
                "trajectory_id_list": buffer.trajectory_id_list,
            }
            assert got == want
    source = read_index(src)
    assert core(read_index(out).entries) == core({i: source.entries[i] for i in (3, 4)})
    for tid in (3, 4):  # hard-linked, not copied
        assert os.path.samefile(file_of(out, tid), file_of(src, tid))


@pytest.mark.parametrize("rel", CLEAN)
def test_a_consistent_checkpoint_repairs_to_itself(rlinf_copy: Any, tmp_path: Path, rel: str) -> None:
    src = rlinf_copy(rel)
    result = repaired(src, tmp_path / "out")
    (ckpt,) = result.checkpoints
    assert ckpt.dropped == [] and ckpt.ignored == [] and ckpt.fixed == []
    before, after = read_index(src), read_index(tmp_path / "out")
    assert after.state() == before.state() and core(after.entries) == core(before.entries)
    assert (after.seed, after.trajectory_format) == (before.seed, before.trajectory_format)


def test_folder_of_ranks_is_repaired_rank_by_rank(rlinf_copy: Any, tmp_path: Path) -> None:
    src = rlinf_copy("ranks/rank_0").parent
    rlinf_copy("ranks/rank_1")
    file_of(src / "rank_1", 2).unlink()
    result = repaired(src, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rank_0", "rank_1"]
    assert [c.index.id_list for c in result.checkpoints] == [[0, 1, 2], [0, 1, 3]]
    assert result.checkpoints[1].dropped[0]["trajectory_id"] == 2


# ------------------------------------------------------------ rebuilding
@pytest.mark.parametrize("rel", ["autosave_pt/autosave", "varying_shapes_pt/ckpt", "nosave_window2_pkl/ckpt"])
@pytest.mark.parametrize("lost", ["metadata", "index", "both", "garbage"])
def test_lost_or_corrupt_json_is_rebuilt_from_the_files(
    rlinf_copy: Any, tmp_path: Path, rel: str, lost: str
) -> None:
    src = rlinf_copy(rel)
    original = read_index(src)
    on_disk = sorted(int(p.name.split("_")[1]) for p in src.glob("trajectory_*_*.p*"))
    if lost in ("metadata", "both"):
        (src / "metadata.json").unlink()
    if lost in ("index", "both"):
        (src / "trajectory_index.json").unlink()
    if lost == "garbage":
        (src / "metadata.json").write_bytes(b"\xff{")
        (src / "trajectory_index.json").write_text('{"trajectory_index": 3}')
    result = repaired(src, tmp_path / "out")
    (ckpt,) = result.checkpoints
    out = read_index(tmp_path / "out")
    assert ckpt.rebuilt_metadata is (lost != "index")
    assert ckpt.rebuilt_index is (lost != "metadata")
    assert out.trajectory_format == original.trajectory_format  # from the files' suffix when lost
    assert out.seed == 1234
    if ckpt.rebuilt_index:
        assert out.id_list == on_disk  # every file, by id
        assert out.trajectory_counter == max(on_disk) + 1
    else:
        assert out.id_list == [i for i in original.id_list if i in on_disk]
        assert out.trajectory_counter == original.trajectory_counter
    assert core(out.entries) == core({i: original.entries[i] for i in out.id_list})


def test_invalid_entries_are_rebuilt_from_their_files(rlinf_copy: Any, tmp_path: Path) -> None:
    src = rlinf_copy(BASE)
    original = read_index(src)
    doc = orjson.loads((src / "trajectory_index.json").read_bytes())
    doc["trajectory_index"]["1"]["shape"] = "four by two"
    del doc["trajectory_index"]["2"]
    doc["trajectory_index"]["3"].update(shape=[9, 2, 7], num_samples=18)
    (src / "trajectory_index.json").write_bytes(orjson.dumps(doc))
    result = repaired(src, tmp_path / "out")
    out = read_index(tmp_path / "out")
    assert out.id_list == original.id_list
    assert core(out.entries) == core(original.entries)
    fixed = [f["trajectory_id"] for f in result.checkpoints[0].fixed if f["trajectory_id"] is not None]
    assert fixed == [1, 2, 3]


# ---------------------------------------------------------------- dropping
def test_unreadable_unsafe_and_altered_files_are_dropped(rlinf_copy: Any, tmp_path: Path) -> None:
    import torch

    src = rlinf_copy(BASE)
    marker = tmp_path / "MARKER"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    file_of(src, 0).write_bytes(file_of(src, 0).read_bytes()[:200])  # truncated
    torch.save({"rewards": Evil()}, file_of(src, 1))  # reaches for os.system
    torch.save({"actions": torch.zeros(4, 2, 7)}, file_of(src, 2))  # no shape field
    doc = orjson.loads((src / "trajectory_index.json").read_bytes())
    doc["trajectory_index"]["3"]["sha256"] = "0" * 64  # content no longer what was written
    (src / "trajectory_index.json").write_bytes(orjson.dumps(doc))
    meta = orjson.loads((src / "metadata.json").read_bytes())
    (src / "metadata.json").write_bytes(orjson.dumps({**meta, "format_version": 1}))  # rbtool wrote last

    result = repaired(src, tmp_path / "out")
    dropped = {d["trajectory_id"]: d["reason"] for d in result.checkpoints[0].dropped}
    assert sorted(dropped) == [0, 1, 2, 3]
    assert "refused" in dropped[1] and "os" in dropped[1]
    assert "cannot determine the trajectory shape" in dropped[2]
    assert "sha256" in dropped[3]
    assert read_index(tmp_path / "out").state() == {
        "size": 1,
        "total_samples": 8,
        "trajectory_counter": 5,
        "trajectory_id_list": [4],
    }
    assert not marker.exists()


def test_unlisted_and_duplicate_files_are_left_out(rlinf_copy: Any, tmp_path: Path) -> None:
    import torch

    src = rlinf_copy(BASE)
    shutil.copy(file_of(src, 0), src / "trajectory_9_late.pt")  # uncommitted leftover
    (src / "trajectory_2_x.pkl").write_bytes(b"not even a pickle")  # a second file for id 2
    torch.save(make_traj(), src / ".trajectory_5_tmp.pt")  # hidden: never adopted
    result = repaired(src, tmp_path / "out")
    (ckpt,) = result.checkpoints
    assert read_index(tmp_path / "out").id_list == [0, 1, 2, 3, 4]
    assert {i["file"] for i in ckpt.ignored} == {"trajectory_9_late.pt", "trajectory_2_x.pkl"}
    kept = [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("trajectory_2_")]
    assert kept == [read_index(src).file_name(2)]


def test_counter_stays_above_every_id(rlinf_copy: Any, tmp_path: Path) -> None:
    src = rlinf_copy(BASE)
    meta = orjson.loads((src / "metadata.json").read_bytes())
    (src / "metadata.json").write_bytes(orjson.dumps({**meta, "trajectory_counter": 2, "size": 99}))
    file_of(src, 4).unlink()
    result = repaired(src, tmp_path / "out")
    out = read_index(tmp_path / "out")
    # 4 is dropped, but it was assigned once: new ids must not reuse it
    assert out.id_list == [0, 1, 2, 3] and out.trajectory_counter == 5
    assert result.checkpoints[0].dropped == [
        {
            "trajectory_id": 4,
            "file": "trajectory_4_98b814db-b0b0-5602-9d14-41bbcbfe434f.pt",
            "reason": "file missing",
        }
    ]


def test_converts_files_whose_suffix_differs_from_the_format(rlinf_copy: Any, tmp_path: Path) -> None:
    """A .pkl file in a pt checkpoint is the trajectory that is really there: kept, rewritten as .pt."""
    from rbtool.files import trajfile

    src = rlinf_copy(BASE)
    pt = file_of(src, 2)
    traj = trajfile.load(pt)
    pt.with_suffix(".pkl").write_bytes(trajfile.to_bytes(traj, "pkl"))
    pt.unlink()
    result = repaired(src, tmp_path / "out")
    assert result.report.written == 1
    assert read_index(tmp_path / "out").id_list == [0, 1, 2, 3, 4]
    again = trajfile.load(file_of(tmp_path / "out", 2))
    assert again.keys() == traj.keys()


# ------------------------------------------------------------------ output
def test_existing_output_needs_overwrite(rlinf_copy: Any, tmp_path: Path) -> None:
    src = rlinf_copy(NOSAVE[0])
    out = tmp_path / "out"
    repaired(src, out)
    first = tree_digest(out)
    with pytest.raises(CheckpointError, match="already exists"):
        repair(src, out)
    assert tree_digest(out) == first
    repaired(src, out, overwrite=True)
    assert read_index(out).id_list == [3, 4]


def test_output_may_not_overlap_the_source(rlinf_copy: Any) -> None:
    src = rlinf_copy(BASE)
    before = tree_digest(src)
    for out in (src, src / "inside", src.parent):
        with pytest.raises(UsageError, match="overlaps"):
            repair(src, out)
    assert tree_digest(src) == before


def test_nothing_to_repair_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        repair(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_plan_repair_writes_nothing(rlinf_copy: Any, tmp_path: Path) -> None:
    src = rlinf_copy(NOSAVE[1])
    before = tree_digest(tmp_path)
    plan = plan_repair(src)
    assert plan.index.id_list == [3, 4] and len(plan.dropped) == 3
    assert tree_digest(tmp_path) == before


def test_metadata_values_that_are_valid_survive(rlinf_copy: Any, tmp_path: Path) -> None:
    src = rlinf_copy(BASE)
    meta = orjson.loads((src / "metadata.json").read_bytes())
    meta.update(seed=7, note={"kept": True}, trajectory_counter="five")
    (src / "metadata.json").write_bytes(orjson.dumps(meta))
    (src / "trajectory_index.json").unlink()
    result = repaired(src, tmp_path / "out")
    out = read_index(tmp_path / "out")
    assert out.seed == 7 and out.extra_metadata == {"note": {"kept": True}} and out.trajectory_counter == 5
    assert any("trajectory_counter" in f["message"] for f in result.checkpoints[0].fixed)


def test_the_file_contents_decide_over_its_name_and_entry(rlinf_copy: Any, tmp_path: Path) -> None:
    """A renamed file keeps its data's model_weights_id; max_episode_length comes from the data."""
    src = rlinf_copy(BASE)
    original = read_index(src)
    file_of(src, 1).rename(src / "trajectory_1_renamed.pt")
    doc = orjson.loads((src / "trajectory_index.json").read_bytes())
    doc["trajectory_index"]["2"]["max_episode_length"] = 0
    (src / "trajectory_index.json").write_bytes(orjson.dumps(doc))
    result = repaired(src, tmp_path / "out")  # verifies --deep without problems
    out = read_index(tmp_path / "out")
    assert core(out.entries) == core(original.entries)
    assert file_of(tmp_path / "out", 1).name == original.file_name(1)
    messages = [f["message"] for f in result.checkpoints[0].fixed]
    assert any("max_episode_length 0 corrected to 4" in m for m in messages)
    assert any("named after it" in m for m in messages)


def test_hashes_recorded_before_another_writer_are_hints(rlinf_copy: Any, tmp_path: Path) -> None:
    """RLinf copies rbtool's sha256/file_bytes forward after re-serialising files: keep what loads."""
    import torch

    src = rlinf_copy(BASE)
    doc = orjson.loads((src / "trajectory_index.json").read_bytes())
    for key in ("1", "3"):
        doc["trajectory_index"][key].update(sha256="0" * 64, file_bytes=7)  # records of other bytes
    (src / "trajectory_index.json").write_bytes(orjson.dumps(doc))
    torch.save({"actions": torch.zeros(4, 2, 7)}, file_of(src, 2))  # still dropped: does not load as one

    result = repaired(src, tmp_path / "out")
    ckpt = result.checkpoints[0]
    assert [d["trajectory_id"] for d in ckpt.dropped] == [2]
    assert read_index(tmp_path / "out").id_list == [0, 1, 3, 4]
    assert {f["trajectory_id"] for f in ckpt.fixed if "another writer" in f["message"]} == {1, 3}
    out = read_index(tmp_path / "out")
    for tid in (1, 3):  # the kept files' records describe the bytes written now
        assert out.entries[tid].get("sha256") != "0" * 64
        assert out.entries[tid]["file_bytes"] == file_of(tmp_path / "out", tid).stat().st_size
    assert verify_checkpoint(tmp_path / "out", deep=True).ok
