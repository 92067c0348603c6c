"""What every writing command shares: --dry-run, and the line that says what a dry run would write.

The rules every writer follows (docs/cli.md, "Writing"): missing parents of the output are
created; a parent that is a file is refused; an existing output is refused without --force;
--force replaces it atomically, and only with something of its own kind. A dry run checks the
inputs and the output path exactly as the real run would, reports what it would write, and
creates, changes and removes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rbtool.cli._common import count, out

DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Check the inputs and the output path, show what would be written, and write nothing.",
    ),
]


def dry_run_note(target: Path | str, what: str) -> None:
    """The human view's last line of a dry run: `dry run: would write OUT (WHAT); nothing written`."""
    out.print(f"dry run: would write {target} ({what}); nothing written", markup=False)


def trajectories(n: int) -> str:
    """`1 trajectory`, `5 trajectories`."""
    return count(n, "trajectory", "trajectories")
