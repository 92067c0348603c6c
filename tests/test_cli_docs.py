"""docs/cli.md and the command line agree: every option in a command's option table exists on the
command, every option of the command is in its table, and the examples are the --help examples.

A command's section runs from its `## rbtool NAME` (or `### rbtool GROUP NAME`) heading to the
next command heading; the options every command shares are in the table of `## Conventions`,
which is also the root's section.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from rbtool.cli import app
from rbtool.cli._app import shared_params
from rbtool.cli._examples import EXAMPLES, epilog

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
HEADING = re.compile(r"^(?:## Conventions|#{2,3} rbtool (?P<path>.+?))\s*$", re.M)
OPTION = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
EXAMPLES_BLOCK = re.compile(r"^\*\*Examples\*\*\n\n```\n(.*?)```\n", re.M | re.S)
HELP = {"-h", "--help"}


def sections() -> dict[str, str]:
    """Each command's section of docs/cli.md by its path as typed ("" for Conventions, the root)."""
    text = DOCS.read_text()
    marks = list(HEADING.finditer(text))
    found = {}
    for mark, following in zip(marks, [*marks[1:], None], strict=True):
        end = following.start() if following else len(text)
        found[mark.group("path") or ""] = text[mark.end() : end]
    return found


def documented_options(section: str) -> set[str]:
    """Options named in the first column of the section's `| option | meaning |` tables."""
    names: set[str] = set()
    for table in re.findall(r"^\| option \| meaning \|\n\|---\|---\|\n((?:\|.*\n)+)", section, flags=re.M):
        for row in table.splitlines():
            names.update(OPTION.findall(row.split(" | ", 1)[0]))
    return names


def commands() -> dict[str, object]:
    found: dict[str, object] = {}

    def walk(path: str, command: object) -> None:
        found[path] = command
        for name, child in getattr(command, "commands", {}).items():
            walk(f"{path} {name}".strip(), child)

    walk("", typer.main.get_command(app))
    return found


SHARED = {o for p in shared_params() for o in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize("path", sorted(commands()))
def test_the_option_table_lists_exactly_the_options_of_the_command(path: str) -> None:
    command = commands()[path]
    actual = {
        o
        for p in command.params  # type: ignore[attr-defined]
        if p.param_type_name == "option"
        for o in (*p.opts, *p.secondary_opts)
    }
    documented = documented_options(sections()[path])
    if path == "":  # the Conventions table: the root's options, the shared ones and -h
        assert documented == actual | HELP
    else:
        assert actual >= SHARED
        assert documented == actual - SHARED, (
            f"rbtool {path}: in docs only {sorted(documented - actual)}, "
            f"on the command only {sorted(actual - SHARED - documented)}"
        )


def test_every_command_and_group_has_a_section() -> None:
    assert set(commands()) <= set(sections())


@pytest.mark.parametrize("path", sorted(EXAMPLES))
def test_the_documented_examples_are_the_help_examples(path: str) -> None:
    blocks = EXAMPLES_BLOCK.findall(sections()[path])
    assert len(blocks) == 1, f"rbtool {path}: one **Examples** block expected"
    lines = [line for what, command in EXAMPLES[path] for line in (f"# {what}", command)]
    assert blocks[0].splitlines() == lines
    help_text = epilog(path)
    assert help_text is not None and commands()[path].epilog == help_text  # type: ignore[attr-defined]


def test_every_command_and_group_has_examples_that_fit_80_columns() -> None:
    assert set(commands()) == set(EXAMPLES)
    for path, examples in EXAMPLES.items():
        assert examples, path
        for what, command in examples:
            assert len(f"    # {what}") <= 80 and len(f"    {command}") <= 80, (path, command)
            assert re.match(r"^(\w+=\S* )*rbtool ", command), command
            assert f"rbtool {path}".strip() in command, (path, command)
