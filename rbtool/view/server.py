"""The web viewer's HTTP server: the viewer's own assets, JSON about one opened checkpoint, PNG frames.

A thin file-and-JSON server on the standard library's `ThreadingHTTPServer`. The routes are a
fixed table (`Viewer.reply`): `/` and `/assets/NAME` serve the files of `rbtool/view/assets`
by an allow-list of names read at start (no part of a URL is ever joined to a path), and
`/api/...` answer from the `Checkpoint` (`rbtool.view.frames`), which reads frames and series
on demand and never writes. Query numbers are bounded; every error is JSON with a 4xx status
(a bug is 500 with its type only; its traceback goes to the server's stderr). Every reply
says its Content-Type, `nosniff`, and a Content-Security-Policy that allows this origin only.
Bound to a loopback address, the server also refuses requests whose Host is no loopback
name, so a web page cannot reach it by rebinding a DNS name to 127.0.0.1.
"""

from __future__ import annotations

import functools
import io
import ipaddress
import re
import secrets
import socket
import socketserver
import sys
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import orjson

from rbtool.errors import NeedsTrajectoryFilesError, RbtoolError, UsageError

if TYPE_CHECKING:
    from rbtool.view.frames import Checkpoint

# The viewer's files, by the name a URL gives them, and their types.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "viewer.css": "text/css; charset=utf-8",
    "plot.js": "text/javascript; charset=utf-8",
    "viewer.js": "text/javascript; charset=utf-8",
}
JSON_TYPE = "application/json"
# This origin only: no inline script or style, no other host, no frames, no form posts.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_ROWS = 500  # most trajectories listed per request
SUMMARY_IDS = 100  # most trajectories whose return is asked for in one request
MAX_NUMBER = 2**63 - 1  # ids, steps and offsets are int64 like the index's
NUMBER = re.compile(r"[0-9]{1,19}")
FIELD = re.compile(r"[\w.\-]{1,256}")  # a camera's dotted field path
KEPT = 64  # series and summaries kept for the next request
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


class HttpError(Exception):
    """A request refused: its status and one line saying why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Reply:
    status: int
    content_type: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def json_reply(doc: Any, status: int = 200) -> Reply:
    return Reply(status, JSON_TYPE, orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY))


def error_reply(status: int, message: str) -> Reply:
    return json_reply({"error": message, "status": status}, status)


def number(query: dict[str, list[str]], name: str, default: int | None = None, top: int = MAX_NUMBER) -> int:
    """The query's whole number `name`, at most `top`; HttpError 400 for anything else."""
    values = query.get(name)
    if not values:
        if default is None:
            raise HttpError(400, f"missing query parameter {name!r}")
        return default
    text = values[-1]
    if len(values) > 1 or not NUMBER.fullmatch(text) or int(text) > top:
        raise HttpError(400, f"{name} must be one whole number from 0 to {top}")
    return int(text)


def png(frame: Any) -> bytes:
    """One uint8 [H, W, C] frame (C 1 or 3) as PNG bytes; fast compression, frames are small."""
    from rbtool.view.extras import require_pil

    Image = require_pil()
    pixels = frame[:, :, 0] if frame.shape[2] == 1 else frame
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def asset(name: str) -> bytes:
    return (resources.files("rbtool.view") / "assets" / name).read_bytes()


StatsSource = Callable[[bool], dict[str, Any]]
STATS_DRAWS = 10_000  # uniform draws simulated for the stats page's draw spread
STATS_SEED = 0


def checkpoint_stats(checkpoint: Checkpoint, window: int) -> StatsSource:
    """The stats page's source: `rbtool stats`' document of the checkpoint (`ops.stats`), with the
    draw spread of STATS_DRAWS uniform draws over the last `window` trajectories; only from the
    index unless asked to read the files. A URL's files are not read (its mirror holds stand-ins
    until fetched): NeedsTrajectoryFilesError."""

    def stats(read_files: bool) -> dict[str, Any]:
        from rbtool.errors import NeedsTrajectoryFilesError
        from rbtool.ops.stats import DrawRequest, collect_stats
        from rbtool.remote import is_url

        if read_files and is_url(checkpoint.path):
            raise NeedsTrajectoryFilesError(
                f"{checkpoint.path}: the viewer reads a URL's index only; `rbtool stats` reads its files"
            )
        entries = checkpoint.entries()
        drawn = entries[-window:] if window > 0 else entries
        # no draw spread of a window without samples (an empty buffer): there is nothing to draw
        draws = DrawRequest(STATS_DRAWS, "uniform", None, 1.0, STATS_SEED)
        doc = collect_stats(
            checkpoint.view.path,
            window=window,
            index_only=not read_files,
            draws=draws if any(e.num_samples for e in drawn) else None,
        )
        doc["path"] = checkpoint.path
        return doc

    return stats


