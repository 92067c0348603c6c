"""`rbtool doctor`: views, exit statuses against --fail-on, usage errors."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import FIXTURES, run
from test_doctor import clean, clean_traj, write


def _defect(tmp_path: Path) -> Path:
    trajs = clean(tmp_path)
    trajs[1]["rewards"][2, 0, 0] = float("nan")  # an error
    trajs[3]["actions"][:, 1] = trajs[3]["actions"][0, 1]  # a warning
    return write(tmp_path / "ck", trajs)


def test_a_clean_rlinf_checkpoint_exits_0_even_failing_on_warnings() -> None:
    result = run("doctor", FIXTURES / "ranks", "--fail-on", "warning", "-j", "1")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("OK ") and "(7 trajectories; 4 info)" in result.stdout


def test_an_error_exits_1_with_the_report_and_one_error_line(tmp_path: Path) -> None:
    path = _defect(tmp_path)
    result = run("doctor", path, "-j", "1")
    assert result.exit_code == 1
    assert result.stdout.startswith("FAILED ") and "non-finite" in result.stdout and "frozen" in result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "1 error" in lines[0]


def test_fail_on_decides_what_fails(tmp_path: Path) -> None:
    path = _defect(tmp_path)
    assert run("doctor", path, "--skip", "non-finite", "-j", "1").exit_code == 0
    assert run("doctor", path, "--skip", "non-finite", "--fail-on", "warning", "-j", "1").exit_code == 1


def test_json_names_field_ids_and_summary(tmp_path: Path) -> None:
    result = run("doctor", _defect(tmp_path), "--json", "-j", "1")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["counts"] == {"error": 1, "warning": 1, "info": doc["counts"]["info"]}
    serious = [(f["check"], f["field"], f["ids"]) for f in doc["findings"] if f["level"] != "info"]
    assert serious == [("non-finite", "rewards", [1]), ("frozen", "actions", [3])]
    assert {"level": "error", "check": "non-finite", "field": "rewards", "count": 1} in [
        {k: row[k] for k in ("level", "check", "field", "count")} for row in doc["by_check"]
    ]
    assert doc["findings_left_out"] == 0


def test_jsonl_is_one_finding_per_line(tmp_path: Path) -> None:
    path = _defect(tmp_path)
    result = run("doctor", path, "--jsonl", "--check", "non-finite", "-j", "1")
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["path"], r["check"], r["ids"]) for r in rows] == [(str(path), "non-finite", [1])]


def test_markdown_is_a_table_fit_for_a_ci_summary(tmp_path: Path) -> None:
    result = run("doctor", _defect(tmp_path), "--markdown", "--fail-on", "warning", "-j", "1")
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("## rbtool doctor: ") and lines[2].startswith("**FAILED** (fail on warning)")
    assert "| level | check | ids | field | where | finding | what to do |" in lines
    assert any(line.startswith("| error | non-finite | 1 | rewards | envs 0; steps 2 |") for line in lines)


def test_several_paths_each_reported(tmp_path: Path) -> None:
    bad = _defect(tmp_path)
    result = run("doctor", FIXTURES / "seedless_pt", bad, "--json", "-j", "1")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert [p["ok"] for p in doc["paths"]] == [True, False] and doc["ok"] is False


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    ckpt = FIXTURES / "seedless_pt"
    assert run("doctor", ckpt, "--check", "nope").exit_code == 2
    assert run("doctor", ckpt, "--markdown", "--json").exit_code == 2
    assert run("doctor", ckpt, "--fail-on", "info").exit_code == 2
    assert run("doctor", ckpt, "--reward-range", "1", "0").exit_code == 2
    assert run("doctor").exit_code == 2


def test_rank_tree_ids_carry_their_directory(tmp_path: Path) -> None:
    trajs = clean(tmp_path)
    trajs[0]["rewards"][0, 0, 0] = float("inf")
    write(tmp_path / "tree" / "rank_0", trajs[:2])
    write(tmp_path / "tree" / "rank_1", trajs[2:])
    result = run("doctor", tmp_path / "tree", "--markdown", "-j", "1")
    assert result.exit_code == 1
    assert any(line.startswith("| error | non-finite | rank_0: 0 |") for line in result.stdout.splitlines())


def test_stats_says_run_doctor_when_rewards_are_not_finite(tmp_path: Path) -> None:
    trajs = clean(tmp_path)
    trajs[2]["rewards"][0, 1, 0] = float("nan")
    path = write(tmp_path / "ck", trajs)
    doc = json.loads(run("stats", path, "--json", "-j", "1").stdout)
    assert doc["data"]["doctor_hints"] == ["1 NaN/Inf reward(s)"]
    human = run("stats", path, "-j", "1")
    assert human.exit_code == 0 and "run rbtool doctor: 1 NaN/Inf reward(s)" in human.stdout
    clean_doc = json.loads(run("stats", FIXTURES / "seedless_pt", "--json", "-j", "1").stdout)
    assert clean_doc["data"]["doctor_hints"] == []
    assert "run rbtool doctor" not in run("stats", FIXTURES / "seedless_pt", "-j", "1").stdout


def test_a_remote_checkpoint_is_read_like_verify_reads_it(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/ckpt"
    saved = run("checkpoint", "save", _defect(tmp_path), url, "--json")
    assert saved.exit_code == 0, saved.stderr
    result = run("doctor", url, "--json", "-j", "1")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["path"] == url and doc["checkpoints"] == [url]
    serious = [(f["check"], f["ids"], f["checkpoint"]) for f in doc["findings"] if f["level"] != "info"]
    assert serious == [("non-finite", [1], url), ("frozen", [3], url)]


def test_a_finding_naming_many_trajectories_is_summarised(tmp_path: Path) -> None:
    import torch

    trajs = [clean_traj(t=3, b=1, seed=i, version=0.0) for i in range(25)]
    for traj in trajs:
        traj["next_obs"] = {k: torch.rand_like(v.float()) for k, v in traj["next_obs"].items()}
        traj["curr_obs"] = {k: v.float() for k, v in traj["curr_obs"].items()}
        for key in ("dones", "terminations", "truncations"):  # no episode end: every pair is compared
            traj[key] = torch.zeros_like(traj[key])
    path = write(tmp_path / "ck", trajs)
    doc = json.loads(run("doctor", path, "--json", "--check", "pairing", "-j", "1").stdout)
    [finding] = doc["findings"]
    assert finding["ids"] == list(range(20)) and finding["ids_left_out"] == 5
    assert finding["message"].startswith("25 trajectories (ids 0-24): next_obs never equals")
    every = json.loads(run("doctor", path, "--json", "--all", "--check", "pairing", "-j", "1").stdout)
    assert every["findings"][0]["ids"] == list(range(25))
    human = run("doctor", path, "--check", "pairing", "-j", "1")
    assert human.exit_code == 0 and "  0-24  " in human.stdout
