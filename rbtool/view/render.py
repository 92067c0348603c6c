"""One trajectory's env column drawn to a file: a PNG contact sheet with plots, a GIF or an mp4.

The PNG shows frames (all steps, or evenly spaced ones past a limit) with each one's step,
reward and done flag under it, and below them the plots of rewards, done flags and every
action dimension over t (`plots.series_plot`); a trajectory with no image field gets the
plots alone. A GIF or mp4 holds one frame per step (T frames), each the camera's image
scaled up by a whole factor (nearest neighbour, so pixels stay pixels) above a caption
strip with the step, reward and done flag. The file is written atomically.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbtool.errors import RbtoolError, UsageError
from rbtool.view.extras import require_av, require_pil, require_pyplot
from rbtool.view.frames import Camera, Checkpoint, Series
from rbtool.view.plots import series_plot

if TYPE_CHECKING:
    import numpy as np

KINDS = {".png": "png", ".gif": "gif", ".mp4": "mp4"}
SHEET_FRAMES = 48  # at most this many frames on a contact sheet, evenly spaced
SHEET_SIDE = 128  # a sheet's frames are scaled up to at least this many pixels on their long side
SHEET_WIDTH = 1100  # a sheet's rows of frames fit in this many pixels
MOVIE_SIDE = 256  # an animation's frames are scaled up to at least this on their long side
FPS = 10
BACKGROUND = (255, 255, 255)
INK = (40, 40, 40)
DONE_INK = (200, 60, 40)
MP4_OPTIONS = {"crf": "18", "preset": "veryfast"}


@dataclass
class Rendered:
    """What a render wrote."""

    out: str
    kind: str  # png, gif or mp4
    trajectory_id: int
    env: int
    camera: str | None  # the image field drawn (None: a PNG of plots alone)
    frames: int  # frames in the file (on the sheet, for a PNG)
    steps: list[int]  # the steps those frames show, in order
    scale: int  # each pixel of the camera drawn as scale x scale pixels
    width: int
    height: int
    plots: bool  # the PNG holds the plots
    bytes: int

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def kind_of(out: Path) -> str:
    """png, gif or mp4, from the output's suffix; UsageError for any other."""
    kind = KINDS.get(out.suffix.lower())
    if kind is None:
        raise UsageError(f"{out}: the output must end in .png, .gif or .mp4")
    return kind


def sheet_steps(t: int, limit: int = SHEET_FRAMES) -> list[int]:
    """Every step when there are at most `limit`, else `limit` evenly spaced ones (first and last kept)."""
    if t <= limit:
        return list(range(t))
    return sorted({round(i * (t - 1) / (limit - 1)) for i in range(limit)})


def scale_for(camera: Camera, side: int) -> int:
    """The whole factor that brings the camera's long side to at least `side` pixels."""
    return max(1, math.ceil(side / max(camera.height, camera.width)))


