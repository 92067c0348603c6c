"""The optional extra `rbtool[view]`: Pillow (images), matplotlib (plots, Agg backend) and PyAV
(mp4), each imported on first use with a message that names the extra when it is missing."""

from __future__ import annotations

from typing import Any

from rbtool.errors import UsageError

EXTRA = "pip install 'rbtool[view]'"


def _missing(what: str, package: str) -> UsageError:
    return UsageError(f"{what} need {package}, which is not installed ({EXTRA})")


def require_pil() -> Any:
    """PIL's Image module."""
    try:
        from PIL import Image
    except ImportError:
        raise _missing("Images", "Pillow") from None
    return Image


def require_pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: it draws into memory, with no display and no network."""
    try:
        import matplotlib
    except ImportError:
        raise _missing("Plots", "matplotlib") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def require_av() -> Any:
    """PyAV, for mp4 files."""
    try:
        import av
    except ImportError:
        raise _missing("mp4 files", "PyAV") from None
    return av
