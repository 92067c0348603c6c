"""Every example of every command's --help (and of docs/cli.md) runs and succeeds.

The examples name `ckpt`, `buffer`, `ranks`, `broken` and `trajs` (see rbtool/cli/_examples.py);
this test puts copies of reference fixtures under those names in an empty directory and runs
every example there in the order of docs/cli.md, so that an example may read what an earlier
one wrote. A leading `NAME=value` word is an environment setting for that command line.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES
from test_cli_docs import sections
from typer.testing import CliRunner

from rbtool.cli import app
from rbtool.cli._examples import EXAMPLES

# Commands that serve until Ctrl-C: tests/test_cli_view.py runs their examples (with --port 0
# --no-open), reads the URL they print, and stops them.
SERVES = {"view"}

PATHS = {
    "ckpt": "varying_shapes_pt/ckpt",
    "buffer": "autosave_pt/autosave",
    "ranks/rank_0": "ranks/rank_0",
    "ranks/rank_1": "ranks/rank_1",
    "broken": "nosave_window2_pt/ckpt",
}


def workspace(root: Path) -> None:
    for name, fixture in PATHS.items():
        shutil.copytree(FIXTURES / fixture, root / name)
    (root / "trajs").mkdir()
    for path in sorted((FIXTURES / "nosave_window2_pkl/ckpt").glob("trajectory_*_*.pkl")):
        shutil.copy(path, root / "trajs" / path.name)
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def split(line: str) -> tuple[dict[str, str], list[str]]:
    """(environment, arguments after `rbtool`) of an example command line."""
    words = shlex.split(line)
    env = {}
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words.pop(0) == "rbtool", line
    return env, words


@pytest.mark.parametrize("width", [80, 200])
def test_every_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    order = [path for path in sections() if path in EXAMPLES]
    assert sorted(order) == sorted(EXAMPLES)
    ran = 0
    for path in order:
        if path in SERVES:
            continue
        for _, line in EXAMPLES[path]:
            env, args = split(line)
            result = CliRunner().invoke(app, args, env={"COLUMNS": str(width), **env}, terminal_width=width)
            assert result.exit_code == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
            assert "Error:" not in result.stderr, (line, result.stderr)
            assert result.stdout, line
            ran += 1
    assert ran == sum(len(examples) for path, examples in EXAMPLES.items() if path not in SERVES)
