"""`rbtool version`."""

from __future__ import annotations

import rbtool
from rbtool.cli._consoles import out
from rbtool.cli._json import print_json
from rbtool.cli._options import JsonOpt, PrettyOpt


def version(json: JsonOpt = False, pretty: PrettyOpt = False) -> None:
    """Print rbtool's version."""
    if json:
        print_json({"version": rbtool.__version__}, pretty)
    else:
        out.print(f"rbtool {rbtool.__version__}")
