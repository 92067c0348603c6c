"""The web viewer's server (rbtool.view.server): its routes, refusals, headers and where it listens.

The routes are called in-process through `Viewer.reply`; what only the HTTP layer does (headers,
methods, the parser's refusals, the bound address) through a server on a free port of 127.0.0.1.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FIXTURES, tree_digest

from rbtool.errors import RbtoolError
from rbtool.view.frames import Checkpoint, open_checkpoint
from rbtool.view.server import (
    ASSETS,
    CSP,
    PAGE_ROWS,
    SUMMARY_IDS,
    Reply,
    Viewer,
    ViewerServer,
    checkpoint_stats,
    loopback_host,
    serve,
)

CKPT = FIXTURES / "autosave_pt/autosave"  # 5 trajectories, T=4, B=2, two 16x16 cameras
HOST = "127.0.0.1:8000"


@pytest.fixture(scope="module")
def checkpoint() -> Iterator[Checkpoint]:
    with open_checkpoint(CKPT) as opened:
        yield opened


@pytest.fixture(scope="module")
def viewer(checkpoint: Checkpoint) -> Viewer:
    return Viewer(checkpoint, checkpoint_stats(checkpoint, 100))


def get(viewer: Viewer, target: str, host: str | None = HOST) -> Reply:
    return viewer.reply(target, host)


def doc(reply: Reply, status: int = 200) -> Any:
    assert reply.status == status, reply.body[:300]
    assert reply.content_type == "application/json"
    return json.loads(reply.body)


def refused(reply: Reply, status: int) -> str:
    """The one-line error of a JSON refusal with `status`."""
    found = doc(reply, status)
    assert set(found) == {"error", "status"} and found["status"] == status
    assert "\n" not in found["error"] and "Traceback" not in found["error"]
    return str(found["error"])


# ------------------------------------------------------------------ the list
def test_the_list_is_paged_from_the_index(viewer: Viewer) -> None:
    first = doc(get(viewer, "/api/trajectories?offset=0&limit=2"))
    assert first["total"] == 5 and [r["id"] for r in first["rows"]] == [0, 1]
    assert first["rows"][0] == {
        "id": 0,
        "T": 4,
        "B": 2,
        "num_samples": 8,
        "model_weights_id": "87a64d8e-0f54-5c7c-a19d-0b3753cad97c",
        "checkpoint": str(CKPT),
    }
    assert [r["id"] for r in doc(get(viewer, "/api/trajectories?offset=3"))["rows"]] == [3, 4]
    assert doc(get(viewer, "/api/trajectories?offset=9000000000000000000"))["rows"] == []
    assert "limit" in refused(get(viewer, f"/api/trajectories?limit={PAGE_ROWS + 1}"), 400)


def test_return_and_episodes_are_read_for_the_rows_asked(viewer: Viewer, checkpoint: Checkpoint) -> None:
    rows = doc(get(viewer, "/api/summaries?ids=1,99"))["rows"]
    series = [checkpoint.series(1, env) for env in range(2)]
    assert rows[0]["id"] == 1
    assert rows[0]["return"] == pytest.approx(sum(s.ret for s in series if s.ret is not None) / 2)
    assert rows[0]["episodes"] == sum(len(s.episode_ends) for s in series) > 0
    assert rows[1] == {"id": 99, "error": "not in the index"}
    for bad in ("", "1,-2", "1;2", ",".join(["0"] * (SUMMARY_IDS + 1))):
        refused(get(viewer, f"/api/summaries?ids={bad}"), 400)


# ------------------------------------------------------------------ one trajectory
def test_a_trajectory_names_its_cameras(viewer: Viewer) -> None:
    found = doc(get(viewer, "/api/trajectory?id=2"))
    assert found["entry"]["id"] == 2 and (found["entry"]["T"], found["entry"]["B"]) == (4, 2)
    assert found["run"] == viewer.run and len(viewer.run) == 16
    assert [c["field"] for c in found["cameras"]] == ["curr_obs.main_images", "next_obs.main_images"]
    assert found["cameras"][0] == {
        "field": "curr_obs.main_images",
        "layout": "hwc",
        "height": 16,
        "width": 16,
        "channels": 3,
    }


def test_series_are_one_env_column(viewer: Viewer, checkpoint: Checkpoint) -> None:
    found = doc(get(viewer, "/api/series?id=0&env=1"))
    expected = checkpoint.series(0, 1)
    assert (found["id"], found["env"], found["steps"]) == (0, 1, 4)
    assert found["rewards"] == pytest.approx(expected.rewards)
    assert found["episode_ends"] == expected.episode_ends
    assert len(found["actions"]) == 4 and len(found["actions"][0]) == 7


def test_a_frame_is_the_png_of_its_pixels(viewer: Viewer, checkpoint: Checkpoint) -> None:
    from PIL import Image

    reply = get(viewer, "/api/frame?id=3&env=1&step=2&camera=next_obs.main_images")
    assert reply.status == 200 and reply.content_type == "image/png"
    shown = np.asarray(Image.open(io.BytesIO(reply.body)))
    assert np.array_equal(shown, checkpoint.frames(3, 1, "next_obs.main_images", [2])[0])
    default = get(viewer, f"/api/frame?id=3&env=1&step=2&run={viewer.run}")
    assert np.array_equal(
        np.asarray(Image.open(io.BytesIO(default.body))), checkpoint.frames(3, 1, None, [2])[0]
    )


@pytest.mark.parametrize(
    ("target", "status"),
    [
        ("/api/trajectory?id=5", 404),
        ("/api/trajectory?id=9223372036854775807", 404),
        ("/api/series?id=0&env=2", 404),
        ("/api/frame?id=0&env=0&step=4", 404),
        ("/api/frame?id=0&env=0&step=0&camera=curr_obs.states", 404),
        ("/api/frame?id=0&env=0&step=0&camera=../../etc/passwd", 400),
        ("/api/frame?id=0&env=0&step=-1", 400),
        ("/api/frame?id=0&env=0&step=1e3", 400),
        ("/api/frame?id=0&env=0&step=99999999999999999999", 400),
        ("/api/frame?id=0&env=0&step=1&step=2", 400),
        ("/api/trajectory", 400),
        ("/api/trajectory?id=zero", 400),
        ("/api/nope", 404),
        ("/nope", 404),
    ],
)
def test_unknown_ids_and_bad_numbers_are_json_errors(viewer: Viewer, target: str, status: int) -> None:
    refused(get(viewer, target), status)


def test_an_unknown_id_is_named(viewer: Viewer) -> None:
    assert "no trajectory with id 7" in refused(get(viewer, "/api/frame?id=7&env=0&step=0"), 404)


# ------------------------------------------------------------------ assets
def test_assets_are_served_by_name_only(viewer: Viewer) -> None:
    page = get(viewer, "/")
    assert page.status == 200 and page.content_type.startswith("text/html")
    assert b'src="/assets/viewer.js"' in page.body
    script = get(viewer, "/assets/plot.js")
    assert script.status == 200 and script.content_type.startswith("text/javascript")
    for target in (
        "/assets/../frames.py",
        "/assets/..%2fframes.py",
        "/assets/%2e%2e/server.py",
        "/assets//etc/passwd",
        "/assets/",
        "/../../../../etc/passwd",
        "/assets/assets/viewer.js",
        "/rbtool/view/server.py",
    ):
        refused(get(viewer, target), 404)


def test_the_assets_ship_in_the_package() -> None:
    """pyproject's package data takes every asset the server serves into the wheel."""
    from fnmatch import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    globs = project["tool"]["setuptools"]["package-data"]["rbtool"]
    for name in ASSETS:
        assert any(fnmatch(f"view/assets/{name}", glob) for glob in globs), name


