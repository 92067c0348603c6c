"""Statistics: episode finding (hand-checked and against a plain loop), summaries, index, data, draws."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, RLINF_DIRS, make_traj
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rbtool import CheckpointError, UsageError, build_from_files
from rbtool.files.index import read_index
from rbtool.format.layout import done_extra_rows, drop_bootstrap_rows
from rbtool.ops.stats import (
    OTHER,
    TERMINATED,
    TRUNCATED,
    DrawRequest,
    IndexHeader,
    collect_stats,
    draws_report,
    find_episodes,
    index_table,
    read_table,
    read_trajectory,
    summarize,
)

F, T = False, True


# ------------------------------------------------------------------ episodes
def test_find_episodes_hand_checked() -> None:
    # Two environment columns, five steps (bootstrap rows already dropped).
    done = np.array([[F, F], [T, F], [F, T], [F, F], [T, F]])
    rewards = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [5.0, 50.0]])
    terminated = np.array([[F, F], [T, F], [F, F], [F, F], [F, F]])
    truncated = np.array([[F, F], [F, F], [F, F], [F, F], [T, F]])
    tally = find_episodes(done, rewards, terminated, truncated)
    # Column 0: steps 0-1 (began at row 0), steps 2-4. Column 1: steps 0-2, then 3-4 still open.
    assert tally.lengths.tolist() == [2, 3, 3]
    assert tally.returns.tolist() == [3.0, 12.0, 60.0]
    assert tally.partial_start.tolist() == [True, False, True]
    assert tally.ended_by.tolist() == [TERMINATED, TRUNCATED, OTHER]
    assert tally.open == 1


def test_find_episodes_edge_cases() -> None:
    none = find_episodes(np.zeros((3, 4), dtype=bool))
    assert none.lengths.size == 0 and none.open == 4
    every = find_episodes(np.ones((2, 1), dtype=bool), np.array([[1.5], [2.5]]))
    assert every.lengths.tolist() == [1, 1] and every.returns.tolist() == [1.5, 2.5] and every.open == 0
    both = find_episodes(np.array([[T]]), None, np.array([[T]]), np.array([[T]]))
    assert both.ended_by.tolist() == [TERMINATED]  # termination wins over truncation
    assert np.isnan(both.returns).all()  # no rewards, no returns


def reference_episodes(done: np.ndarray, rewards: np.ndarray) -> tuple[list, list, list, int]:
    """A plain per-column loop: the definition find_episodes must agree with."""
    lengths, returns, partial, open_count = [], [], [], 0
    t_len, b_len = done.shape
    for b in range(b_len):
        start = 0
        for t in range(t_len):
            if done[t, b]:
                lengths.append(t - start + 1)
                returns.append(float(rewards[start : t + 1, b].sum()))
                partial.append(start == 0)
                start = t + 1
        open_count += start < t_len
    return lengths, returns, partial, open_count


@settings(max_examples=200, deadline=None)
@given(
    arrays(bool, st.tuples(st.integers(1, 9), st.integers(1, 5))),
    st.integers(0, 2**31 - 1),
)
def test_find_episodes_agrees_with_a_plain_loop(done: np.ndarray, seed: int) -> None:
    rewards = np.random.default_rng(seed).integers(-5, 6, size=done.shape).astype(np.float64)
    tally = find_episodes(done, rewards)
    lengths, returns, partial, open_count = reference_episodes(done, rewards)
    assert tally.lengths.tolist() == lengths
    assert tally.returns.tolist() == returns
    assert tally.partial_start.tolist() == partial
    assert tally.open == open_count
    assert tally.lengths.sum() <= done.size


def test_bootstrap_rows_follow_the_layout_rule() -> None:
    # T=4, E=2: epochs of 1 + 2 rows; rows 0 and 3 are the bootstrap rows.
    rows = np.array([100, 1, 2, 200, 3, 4])[:, None]
    assert drop_bootstrap_rows(rows, 4)[:, 0].tolist() == [1, 2, 3, 4]
    assert drop_bootstrap_rows(rows[1:3], 2)[:, 0].tolist() == [1, 2]  # E = 0 keeps everything
    with pytest.raises(ValueError):
        done_extra_rows(5, 3, 1, 1)  # E = 2 epochs cannot split T = 3
    with pytest.raises(ValueError):
        done_extra_rows(3, 4, 1, 1)  # fewer rows than T


def test_bootstrap_rows_are_dropped_before_episodes_are_found(tmp_path: Path) -> None:
    traj = make_traj(t=4, b=1, extra_rows=2)
    traj["rewards"] = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(4, 1, 1)
    # Bootstrap rows (0 and 3) are set and must be ignored; the real ends are steps 1 and 3.
    traj["dones"] = torch.tensor([T, F, T, T, F, T]).reshape(6, 1, 1)
    traj["terminations"] = torch.tensor([T, F, T, F, F, F]).reshape(6, 1, 1)
    traj["truncations"] = torch.tensor([F, F, F, T, F, T]).reshape(6, 1, 1)
    path = tmp_path / "traj.pt"
    torch.save(traj, path)
    got = read_trajectory(path, 4, 1)
    assert got.episodes is not None
    assert got.episodes.lengths.tolist() == [2, 2]
    assert got.episodes.returns.tolist() == [3.0, 7.0]
    assert got.episodes.ended_by.tolist() == [TERMINATED, TRUNCATED]
    assert got.episodes.open == 0


def test_episodes_from_terminations_and_truncations_without_dones(tmp_path: Path) -> None:
    traj = make_traj(t=2, b=1, extra_rows=1, dones=None)
    traj["terminations"] = torch.tensor([F, T, F]).reshape(3, 1, 1)
    traj["truncations"] = torch.tensor([F, F, T]).reshape(3, 1, 1)
    path = tmp_path / "traj.pt"
    torch.save({k: v for k, v in traj.items() if v is not None}, path)
    got = read_trajectory(path, 2, 1)
    assert got.episodes is not None and got.episodes.ended_by.tolist() == [TERMINATED, TRUNCATED]


# ------------------------------------------------------------------ summaries
def test_summarize() -> None:
    doc = summarize(np.array([1.0, 2.0, 2.0, 4.0, np.inf]), bins=8)
    assert (doc["count"], doc["nonfinite"], doc["min"], doc["max"]) == (4, 1, 1.0, 4.0)
    assert doc["mean"] == pytest.approx(2.25) and doc["std"] == pytest.approx(np.std([1, 2, 2, 4]))
    # Integer data that fits: one bin per integer.
    assert doc["histogram"] == {"edges": [0.5, 1.5, 2.5, 3.5, 4.5], "counts": [1, 2, 0, 1]}
    wide = summarize(np.linspace(0.0, 1.0, 101), bins=4)
    assert wide["histogram"]["counts"] == [25, 25, 25, 26] and len(wide["histogram"]["edges"]) == 5
    empty = summarize(np.empty(0))
    assert empty["count"] == 0 and empty["mean"] is None and empty["histogram"]["counts"] == []


# ------------------------------------------------------------------ reading
def test_read_trajectory_touches_only_the_fields_it_needs(tmp_path: Path) -> None:
    traj = make_traj(t=4, b=2, image=32)
    path = tmp_path / "traj.pt"
    torch.save(traj, path)
    got = read_trajectory(path, 4, 2)
    needed = ("rewards", "dones", "terminations", "truncations", "versions")
    assert got.bytes_read == sum(traj[k].numel() * traj[k].element_size() for k in needed)
    assert got.bytes_read < traj["curr_obs"]["main_images"].numel()
    assert got.rewards is not None and np.array_equal(got.rewards, traj["rewards"][..., 0].double().numpy())
    fields = {f.path: f for f in got.fields}
    assert fields["dones"].extra_rows == 1 and fields["dones"].per_sample_shape == (1,)
    assert fields["curr_obs.main_images"].per_sample_shape == (32, 32, 3)
    assert fields["curr_obs.main_images"].nbytes == 4 * 2 * 32 * 32 * 3


def test_read_trajectory_refuses_a_shape_the_index_does_not_say(tmp_path: Path) -> None:
    path = tmp_path / "traj.pt"
    torch.save(make_traj(t=4, b=2), path)
    with pytest.raises(Exception, match=r"index says \[3, 2\]"):
        read_trajectory(path, 3, 2)


# ------------------------------------------------------------------ whole documents
def test_fixture_index_window_and_data() -> None:
    doc = collect_stats(FIXTURES / "ranks" / "rank_1", window=3)
    assert doc["index"] == {
        "trajectory_format": "pt",
        "seed": 1234,
        "size": 4,
        "total_samples": 32,
        "trajectory_counter": 4,
        "id_min": 0,
        "id_max": 3,
        "model_weights_ids": 3,
    }
    assert doc["files"]["missing"] == 0 and doc["files"]["bytes"] == 4 * 19802
    assert doc["window"]["trajectories"] == 3 and doc["window"]["samples"] == 24
    rows = doc["trajectories"]
    assert rows["in_window"] == [False, True, True, True]
    assert rows["draw_probability"] == [0.0, 1 / 3, 1 / 3, 1 / 3]
    assert [g["trajectories"] for g in doc["model_weights"]] == [1, 2, 1]
    assert [g["window_samples"] for g in doc["model_weights"]] == [0, 16, 8]
    data = doc["data"]
    assert data["trajectories_read"] == 4 and data["rewards"]["count"] == 32
    versions = data["versions"]  # rank 1 trained with policy versions 0, 1, 1, 2
    assert versions["newest"] == 2.0
    spread = ((0.0, 8), (1.0, 16), (2.0, 8))
    assert versions["values"] == [{"version": v, "samples": n} for v, n in spread]
    assert versions["staleness"] == [{"staleness": s, "samples": n} for s, n in spread]
    per_traj = 8 * 4 + 3 * 10 + 8 * 4  # rewards f32 [4,2,1], three bool [5,2,1], versions f32 [4,2,1]
    assert data["bytes_read"] == 4 * per_traj
    schema = {row["field"]: row for row in doc["schema"]}
    assert schema["next_obs.main_images"]["bytes"] == 4 * 4 * 2 * 16 * 16 * 3
    assert schema["dones"]["extra_rows"] == [1] and all(row["sampled"] for row in doc["schema"])


def test_episode_counts_add_up_on_a_fixture() -> None:
    episodes = collect_stats(FIXTURES / "autosave_pt" / "autosave")["data"]["episodes"]
    assert episodes["finished"] == episodes["terminated"] + episodes["truncated"] + episodes["other"]
    assert episodes["length"]["count"] == episodes["finished"]
    assert episodes["open"] <= 5 * 2  # at most one open episode per column per trajectory


def test_missing_files_are_reported_not_refused() -> None:
    doc = collect_stats(FIXTURES / "nosave_window2_pkl" / "ckpt")
    assert doc["files"]["missing_ids"] == [0, 1, 2] and doc["files"]["present"] == 2
    assert doc["trajectories"]["exists"] == [False, False, False, True, True]
    assert doc["window"]["first_id"] == 3 and doc["window"]["samples"] == 16  # what a non-strict load samples
    pkl_sizes = sum(p.stat().st_size for p in (FIXTURES / "nosave_window2_pkl" / "ckpt").glob("*.pkl"))
    assert doc["data"]["bytes_read"] == doc["data"]["pkl_bytes_read"] == pkl_sizes


def test_index_only_reads_just_the_json(tmp_path: Path) -> None:
    src = FIXTURES / "varying_shapes_pt" / "ckpt"
    only_json = tmp_path / "ckpt"
    only_json.mkdir()
    for name in ("metadata.json", "trajectory_index.json"):
        shutil.copy(src / name, only_json / name)
    doc = collect_stats(only_json, index_only=True, window=2)
    assert doc["schema"] is None and doc["data"] is None and doc["files"]["checked"] is False
    assert doc["trajectories"]["T"] == [3, 4, 5, 3, 4, 5] and doc["trajectories"]["B"] == [1, 2, 1, 2, 1, 2]
    assert doc["window"]["samples"] == 4 + 10
    assert doc["trajectories"]["draw_probability"][4:] == [4 / 14, 10 / 14]
    with pytest.raises(UsageError):
        collect_stats(only_json, index_only=True, draws=DrawRequest(10, "topk", k=2))


def test_index_only_does_not_import_torch() -> None:
    code = (
        "import sys; from rbtool.ops.stats import collect_stats; "
        f"collect_stats({str(FIXTURES / 'autosave_pt' / 'autosave')!r}, index_only=True); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_file_sizes_come_from_the_index_when_only_it_is_read(tmp_path: Path, five_files: list[Path]) -> None:
    ckpt = tmp_path / "ckpt"
    build_from_files(five_files, ckpt, 2)
    full = collect_stats(ckpt)
    light = collect_stats(ckpt, index_only=True)
    assert light["trajectories"]["file_bytes"] == full["trajectories"]["file_bytes"]
    on_disk = sum(p.stat().st_size for p in ckpt.glob("*.pt"))
    assert light["files"]["bytes"] == full["files"]["bytes"] == on_disk


def test_not_a_checkpoint() -> None:
    with pytest.raises(CheckpointError):
        collect_stats(FIXTURES / "does-not-exist")


# ------------------------------------------------------------------ draw spread
def test_uniform_draws_are_the_buffers_draws() -> None:
    """Same seed: the spread counts exactly the trajectories the reference sample(8) drew."""
    doc = collect_stats(FIXTURES / "autosave_pt" / "autosave", draws=DrawRequest(8))
    drawn = [1, 1, 0, 0, 4, 0, 4, 3]  # autosave.expected.json, window 0, seed 1234
    assert doc["draws"]["trajectories"]["draws"] == [drawn.count(i) for i in range(5)]
    assert doc["draws"]["seed"] == 1234


def test_uniform_spread_matches_expected_and_is_not_concentrated() -> None:
    report = draws_report([7, 8, 9], [10, 30, 60], DrawRequest(20000, seed=3), 3)
    assert report["trajectories"]["expected"] == [0.1, 0.3, 0.6]
    assert report["total_variation"] < 0.03
    assert report["concentration"]["concentrated"] is False
    assert report["distinct_samples_drawn"] == 100


def test_topk_spread_and_concentration_flag() -> None:
    scores = {0: np.arange(40.0), 1: np.zeros(60)}
    report = draws_report([0, 1], [40, 60], DrawRequest(5000, "topk", k=1, seed=1), 1, scores)
    assert report["trajectories"]["draws"] == [5000, 0]
    assert report["concentration"]["samples_holding_half_of_draws"] == 1
    assert report["concentration"]["concentrated"] is True  # 100% of draws on 1 of 100 samples
    broad = draws_report([0, 1], [40, 60], DrawRequest(20000, "topk", k=40, temperature=100.0), 2, scores)
    assert sum(broad["trajectories"]["expected"]) == pytest.approx(1.0)
    assert broad["trajectories"]["expected"][1] == 0.0  # the 40 best samples all sit in trajectory 0
    assert broad["total_variation"] < 0.03
    assert broad["concentration"]["concentrated"] is False


def test_staleness_is_measured_from_the_newest_version(tmp_path: Path, five_files: list[Path]) -> None:
    ckpt = tmp_path / "ckpt"
    build_from_files(five_files, ckpt, 0)  # versions are seed % 3: 0, 1, 2, 0, 1
    versions = collect_stats(ckpt)["data"]["versions"]
    assert versions["newest"] == 2.0
    assert [(v["version"], v["samples"]) for v in versions["values"]] == [(0.0, 16), (1.0, 16), (2.0, 8)]
    assert [(v["staleness"], v["samples"]) for v in versions["staleness"]] == [(0.0, 8), (1.0, 16), (2.0, 16)]


# ------------------------------------------------------------------ index-only columns
def assert_same_table(directory: Path) -> None:
    header, table = read_table(directory)
    index = read_index(directory)
    ref = index_table(index)
    assert header == IndexHeader.of(index)
    for name in ("ids", "t", "b", "num_samples", "file_bytes"):
        assert np.array_equal(getattr(table, name), getattr(ref, name)), name
    assert table.model_weights_id == ref.model_weights_id


@pytest.mark.parametrize("rel", RLINF_DIRS)
def test_columns_agree_with_read_index(rel: str) -> None:
    assert_same_table(FIXTURES / rel)


def write_index(directory: Path, entries: dict, id_list: list, meta: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trajectory_index.json").write_text(
        json.dumps({"trajectory_index": entries, "trajectory_id_list": id_list})
    )
    listed = [entries[str(i)]["num_samples"] for i in id_list if str(i) in entries]
    counts = {
        "size": len(id_list),
        "total_samples": sum(listed),
        "trajectory_counter": max(id_list, default=-1) + 1,
    }
    full = {"trajectory_format": "pt", **counts, "seed": 5}
    (directory / "metadata.json").write_text(json.dumps(meta or full))
    return directory


def entry(tid: int, t: int = 4, b: int = 2, **extra: object) -> dict:
    return {
        "num_samples": t * b,
        "trajectory_id": tid,
        "max_episode_length": t,
        "shape": [t, b, 7],
        "model_weights_id": f"w{tid}",
        **extra,
    }


def test_columns_follow_the_list_order_not_the_file_order(tmp_path: Path) -> None:
    entries = {"7": entry(7, 3, 1), "2": entry(2, file_bytes=99), "5": entry(5, 5, 2)}
    meta = {"trajectory_format": "pt", "size": 3, "total_samples": 21, "trajectory_counter": 9}
    directory = write_index(tmp_path / "c", entries, [5, 7, 2], meta)
    header, table = read_table(directory)
    assert table.ids.tolist() == [5, 7, 2] and table.t.tolist() == [5, 3, 4]
    assert table.model_weights_id == ["w5", "w7", "w2"] and table.file_bytes.tolist() == [-1, -1, 99]
    assert header.trajectory_counter == 9 and header.seed is None
    assert_same_table(directory)


@pytest.mark.parametrize(
    ("entries", "id_list", "message"),
    [
        ({"0": entry(0), "1": entry(1)}, [0, 1, 0], "appears more than once"),
        ({"0": entry(0)}, [0, 3], "which has no entry"),
        ({"0": {**entry(0), "num_samples": 5}}, [0], "num_samples 5"),
        ({"0": entry(1)}, [0], "trajectory_id 1"),
        ({"0": {**entry(0), "model_weights_id": "../x"}}, [0], "holds a path separator"),
        ({"0": {**entry(0), "shape": [4]}}, [0], "invalid shape"),
    ],
)
def test_bad_indexes_get_read_index_errors(
    tmp_path: Path, entries: dict, id_list: list, message: str
) -> None:
    directory = write_index(tmp_path / "bad", entries, id_list)
    with pytest.raises(CheckpointError, match=message) as fast:
        read_table(directory)
    with pytest.raises(CheckpointError) as slow:
        read_index(directory)
    assert str(fast.value) == str(slow.value)
