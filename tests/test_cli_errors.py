"""How the command line reports errors: library usage errors exit 2, input errors exit 1, bugs keep
their traceback; option hints come from the command line, never from library messages."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from conftest import FIXTURES, assert_one_error, run

from rbtool.cli import _common
from rbtool.errors import FieldsLeftOutWarning, MissingTrajectoryFilesError, OutputExistsError

PACKAGE = Path(__file__).resolve().parents[1] / "rbtool"
CKPT = FIXTURES / "autosave_pt" / "autosave"


def test_library_usage_error_exits_2_with_one_line() -> None:
    result = run("sample", CKPT, "--num-chunks", "4", "--strategy", "topk")  # no --k
    assert_one_error(result, status=2)
    assert "needs k" in result.stderr


def test_rank_out_of_range_is_a_usage_error_before_anything_is_read(tmp_path: Path) -> None:
    result = run("checkpoint", "load", tmp_path / "missing", "--rank", "3", "--world-size", "2")
    assert_one_error(result, status=2)
    assert "rank" in result.stderr


def test_rank_without_world_size_is_a_usage_error() -> None:
    assert_one_error(run("checkpoint", "load", CKPT, "--rank", "0"), status=2)


def test_usage_error_through_the_console_entry_point(tmp_path: Path) -> None:
    """`python -m rbtool` runs main(), which maps errors the same way."""
    args = ["checkpoint", "load", str(tmp_path / "missing"), "--rank", "3", "--world-size", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "rbtool", *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr


def test_checkpoint_error_exits_1(tmp_path: Path) -> None:
    result = run("checkpoint", "load", tmp_path / "missing")
    assert_one_error(result)
    assert str(tmp_path / "missing") in result.stderr


def test_unexpected_exception_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    from rbtool.cli import version

    def broken(doc: object, *args: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(version, "print_json", broken)
    result = run("version", "--json")
    assert result.exit_code == 1
    assert isinstance(result.exception, ZeroDivisionError)  # not swallowed into an `Error:` line
    assert result.exc_info is not None and result.exc_info[2] is not None
    assert "Error:" not in result.stderr


def test_missing_files_hint_only_where_the_option_exists(rlinf_copy, tmp_path: Path) -> None:
    broken = rlinf_copy("nosave_window2_pt/ckpt")
    result = run("shard", broken, "--world-size", "2", "--out", tmp_path / "s")
    assert_one_error(result)
    assert "--non-strict" in result.stderr
    # `ingest` has no --non-strict: the error must not point at an option it lacks.
    result = run("ingest", broken, "--buffer", tmp_path / "buf")
    assert_one_error(result)
    assert "--non-strict" not in result.stderr


def test_output_exists_hint_names_force(tmp_path: Path) -> None:
    out = tmp_path / "s"
    assert run("shard", CKPT, "--world-size", "2", "--out", out).exit_code == 0
    result = run("shard", CKPT, "--world-size", "2", "--out", out)
    assert_one_error(result)
    assert "already exists" in result.stderr and "--force" in result.stderr


def command(name: str) -> object:
    from rbtool.cli import app

    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def test_hints_depend_on_the_command_options() -> None:
    missing = MissingTrajectoryFilesError("x: files missing", [1])
    exists = OutputExistsError("x: already exists")
    assert _common.option_hint(missing, command("shard")) == "; pass --non-strict to keep only what exists"
    assert (
        _common.option_hint(exists, command("shard")) == "; choose another path or pass --force to replace it"
    )
    assert _common.option_hint(missing, command("version")) == ""
    assert _common.option_hint(exists, None) == ""


def test_left_out_fields_warning_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    warning = FieldsLeftOutWarning("left out a.b; ask for extra fields", ["a.b", "c"])
    _common.print_warning(warning, command("sample"))
    line = capsys.readouterr().err.strip()
    assert line.startswith("Warning: ") and "a.b, c" in line and "--all-fields" in line
    _common.print_warning(warning, None)  # a command without the option: the library's words
    assert capsys.readouterr().err.strip() == "Warning: left out a.b; ask for extra fields"


# ------------------------------------------------------------ library messages name no flags
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def flag_mentions(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal, docstrings aside, that names a `--flag`."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in skip
        and FLAG.search(node.value)
    ]


def test_the_scan_finds_flags_in_messages() -> None:
    code = 'def f():\n    """Like `rbtool x --json`."""\n    raise ValueError(f"{p}: pass --force")\n'
    assert flag_mentions(code) == [(3, ": pass --force")]
    assert flag_mentions('x = "a -- b, --1, well--known"\n') == []


def test_library_messages_name_no_command_line_flags() -> None:
    """Library modules speak of their own arguments; the command line adds the flag hint."""
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        try:
            found = flag_mentions(path.read_text())
        except SyntaxError:  # a module half-way through an edit is judged once it parses
            continue
        offenders += [f"{path.name}:{line}: {text!r}" for line, text in found]
    assert offenders == []
