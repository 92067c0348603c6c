"""benchmarks/bench.py runs end to end on a tiny size and reports every figure (no timing asserts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"

CHILD_KEYS = {"status", "argv", "wall_s", "peak_rss_bytes", "exit_code", "stderr_tail"}
SAMPLING_KEYS = {
    "window",
    "window_trajectories",
    "num_chunks",
    "rbtool_s",
    "rbtool_fresh_s",
    "eager_s",
    "ratio",
    "fresh_ratio",
    "eager_files_loaded",
    "batch_bytes",
    "batch_bytes_per_s",
    "memcpy_fraction",
    "batches_equal",
}
GOALS = {
    "sampling_vs_eager_window_0",
    "shard_vs_cp",
    "save_vs_cp",
    "stats_index_only_s",
    "verify_quick_s",
    "rbtool_help_s",
    "sampling_peak_rss_bytes",
}


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def check_child(summary: dict[str, Any]) -> None:
    """A subprocess figure: measured (and not crashed), or marked missing with a reason."""
    if summary["status"] == "missing":
        assert summary["reason"] in ("command missing",) or summary["reason"].startswith("option ")
        assert summary["wall_s"] is None
        return
    assert summary.keys() >= CHILD_KEYS
    assert summary["status"] == "ok", summary
    assert positive(summary["wall_s"]) and positive(summary["peak_rss_bytes"])
    assert summary["exit_code"] in (0, 1)


def test_quick_json_reports_every_figure(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        str(BENCH),
        "--quick",
        "--json",
        "--trajectories",
        "6",
        "--t",
        "4",
        "--b",
        "2",
        "--image",
        "16",
        "--index-size",
        "10000",
        "--repeats",
        "1",
        "--rss-batches",
        "5",
        "--workdir",
        str(tmp_path / "data"),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)  # exactly one JSON document on stdout

    assert doc["config"]["trajectories"] == 6 and doc["config"]["index_size"] == 10000
    assert positive(doc["memcpy"]["bytes_per_s"])

    assert set(doc["sampling"]) == {"window_0", "window_20"}
    for figures in doc["sampling"].values():
        assert figures.keys() >= SAMPLING_KEYS
        assert figures["batches_equal"] is True  # rbtool and the eager sampler drew the same rows
        for key in ("rbtool_s", "rbtool_fresh_s", "eager_s", "ratio", "batch_bytes", "memcpy_fraction"):
            assert positive(figures[key]), key
    assert doc["sampling"]["window_0"]["window_trajectories"] == 6

    copies = doc["copies"]
    assert positive(copies["cp_s"]) and positive(copies["checkpoint_bytes"])
    for op in ("shard", "save"):
        assert positive(copies[op]["rbtool_s"]) and positive(copies[op]["ratio"])
        check_child(copies[op]["cli"])
    assert not any(p.name == "out" for p in (tmp_path / "data").iterdir())  # outputs removed after timing

    assert doc["index_commands"]["index_size"] == 10000
    check_child(doc["index_commands"]["stats"])
    check_child(doc["index_commands"]["verify"])
    check_child(doc["index_commands"]["stats_json"])
    check_child(doc["index_commands"]["verify_json"])

    startup = doc["startup"]
    assert startup["rbtool_help_exit_code"] == 0
    assert positive(startup["rbtool_help_s"]) and positive(startup["import_torch_s"])

    rss = doc["sampling_rss"]
    assert rss["exit_code"] == 0, rss["stderr_tail"]
    assert positive(rss["peak_rss_bytes"]) and rss["batches"] == 5
    assert positive(rss["first_sample_s"]) and positive(rss["median_sample_s"])
    assert {"rss_anon_bytes", "rss_file_bytes"} <= rss.keys()

    assert {g["name"] for g in doc["goals"]} == GOALS
    for goal in doc["goals"]:
        assert goal["met"] in (True, False, None) and isinstance(goal["target"], str)


# ------------------------------------------------------------------ the scaling scripts
BENCHMARKS = BENCH.parent


def run_script(name: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run benchmarks/<name> with --json; exactly one JSON document on stdout."""
    argv = [sys.executable, str(BENCHMARKS / name), "--json", *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def check_goals(doc: dict[str, Any], names: set[str]) -> None:
    assert {g["name"] for g in doc["goals"]} == names
    for goal in doc["goals"]:
        assert goal["met"] in (True, False) and isinstance(goal["target"], str), goal
        assert positive(goal["value"]), goal


def test_scale_reports_every_figure(tmp_path: Path) -> None:
    doc = run_script(
        "bench_scale.py",
        *("--sizes", "6,12", "--first-size", "12", "--steps", "2", "--repeats", "1"),
        *("--num-chunks", "8", "--workdir", str(tmp_path / "data")),
    )
    assert doc["config"]["sizes"] == [6, 12] and doc["config"]["page_cache"] == "warm"
    for mode in ("auto_save_on", "auto_save_off"):
        steps = doc["training_step"][mode]
        for n in ("6", "12"):
            s = steps["sizes"][n]
            assert "error" not in s, s
            assert s["batches_equal"] is True  # the eager path drew and gathered the same rows
            assert s["steps"] == 2
            for key in ("rbtool_step_s", "eager_step_s", "ratio", "load_s", "first_sample_s"):
                assert positive(s[key]), key
        assert positive(steps["growth"])
        for writer in ("rbtool", "other"):
            first = doc["first_sample"][f"{writer}_{mode}"]
            assert "error" not in first, first
            assert first["runs"] == 1 and first["trajectories"] == 12
            for key in ("first_sample_s", "load_s", "load_and_sample_s"):
                assert positive(first[key]), key
    names = {
        f"{kind}_{mode}"
        for mode in ("auto_save_on", "auto_save_off")
        for kind in (
            "step_growth",
            "step_vs_eager_6",
            "step_vs_eager_12",
            "first_sample_rbtool",
            "first_sample_other",
        )
    }
    check_goals(doc, names)
    # the data was built into hidden .partial directories and renamed; scratch space is gone
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "rbtool_12x4x2_img16",
        "rbtool_12x4x2_img16.writer",  # which rbtool sources wrote it (rebuilt when they change)
        "rlinf_12x4x2_img16",
        "rlinf_6x4x2_img16",
    ]
    index = json.loads((tmp_path / "data" / "rlinf_6x4x2_img16" / "trajectory_index.json").read_text())
    assert set(index["trajectory_index"]["0"]) == {  # the reference's entry keys only
        "num_samples",
        "trajectory_id",
        "max_episode_length",
        "shape",
        "model_weights_id",
    }