def test_the_page_loads_nothing_from_elsewhere() -> None:
    """No URL with a host in the assets: every script, style and image is this server's."""
    import re
    from importlib import resources

    for path in (resources.files("rbtool.view") / "assets").iterdir():
        text = path.read_text()
        assert not re.search(r"(https?:)?//[\w.-]+\.\w", text.replace("http://www.w3.org", "")), path.name
    assert "default-src 'none'" in CSP and "http" not in CSP


# ------------------------------------------------------------------ hosts
@pytest.mark.parametrize(
    ("host", "answered"),
    [
        ("127.0.0.1:8000", True),
        ("localhost:9000", True),
        ("[::1]:8000", True),
        ("127.0.0.1", True),
        ("evil.example:8000", False),
        ("127.0.0.1.evil.example", False),
        ("10.0.0.5:8000", False),
        (None, False),
    ],
)
def test_only_loopback_hosts_are_answered(viewer: Viewer, host: str | None, answered: bool) -> None:
    assert loopback_host(host) is answered
    reply = get(viewer, "/api/checkpoint", host=host)
    assert reply.status == (200 if answered else 421)


def test_bound_elsewhere_any_host_is_answered(checkpoint: Checkpoint) -> None:
    opened = Viewer(checkpoint, checkpoint_stats(checkpoint, 100), loopback_only=False)
    assert doc(get(opened, "/api/checkpoint", host="viewer.lab:8000"))["trajectories"] == 5


