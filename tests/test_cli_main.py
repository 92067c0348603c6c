"""The command line as a whole: entry points, start-up without torch, and documentation coverage."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import typer

from rbtool.cli import app
from rbtool.cli._app import shared_params

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
# Options of every command, documented once under "Conventions" in docs/cli.md.
SHARED_OPTIONS = {opt for param in shared_params() for opt in param.opts}


def command_names() -> list[str]:
    """Every command as typed on the command line, groups expanded ("checkpoint save", ...)."""
    root = typer.main.get_command(app)
    names = []
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        sub = getattr(command, "commands", None)
        names.extend(f"{name} {child}" for child in sub) if sub else names.append(name)
    return sorted(names)


def test_python_m_rbtool_help_is_clean_and_does_not_import_torch() -> None:
    code = (
        "import runpy, sys\n"
        "sys.argv = ['rbtool', '--help']\n"
        "try:\n    runpy.run_module('rbtool', run_name='__main__')\n"
        "except SystemExit as exit:\n    assert exit.code in (0, None)\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0
    assert probe.stderr.strip() == "False"
    result = subprocess.run(
        [sys.executable, "-m", "rbtool", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stderr == ""
    for name in {n.split()[0] for n in command_names()}:
        assert name in result.stdout


def test_every_command_is_documented() -> None:
    text = DOCS.read_text()
    headings = set(re.findall(r"^#{2,3} rbtool (.+?)\s*$", text, flags=re.M))
    for name in command_names():
        assert name in headings, f"docs/cli.md does not document `rbtool {name}`"


def test_unknown_command_is_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rbtool", "nope"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and result.stdout == "" and "No such command" in result.stderr


def json_keys(doc: object) -> set[str]:
    """Every key of a JSON document, at any depth (inside lists too)."""
    keys: set[str] = set()
    if isinstance(doc, dict):
        for key, value in doc.items():
            keys.add(key)
            keys |= json_keys(value)
    elif isinstance(doc, list):
        for value in doc:
            keys |= json_keys(value)
    return keys


def test_every_json_key_is_documented(tmp_path: Path) -> None:
    import json
    import shutil

    from conftest import FIXTURES
    from typer.testing import CliRunner

    runner = CliRunner()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "autosave_pt/autosave", ckpt)
    broken = tmp_path / "broken"
    shutil.copytree(FIXTURES / "nosave_window2_pt/ckpt", broken)
    loose = FIXTURES / "autosave_pt/autosave/trajectory_0_87a64d8e-0f54-5c7c-a19d-0b3753cad97c.pt"
    calls = [
        ["version"],
        ["ingest", str(loose), "--buffer", str(tmp_path / "buf")],
        ["checkpoint", "save", str(ckpt), str(tmp_path / "saved"), "--window", "3"],
        ["checkpoint", "load", str(ckpt)],
        ["checkpoint", "load", str(ckpt), "--world-size", "2"],
        ["checkpoint", "load", str(broken), "--non-strict", "--buffer", str(tmp_path / "restored")],
        ["shard", str(ckpt), "--world-size", "2", "--out", str(tmp_path / "shards")],
        ["merge", str(FIXTURES / "ranks"), "--out", str(tmp_path / "merged")],
        ["reshard", str(FIXTURES / "ranks"), "--world-size", "3", "--out", str(tmp_path / "resharded")],
        ["reshard", str(FIXTURES / "ranks"), "-n", "2", "--out", str(tmp_path / "r"), "--dry-run"],
        ["filter", str(FIXTURES / "ranks"), "--out", str(tmp_path / "filtered"), "--max-staleness", "1"],
        ["filter", str(ckpt), "--out", str(tmp_path / "f2"), "--last", "2", "--dry-run"],
        ["diff", str(FIXTURES / "ranks"), str(tmp_path / "filtered"), "--deep"],
        ["diff", str(ckpt), str(tmp_path / "saved")],
        ["convert", str(FIXTURES / "ranks"), "--out", str(tmp_path / "converted"), "--format", "pkl"],
        ["stats", str(ckpt), "--sample-draws", "100"],
        ["stats", str(ckpt), "--index-only"],
        ["sample", str(ckpt), "--num-chunks", "4", "--out", str(tmp_path / "b.pt")],
        ["render", str(ckpt), "--id", "0", "--out", str(tmp_path / "t0.png")],
        ["report", str(ckpt), "--out", str(tmp_path / "r.md"), "--markdown", "--sample-draws", "50"],
        ["verify", str(broken), "--deep"],
        ["verify", str(ckpt)],
        ["repair", str(broken), "--out", str(tmp_path / "repaired")],
    ]
    # Keys are documented inside backticks, alone or on a dotted path (`window.samples`).
    documented = {
        word for span in re.findall(r"`([^`\n]+)`", DOCS.read_text()) for word in re.findall(r"\w+", span)
    }
    undocumented = {}
    for args in calls:
        result = runner.invoke(app, [*args, "--json"])
        assert result.exit_code in (0, 1), (args, result.stderr)
        missing = sorted(json_keys(json.loads(result.stdout)) - documented)
        if missing:
            undocumented[" ".join(args[:2])] = missing
    assert not undocumented, f"JSON keys missing from docs/cli.md: {undocumented}"


def test_start_up_imports_no_library_module() -> None:
    """`rbtool --help` loads the command modules only: the library, numpy and torch wait for a command."""
    code = (
        "import sys, rbtool.cli\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(('rbtool', 'numpy', 'torch')))))"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    loaded = set(probe.stdout.split())
    assert loaded - {"rbtool", "rbtool.errors"} == {m for m in loaded if m.startswith("rbtool.cli")}


def test_commands_import_only_the_shared_helpers() -> None:
    """Command modules never import each other; what they share lives in private rbtool.cli._* modules."""
    cli = Path(__file__).resolve().parents[1] / "rbtool" / "cli"
    for path in cli.glob("*.py"):
        if path.name == "__init__.py":
            continue
        imports = set(re.findall(r"^\s*(?:from|import) (rbtool\.cli[\w.]*)", path.read_text(), flags=re.M))
        assert all(name.startswith("rbtool.cli._") for name in imports), (path.name, imports)


def test_every_option_of_the_resharding_commands_is_documented() -> None:
    """reshard, filter, diff, convert: each option appears in its own section of docs/cli.md."""
    text = DOCS.read_text()
    root = typer.main.get_command(app)
    for name in ("reshard", "filter", "diff", "convert"):
        section = text.split(f"\n## rbtool {name}\n", 1)[1].split("\n## rbtool ", 1)[0]
        command = root.commands[name]  # type: ignore[attr-defined]
        for param in command.params:
            for opt in [*param.opts, *param.secondary_opts]:
                if opt.startswith("--") and opt != "--help" and opt not in SHARED_OPTIONS:
                    assert f"`{opt}" in section or f" {opt}" in section, f"rbtool {name}: {opt}"
