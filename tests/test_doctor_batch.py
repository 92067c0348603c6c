"""doctor's checks over runs of files at once (rbtool.ops.doctor.batch) give each file exactly
the Result check_file gives it alone: findings, their order, the traits and the bytes read.

Each case writes runs of trajectories of one structure (T = 1 as RLT stores them, and T >= 2
with and without observations), with random defects in some files: NaN and Inf, frozen
actions, blank and frozen cameras, done flags that disagree, rewards out of range, episodes
too long or never ending, model_weights_ids not derived from versions, NaN versions,
duplicates, index entries that disagree, and fields numpy cannot hold.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from test_doctor import write

import rbtool
from rbtool.ops.doctor import CHECKS, weights_id_of
from rbtool.ops.doctor import batch as batch_mod

CASES = 8


def _base(rng: random.Random, g: Any, t: int, b: int, k: int, obs: bool) -> dict[str, Any]:
    import torch

    extra = rng.choice([0, 1])
    rows = t + extra
    terms = torch.rand(rows, b, k, generator=g) < 0.3
    truncs = torch.rand(rows, b, k, generator=g) < 0.2
    traj: dict[str, Any] = {
        "max_episode_length": rng.choice([0, 1, 2, 4 * t * k]),
        "actions": torch.randn(t, b, 3, generator=g),
        "rewards": torch.rand(t, b, 1, generator=g),
        "terminations": terms,
        "truncations": truncs,
        "dones": terms | truncs,
        "prev_logprobs": torch.randn(t, b, 2, generator=g),
        "versions": torch.full((t, b, 1), float(rng.randint(0, 3))),
    }
    if rng.random() < 0.5:
        traj["half"] = torch.randn(t, b, 2, generator=g).to(torch.float16)
    if rng.random() < 0.3:
        traj["counts"] = torch.randint(0, 5, (t, b, 2), generator=g)
    if obs:  # paired as RLinf's env worker pairs them: next_obs[t] = curr_obs[t + 1]
        states = torch.randn(t + 1, b, 4, generator=g)
        images = torch.randint(0, 255, (t + 1, b, 2, 2, 3), generator=g, dtype=torch.uint8)
        traj["curr_obs"] = {"states": states[:-1].clone(), "main_images": images[:-1].clone()}
        traj["next_obs"] = {"states": states[1:].clone(), "main_images": images[1:].clone()}
        if rng.random() < 0.2:  # not recorded as transitions
            traj["next_obs"] = {k2: v.clone() for k2, v in traj["curr_obs"].items()}
    traj["model_weights_id"] = weights_id_of(traj["versions"])
    return traj


def _defect(rng: random.Random, traj: dict[str, Any], g: Any) -> None:
    import torch

    kind = rng.choice(
        ["nan", "inf16", "frozen", "blank", "dones", "reward", "policy", "nan-version", "no-versions",
         "bool-versions", "bf16", "one-value-camera", "complex", "pairing", "none"]
    )  # fmt: skip
    t, b = traj["actions"].shape[:2]
    if kind == "nan":
        traj["actions"][rng.randrange(t), rng.randrange(b), 0] = float("nan")
    elif kind == "inf16" and "half" in traj:
        traj["half"][0, rng.randrange(b), 1] = float("inf")
    elif kind == "frozen":
        traj["actions"][:, rng.randrange(b)] = traj["actions"][0, 0].clone()
    elif kind in ("blank", "one-value-camera"):
        shape = (t, b, 3, 3, 3)
        image = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
        image[:, rng.randrange(b)] = 9 if kind == "one-value-camera" else image[0, 0].clone()
        traj["camera_image"] = image
    elif kind == "dones":
        traj["dones"] = traj["dones"].clone()
        traj["dones"][rng.randrange(traj["dones"].shape[0]), rng.randrange(b), 0] ^= True
    elif kind == "reward":
        traj["rewards"][rng.randrange(t), rng.randrange(b), 0] = 7.0
    elif kind == "policy":
        traj["model_weights_id"] = "v1"
    elif kind == "nan-version":
        traj["versions"][0, 0, 0] = float("nan")
    elif kind == "no-versions":
        del traj["versions"]
    elif kind == "bool-versions":
        traj["versions"] = torch.ones(t, b, 1, dtype=torch.bool)
    elif kind == "bf16":
        traj["brain"] = torch.randn(t, b, 2, generator=g).to(torch.bfloat16)
    elif kind == "pairing" and "next_obs" in traj:
        traj["next_obs"]["states"][rng.randrange(t), rng.randrange(b)] = 5.0
    elif kind == "complex":
        traj["waves"] = torch.randn(t, b, 2, generator=g, dtype=torch.complex64)


def _checkpoint(tmp_path: Path, case: int) -> Path:
    import torch

    rng = random.Random(case)
    g = torch.Generator().manual_seed(case)
    trajs: list[dict[str, Any]] = []
    for _ in range(rng.randint(2, 4)):  # runs of one structure
        t, b, k = rng.choice([1, 1, 2, 3]), rng.randint(1, 3), rng.randint(1, 2)
        obs = rng.random() < 0.4
        template = _base(rng, g, t, b, k, obs)
        for _ in range(rng.randint(5, 25)):
            traj = {
                key: value.clone() if isinstance(value, torch.Tensor) else value
                for key, value in template.items()
            }
            for key in ("curr_obs", "next_obs"):
                if key in traj:
                    traj[key] = {k2: v.clone() for k2, v in traj[key].items()}
            for key in ("actions", "rewards", "prev_logprobs"):
                traj[key] = (
                    torch.randn(traj[key].shape, generator=g)
                    if key != "rewards"
                    else torch.rand(traj[key].shape, generator=g)
                )
            if rng.random() < 0.5:  # another policy version, another pickle: the same layout
                traj["versions"] = torch.full_like(traj["versions"], float(rng.randint(0, 9)))
                traj["model_weights_id"] = weights_id_of(traj["versions"])
                traj["max_episode_length"] = rng.choice([0, 1, 2, 3, 4 * t * k])
            if rng.random() < 0.3:
                _defect(rng, traj, g)
            if rng.random() < 0.1 and trajs:
                traj = trajs[-1]  # a duplicate
            trajs.append(traj)
    path = write(tmp_path / "ck", trajs)
    if rng.random() < 0.5:  # an index entry that disagrees with its file
        import json

        index_file = path / "trajectory_index.json"
        index = json.loads(index_file.read_text())
        first = next(iter(index["trajectory_index"].values()))
        first["model_weights_id"] = "6f1ed002-ab5a-5a4f-8e5b-2a6e3c1f4f6b"
        index_file.write_text(json.dumps(index))
    return path


def _run(
    path: Path,
    monkeypatch: pytest.MonkeyPatch,
    together: bool,
    rewards: tuple[float, float] | None = (0.0, 1.0),
) -> tuple[list[Any], int, int]:
    alone = [0]
    check_file = batch_mod.check_file

    def counted(task: Any) -> Any:
        alone[0] += 1
        return check_file(task)

    with monkeypatch.context() as patch:
        patch.setattr(batch_mod, "check_file", counted)
        if not together:
            patch.setattr(batch_mod._Run, "check", lambda self: None)
        report = rbtool.doctor(path, jobs=1, reward_range=rewards, max_staleness=1.0)
    return [f.as_json() for f in report.findings], report.bytes_read, alone[0]


@pytest.mark.parametrize("case", range(CASES))
def test_files_checked_together_get_what_check_file_gives_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: int
) -> None:
    path = _checkpoint(tmp_path, case)
    together, read_together, left = _run(path, monkeypatch, together=True)
    alone, read_alone, files = _run(path, monkeypatch, together=False)
    assert together == alone
    assert read_together == read_alone
    assert left < files  # some files were checked together


def test_the_results_and_traits_are_check_files_file_by_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rbtool.files.index import read_index
    from rbtool.ops.doctor.trajectory import Options, check_file

    alone: list[Any] = []
    monkeypatch.setattr(batch_mod, "check_file", lambda task: alone.append(task) or check_file(task))
    monkeypatch.setattr(batch_mod, "SEGMENT_BYTES", 20_000)  # a segment read a few files at a time
    tasks_in_all = 0
    for case in range(CASES):
        path = _checkpoint(tmp_path / str(case), case)
        index = read_index(path)
        options = Options(tuple(CHECKS), reward_range=(0.0, 1.0))
        ids = index.id_list
        listed = list(zip(index.file_names(ids), ids, map(index.entries.get, ids), strict=True))
        (segment,) = batch_mod.cut_segments(path, listed, options, len(listed))
        tasks = segment.tasks()
        assert [(t.path, t.tid, t.entry) for t in tasks] == [
            (path / index.file_name(tid), tid, index.entries[tid]) for tid in index.id_list
        ]
        got = batch_mod.check_segment(segment).results
        assert got == [check_file(task) for task in tasks]
        tasks_in_all += len(tasks)
    assert 0 < len(alone) < tasks_in_all  # some alone, the others together


def test_random_clean_buffers_with_defects_get_check_files_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fuzz suite's clean trajectories (random T, B, E, K, fields and episode ends, paired
    observations), some with a defect, each its own layout."""
    import torch
    from test_doctor_fuzz import random_clean

    left_in_all = files_in_all = 0
    for case in range(6):
        rng = random.Random(100 + case)
        g = torch.Generator().manual_seed(case)
        trajs = []
        for i in range(12):
            traj = random_clean(rng, 1000 * case + i)
            if rng.random() < 0.4:
                _defect(rng, traj, g)
            trajs.append(traj)
        path = write(tmp_path / str(case), trajs)
        together, read_together, left = _run(path, monkeypatch, together=True, rewards=None)
        alone, read_alone, files = _run(path, monkeypatch, together=False, rewards=None)
        assert together == alone and read_together == read_alone
        left_in_all, files_in_all = left_in_all + left, files_in_all + files
    assert left_in_all < files_in_all  # (a column that never ends where others do is checked alone)