class Viewer:
    """The viewer's routes over one opened checkpoint; `reply(path, host)` answers one GET.

    `stats(read_files)` gives the stats document of the checkpoint (`rbtool.ops.stats`), only
    from the index when `read_files` is false; it runs when the stats page asks, once each.
    """

    def __init__(self, checkpoint: Checkpoint, stats: StatsSource, loopback_only: bool = True) -> None:
        self.checkpoint = checkpoint
        self.stats = stats
        self.loopback_only = loopback_only
        self.entries = checkpoint.entries()
        self.samples = sum(e.num_samples for e in self.entries)
        # Frame URLs carry this run's token, so a browser's cached frames of another checkpoint
        # served earlier at the same port are never shown for this one.
        self.run = secrets.token_hex(8)
        self.assets = {name: asset(name) for name in ASSETS}
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._stats: dict[bool, dict[str, Any]] = {}
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------ routing
    def reply(self, target: str, host: str | None) -> Reply:
        """The reply to `GET target` with this Host header; never raises."""
        try:
            if self.loopback_only and not loopback_host(host):
                raise HttpError(421, "this viewer answers only at 127.0.0.1 or localhost")
            parts = urlsplit(target)
            query = parse_qs(parts.query, keep_blank_values=True, max_num_fields=16)
            route = parts.path
            if route in ("/", "/index.html"):
                return self._asset("index.html")
            if route.startswith("/assets/"):
                return self._asset(route.removeprefix("/assets/"))
            handler = API.get(route)
            if handler is None:
                raise HttpError(404, "no such page")
            return handler(self, query)
        except HttpError as exc:
            return error_reply(exc.status, str(exc))
        except NeedsTrajectoryFilesError as exc:
            return error_reply(409, one_line(exc))
        except UsageError as exc:  # an id, env, step or camera the checkpoint does not have
            return error_reply(404, one_line(exc))
        except RbtoolError as exc:  # a trajectory file that cannot be read
            return error_reply(422, one_line(exc))
        except ValueError as exc:  # parse_qs: too many fields
            return error_reply(400, one_line(exc))
        except Exception as exc:  # a bug: its traceback on the server's terminal, not in the page
            traceback.print_exc(file=sys.stderr)
            return error_reply(500, f"internal error ({type(exc).__name__})")

    def _asset(self, name: str) -> Reply:
        body = self.assets.get(name)
        if body is None:  # only the names read at start: nothing else on disk is reachable
            raise HttpError(404, "no such file")
        return Reply(200, ASSETS[name], body, {"Cache-Control": "no-cache"})

    def _remember(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        value = make()
        with self._lock:
            self._kept[key] = value
            while len(self._kept) > KEPT:
                self._kept.popitem(last=False)
        return value

    # ------------------------------------------------------------ the index
    def checkpoint_doc(self, query: dict[str, list[str]]) -> Reply:
        return json_reply(
            {"path": self.checkpoint.path, "trajectories": len(self.entries), "samples": self.samples}
        )

    def trajectories(self, query: dict[str, list[str]]) -> Reply:
        """A page of the trajectory list, from the index only."""
        offset = number(query, "offset", 0)
        limit = number(query, "limit", 50, top=PAGE_ROWS)
        rows = [entry_doc(e) for e in self.entries[offset : offset + limit]]
        return json_reply({"total": len(self.entries), "offset": offset, "rows": rows})

    def summaries(self, query: dict[str, list[str]]) -> Reply:
        """Return and episodes of the listed trajectories, read from their files (`ids=1,2,3`)."""
        given = (query.get("ids") or [""])[-1]
        words = [w for w in given.split(",") if w]
        if not words or len(words) > SUMMARY_IDS or not all(NUMBER.fullmatch(w) for w in words):
            raise HttpError(400, f"ids must be 1 to {SUMMARY_IDS} whole numbers separated by commas")
        rows = []
        for word in words:
            tid = int(word)
            try:
                rows.append(self._remember(("summary", tid), functools.partial(self._summary, tid)))
            except UsageError:
                rows.append({"id": tid, "error": "not in the index"})
            except RbtoolError as exc:  # one unreadable file spoils its own row only
                rows.append({"id": tid, "error": one_line(exc)})
        return json_reply({"rows": rows})

    def _summary(self, tid: int) -> dict[str, Any]:
        summary = self.checkpoint.summary(tid)  # one read of the file's rewards and flags
        returns = summary.returns
        ret = sum(returns) / len(returns) if returns else None
        return {"id": tid, "return": ret, "episodes": summary.episodes}

    # ------------------------------------------------------------ one trajectory
    def _entry(self, query: dict[str, list[str]]) -> Any:
        return self.checkpoint.entry(number(query, "id"))

    def _env(self, query: dict[str, list[str]], entry: Any) -> int:
        env = number(query, "env", 0)
        if env >= entry.b:
            raise HttpError(404, f"trajectory {entry.tid} has {entry.b} env column(s); no env {env}")
        return env

    def _series(self, tid: int, env: int) -> Any:
        return self._remember(("series", tid, env), lambda: self.checkpoint.series(tid, env))

    def trajectory(self, query: dict[str, list[str]]) -> Reply:
        """One trajectory: its index entry and cameras."""
        entry = self._entry(query)
        cameras = [asdict(c) for c in self.checkpoint.cameras(entry.tid)]
        return json_reply({"entry": entry_doc(entry), "cameras": cameras, "run": self.run})

    def series(self, query: dict[str, list[str]]) -> Reply:
        """One env column's rewards, done flags, actions and episode ends, per step."""
        entry = self._entry(query)
        env = self._env(query, entry)
        return json_reply({"id": entry.tid, "env": env, **asdict(self._series(entry.tid, env))})

    def frame(self, query: dict[str, list[str]]) -> Reply:
        """One frame as PNG: `id`, `env`, `step` and `camera` (a field path; default the first);
        `run`, the token of the run that listed the cameras, only keeps browsers' caches apart."""
        entry = self._entry(query)
        env = self._env(query, entry)
        step = number(query, "step", 0)
        if step >= entry.t:
            raise HttpError(404, f"trajectory {entry.tid} has {entry.t} steps; no step {step}")
        cameras = query.get("camera")
        camera = cameras[-1] if cameras else None
        if camera is not None and not FIELD.fullmatch(camera):
            raise HttpError(400, "camera must be a field path such as curr_obs.main_images")
        pixels = self.checkpoint.frames(entry.tid, env, camera, [step])
        return Reply(200, "image/png", png(pixels[0]), {"Cache-Control": "private, max-age=3600"})

    # ------------------------------------------------------------ stats
    def stats_doc(self, query: dict[str, list[str]]) -> Reply:
        """rbtool stats' document (`files=1`: also the trajectory files' schema and data)."""
        read_files = bool(number(query, "files", 0, top=1))
        with self._stats_lock:  # one pass at a time; a second asker waits for the first's result
            doc = self._stats.get(read_files)
            if doc is None:
                doc = self._stats[read_files] = trimmed(self.stats(read_files))
        return json_reply(doc)


API: dict[str, Callable[[Viewer, dict[str, list[str]]], Reply]] = {
    "/api/checkpoint": Viewer.checkpoint_doc,
    "/api/trajectories": Viewer.trajectories,
    "/api/summaries": Viewer.summaries,
    "/api/trajectory": Viewer.trajectory,
    "/api/series": Viewer.series,
    "/api/frame": Viewer.frame,
    "/api/stats": Viewer.stats_doc,
}

STATS_ROWS = 200  # rows of the stats document's per-group tables sent to the page


def trimmed(doc: dict[str, Any]) -> dict[str, Any]:
    """The stats document without its per-trajectory columns (the list page has them) and with
    its per-group tables cut to STATS_ROWS rows (`<key>_left_out` says how many are not sent)."""
    doc = dict(doc)
    doc.pop("trajectories", None)
    groups = doc.get("model_weights") or []
    doc["model_weights"], doc["model_weights_left_out"] = (
        groups[:STATS_ROWS],
        max(0, len(groups) - STATS_ROWS),
    )
    draws = doc.get("draws")
    if draws is not None:
        draws = doc["draws"] = dict(draws)
        columns = draws["trajectories"]
        n = len(columns["id"])
        draws["trajectories"] = {key: values[:STATS_ROWS] for key, values in columns.items()}
        draws["trajectories_left_out"] = max(0, n - STATS_ROWS)
    return doc


def entry_doc(entry: Any) -> dict[str, Any]:
    return {
        "id": entry.tid,
        "T": entry.t,
        "B": entry.b,
        "num_samples": entry.num_samples,
        "model_weights_id": entry.model_weights_id,
        "checkpoint": entry.checkpoint,
    }


def one_line(message: object) -> str:
    return " ".join(str(message).split("\n")[0].split())


def loopback_host(host: str | None) -> bool:
    """Whether a Host header names this machine's loopback (any port: an SSH tunnel may map it)."""
    if not host:
        return False
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") else host
    if name.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether a bind address is a loopback one (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------- HTTP
class Handler(BaseHTTPRequestHandler):
    """GET and HEAD through `Viewer.reply`; every other method 405; no request logged."""

    server: ViewerServer
    server_version = "rbtool-view"
    default_request_version = "HTTP/1.0"  # a request line without a version still gets headers
    protocol_version = "HTTP/1.1"

    def version_string(self) -> str:
        return self.server_version  # no Python version in the Server header

    def _send(self, reply: Reply, body: bool = True) -> None:
        self.send_response(reply.status)
        headers = {
            "Content-Type": reply.content_type,
            "Content-Length": str(len(reply.body)),
            "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": CSP,
            "Referrer-Policy": "no-referrer",
            "Cross-Origin-Resource-Policy": "same-origin",
            "Cache-Control": "no-store",
            **reply.headers,
        }
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(reply.body)

    def do_GET(self) -> None:
        self._send(self.server.viewer.reply(self.path, self.headers.get("Host")))

    def do_HEAD(self) -> None:
        self._send(self.server.viewer.reply(self.path, self.headers.get("Host")), body=False)

    def _not_allowed(self) -> None:
        reply = error_reply(405, "the viewer is read-only: GET only")
        reply.headers["Allow"] = "GET, HEAD"
        self.close_connection = True
        self._send(reply)

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The parser's own refusals (a malformed request line, a header too long) as JSON too."""
        self.close_connection = True
        self._send(error_reply(code, message or "bad request"))

    def log_message(self, format: str, *args: Any) -> None:
        return  # the terminal shows the URL and errors, not every request


class ViewerServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer bound to (host, port) that answers through one `Viewer`."""

    daemon_threads = True  # a browser's open connection does not hold up the end
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], viewer: Viewer) -> None:
        self.viewer = viewer
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)

    def server_bind(self) -> None:
        """Bind without HTTPServer's reverse lookup of the address (getfqdn may ask a DNS server)."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), self.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"


def serve(checkpoint: Checkpoint, stats: StatsSource, host: str, port: int) -> ViewerServer:
    """A server for `checkpoint` bound to host:port (0: a free port), ready for `serve_forever`.

    A port in use, or an address this machine does not have, is an RbtoolError.
    """
    import errno

    viewer = Viewer(checkpoint, stats, loopback_only=is_loopback(host))
    try:
        return ViewerServer((host, port), viewer)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise RbtoolError(
                f"{host}:{port} is in use by another program; choose another port (0 picks a free one)"
            ) from None
        if exc.errno == errno.EACCES:
            raise RbtoolError(
                f"{host}:{port}: not allowed to listen there (ports below 1024 need root)"
            ) from None
        raise RbtoolError(f"cannot listen at {host}:{port}: {exc.strerror or exc}") from None
