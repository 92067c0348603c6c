"""Snapshots of every command's human view on a reference fixture, at an 80- and a 200-column
terminal and piped, compared exactly with the files in tests/snapshots/.

A layout change shows up in review as a change to those files. After a deliberate change,
regenerate them and read the diff:

    RBTOOL_UPDATE_SNAPSHOTS=1 pytest tests/test_snapshots.py

Each command runs in a fresh directory with short relative names (`buf`, `ckpt`, `out`), so
paths are the same everywhere; timings, throughputs and how files were placed (reflink, hard
link or copy depends on the file system) are normalised, and colour codes are stripped.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import FIXTURES
from typer.testing import CliRunner

from rbtool.cli import app

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"
UPDATE = os.environ.get("RBTOOL_UPDATE_SNAPSHOTS") == "1"
MODES = {"80": {"TTY_COMPATIBLE": "1", "COLUMNS": "80"}, "200": {"TTY_COMPATIBLE": "1", "COLUMNS": "200"}}
MODES["piped"] = {"TTY_COMPATIBLE": "0", "COLUMNS": "80"}  # a pipe ignores the width

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
NORMALISE = (
    (re.compile(r"\b\d+\.\d\d s\b"), "0.00 s"),  # durations
    (re.compile(r"\b\d+\.\d MB/s"), "0.0 MB/s"),  # throughputs
    (re.compile(r"\b\d+ (reflinked|linked|copied)\b"), r"# \1"),  # placement depends on the file system
)


def copy(name: str, to: str) -> None:
    shutil.copytree(FIXTURES / name, to)


def prepare_buffer() -> None:
    copy("autosave_pt/autosave", "buf")


def prepare_damaged() -> None:
    copy("nosave_window2_pt/ckpt", "ckpt")


def prepare_ranks() -> None:
    copy("ranks/rank_0", "ranks/rank_0")
    copy("ranks/rank_1", "ranks/rank_1")


def prepare_diff() -> None:
    copy("autosave_pt/autosave", "a")
    copy("varying_shapes_pt/ckpt", "b")


def prepare_import() -> None:
    prepare_buffer()
    runner = CliRunner()
    result = runner.invoke(app, ["export", "buf", "ds", "--to", "lerobot", "--fps", "10"])
    assert result.exit_code == 0, result.stderr


def prepare_loose() -> None:
    Path("loose").mkdir()
    for f in sorted((FIXTURES / "autosave_pt" / "autosave").glob("trajectory_*.pt"))[:3]:
        shutil.copy(f, Path("loose") / f.name)


# name: (prepare, argv, expected exit status). Each runs in an empty directory of its own.
CASES: dict[str, tuple[Callable[[], None], list[str], int]] = {
    "ingest": (prepare_loose, ["ingest", "loose", "--buffer", "buf"], 0),
    "checkpoint-save": (prepare_buffer, ["checkpoint", "save", "buf", "out", "--window", "3"], 0),
    "checkpoint-load": (prepare_buffer, ["checkpoint", "load", "buf", "--world-size", "2"], 0),
    "shard": (prepare_buffer, ["shard", "buf", "--world-size", "2", "--out", "out"], 0),
    "merge": (prepare_ranks, ["merge", "ranks", "--out", "out"], 0),
    "reshard": (prepare_ranks, ["reshard", "ranks", "--world-size", "3", "--out", "out"], 0),
    "filter": (prepare_buffer, ["filter", "buf", "--out", "out", "--min-id", "1", "--max-id", "3"], 0),
    "diff": (prepare_diff, ["diff", "a", "b"], 1),
    "convert": (prepare_buffer, ["convert", "buf", "--out", "out", "--format", "pkl", "--jobs", "1"], 0),
    "export": (prepare_buffer, ["export", "buf", "ds", "--to", "lerobot", "--fps", "10"], 0),
    "import-lerobot": (prepare_import, ["import", "lerobot", "ds", "--buffer", "back"], 0),
    "stats": (prepare_damaged, ["stats", "ckpt", "--jobs", "1", "--sample-draws", "100"], 0),
    "stats-several": (prepare_buffer, ["stats", "buf", "ranks-missing", "--index-only"], 1),
    "sample": (prepare_buffer, ["sample", "buf", "--num-chunks", "6", "--window", "2"], 0),
    "verify": (prepare_damaged, ["verify", "ckpt"], 1),
    "verify-several": (prepare_ranks, ["verify", "ranks", "ranks/rank_1"], 0),
    "repair": (prepare_damaged, ["repair", "ckpt", "--out", "out", "--jobs", "1"], 0),
    "version": (lambda: None, ["version"], 0),
}
NEEDS = {"export": ("pyarrow", "PIL"), "import-lerobot": ("pyarrow", "PIL")}


def normalised(text: str) -> str:
    text = ANSI.sub("", text)
    for pattern, replacement in NORMALISE:
        text = pattern.sub(replacement, text)
    return text


def human_view(case: str, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    for module in NEEDS.get(case, ()):
        pytest.importorskip(module)
    prepare, argv, status = CASES[case]
    monkeypatch.chdir(tmp_path)
    prepare()
    result = CliRunner().invoke(app, argv, env=MODES[mode])
    assert result.exit_code == status, (result.stdout, result.stderr)
    return normalised(result.stdout)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_human_view_matches_its_snapshot(
    case: str, mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = human_view(case, mode, tmp_path, monkeypatch)
    lines = text.split("\n")
    if mode == "80":  # fits without a cut cell: nothing longer than the terminal, no ellipsis but a prefix's
        assert all(len(line) <= 80 for line in lines), max(lines, key=len)
        assert all(re.search(r"[0-9a-f]{8}…", line) for line in lines if "…" in line and "more" not in line)
    if mode == "piped":  # grep-friendly: no trailing spaces, nothing shortened
        assert all(line == line.rstrip() for line in lines) and "…" not in text.replace("… ", "")
    snapshot = SNAPSHOTS / f"{case}.{mode}.txt"
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        snapshot.write_text(text)
    assert snapshot.exists(), f"no snapshot {snapshot.name}: run with RBTOOL_UPDATE_SNAPSHOTS=1 and review it"
    assert text == snapshot.read_text(), f"{snapshot.name} differs (RBTOOL_UPDATE_SNAPSHOTS=1 rewrites it)"


def test_every_snapshot_file_belongs_to_a_case() -> None:
    """A renamed or removed case leaves no stale snapshot behind."""
    expected = {f"{case}.{mode}.txt" for case in CASES for mode in MODES}
    assert {p.name for p in SNAPSHOTS.glob("*.txt")} <= expected