def _font(size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def caption(series: Series, step: int, of_steps: bool = False) -> tuple[str, bool]:
    """The words under a frame: its step (`of_steps`: and T) and reward; and whether an episode
    ended there."""
    words = f"t={step}" + (f" of {series.steps}" if of_steps else "")
    if series.rewards is not None:
        words += f"  r={series.rewards[step]:.3g}"
    done = series.dones is not None and series.dones[step]
    return words, done


def _rgb(frame: np.ndarray) -> Any:
    """A HWC uint8 frame (C 1 or 3) as a PIL RGB image."""
    image_mod = require_pil()
    pixels = frame[:, :, 0] if frame.shape[2] == 1 else frame
    return image_mod.fromarray(pixels).convert("RGB")


def _scaled(frame: np.ndarray, scale: int) -> Any:
    image = _rgb(frame)
    if scale == 1:
        return image
    image_mod = require_pil()
    return image.resize((image.width * scale, image.height * scale), image_mod.Resampling.NEAREST)


def contact_sheet(frames: np.ndarray, steps: Sequence[int], series: Series, scale: int) -> Any:
    """Frames in rows, each with its caption under it."""
    image_mod = require_pil()
    from PIL import ImageDraw

    tile_w, tile_h = frames.shape[2] * scale, frames.shape[1] * scale
    pad, text_h = 6, 30
    columns = max(1, min(len(steps), SHEET_WIDTH // (tile_w + pad)))
    rows = -(-len(steps) // columns)
    sheet = image_mod.new(
        "RGB", (columns * (tile_w + pad) + pad, rows * (tile_h + text_h + pad) + pad), BACKGROUND
    )
    draw = ImageDraw.Draw(sheet)
    font = _font(11)
    for n, (frame, step) in enumerate(zip(frames, steps, strict=True)):
        x = pad + (n % columns) * (tile_w + pad)
        y = pad + (n // columns) * (tile_h + text_h + pad)
        sheet.paste(_scaled(frame, scale), (x, y))
        words, done = caption(series, step)
        draw.text((x, y + tile_h + 2), words, fill=INK, font=font)
        if done:
            draw.text((x, y + tile_h + 15), "done", fill=DONE_INK, font=font)
    return sheet


def _stacked(parts: Sequence[Any]) -> Any:
    image_mod = require_pil()
    width = max(p.width for p in parts)
    out = image_mod.new("RGB", (width, sum(p.height for p in parts)), BACKGROUND)
    y = 0
    for part in parts:
        out.paste(part, (0, y))
        y += part.height
    return out


def png_bytes(image: Any) -> bytes:
    """A PIL image as PNG bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def movie_frames(frames: np.ndarray, series: Series, scale: int) -> list[Any]:
    """One RGB image per step: the scaled frame above its caption strip (even sizes, for H.264)."""
    image_mod = require_pil()
    from PIL import ImageDraw

    tile_w, tile_h = frames.shape[2] * scale, frames.shape[1] * scale
    strip = 22
    width, height = tile_w + tile_w % 2, tile_h + strip + (tile_h + strip) % 2
    font = _font(12)
    images = []
    for step, frame in enumerate(frames):
        image = image_mod.new("RGB", (width, height), BACKGROUND)
        image.paste(_scaled(frame, scale), (0, 0))
        draw = ImageDraw.Draw(image)
        # the step in every caption also keeps the GIF writer from merging equal frames
        words, done = caption(series, step, of_steps=True)
        draw.text(
            (4, tile_h + 4), words + ("  done" if done else ""), fill=DONE_INK if done else INK, font=font
        )
        if done:
            draw.rectangle((0, tile_h, width - 1, tile_h + 2), fill=DONE_INK)
        images.append(image)
    return images


def gif_bytes(images: Sequence[Any], fps: int) -> bytes:
    buffer = io.BytesIO()
    images[0].save(
        buffer,
        format="GIF",
        save_all=True,
        append_images=list(images[1:]),
        duration=max(20, round(1000 / fps)),
        loop=0,
        disposal=1,
    )
    return buffer.getvalue()


def mp4_bytes(images: Sequence[Any], fps: int) -> bytes:
    """H.264 in an mp4 container, written in memory."""
    av = require_av()
    buffer = io.BytesIO()
    container = av.open(buffer, mode="w", format="mp4")
    try:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = images[0].width, images[0].height
        stream.pix_fmt = "yuv420p"
        stream.options = dict(MP4_OPTIONS)
        for n, image in enumerate(images):
            picture = av.VideoFrame.from_image(image)
            picture.pts = n
            for packet in stream.encode(picture):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    finally:
        container.close()
    return buffer.getvalue()


def render_trajectory(
    opened: Checkpoint,
    tid: int,
    env: int,
    out: Path,
    *,
    camera: str | None = None,
    overwrite: bool = False,
    sheet_frames: int = SHEET_FRAMES,
    fps: int = FPS,
) -> Rendered:
    """Draw env column `env` of trajectory `tid` to `out` (.png, .gif or .mp4; see the module docstring)."""
    from rbtool.files.fsutil import check_file_target, make_parents, write_bytes_atomic

    kind = kind_of(out)
    if sheet_frames < 1 or fps < 1:
        raise UsageError(f"frames and fps must be >= 1, got {sheet_frames} and {fps}")
    require_pil()  # a missing extra said before anything is read
    if kind == "mp4":
        require_av()
    if kind == "png":
        require_pyplot()
    check_file_target(out, overwrite=overwrite)
    opened.entry(tid)
    series = opened.series(tid, env)
    cams = opened.cameras(tid)
    if camera is None and not cams and kind != "png":
        raise UsageError(
            f"{opened.path}: trajectory {tid} has no image field (uint8 [T, B, H, W, C]) to make "
            f"a .{kind} of; a .png draws its plots alone"
        )
    cam = opened.camera(tid, camera) if (camera is not None or cams) else None
    scale, steps = 1, []
    if kind == "png":
        parts = []
        if cam is not None:
            steps = sheet_steps(series.steps, sheet_frames)
            scale = scale_for(cam, SHEET_SIDE)
            parts.append(contact_sheet(opened.frames(tid, env, cam.field, steps), steps, series, scale))
        width = parts[0].width if parts else SHEET_WIDTH
        plot = series_plot(series, width)
        if plot is not None:
            image_mod = require_pil()
            parts.append(image_mod.open(io.BytesIO(plot)).convert("RGB"))
        if not parts:
            raise UsageError(
                f"{opened.path}: trajectory {tid} has no image field, rewards, done flags or actions to draw"
            )
        image = _stacked(parts)
        data, size, shown = png_bytes(image), image.size, len(steps)
        has_plots = plot is not None
    else:
        assert cam is not None
        scale = scale_for(cam, MOVIE_SIDE)
        images = movie_frames(opened.frames(tid, env, cam.field), series, scale)
        steps = list(range(series.steps))
        data = gif_bytes(images, fps) if kind == "gif" else mp4_bytes(images, fps)
        size, shown, has_plots = images[0].size, len(images), False
    make_parents(out)
    try:
        write_bytes_atomic(out, data)
    except OSError as exc:
        raise RbtoolError(f"{out}: cannot write ({exc.strerror})") from None
    return Rendered(
        str(out),
        kind,
        tid,
        env,
        None if cam is None else cam.field,
        shown,
        steps,
        scale,
        int(size[0]),
        int(size[1]),
        has_plots,
        len(data),
    )
