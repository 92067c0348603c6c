"""`rbtool stats`: JSON document, human view, --index-only, draw spread, and errors."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, RLINF_DIRS, assert_one_error, tree_digest
from typer.testing import CliRunner

from rbtool.cli import app

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
TOP_KEYS = [
    "path",
    "rank_dirs",
    "renumbered",
    "index_only",
    "index",
    "files",
    "window",
    "trajectories",
    "model_weights",
    "model_weights_left_out",
    "schema",
    "data",
    "journal",
    "draws",
]
runner = CliRunner()
F, T = False, True


def stats_json(*args: str) -> dict:
    result = runner.invoke(app, ["stats", *args, "--json"])
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    return json.loads(result.stdout)


@pytest.mark.parametrize("rel", RLINF_DIRS)
def test_every_reference_fixture(rel: str) -> None:
    expected = json.loads((FIXTURES / f"{rel}.expected.json").read_text())
    doc = stats_json(str(FIXTURES / rel))
    assert list(doc) == TOP_KEYS
    state = expected["full_load"]  # what the index lists, whether or not the files exist
    assert doc["index"]["size"] == state["size"] and doc["index"]["total_samples"] == state["total_samples"]
    assert doc["trajectories"]["id"] == state["trajectory_id_list"]
    missing = expected.get("consistent_view", {}).get("missing_trajectory_ids", [])
    assert doc["files"]["missing_ids"] == missing
    assert doc["data"]["trajectories_read"] == state["size"] - len(missing)
    assert sum(doc["trajectories"]["draw_probability"]) == pytest.approx(1.0)


def test_json_keys_are_documented() -> None:
    doc = stats_json(str(FIXTURES / "ranks" / "rank_1"), "--sample-draws", "100")
    text = DOCS.read_text()
    keys: set[str] = set(doc)
    for section in ("index", "files", "window", "trajectories", "data", "draws"):
        keys |= {f"{section}.{k}" for k in doc[section]}
    keys |= {f"model_weights[].{k}" for k in doc["model_weights"][0]}
    keys |= {f"schema[].{k}" for k in doc["schema"][0]}
    for part in ("rewards", "episodes", "versions"):
        keys |= {f"data.{part}.{k}" for k in doc["data"][part]}
    keys |= {f"draws.concentration.{k}" for k in doc["draws"]["concentration"]}
    keys |= {f"draws.trajectories.{k}" for k in doc["draws"]["trajectories"]}
    undocumented = sorted(k for k in keys if f"`{k}`" not in text)
    assert undocumented == []


def test_human_view_fits_one_screen() -> None:
    result = runner.invoke(
        app, ["stats", str(FIXTURES / "autosave_pt" / "autosave"), "--sample-draws", "2000"]
    )
    assert result.exit_code == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) <= 55
    text = result.stdout
    for piece in (
        "5 trajectories, 40 samples",
        "next_obs.main_images",
        "episode length",
        "reward",
        "staleness",
        "2000 draws (uniform, seed 1234)",
        "total variation",
    ):
        assert piece in text
    assert re.search(r"episodes: \d+ finished \(\d+ terminated, \d+ truncated, \d+ other\)", text)


def test_human_view_of_missing_files_and_a_long_index(tmp_path: Path) -> None:
    result = runner.invoke(app, ["stats", str(FIXTURES / "nosave_window2_pt" / "ckpt")])
    assert result.exit_code == 0
    assert "3 missing (ids 0-2)" in result.stdout and "missing" in result.stdout

    many = tmp_path / "many"
    many.mkdir()
    entries = {
        str(i): {
            "num_samples": 8,
            "trajectory_id": i,
            "max_episode_length": 4,
            "shape": [4, 2, 7],
            "model_weights_id": f"v{i // 10}",
        }
        for i in range(40)
    }
    (many / "trajectory_index.json").write_text(
        json.dumps({"trajectory_index": entries, "trajectory_id_list": list(range(40))})
    )
    meta = {"trajectory_format": "pt", "size": 40, "total_samples": 320, "trajectory_counter": 40, "seed": 3}
    (many / "metadata.json").write_text(json.dumps(meta))
    result = runner.invoke(app, ["stats", str(many), "--index-only", "--window", "10"])
    assert result.exit_code == 0, result.stderr
    assert "30 more" in result.stdout and "not opened (--index-only)" in result.stdout
    assert "p(draw) 0.1 each" in result.stdout


def test_index_only_needs_only_the_json(tmp_path: Path) -> None:
    src = FIXTURES / "autosave_pt" / "autosave"
    for name in ("metadata.json", "trajectory_index.json"):
        shutil.copy(src / name, tmp_path / name)
    doc = stats_json(str(tmp_path), "--index-only", "--window", "2", "--sample-draws", "1000")
    assert doc["index_only"] is True and doc["schema"] is None and doc["data"] is None
    assert doc["files"] == {
        "checked": False,
        "present": None,
        "missing": None,
        "missing_ids": None,
        "missing_ids_left_out": None,
        "missing_id_ranges": None,
        "missing_id_ranges_left_out": None,
        "not_files": None,
        "not_files_left_out": None,
        "bytes": None,
        "bytes_known_for": 0,
    }
    assert doc["trajectories"]["exists"] is None and doc["trajectories"]["in_window"] == [F, F, F, T, T]
    assert doc["draws"]["trajectories"]["id"] == [3, 4] and doc["draws"]["trajectories"]["expected"] == [
        0.5,
        0.5,
    ]


def test_index_only_command_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from rbtool.cli import app\n"
        f"try: app(['stats', {str(FIXTURES / 'ranks' / 'rank_0')!r}, '--index-only', '--json'])\n"
        "except SystemExit as exc: assert exc.code == 0, exc.code\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stderr.strip() == "False"
    assert json.loads(result.stdout)["index"]["size"] == 3


def test_topk_draw_spread() -> None:
    doc = stats_json(
        str(FIXTURES / "ranks" / "rank_1"),
        "--sample-draws",
        "20000",
        "--strategy",
        "topk",
        "--k",
        "6",
        "--temperature",
        "2",
        "--seed",
        "9",
    )
    draws = doc["draws"]
    assert (draws["strategy"], draws["k"], draws["temperature"], draws["seed"]) == ("topk", 6, 2.0, 9)
    assert draws["candidates"] == 6 and draws["distinct_samples_drawn"] <= 6
    assert sum(draws["trajectories"]["expected"]) == pytest.approx(1.0)
    assert draws["total_variation"] < 0.03
    assert sum(draws["trajectories"]["draws"]) == 20000


def test_concentration_is_flagged() -> None:
    result = runner.invoke(
        app,
        [
            "stats",
            str(FIXTURES / "ranks" / "rank_1"),
            "--sample-draws",
            "500",
            "--strategy",
            "topk",
            "--k",
            "1",
        ],
    )
    assert result.exit_code == 0
    assert "CONCENTRATED" in result.stdout


def test_inputs_are_not_changed(rlinf_copy) -> None:
    ckpt = rlinf_copy("nosave_window2_pkl/ckpt")
    before = tree_digest(ckpt)
    assert runner.invoke(app, ["stats", str(ckpt), "--sample-draws", "10"]).exit_code == 0
    assert tree_digest(ckpt) == before


def test_a_corrupt_trajectory_file_is_one_line_error(rlinf_copy) -> None:
    ckpt = rlinf_copy("ranks/rank_0")
    victim = next(ckpt.glob("trajectory_1_*.pt"))
    victim.write_bytes(victim.read_bytes()[:200])
    result = runner.invoke(app, ["stats", str(ckpt), "--json"])
    assert result.exit_code == 1 and result.stdout == ""
    assert (
        result.stderr.startswith("Error: ")
        and victim.name in result.stderr
        and result.stderr.count("\n") == 1
    )
    assert runner.invoke(app, ["stats", str(ckpt), "--index-only"]).exit_code == 0  # the JSON is still fine


def test_not_a_checkpoint(tmp_path: Path) -> None:
    result = runner.invoke(app, ["stats", str(tmp_path)])
    assert result.exit_code == 1 and result.stderr.startswith("Error: ") and result.stdout == ""


@pytest.mark.parametrize(
    "extra",
    [
        ["--strategy", "topk"],  # only with --sample-draws
        ["--k", "3"],
        ["--seed", "3"],
        ["--sample-draws", "10", "--k", "3"],  # --k with uniform
        ["--sample-draws", "0"],
        ["--window", "-2"],
        ["--bins", "0"],
    ],
)
def test_usage_errors(extra: list[str]) -> None:
    result = runner.invoke(app, ["stats", str(FIXTURES / "ranks" / "rank_0"), *extra])
    assert result.exit_code == 2, result.stdout
    assert result.stdout == "" and "Usage" in result.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sample-draws", "10", "--strategy", "topk"], "--strategy topk needs --k"),
        (["--sample-draws", "10", "--strategy", "topk", "--k", "3", "--index-only"], "--index-only"),
        (["--sample-draws", "10", "--strategy", "topk", "--k", "3", "--temperature", "-1"], "temperature"),
    ],
)
def test_usage_errors_found_by_the_library(extra: list[str], message: str) -> None:
    result = runner.invoke(app, ["stats", str(FIXTURES / "ranks" / "rank_0"), *extra])
    assert_one_error(result, status=2)
    assert message in result.stderr


def test_topk_spread_draws_what_sample_draws() -> None:
    """Same seed, window and strategy: the spread counts the rows `rbtool sample` draws."""
    rel = str(FIXTURES / "varying_shapes_pt" / "ckpt")
    opts = ["--window", "4", "--strategy", "topk", "--k", "5", "--temperature", "0.7", "--seed", "21"]
    sampled = runner.invoke(app, ["sample", rel, "--num-chunks", "12", *opts, "--json"])
    assert sampled.exit_code == 0, sampled.stderr
    drawn = json.loads(sampled.stdout)["draws"]["trajectory_id"]
    spread = stats_json(rel, "--sample-draws", "12", *opts)["draws"]["trajectories"]
    assert spread["draws"] == [drawn.count(tid) for tid in spread["id"]]


def test_an_empty_buffer_directory(tmp_path: Path) -> None:
    meta = {"trajectory_format": "pt", "size": 0, "total_samples": 0, "trajectory_counter": 0}
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    (tmp_path / "trajectory_index.json").write_text(
        json.dumps({"trajectory_index": {}, "trajectory_id_list": []})
    )
    doc = stats_json(str(tmp_path))
    assert doc["index"]["size"] == 0 and doc["window"]["samples"] == 0 and doc["model_weights"] == []
    assert doc["data"]["rewards"] is None and doc["data"]["episodes"] is None
    human = runner.invoke(app, ["stats", str(tmp_path)])
    assert human.exit_code == 0 and "0 trajectories, 0 samples" in human.stdout
    drawn = runner.invoke(app, ["stats", str(tmp_path), "--sample-draws", "5"])
    assert drawn.exit_code == 1 and "no samples" in drawn.stderr


def test_jobs_read_the_files_on_worker_processes_with_the_same_numbers(tmp_path: Path) -> None:
    rel = str(FIXTURES / "ranks")
    one, two = (stats_json(rel, "--jobs", j) for j in ("1", "2"))
    assert (one["data"]["jobs"], two["data"]["jobs"]) == (1, 2)
    for doc in (one, two):
        assert doc["data"]["bytes_per_second"] > 0 and doc["data"]["seconds"] > 0
        for key in ("jobs", "seconds", "bytes_per_second"):
            doc["data"].pop(key)
    assert one == two
    assert runner.invoke(app, ["stats", rel, "--jobs", "0"]).exit_code == 2
    # a file that cannot be read is one line naming it, whichever worker read it
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "autosave_pt" / "autosave", ckpt)
    (bad,) = ckpt.glob("trajectory_3_*.pt")
    bad.chmod(0o644)
    bad.write_bytes(b"not a trajectory")
    result = runner.invoke(app, ["stats", str(ckpt), "--jobs", "2"])
    assert_one_error(result)
    assert bad.name in result.stderr