# ------------------------------------------------------------------ stats
def test_the_stats_page_reads_the_index_unless_asked(viewer: Viewer) -> None:
    index = doc(get(viewer, "/api/stats"))
    assert index["index_only"] is True and index["schema"] is None and index["data"] is None
    assert "trajectories" not in index  # the list page has them
    assert index["index"]["size"] == 5 and len(index["model_weights"]) == 5
    assert index["draws"]["n"] == 10_000 and len(index["draws"]["trajectories"]["id"]) == 5
    files = doc(get(viewer, "/api/stats?files=1"))
    assert files["index_only"] is False
    assert "curr_obs.main_images" in {row["field"] for row in files["schema"]}
    assert files["data"]["rewards"]["count"] == 40
    refused(get(viewer, "/api/stats?files=2"), 400)


def test_a_urls_files_are_not_read_for_the_stats_page(checkpoint: Checkpoint) -> None:
    class Remote:
        path = "s3://bucket/ckpt"
        view = checkpoint.view

        def entries(self) -> list[Any]:
            return checkpoint.entries()

    opened = Viewer(Remote(), checkpoint_stats(Remote(), 100))  # type: ignore[arg-type]
    assert doc(get(opened, "/api/stats"))["path"] == "s3://bucket/ckpt"
    assert "rbtool stats" in refused(get(opened, "/api/stats?files=1"), 409)


