"""The `rbtool` command line: parses, calls the library, prints. Commands live one per module."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperGroup

from rbtool.cli._common import INVOKED, handle_library_errors
from rbtool.errors import RbtoolError


class Group(TyperGroup):
    """Turns library errors raised by any command into `Error: ...`, exit 1.

    Every group records the command it resolves, so the error can name that command's options.
    """

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, command, rest = super().resolve_command(ctx, args)
        INVOKED[:] = [command]
        return name, command, rest

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except RbtoolError as exc:
            handle_library_errors(exc)


app = typer.Typer(
    cls=Group,
    name="rbtool",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root() -> None:
    """Build, inspect, shard, merge and check trajectory replay-buffer checkpoints.

    Every command prints a human view, or with --json exactly one JSON document on stdout.
    Exit status: 0 success, 1 an error in the input or the checkpoint, 2 usage.
    """


def _register() -> None:
    """Import the command modules, each of which adds its commands to `app`."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


_register()


def main() -> None:
    """Console-script entry point."""
    app()
