"""The `rbtool` command line: parses, calls the library, prints.

The command set is the list below. Each command module defines its command functions (the
`checkpoint` module its sub-group) and imports only the private `rbtool.cli._*` modules at
import time; the library is imported inside each command, so `rbtool --help` loads neither
torch nor the library. Library errors become exit statuses in one place, `_app.Group.invoke`.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from rbtool.cli import (
    checkpoint,
    convert,
    diff,
    doctor,
    filter,
    ingest,
    lerobot,
    merge,
    render,
    repair,
    report,
    reshard,
    sample,
    shard,
    stats,
    verify,
    version,
    view,
)
from rbtool.cli._app import Command, Group, Typer

app = Typer(
    cls=Group,
    name="rbtool",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        version.version()
        raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", is_eager=True, callback=_print_version, help="Print rbtool's version and exit."
        ),
    ] = False,
) -> None:
    """Build, inspect, shard, reshard, merge, filter, diff, convert and check replay-buffer checkpoints.

    Every command prints a human view, or with --json exactly one JSON document on stdout.
    Exit status: 0 success, 1 an error in the input or the checkpoint, 2 usage.
    """


# The command set, in the order `rbtool --help` lists it.
app.command(cls=Command)(ingest.ingest)
app.add_typer(checkpoint.checkpoint_app)  # checkpoint save, checkpoint load
app.command(cls=Command)(shard.shard)
app.command(cls=Command)(merge.merge)
app.command(cls=Command)(reshard.reshard)
app.command(name="filter", cls=Command)(filter.filter_)
app.command(cls=Command)(diff.diff)
app.command(cls=Command)(convert.convert)
app.command(cls=Command)(lerobot.export)  # export --to lerobot
app.add_typer(lerobot.import_app)  # import lerobot
app.command(cls=Command)(stats.stats)
app.command(cls=Command)(sample.sample)
app.command(cls=Command)(render.render)
app.command(cls=Command)(report.report)
app.command(cls=Command)(view.view)
app.command(cls=Command)(verify.verify)
app.command(cls=Command)(doctor.doctor)
app.command(cls=Command)(repair.repair)
app.command(cls=Command)(version.version)


def main() -> None:
    """Console-script entry point, also run by `python -m rbtool`.

    Under torchrun, ranks other than 0 print nothing on stdout: every rank builds the same
    report (rbtool.passes.ranks), rank 0 prints it; and no rank leaves before the others are done
    (torchrun ends every rank as soon as one exits with an error: rank 0 could be cut off
    in the middle of its report).
    """
    try:
        if os.environ.get("RANK", "0") != "0" and os.environ.get("WORLD_SIZE"):
            from rbtool.passes.ranks import from_env, silenced_stdout

            try:
                world = from_env()
            except Exception:  # the command reports a bad torchrun environment itself
                world = None
            with silenced_stdout(world):
                app()
        else:
            app()
    finally:
        ranks = sys.modules.get("rbtool.passes.ranks")
        if ranks is not None:
            sys.stdout.flush()
            ranks.finish()
