"""`rbtool version`."""

from __future__ import annotations

import rbtool
from rbtool.cli._common import JsonOpt, out, print_json


def version(json: JsonOpt = False) -> None:
    """Print rbtool's version."""
    if json:
        print_json({"version": rbtool.__version__})
    else:
        out.print(f"rbtool {rbtool.__version__}")
