"""`rbtool render`: one trajectory's env column drawn to a PNG contact sheet, a GIF or an mp4."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rbtool.cli._consoles import out
from rbtool.cli._json import print_json
from rbtool.cli._options import DirArg, Json, StorageOpt
from rbtool.cli._output import count, printable, size
from rbtool.cli._places import is_url, local_path_arg, refuse_overlap

SUFFIXES = (".png", ".gif", ".mp4")


def render(
    path: DirArg,
    trajectory_id: Annotated[int, typer.Option("--id", min=0, help="The trajectory to draw (its index id).")],
    out_path: Annotated[
        Path,
        typer.Option(
            "--out",
            metavar="FILE",
            help="The file to write: .png (contact sheet and plots), .gif or .mp4 (one frame per step).",
            parser=local_path_arg,
        ),
    ],
    env: Annotated[int, typer.Option("--env", min=0, help="The env column (index along B).")] = 0,
    camera: Annotated[
        str | None,
        typer.Option(
            "--camera",
            metavar="KEY",
            help="The image field to draw, a dotted path such as curr_obs.main_images "
            "(default: the first camera under curr_obs).",
            show_default=False,
        ),
    ] = None,
    frames: Annotated[
        int, typer.Option("--frames", min=1, help=".png: at most this many frames, evenly spaced over t.")
    ] = 48,
    fps: Annotated[int, typer.Option("--fps", min=1, max=120, help=".gif and .mp4: frames per second.")] = 10,
    force: Annotated[bool, typer.Option("--force", help="Replace the --out file if it exists.")] = False,
    output: Json = Json(),
    storage_option: StorageOpt = None,
) -> None:
    """Draw one trajectory's env column: a contact sheet with plots (.png), or its frames over time.

    The .png shows each frame with its step, reward and done flag, and plots of rewards,
    done flags and every action dimension over t (the plots alone when the trajectory has no
    image field). A .gif or .mp4 holds one frame per step. Only the drawn rows are read.
    Needs the view extra: pip install 'rbtool[view]'.
    """
    if out_path.suffix.lower() not in SUFFIXES:
        raise typer.BadParameter(f"{out_path}: must end in .png, .gif or .mp4", param_hint="--out")
    if not is_url(path):
        refuse_overlap(out_path, [local_path_arg(path)], "--out")

    from rbtool.files.fsutil import check_file_target
    from rbtool.remote import parse_storage_options
    from rbtool.view.frames import open_checkpoint
    from rbtool.view.render import render_trajectory

    check_file_target(out_path, overwrite=force)  # before anything is read
    options = parse_storage_options(storage_option) if is_url(path) else None
    with open_checkpoint(path, options) as opened:
        done = render_trajectory(
            opened,
            trajectory_id,
            env,
            out_path,
            camera=camera,
            overwrite=force,
            sheet_frames=frames,
            fps=fps,
        )
    doc = {"path": opened.path, **done.as_json()}
    if output.json:
        print_json(doc, output.pretty)
        return
    what = "contact sheet" if done.kind == "png" else done.kind
    drawn = count(done.frames, "frame") + (f" of {done.camera}" if done.camera else "")
    plots = " and plots" if done.plots else ""
    if done.camera is None:
        drawn, plots = "plots (no image field)", ""
    out.print(
        f"wrote {printable(done.out)} ({size(done.bytes)}): {what}, {drawn}{plots}, "
        f"trajectory {done.trajectory_id} env {done.env}, {done.width}x{done.height}",
        markup=False,
    )
