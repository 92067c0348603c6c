"""`rbtool view`: a local web viewer of a checkpoint's trajectories, frames, per-step series and stats."""

from __future__ import annotations

from typing import Annotated

import typer

from rbtool.cli._consoles import err, note, out
from rbtool.cli._errors import print_warning
from rbtool.cli._options import StorageOpt
from rbtool.cli._window import DEFAULT_WINDOW

DEFAULT_PORT = 8000


def view(
    ckpt: Annotated[
        str,
        typer.Argument(
            metavar="CKPT", help="A checkpoint or buffer directory, a folder of rank_* checkpoints, or a URL."
        ),
    ],
    port: Annotated[
        int,
        typer.Option("--port", "-p", min=0, max=65535, help="Port to listen at (0: a free port, printed)."),
    ] = DEFAULT_PORT,
    host: Annotated[
        str,
        typer.Option(
            "--host",
            metavar="ADDRESS",
            help="Address to listen at. Anything but a loopback address lets other machines read the "
            "checkpoint (the viewer has no login), and is warned about.",
        ),
    ] = "127.0.0.1",
    no_open: Annotated[
        bool, typer.Option("--no-open", help="Do not open a web browser; only print the URL.")
    ] = False,
    storage_option: StorageOpt = None,
) -> None:
    """Look at a checkpoint in a web browser: trajectories, frames, rewards, dones, actions, stats.

    Serves a local web page listing the trajectories (id, TxB, model_weights_id, and the return
    and episodes of the rows shown); for one trajectory, a frame player per camera (step with
    the arrow keys, choose the env column) above plots of its rewards, dones and actions with
    episode ends marked; and the stats page (index, policy versions, draw spread; schema and
    data statistics on request). Frames and series are read from the files when shown, so a
    large checkpoint opens as fast as its index reads. Nothing is written to the checkpoint.

    Prints the URL on stdout and opens it in a browser unless --no-open. It listens at
    127.0.0.1 only: from another machine, forward the port over SSH (ssh -L
    8000:127.0.0.1:8000 HOST, then open http://127.0.0.1:8000/ there). Ctrl-C stops it.
    """
    from rbtool.remote import parse_storage_options
    from rbtool.view.extras import require_pil
    from rbtool.view.server import checkpoint_stats, is_loopback, serve

    require_pil()  # the frames are PNG: refused before the server starts
    from rbtool.view.frames import open_checkpoint

    with open_checkpoint(ckpt, parse_storage_options(storage_option)) as checkpoint:
        server = serve(checkpoint, checkpoint_stats(checkpoint, DEFAULT_WINDOW), host, port)
        with server:
            real_port = server.server_address[1]
            if not is_loopback(host):
                print_warning(
                    f"listening at {host}: anyone who can reach this machine's port {real_port} can read "
                    "the checkpoint (the viewer has no login); without --host it listens at 127.0.0.1 only",
                    None,
                )
            out.print(server.url, markup=False, highlight=False, soft_wrap=True)
            note(
                f"viewing {checkpoint.path}; from another machine: ssh -L {real_port}:127.0.0.1:{real_port} "
                "HOST; Ctrl-C stops"
            )
            if not no_open:
                import webbrowser

                webbrowser.open(server.url, new=2)
            try:
                server.serve_forever(poll_interval=0.2)
            except KeyboardInterrupt:
                err.print(
                    f"interrupted: the viewer at {server.url} stopped; nothing was written",
                    markup=False,
                    highlight=False,
                )
                raise typer.Exit(130) from None
