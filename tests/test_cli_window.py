"""One default window (100, the buffer's sample_window_size) for every command with --window,
shown in --help, and each command says which ids its window kept, of which, and why."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import FIXTURES, runner

from rbtool.buffer.replay import TrajectoryReplayBuffer
from rbtool.cli import app
from rbtool.cli._window import DEFAULT_WINDOW

CKPT = FIXTURES / "autosave_pt" / "autosave"  # ids 0-4


def run(*args: str | Path, width: int = 200) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args], terminal_width=width)
    return result.exit_code, result.stdout


def flat(text: str) -> str:
    return " ".join(text.split())


def test_the_default_is_the_buffer_default() -> None:
    import inspect

    buffer_default = inspect.signature(TrajectoryReplayBuffer).parameters["sample_window_size"].default
    assert buffer_default == DEFAULT_WINDOW


WINDOWED = [["sample", "--help"], ["stats", "--help"], ["checkpoint", "save", "--help"], ["report", "--help"]]


@pytest.mark.parametrize("args", WINDOWED, ids=lambda a: a[0])
@pytest.mark.parametrize("width", [80, 200])
def test_help_shows_the_default(args: list[str], width: int) -> None:
    status, text = run(*args, width=width)
    assert status == 0
    option = flat(text).split("--window", 1)[1].split(" -", 1)[0]
    assert re.search(rf"\[(?:[^]]*; )?default: {DEFAULT_WINDOW}[;\]]", option), option


def _many(tmp_path: Path, n: int) -> Path:
    """An index-only checkpoint of n trajectories (stats --index-only needs no file)."""
    many = tmp_path / "many"
    many.mkdir()
    entries = {
        str(i): {"num_samples": 8, "trajectory_id": i, "max_episode_length": 4, "shape": [4, 2, 7],
                 "model_weights_id": "v"}
        for i in range(n)
    }  # fmt: skip
    (many / "trajectory_index.json").write_text(
        json.dumps({"trajectory_index": entries, "trajectory_id_list": list(range(n))})
    )
    meta = {"trajectory_format": "pt", "size": n, "total_samples": 8 * n, "trajectory_counter": n}
    (many / "metadata.json").write_text(json.dumps(meta))
    return many


def test_stats_default_window_says_what_it_kept_and_why(tmp_path: Path, columns: int) -> None:
    many = _many(tmp_path, 150)
    status, text = run("stats", many, "--index-only")
    assert status == 0
    assert "window 100: kept ids 50-149 of 0-149 (the last 100 of 150 trajectories; 0 keeps all)" in text
    status, text = run("stats", many, "--index-only", "--json")
    doc = json.loads(text)
    assert doc["window"]["requested"] == 100 and doc["window"]["first_id"] == 50


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ([], "window 100: kept ids 0-4 of 0-4 (the last 100: all 5, fewer than 100)"),
        (["-w", "2"], "window 2: kept ids 3-4 of 0-4 (the last 2 of 5 trajectories; 0 keeps all)"),
        (["-w", "0"], "window 0: kept ids 0-4 of 0-4 (0 keeps all 5)"),
    ],
    ids=["default", "two", "all"],
)
@pytest.mark.parametrize("command", ["stats", "sample", "checkpoint-save"])
def test_every_windowed_command_says_what_it_kept(
    tmp_path: Path, columns: int, command: str, extra: list[str], line: str
) -> None:
    args: list[str | Path] = {
        "stats": ["stats", CKPT],
        "sample": ["sample", CKPT, "--num-chunks", "3"],
        "checkpoint-save": ["checkpoint", "save", CKPT, tmp_path / "out"],
    }[command]
    status, text = run(*args, *extra)
    assert status == 0
    assert line in text.splitlines()  # one line of its own, not wrapped
    status, text = run(*args, *extra, "--json", *(["--force"] if command == "checkpoint-save" else []))
    doc = json.loads(text)
    window = doc["window"]["requested"] if command == "stats" else doc["window"]
    assert window == int(extra[1]) if extra else window == DEFAULT_WINDOW


def test_in_memory_save_window_counts_every_source(five_files: list[Path], tmp_path: Path) -> None:
    status, text = run("checkpoint", "save", *five_files, tmp_path / "out", "--window", "2")
    assert status == 0
    assert "window 2: kept ids 3-4 of 0-4 (the last 2 of 5 trajectories; 0 keeps all)" in text.splitlines()