def test_a_broken_pairing_among_paired_files_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files of T = 4 paired as RLinf pairs them, no episode ending, one epoch boundary: only the
    file with a broken pair (and the one whose NaN observations still pair) go to check_file."""
    import torch

    g = torch.Generator().manual_seed(3)
    trajs = []
    for _ in range(12):
        states = torch.randn(5, 2, 4, generator=g)
        flags = torch.zeros(6, 2, 1, dtype=torch.bool)  # E = 2: an epoch boundary after t = 1
        traj = {
            "max_episode_length": 100,
            "actions": torch.randn(4, 2, 3, generator=g),
            "rewards": torch.rand(4, 2, 1, generator=g),
            "dones": flags, "terminations": flags.clone(), "truncations": flags.clone(),
            "prev_logprobs": torch.randn(4, 2, 2, generator=g),
            "curr_obs": {"states": states[:-1].clone()},
            "next_obs": {"states": states[1:].clone()},
        }  # fmt: skip
        traj["next_obs"]["states"][1, 1] = 9.0  # at the epoch boundary: not compared
        traj["model_weights_id"] = weights_id_of(None)
        trajs.append(traj)
    trajs[4]["next_obs"]["states"][2, 0] = 7.0  # compared: broken
    trajs[6]["curr_obs"]["states"][3, 1, 0] = trajs[6]["next_obs"]["states"][2, 1, 0] = float("nan")
    path = write(tmp_path / "ck", trajs)
    together, _, left = _run(path, monkeypatch, together=True)
    alone, _, files = _run(path, monkeypatch, together=False)
    assert together == alone
    assert [(f["check"], f["ids"]) for f in together if f["check"] == "pairing"] == [("pairing", [4])]
    assert (left, files) == (2, 12)


@pytest.mark.parametrize("case", range(4))
def test_damaged_files_get_what_check_file_gives_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: int
) -> None:
    """Files truncated, or with a byte changed anywhere (zip headers, pickle, tensor bytes,
    central directory): each gets check_file's verdict, findings or `cannot be checked`."""
    path = _checkpoint(tmp_path, case)
    rng = random.Random(case)
    files = sorted(path.glob("*.pt"))
    for victim in rng.sample(files, min(8, len(files))):
        data = bytearray(victim.read_bytes())
        if rng.random() < 0.25:
            del data[rng.randrange(len(data)) :]
        else:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(data))
    together, read_together, _ = _run(path, monkeypatch, together=True)
    alone, read_alone, _ = _run(path, monkeypatch, together=False)
    assert together == alone and read_together == read_alone


