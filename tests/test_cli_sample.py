"""`rbtool sample`: reference batches bit for bit, seeds, top-k, saving, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, RLINF_DIRS, assert_batches_equal, assert_one_error, tree_digest
from typer.testing import CliRunner

from rbtool.cli import app

NOSAVE = {"nosave_window2_pt/ckpt", "nosave_window2_pkl/ckpt"}
runner = CliRunner()


def sample_cases() -> list[tuple[str, dict]]:
    cases = []
    for rel in RLINF_DIRS:
        expected = json.loads((FIXTURES / f"{rel}.expected.json").read_text())
        cases += [(rel, case) for case in expected["samples"]]
    return cases


@pytest.mark.parametrize(
    ("rel", "case"), sample_cases(), ids=lambda v: v if isinstance(v, str) else v["batch_file"]
)
def test_reference_batches_are_reproduced(tmp_path: Path, rel: str, case: dict) -> None:
    out = tmp_path / "b.pt"
    args = ["sample", str(FIXTURES / rel), "--num-chunks", str(case["num_chunks"])]
    args += ["--window", str(case["sample_window_size"]), "--out", str(out), "--json"]
    args += ["--non-strict"] if rel in NOSAVE else []
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["seed"] == case["seed"]
    assert doc["draws"]["trajectory_id"] == case["trajectory_ids"]
    assert doc["draws"]["row"] == case["local_indices"]
    assert doc["draws"]["global_index"] == case["global_indices"]
    reference = torch.load(Path(FIXTURES / rel).parent / case["batch_file"], weights_only=True)
    assert_batches_equal(torch.load(out, weights_only=True), reference)
    assert doc["out_bytes"] == out.stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == ["b.pt"]  # no temporary file left behind


def test_json_document_keys_and_field_list() -> None:
    result = runner.invoke(app, ["sample", str(FIXTURES / "ranks" / "rank_0"), "--num-chunks", "3", "--json"])
    assert result.exit_code == 0 and result.stderr == ""
    doc = json.loads(result.stdout)
    assert list(doc) == [
        "path",
        "seed",
        "window",
        "window_trajectories",
        "window_samples",
        "missing_ids",
        "missing_ids_left_out",
        "all_fields",
        "strategy",
        "k",
        "k_used",
        "temperature",
        "requested_chunks",
        "num_chunks",
        "draws",
        "fields",
        "out",
        "out_bytes",
        "dry_run",
        "fetched",
    ]
    fields = {row["field"]: row for row in doc["fields"]}
    assert fields["curr_obs.main_images"] == {
        "field": "curr_obs.main_images",
        "dtype": "uint8",
        "shape": [3, 16, 16, 3],
    }
    assert fields["dones"]["shape"] == [3, 1]  # bootstrap rows are not part of a sample
    draws = doc["draws"]
    assert [r // 2 for r in draws["row"]] == draws["t"] and [r % 2 for r in draws["row"]] == draws["b"]
    assert doc["out"] is None and doc["missing_ids"] == []


def test_clamped_to_the_window_and_missing_files_listed() -> None:
    rel = FIXTURES / "nosave_window2_pkl" / "ckpt"
    result = runner.invoke(app, ["sample", str(rel), "--num-chunks", "100", "--non-strict", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert (doc["requested_chunks"], doc["num_chunks"], doc["window_samples"]) == (100, 16, 16)
    assert doc["missing_ids"] == [0, 1, 2] and set(doc["draws"]["trajectory_id"]) <= {3, 4}


def test_seed_option() -> None:
    base = ["sample", str(FIXTURES / "autosave_pt" / "autosave"), "--num-chunks", "8", "--json"]

    def draws(*extra: str) -> list[int]:
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)["draws"]["global_index"]

    assert draws() == draws("--seed", "1234")  # the checkpoint's seed is the default
    assert draws("--seed", "7") == draws("--seed", "7") != draws()


def test_topk_draws_only_the_best_samples(tmp_path: Path) -> None:
    rel = FIXTURES / "autosave_pt" / "autosave"
    out = tmp_path / "top.pt"
    result = runner.invoke(
        app,
        [
            "sample",
            str(rel),
            "--num-chunks",
            "32",
            "--strategy",
            "topk",
            "--k",
            "2",
            "--temperature",
            "0.5",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert (doc["strategy"], doc["k"], doc["temperature"]) == ("topk", 2, 0.5)
    scored = []
    for tid in range(5):
        traj = torch.load(next(rel.glob(f"trajectory_{tid}_*.pt")), weights_only=True)
        scored += [(-r, tid, row) for row, r in enumerate(traj["rewards"].reshape(-1).tolist())]
    best = {(tid, row) for _, tid, row in sorted(scored)[:2]}
    assert set(zip(doc["draws"]["trajectory_id"], doc["draws"]["row"], strict=True)) <= best
    batch = torch.load(out, weights_only=True)
    assert batch["rewards"].shape == (32, 1)
    assert set(batch["rewards"].reshape(-1).tolist()) <= {-s for s, _, _ in sorted(scored)[:2]}


def test_human_view() -> None:
    result = runner.invoke(app, ["sample", str(FIXTURES / "ranks" / "rank_1"), "--num-chunks", "20"])
    assert result.exit_code == 0 and result.stderr == ""
    text = result.stdout
    assert "20 chunks (uniform)" in text and "seed 1234" in text
    assert "next_obs.main_images" in text and "[20, 16, 16, 3]" in text
    assert "4 more" in text and "draws per trajectory:" in text


def test_strict_load_refuses_missing_files(tmp_path: Path) -> None:
    out = tmp_path / "b.pt"
    rel = FIXTURES / "nosave_window2_pt" / "ckpt"
    result = runner.invoke(app, ["sample", str(rel), "--num-chunks", "8", "--out", str(out)])
    assert result.exit_code == 1
    assert result.stdout == "" and result.stderr.startswith("Error: ") and "--non-strict" in result.stderr
    assert result.stderr.count("\n") == 1 and not out.exists()


def test_out_inside_the_checkpoint_is_refused(rlinf_copy) -> None:
    ckpt = rlinf_copy("ranks/rank_0")
    before = tree_digest(ckpt)
    result = runner.invoke(app, ["sample", str(ckpt), "--num-chunks", "2", "--out", str(ckpt / "b.pt")])
    assert result.exit_code == 2 and "overlaps the input" in result.stderr
    assert tree_digest(ckpt) == before


def test_out_in_a_missing_directory_creates_it(tmp_path: Path) -> None:
    """The writers' rule: missing parents of the output are created."""
    out = tmp_path / "nope" / "deeper" / "b.pt"
    result = runner.invoke(
        app, ["sample", str(FIXTURES / "ranks" / "rank_0"), "--num-chunks", "2", "--out", str(out)]
    )
    assert result.exit_code == 0, result.stderr
    assert out.is_file() and f"wrote {out}" in result.stdout