TINY_CKPT = ("--trajectories", "4", "--t", "4", "--b", "2", "--image", "8", "--repeats", "1")


def test_torchrl_reports_every_figure_or_says_why_not(tmp_path: Path) -> None:
    doc = run_script("bench_torchrl.py", "--quick", *TINY_CKPT, "--calls", "3", "--workdir", str(tmp_path))
    assert positive(doc["memcpy"]["bytes_per_s"]) and positive(doc["checkpoint_bytes"])
    if doc["skipped"] is not None:  # torchrl not installed: said so, nothing measured
        assert "torchrl" in doc["skipped"] and doc["ratio"] is None
        return
    assert doc["same_fields"] is True and doc["rows"] == 4 * 4 * 2
    for key in ("rbtool_s", "torchrl_s", "ratio", "rbtool_memcpy_fraction", "torchrl_memcpy_fraction"):
        assert positive(doc[key]), key
    assert doc["met"] in (True, False)
    # one process per side, each with its own time, first call and memory
    assert set(doc["sides"]) == {"torchrl", "memcpy", *doc["settings"]}
    assert doc["goal_setting"] in doc["settings"]
    assert doc["vs_memcpy"] == doc["rbtool_s"] / doc["sides"]["memcpy"]["median_s"]
    assert positive(doc["vs_memcpy_cold"])
    assert doc["settings"]["default"] == {} and doc["goal_setting"] == "default"
    assert doc["settings"]["rows_from_files"] == {"hold_rows_budget": 0}
    copy = doc["batch_memcpy"]
    assert copy["bytes"] == doc["rbtool_batch_bytes"] and positive(copy["cold_s"]) and positive(copy["hot_s"])
    assert (
        positive(doc["vs_memcpy"])
        and doc["met_memcpy"] in (True, False)
        and doc["met_torchrl"] in (True, False)
    )
    assert positive(doc["sides"]["default"]["load_s"])
    for name, side in doc["sides"].items():
        for key in ("median_s", "first_sample_s", "memcpy_fraction", "peak_rss_bytes", "rss_anon_bytes"):
            assert positive(side[key]), (name, key)
    assert doc["rbtool_s"] == doc["sides"][doc["goal_setting"]]["median_s"]
    assert positive(doc["rbtool_default_s"]) and positive(doc["default_ratio"])
    assert not any(p.name.startswith("torchrl_") for p in tmp_path.iterdir())  # its storage is removed