def test_a_clean_one_transition_buffer_never_needs_check_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    rng = random.Random(5)
    g = torch.Generator().manual_seed(5)
    template = _base(rng, g, 1, 1, 1, obs=False)  # one env: no column ends where another does not
    template["max_episode_length"] = 1
    trajs = []
    for i in range(40):
        traj = dict(
            template, actions=torch.randn(1, 1, 3, generator=g), rewards=torch.rand(1, 1, 1, generator=g)
        )
        traj["versions"] = torch.full((1, 1, 1), float(i % 3))
        traj["model_weights_id"] = weights_id_of(traj["versions"])
        trajs.append(traj)
    path = write(tmp_path / "ck", trajs)
    monkeypatch.setattr(batch_mod, "check_file", lambda task: pytest.fail(f"{task.path.name} checked alone"))
    runs: list[int] = []
    run = batch_mod._Run
    monkeypatch.setattr(batch_mod, "_Run", lambda tasks, *rest: runs.append(len(tasks)) or run(tasks, *rest))
    report = rbtool.doctor(path, jobs=1, reward_range=(0.0, 1.0), max_staleness=5.0)
    assert [f.check for f in report.findings if f.level != "info"] == []
    # three policy versions, three pickles, one layout: each segment's files checked as one run
    assert runs == [batch_mod.segment_files(40, 8, single=False)] * 8


def test_segments_cover_the_files_in_order() -> None:
    from rbtool.ops.doctor.trajectory import Options

    listed = [(f"trajectory_{i}.pt", i, None) for i in range(2500)]
    options = Options(tuple(CHECKS))
    most = batch_mod.segment_files(len(listed), 16, single=False)
    segments = batch_mod.cut_segments(Path("ck"), listed, options, most)
    assert [(n, t) for s in segments for n, t in zip(s.names, s.tids, strict=True)] == [
        (n, t) for n, t, _ in listed
    ]
    assert [p for s in segments for p in s.paths()] == [Path("ck") / n for n, _, _ in listed]
    assert max(len(s.names) for s in segments) <= batch_mod.SEGMENT_FILES and len(segments) >= 16
    assert batch_mod.segment_files(5, 16, single=True) == 1
    assert batch_mod.segment_files(10**6, 16, single=False) == batch_mod.SEGMENT_FILES
