"""`rbtool version`."""

from __future__ import annotations

import rbtool
from rbtool.cli._consoles import out
from rbtool.cli._json import print_json
from rbtool.cli._options import Json


def version(output: Json = Json()) -> None:
    """Print rbtool's version."""
    if output.json:
        print_json({"version": rbtool.__version__}, output.pretty)
    else:
        out.print(f"rbtool {rbtool.__version__}")
