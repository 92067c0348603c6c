"""benchmarks/bench.py runs end to end on a tiny size and reports every figure (no timing asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

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
