"""The optional extra `rbtool[lerobot]`: pyarrow (Parquet), Pillow (PNG) and PyAV (video),
each imported on first use with a message that names the extra when it is missing.
"""

from __future__ import annotations

from typing import Any

from rbtool.errors import UsageError


def _missing(what: str, package: str) -> UsageError:
    return UsageError(
        f"LeRobot {what} need {package}, which is not installed (pip install 'rbtool[lerobot]')"
    )


def require_arrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise _missing("datasets", "pyarrow") from None
    return pyarrow


def require_av() -> Any:
    try:
        import av
    except ImportError:
        raise _missing("video features", "PyAV") from None
    return av


def require_pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise _missing("image features", "Pillow") from None
    return Image
