"""The optional extra `rbtool[lerobot]`: pyarrow (Parquet), Pillow (PNG) and PyAV (video),
each imported on first use with a message that names the extra when it is missing.
"""

from __future__ import annotations

from typing import Any

from rbtool.errors import UsageError


def require_arrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UsageError(
            "LeRobot datasets need pyarrow, which is not installed (pip install 'rbtool[lerobot]')"
        ) from None
    return pyarrow


def require_av() -> Any:
    try:
        import av
    except ImportError:
        raise UsageError(
            "LeRobot video features need PyAV, which is not installed (pip install 'rbtool[lerobot]')"
        ) from None
    return av


def require_pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise UsageError(
            "LeRobot image features need Pillow, which is not installed (pip install 'rbtool[lerobot]')"
        ) from None
    return Image