@pytest.mark.parametrize(
    "extra",
    [
        [],  # --num-chunks is required
        ["--num-chunks", "0"],
        ["--num-chunks", "4", "--strategy", "best"],
        ["--num-chunks", "4", "--k", "3"],
        ["--num-chunks", "4", "--strategy", "topk", "--k", "0"],
        ["--num-chunks", "4", "--window", "-1"],
    ],
)
def test_usage_errors(extra: list[str]) -> None:
    result = runner.invoke(app, ["sample", str(FIXTURES / "ranks" / "rank_0"), *extra])
    assert result.exit_code == 2, result.stdout
    assert result.stdout == "" and "Usage" in result.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--strategy", "topk"], "--strategy topk needs --k"),
        (["--strategy", "topk", "--k", "2", "--temperature", "0"], "temperature must be"),
    ],
)
def test_usage_errors_found_by_the_library(extra: list[str], message: str) -> None:
    result = runner.invoke(app, ["sample", str(FIXTURES / "ranks" / "rank_0"), "--num-chunks", "4", *extra])
    assert_one_error(result, status=2)
    assert message in result.stderr


def test_not_a_checkpoint(tmp_path: Path) -> None:
    result = runner.invoke(app, ["sample", str(tmp_path / "missing"), "--num-chunks", "2"])
    assert_one_error(result)
    assert str(tmp_path / "missing") in result.stderr


def test_json_keys_are_documented() -> None:
    result = runner.invoke(app, ["sample", str(FIXTURES / "ranks" / "rank_0"), "--num-chunks", "2", "--json"])
    doc = json.loads(result.stdout)
    keys = set(doc) | {f"draws.{k}" for k in doc["draws"]} | {f"fields[].{k}" for k in doc["fields"][0]}
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    assert sorted(k for k in keys if f"`{k}`" not in text) == []


NESTED = FIXTURES / "nested_obs_pt"


def test_batch_holds_rlinf_fields_unless_all_fields_is_asked() -> None:
    """RLinf's batch leaves out dicts nested in curr_obs/next_obs; --all-fields samples them too."""
    expected = json.loads((FIXTURES / "nested_obs_pt.expected.json").read_text())
    result = runner.invoke(app, ["sample", str(NESTED), "--num-chunks", "4", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["all_fields"] is False
    assert sorted(row["field"] for row in doc["fields"]) == sorted(expected["batch_keys"])
    warning = result.stderr.splitlines()  # the left-out fields are named once, on one line
    assert len(warning) == 1 and warning[0].startswith("Warning: ") and "cams.wrist" in warning[0]

    result = runner.invoke(app, ["sample", str(NESTED), "--num-chunks", "4", "--all-fields", "--json"])
    assert result.exit_code == 0 and result.stderr == "", result.stderr
    doc = json.loads(result.stdout)
    fields = {row["field"]: row for row in doc["fields"]}
    assert doc["all_fields"] is True and {"curr_obs.cams.wrist", "next_obs.cams.wrist"} <= set(fields)
    assert fields["curr_obs.cams.wrist"]["shape"] == [4, 5]
    assert "curr_obs.task_id" not in fields  # 1-dim tensors are never sampled
