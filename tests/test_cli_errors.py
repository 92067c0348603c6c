"""How the command line reports errors: library usage errors exit 2, input errors exit 1, bugs keep
their traceback; option hints come from the command line, never from library messages."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
from conftest import FIXTURES, assert_one_error, run

from rbtool.cli import _errors
from rbtool.errors import FieldsLeftOutWarning, MissingTrajectoryFilesError, OutputExistsError

PACKAGE = Path(__file__).resolve().parents[1] / "rbtool"
CKPT = FIXTURES / "autosave_pt" / "autosave"


def test_library_usage_error_exits_2_with_one_line() -> None:
    result = run("sample", CKPT, "--num-chunks", "4", "--strategy", "topk", "--k", "2", "--temperature", "0")
    assert_one_error(result, status=2)
    assert "temperature must be" in result.stderr


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
    assert _errors.option_hint(missing, command("shard")) == "; pass --non-strict to keep only what exists"
    assert (
        _errors.option_hint(exists, command("shard")) == "; choose another path or pass --force to replace it"
    )
    assert _errors.option_hint(missing, command("version")) == ""
    assert _errors.option_hint(exists, None) == ""


def test_left_out_fields_warning_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    warning = FieldsLeftOutWarning("left out a.b; ask for extra fields", ["a.b", "c"])
    _errors.print_warning(warning, command("sample"))
    line = capsys.readouterr().err.strip()
    assert line.startswith("Warning: ") and "a.b, c" in line and "--all-fields" in line
    _errors.print_warning(warning, None)  # a command without the option: the library's words
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


# ------------------------------------------------------------ one message per kind of mistake
# Every command is tried with the same bad input; each kind of mistake gives one message, the
# same wherever it happens, on one line at any terminal width and with stdout piped (CliRunner's
# stdout is not a terminal).


def _readers(path: Path, out: Path) -> dict[str, list[str | Path]]:
    """Every command that reads a checkpoint, with `path` where the checkpoint goes."""
    return {
        "stats": ["stats", path],
        "verify": ["verify", path],
        "verify-deep": ["verify", path, "--deep"],
        "checkpoint-load": ["checkpoint", "load", path],
        "sample": ["sample", path, "--num-chunks", "2"],
        "diff-a": ["diff", path, CKPT],
        "diff-b": ["diff", CKPT, path],
        "shard": ["shard", path, "-n", "2", "-o", out],
        "merge": ["merge", path, "-o", out],
        "reshard": ["reshard", path, "-n", "2", "-o", out],
        "filter": ["filter", path, "-o", out, "--last", "1"],
        "convert": ["convert", path, "-o", out, "--format", "pkl"],
        "repair": ["repair", path, "-o", out],
        "checkpoint-save": ["checkpoint", "save", path, out],
        "export": ["export", path, out, "--to", "lerobot", "--fps", "10"],
    }


MISSING_SOURCE = [*_readers(Path("x"), Path("y")), "ingest", "import-lerobot"]


@pytest.mark.parametrize("name", MISSING_SOURCE)
def test_a_missing_path_gives_the_same_message_everywhere(tmp_path: Path, columns: int, name: str) -> None:
    missing, out = tmp_path / "missing", tmp_path / "out"
    commands = {
        **_readers(missing, out),
        "ingest": ["ingest", missing, "--buffer", out],
        "import-lerobot": ["import", "lerobot", missing, "--buffer", out],
    }
    result = run(*commands[name])
    assert_one_error(result)
    assert result.stderr.strip() == f"Error: {missing}: no such file or directory"
    assert not out.exists()


CHECKPOINT_READERS = [n for n in _readers(Path("x"), Path("y")) if n != "diff-b"]


@pytest.mark.parametrize("name", CHECKPOINT_READERS)
def test_the_parent_of_checkpoints_names_them_and_the_path_to_give(
    tmp_path: Path, columns: int, name: str
) -> None:
    parent, out = tmp_path / "runs", tmp_path / "out"
    for child in ("b", "a"):
        shutil.copytree(CKPT, parent / child)
    result = run(*_readers(parent, out)[name])
    assert_one_error(result)
    line = result.stderr.strip()
    assert line.startswith(f"Error: {parent}: not a checkpoint but a folder holding 2 checkpoint directories")
    assert "(a, b)" in line and line.endswith(f"give one of them, e.g. {parent / 'a'}")
    assert not out.exists()


def _damage(kind: str, path: Path) -> str:
    """Damage a .pt file in place; the words its error must use."""
    data = path.read_bytes()
    if kind == "empty":
        path.write_bytes(b"")
        return "empty (0 bytes)"
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
        return f"truncated ({len(data) // 2} bytes)"
    if kind == "cut-short":
        path.write_bytes(data[:300])
        return "truncated (300 bytes)"
    path.write_bytes(b"this is not a torch file\n")
    return "not a zip"


DAMAGE = ["empty", "truncated", "cut-short", "garbage"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_pt_says_truncated_or_not_a_zip_in_verify_deep(rlinf_copy, columns: int, kind: str) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    (target,) = ckpt.glob("trajectory_2_*.pt")
    words = _damage(kind, target)
    result = run("verify", ckpt, "--deep", "--json")
    assert result.exit_code == 1
    (problem,) = [p for c in json.loads(result.stdout)["checkpoints"] for p in c["problems"]]
    assert problem["code"] == "file_unreadable" and problem["file"] == target.name
    assert problem["message"].startswith(f"{target}: {words}")
    assert "Errno" not in problem["message"] and "seek" not in problem["message"]
    human = run("verify", ckpt, "--deep")
    assert words.split(" (")[0] in " ".join(human.stdout.split())


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_pt_says_truncated_or_not_a_zip_in_repair(
    rlinf_copy, tmp_path: Path, columns: int, kind: str
) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    (target,) = ckpt.glob("trajectory_2_*.pt")
    words = _damage(kind, target)
    doc = json.loads(run("repair", ckpt, "-o", tmp_path / "fixed", "--json").stdout)
    (dropped,) = doc["checkpoints"][0]["dropped"]
    assert dropped["trajectory_id"] == 2 and dropped["reason"].startswith(f"{target}: {words}")
    assert "Errno" not in dropped["reason"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_pt_read_by_sample_is_one_line_naming_it(rlinf_copy, columns: int, kind: str) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    (target,) = ckpt.glob("trajectory_2_*.pt")
    words = _damage(kind, target)
    result = run("sample", ckpt, "--num-chunks", "64")
    assert_one_error(result)
    assert f"{target}: {words}" in result.stderr and "Errno" not in result.stderr


# (arguments, option, the plain words of the message)
OPTION_ERRORS: list[tuple[list[str], str, str]] = [
    (["sample", str(CKPT), "--num-chunks", "2", "--strategy", "TopK"], "--strategy",
     "'TopK' is not a choice; give one of: uniform, topk (did you mean topk? choices are case-sensitive)"),
    (["stats", str(CKPT), "--sample-draws", "5", "--strategy", "best"], "--strategy",
     "'best' is not a choice; give one of: uniform, topk"),
    (["convert", str(CKPT), "-o", "x", "--format", "PT"], "--format",
     "'PT' is not a choice; give one of: pt, pkl (did you mean pt?"),
    (["ingest", str(CKPT), "--buffer", "x", "--format", "zip"], "--format",
     "'zip' is not a choice; give one of: pt, pkl"),
    (["checkpoint", "save", str(CKPT), "x", "--mode", "bad"], "--mode",
     "'bad' is not a choice; give one of: auto, auto-save, in-memory"),
    (["reshard", str(CKPT), "-n", "2", "-o", "x", "--balance", "Count"], "--balance",
     "'Count' is not a choice; give one of: count, samples (did you mean count?"),
    (["sample", str(CKPT), "--num-chunks", "abc"], "--num-chunks", "'abc' is not a whole number"),
    (["sample", str(CKPT), "--num-chunks", "0"], "--num-chunks", "0 is too small; give 1 or more"),
    (["sample", str(CKPT), "--num-chunks", "2", "--window", "-1"], "--window",
     "-1 is too small; give 0 or more"),
    (["sample", str(CKPT), "--num-chunks", "2", "--temperature", "warm"], "--temperature",
     "'warm' is not a number"),
    (["shard", str(CKPT), "-n", "1.5", "-o", "x"], "--world-size", "'1.5' is not a whole number"),
    (["stats", str(CKPT), "--bins", "5000"], "--bins", "5000 is too large; give 1000 or less"),
    (["filter", str(CKPT), "-o", "x", "--max-staleness", "-2"], "--max-staleness",
     "-2 is too small; give 0 or more"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "option", "words"), OPTION_ERRORS, ids=[f"{a[0]}{o}" for a, o, _ in OPTION_ERRORS]
)
def test_option_errors_are_plain_words_with_the_allowed_values(
    columns: int, args: list[str], option: str, words: str
) -> None:
    result = run(*args)
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("Error: ")]
    assert line.startswith(f"Error: Invalid value for '{option}'") and words in line, line
    assert "Value error" not in line and "Input should" not in line


def _writers(src: Path, out: Path) -> dict[str, list[str | Path]]:
    """Every command that writes, with `out` where its output goes."""
    return {
        "ingest": ["ingest", src, "--buffer", out],
        "checkpoint-save": ["checkpoint", "save", src, out],
        "checkpoint-load-buffer": ["checkpoint", "load", src, "--buffer", out],
        "shard": ["shard", src, "-n", "2", "-o", out],
        "merge": ["merge", src, "-o", out],
        "reshard": ["reshard", src, "-n", "2", "-o", out],
        "filter": ["filter", src, "-o", out, "--last", "1"],
        "convert": ["convert", src, "-o", out, "--format", "pkl"],
        "repair": ["repair", src, "-o", out],
        "export": ["export", src, out, "--to", "lerobot", "--fps", "10"],
        "sample-out": ["sample", src, "--num-chunks", "2", "--out", out],
    }


@pytest.mark.parametrize("name", list(_writers(Path("x"), Path("y"))))
@pytest.mark.parametrize("depth", [1, 2], ids=["parent", "grandparent"])
def test_a_parent_of_the_output_that_is_a_file_is_named(
    tmp_path: Path, columns: int, name: str, depth: int
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    out = afile / "o" if depth == 1 else afile / "deeper" / "o"
    result = run(*_writers(CKPT, out)[name])
    assert_one_error(result)
    assert result.stderr.strip() == (
        f"Error: {afile}: not a directory (a file), so {out} cannot be made in it; choose another path"
    )
    assert afile.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_buffer_path_that_is_a_file_says_so(tmp_path: Path, columns: int) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for args in (["ingest", CKPT, "--buffer", afile], ["import", "lerobot", CKPT, "--buffer", afile]):
        result = run(*args)
        assert result.exit_code in (1, 2) and result.stdout == ""
        assert "File exists" not in result.stderr
    assert afile.read_text() == "keep me"


# a listed trajectory file replaced by something that is no regular file
NOT_FILES = pytest.mark.parametrize(
    ("make", "what"),
    [(os.mkfifo, "a FIFO"), (os.mkdir, "a directory")],
    ids=["fifo", "directory"],
)


def _with_id_3_no_file(rlinf_copy: Callable[[str], Path], make: Callable[[Path], None]) -> Path:
    """A copy of the autosave fixture whose trajectory 3 is `make(path)` instead of its file."""
    ckpt = rlinf_copy("autosave_pt/autosave")
    (target,) = ckpt.glob("trajectory_3_*.pt")
    target.unlink()
    make(target)
    return ckpt


@NOT_FILES
def test_stats_says_what_a_listed_name_is_when_it_is_no_file(
    rlinf_copy, columns: int, make: Callable[[Path], None], what: str
) -> None:
    ckpt = _with_id_3_no_file(rlinf_copy, make)
    doc = json.loads(run("stats", ckpt, "--json").stdout)
    assert doc["files"]["missing"] == 0 and doc["files"]["missing_ids"] == []
    assert doc["files"]["not_files"] == [{"trajectory_id": 3, "is": what}]
    assert doc["trajectories"]["in_window"][3] is False
    human = run("stats", ckpt)
    assert human.exit_code == 0, human.stderr
    text = " ".join(human.stdout.split())
    assert f"1 not a regular file (id 3 is {what})" in text and "missing" not in text


# ------------------------------------------------------------ the fix that exists
@pytest.mark.parametrize("name", ["stats", "checkpoint-load", "sample", "shard"])
def test_a_damaged_index_names_the_repair_that_rebuilds_it(
    rlinf_copy, tmp_path: Path, columns: int, name: str
) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    (ckpt / "trajectory_index.json").write_text("{not json")
    argv = {
        "stats": ["stats", ckpt],
        "checkpoint-load": ["checkpoint", "load", ckpt],
        "sample": ["sample", ckpt, "--num-chunks", "2"],
        "shard": ["shard", ckpt, "-n", "2", "-o", tmp_path / "o"],
    }[name]
    result = run(*argv)
    assert_one_error(result)
    line = result.stderr.strip()
    assert line.startswith(f"Error: {ckpt / 'trajectory_index.json'}: invalid JSON")
    assert line.endswith(
        f"; `rbtool repair {ckpt} --out OUT` rebuilds the metadata and index from the trajectory files"
    )


def test_a_damaged_trajectory_file_names_verify_and_repair(rlinf_copy, columns: int) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    (target,) = ckpt.glob("trajectory_2_*.pt")
    _damage("truncated", target)
    result = run("sample", ckpt, "--num-chunks", "64")
    assert_one_error(result)
    assert result.stderr.strip().endswith(
        f"; `rbtool verify --deep {ckpt}` lists every damaged file, "
        f"`rbtool repair {ckpt} --out OUT` writes a checkpoint without them"
    )


def test_no_repair_hint_where_repair_cannot_mend_it(tmp_path: Path, columns: int) -> None:
    loose = tmp_path / "t.pt"
    loose.write_bytes(b"")
    result = run("ingest", loose, "--buffer", tmp_path / "buf")  # a loose file, not a checkpoint's
    assert_one_error(result)
    assert (
        result.stderr.strip()
        == f"Error: {loose}: empty (0 bytes); the file was never written or was cut to nothing"
    )


@NOT_FILES
def test_verify_says_what_a_listed_name_is_when_it_is_no_file(
    rlinf_copy, columns: int, make: Callable[[Path], None], what: str
) -> None:
    ckpt = _with_id_3_no_file(rlinf_copy, make)
    result = run("verify", ckpt, "--json")
    assert result.exit_code == 1
    (problem,) = [
        p for c in json.loads(result.stdout)["checkpoints"] for p in c["problems"] if p["trajectory_id"]
    ]
    assert problem["code"] == "file_missing"
    (target,) = ckpt.glob("trajectory_3_*.pt")
    assert problem["message"] == f"{target.name}: listed trajectory 3 has no file: the name is {what}"


OVERLAPPING = [n for n in _writers(Path("x"), Path("y")) if n != "ingest"]


@pytest.mark.parametrize("name", OVERLAPPING)
def test_an_output_inside_the_input_is_refused_in_the_same_words(rlinf_copy, columns: int, name: str) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    before = sorted(p.name for p in ckpt.iterdir())
    out = ckpt / "inside"
    result = run(*_writers(ckpt, out)[name])
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("Error: ")]
    assert line.endswith(f"{out} overlaps the input {ckpt}; choose a path outside it"), line
    assert sorted(p.name for p in ckpt.iterdir()) == before