def test_a_bug_is_a_500_without_its_traceback(
    checkpoint: Checkpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(read_files: bool) -> dict[str, Any]:
        raise KeyError("secret detail")

    opened = Viewer(checkpoint, broken)
    assert refused(get(opened, "/api/stats"), 500) == "internal error (KeyError)"
    assert "secret detail" in capsys.readouterr().err


# ------------------------------------------------------------------ over HTTP
@pytest.fixture
def server(checkpoint: Checkpoint) -> Iterator[ViewerServer]:
    running = serve(checkpoint, checkpoint_stats(checkpoint, 100), "127.0.0.1", 0)
    thread = threading.Thread(target=running.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield running
    running.shutdown()
    running.server_close()
    thread.join(5)


def raw(server: ViewerServer, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are (no client library normalising the path) and read the reply."""
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(request)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def test_every_reply_says_its_type_nosniff_and_the_policy(server: ViewerServer) -> None:
    host = f"127.0.0.1:{server.server_address[1]}".encode()
    for path in (b"/", b"/assets/viewer.css", b"/api/checkpoint", b"/api/frame?id=0&step=0", b"/x"):
        status, headers, body = raw(server, b"GET " + path + b" HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        assert headers["x-content-type-options"] == "nosniff", path
        assert headers["content-security-policy"] == CSP
        assert headers["content-type"] and int(headers["content-length"]) == len(body)
    assert headers["content-type"] == "application/json" and status == 404


def test_path_traversal_over_the_wire_is_refused(server: ViewerServer) -> None:
    host = f"127.0.0.1:{server.server_address[1]}".encode()
    for path in (b"/assets/../../../../etc/passwd", b"/assets/..%2f..%2fframes.py", b"/../pyproject.toml"):
        status, headers, body = raw(server, b"GET " + path + b" HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        assert status == 404 and headers["content-type"] == "application/json", path
        assert json.loads(body)["error"] == "no such file" or json.loads(body)["error"] == "no such page"
        assert b"root:" not in body


def test_only_get_is_answered_and_malformed_requests_are_json(server: ViewerServer) -> None:
    host = f"127.0.0.1:{server.server_address[1]}".encode()
    status, headers, body = raw(
        server, b"POST /api/stats HTTP/1.1\r\nHost: " + host + b"\r\nContent-Length: 0\r\n\r\n"
    )
    assert status == 405 and headers["allow"] == "GET, HEAD" and json.loads(body)["status"] == 405
    status, headers, body = raw(server, b"GARBAGE\r\n\r\n")
    assert (
        status == 400 and headers["content-type"] == "application/json" and json.loads(body)["status"] == 400
    )


def test_it_listens_on_loopback_only(server: ViewerServer) -> None:
    address, port = server.server_address[:2]
    assert address == "127.0.0.1" and server.url == f"http://127.0.0.1:{port}/"
    other = outward_address()
    if other is None:
        pytest.skip("this machine has no address besides loopback")
    with pytest.raises(OSError), socket.create_connection((other, port), timeout=2):
        pass


def outward_address() -> str | None:
    """This machine's address on its default route, if any (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere real
            address = str(probe.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_a_port_in_use_is_one_error(checkpoint: Checkpoint) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RbtoolError, match=f"127.0.0.1:{port} is in use by another program"):
            serve(checkpoint, checkpoint_stats(checkpoint, 100), "127.0.0.1", port)


def test_browsing_writes_nothing(tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(CKPT, copy)
    before = tree_digest(copy)
    with open_checkpoint(copy) as opened:
        viewer = Viewer(opened, checkpoint_stats(opened, 100))
        for target in (
            "/api/trajectories",
            "/api/summaries?ids=0,1,2,3,4",
            "/api/trajectory?id=4",
            "/api/series?id=4&env=1",
            "/api/frame?id=4&env=1&step=3",
            "/api/stats",
            "/api/stats?files=1",
        ):
            assert get(viewer, target).status == 200, target
    assert tree_digest(copy) == before


def test_a_listed_trajectory_without_its_file_is_named_not_served() -> None:
    """RLinf with auto_save off lists ids whose files it never wrote: the others are shown."""
    with open_checkpoint(FIXTURES / "nosave_window2_pt/ckpt") as opened:
        viewer = Viewer(opened, checkpoint_stats(opened, 100))
        assert [r["id"] for r in doc(get(viewer, "/api/trajectories"))["rows"]] == [3, 4]
        rows = doc(get(viewer, "/api/summaries?ids=0,3"))["rows"]
        assert "trajectory 0 is listed, but its file is missing" in rows[0]["error"]
        assert rows[1]["episodes"] > 0
        for target in ("/api/trajectory?id=0", "/api/frame?id=0&env=0&step=0", "/api/series?id=0"):
            assert "its file is missing" in refused(get(viewer, target), 422)


def test_an_empty_checkpoint_is_listed_and_has_stats_without_draws(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metadata.json").write_text(
        json.dumps({"trajectory_format": "pt", "size": 0, "total_samples": 0, "trajectory_counter": 0})
    )
    (empty / "trajectory_index.json").write_text(
        json.dumps({"trajectory_index": {}, "trajectory_id_list": []})
    )
    with open_checkpoint(empty) as opened:
        viewer = Viewer(opened, checkpoint_stats(opened, 100))
        assert doc(get(viewer, "/api/trajectories")) == {"total": 0, "offset": 0, "rows": []}
        for target in ("/api/stats", "/api/stats?files=1"):
            found = doc(get(viewer, target))
            assert found["index"]["size"] == 0 and found["draws"] is None