def test_torchrl_absent_is_a_clear_skip(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    (fake / "torchrl").mkdir(parents=True)
    (fake / "torchrl" / "__init__.py").write_text("raise ImportError('No module named torchrl')\n")
    env = {**os.environ, "PYTHONPATH": str(fake)}
    argv = [sys.executable, str(BENCHMARKS / "bench_torchrl.py"), "--quick", *TINY_CKPT]
    result = subprocess.run(
        [*argv, "--workdir", str(tmp_path / "data")], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "TorchRL comparison skipped: torchrl is not available" in result.stdout
    assert "pip install -e '.[bench]'" in result.stdout


def test_ingest_reports_every_figure(tmp_path: Path) -> None:
    doc = run_script("bench_ingest.py", "--files", "5", "--repeats", "1", "--workdir", str(tmp_path))
    assert doc["files"] == 5 and isinstance(doc["link_option"], bool)
    for name in ("rbtool", "cp_r"):
        assert doc[name]["ok"] is True, doc[name]
        assert positive(doc[name]["wall_s"]) and doc[name]["added"] == 5
    if doc["old_tree_problem"] is None:  # a worktree of 0.1 exists: measured beside this tree
        assert doc["rbtool_0_1"]["ok"] is True, doc["rbtool_0_1"]
        assert positive(doc["ratio"]) and doc["met"] in (True, False)
    else:
        assert doc["rbtool_0_1"] is None and doc["ratio"] is None and doc["met"] is None
    assert not (tmp_path / "ingest_out").exists()


def test_outputs_reports_every_figure(tmp_path: Path) -> None:
    doc = run_script("bench_outputs.py", "--index-size", "2000", "--repeats", "1", "--workdir", str(tmp_path))
    assert doc["index_size"] == 2000
    for name, figure in doc["figures"].items():
        if figure["status"] == "not available":
            assert figure["reason"], name
            continue
        assert figure["status"] == "ok", figure
        assert positive(figure["wall_s"]) and positive(figure["output_bytes"]), name
        assert figure["output_whole"] is True, name
        assert figure["exit_code"] == (0 if name.startswith("stats") else 1), figure
    names = {"stats_s", "stats_json_s", "stats_json_bytes", "verify_s", "verify_json_s", "verify_json_bytes"}
    names |= {f"{c}_{k}_streams" for c in ("stats", "verify") for k in ("jsonl", "json_all")}
    assert {g["name"] for g in doc["goals"]} == names
    assert not (tmp_path / ".outputs-scratch").exists()


def test_deep_reports_every_figure(tmp_path: Path) -> None:
    doc = run_script(
        "bench_deep.py",
        *("--quick", "--trajectories", "4", "--t", "2", "--b", "2", "--image", "8"),
        *("--repeats", "1", "--workdir", str(tmp_path)),
    )
    runs = ("sha256sum", "hashlib", "jobs_1", f"jobs_{max(2, doc['cores'])}")
    assert doc["files"] == 4 and positive(doc["bytes"]) and set(doc["median_seconds"]) == set(runs)
    assert all(positive(doc["median_seconds"][k]) for k in runs)
    assert all(positive(v) for v in doc["verify_vs_sha256sum"].values())
    assert positive(doc["speedup_1_to_n_jobs"]) and doc["met"] in (True, False)
    assert not list(tmp_path.rglob(".files"))


def test_deep_tiny_reports_files_per_second(tmp_path: Path) -> None:
    doc = run_script("bench_deep.py", "--tiny", "30", "--repeats", "1", "--workdir", str(tmp_path))
    runs = ("default_jobs", "jobs_1")
    assert doc["files"] == 30 and positive(doc["bytes"]) and set(doc["median_seconds"]) == set(runs)
    assert all(positive(doc["files_per_second"][k]) for k in runs)
    assert doc["goal_files_per_second"] == 5000 and doc["met"] in (True, False)
    assert len(doc["load_average"]["before"]) == 3
    assert (tmp_path / "tiny_30" / "trajectory_index.json").is_file()


TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
def test_ranks_reports_every_figure(tmp_path: Path) -> None:
    doc = run_script(
        "bench_ranks.py",
        *("--quick", "--trajectories", "4", "--t", "2", "--b", "2", "--image", "8"),
        *("--repeats", "1", "--workdir", str(tmp_path)),
    )
    runs = ("process", "ranks_1", "ranks_2")
    assert doc["files"] == 4 and positive(doc["bytes"]) and set(doc["median_seconds"]) == set(runs)
    assert all(positive(doc["median_seconds"][k]) for k in runs)
    assert positive(doc["speedup_1_to_2_ranks"]) and positive(doc["torchrun_overhead_1_rank"])
    assert doc["same_report"] is True


def test_dataset_reports_every_figure(tmp_path: Path) -> None:
    doc = run_script(
        "bench_dataset.py",
        *TINY_CKPT,
        *("--batches", "4", "--step-ms", "1", "--num-chunks", "16", "--workdir", str(tmp_path)),
    )
    assert doc["num_chunks"] == 16 and doc["step_s"] == 0.001 and positive(doc["checkpoint_bytes"])
    assert set(doc["consumers"]) == {"sleep", "compute"}
    for consumer in doc["consumers"].values():
        assert positive(consumer["ratio"])
        for kind in ("plain", "preload"):
            side = consumer[kind]
            assert side["batches"] == 4
            for key in ("median_wait_s", "p90_wait_s", "max_wait_s", "median_step_s"):
                assert positive(side[key]), (kind, key)
    check_goals(doc, {"preload_median_wait_sleep"})


def test_doctor_reports_every_figure(tmp_path: Path) -> None:
    doc = run_script(
        "bench_doctor.py",
        *("--quick", "--trajectories", "4", "--t", "2", "--b", "2", "--image", "8"),
        *("--repeats", "1", "--workdir", str(tmp_path)),
    )
    assert doc["files"] == 4 and positive(doc["bytes"]) and doc["jobs"] >= 2
    assert set(doc["median_seconds"]) == {"verify_deep", "doctor"}
    assert all(positive(v) for v in doc["median_seconds"].values())
    assert positive(doc["doctor_vs_verify_deep"]) and doc["goal"] == 2.0 and doc["met"] in (True, False)


def test_tiny_reports_every_figure(tmp_path: Path) -> None:
    doc = run_script(
        "bench_tiny.py",
        *("--sizes", "300", "--calls", "5", "--first-calls", "10", "--no-cli", "--jobs", "2"),
        *("--loads", "2", "--workdir", str(tmp_path)),
    )
    assert doc["config"]["sizes"] == [300] and doc["config"]["cli_sizes"] == []
    assert doc["config"]["loads"] == 2
    assert positive(doc["memcpy"]["bytes_per_s"])
    # the data: RLinf's layout, built into a hidden .partial directory and renamed
    data = tmp_path / "tiny_300"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny_300"]
    assert doc["data"]["300"]["reused"] is False and positive(doc["data"]["300"]["build_s"])
    meta = json.loads((data / "metadata.json").read_text())
    assert meta == {
        "trajectory_format": "pt",
        "size": 300,
        "total_samples": 300,
        "trajectory_counter": 300,
        "seed": 1234,
    }
    index = json.loads((data / "trajectory_index.json").read_text())
    assert index["trajectory_id_list"] == list(range(300))
    entry = index["trajectory_index"]["7"]
    assert (
        entry["num_samples"] == 1
        and entry["shape"] == [1, 1, 7]
        and set(entry)
        == {
            "num_samples",
            "trajectory_id",
            "max_episode_length",
            "shape",
            "model_weights_id",
        }
    )
    assert (data / f"trajectory_7_{entry['model_weights_id']}.pt").is_file()
    assert len(list(data.glob("trajectory_*.pt"))) == 300

    s = doc["sizes"]["300"]
    assert s["cli"] is None and s["trajectories"] == 300
    rb = s["rbtool"]
    assert positive(rb["load_s"]) and rb["first_calls"]["count"] == 10
    assert len(rb["load_runs_s"]) == 2 and all(positive(x) for x in rb["load_runs_s"])
    assert rb["load_s"] == sum(rb["load_runs_s"]) / 2  # the median of two
    for key in ("first_s", "median_s", "sum_s"):
        assert positive(rb["first_calls"][key]), key
    for key in ("steady_s", "peak_rss_bytes", "rss_anon_bytes", "batch_bytes"):
        assert positive(rb[key]), key
    assert rb["first_calls"]["minor_faults_per_call"] >= 0 and rb["steady_minor_faults_per_call"] >= 0
    for key in ("batch_bytes", "memcpy_floor_s", "batch_copy_s"):
        assert positive(s[key]), key
    first = s["first_sample_after_load"]
    assert positive(first["first_sample_s"]) and positive(first["load_and_sample_s"])
    names = {"rbtool_load_s_300", "first_sample_after_load_s_300"}
    trl_names = {"torchrl_over_rbtool_steady_300", "rbtool_first_calls_over_torchrl_steady_300"}
    assert {g["name"] for g in doc["goals"]} == names | trl_names
    if doc["torchrl_skipped"] is not None:  # torchrl not installed: said so, its figures null
        assert "torchrl" in doc["torchrl_skipped"] and s["torchrl"] is None and s["steady_ratio"] is None
        assert all(g["met"] is None for g in doc["goals"] if g["name"] in trl_names)
        return
    trl = s["torchrl"]
    assert s["torchrl_error"] is None
    assert s["same_fields"] is True and trl["rows"] == 300 and trl["files"] == 300
    for key in ("read_s", "build_s", "steady_s", "peak_rss_bytes", "batch_bytes"):
        assert positive(trl[key]), key
    assert trl["first_calls"]["count"] == 10 and positive(trl["first_calls"]["median_s"])
    assert positive(s["steady_ratio"]) and positive(s["first_calls_ratio"])
    for goal in doc["goals"]:
        assert goal["met"] in (True, False) and positive(goal["value"]), goal


def test_tiny_cli_figures(tmp_path: Path) -> None:
    doc = run_script(
        "bench_tiny.py",
        *("--sizes", "40", "--calls", "2", "--first-calls", "2", "--cli", "--jobs", "1"),
        *("--budget", "120", "--workdir", str(tmp_path)),
    )
    cli = doc["sizes"]["40"]["cli"]
    assert set(cli) == {"stats", "stats_index_only", "verify_deep", "doctor", "ingest", "reshard"}
    for name, record in cli.items():
        assert record["status"] == "ok", (name, record)
        assert (
            positive(record["wall_s"])
            and positive(record["files_per_s"])
            and positive(record["peak_rss_bytes"])
        )
        assert record["exit_code"] in (0, 1) and isinstance(record["stderr_tail"], str)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny_40"]  # the outputs were removed
