"""`rbtool view`: started as the user starts it, looked at in a real browser, stopped with Ctrl-C.

The browser test drives Debian's headless Chromium over the DevTools protocol (tests/cdp.py),
reaching 127.0.0.1 only, and checks what the page shows: the trajectory list, a frame that
loads, the next frame after a key press, the plots drawn, the stats page.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cdp import CHROMIUM, Browser
from conftest import FIXTURES, assert_one_error, run, sigint_default

from rbtool.cli._examples import EXAMPLES

CKPT = FIXTURES / "autosave_pt/autosave"  # 5 trajectories, T=4, B=2, two 16x16 cameras
REPO = Path(__file__).resolve().parents[1]


@contextmanager
def viewing(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`rbtool view ARGS --no-open --port 0` running, and the URL it printed; killed if left running."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "BROWSER": "false", "COLUMNS": "200"}
    process = subprocess.Popen(
        [sys.executable, "-m", "rbtool", "view", *args, "--no-open", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=sigint_default,
    )
    try:
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready, "rbtool view printed no URL in 60 s"
        url = process.stdout.readline().strip()  # type: ignore[union-attr]
        assert url.startswith("http://") and url.endswith("/"), (url, process.stderr.read())  # type: ignore[union-attr]
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def fetch(url: str, path: str) -> tuple[int, Any]:
    """GET from the viewer with a plain connection to its address (no proxy from the environment)."""
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    connection = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=30)
    try:
        connection.request("GET", path, headers={"Host": f"127.0.0.1:{port}"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def stop(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Ctrl-C, then the rest of stdout and stderr; the exit status is 130 with one line said."""
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130, (out, err)
    return out, err


@pytest.mark.slow  # Ctrl-C sent to a running command
@pytest.mark.parametrize("line", [command for _, command in EXAMPLES["view"]])
def test_every_example_serves_until_ctrl_c(line: str) -> None:
    """The --help examples (tests/test_cli_examples.py leaves them to this test), on a free port."""
    words = shlex.split(line)
    assert words[:3] == ["rbtool", "view", "ckpt"]
    with viewing(str(CKPT), *words[3:]) as (process, url):
        assert url.startswith("http://127.0.0.1:")
        status, found = fetch(url, "/api/checkpoint")
        assert status == 200 and found == {"path": str(CKPT), "trajectories": 5, "samples": 40}
        out, err = stop(process)
    assert out == ""  # the URL was the only line on stdout
    lines = err.splitlines()
    port = url.rstrip("/").rsplit(":", 1)[1]
    assert f"ssh -L {port}:127.0.0.1:{port}" in lines[0]
    assert lines[-1] == f"interrupted: the viewer at {url} stopped; nothing was written"
    assert "Traceback" not in err


@pytest.mark.slow  # Ctrl-C sent to a running command
def test_another_host_is_warned_about() -> None:
    with viewing(str(CKPT), "--host", "0.0.0.0") as (process, url):
        assert url.startswith("http://0.0.0.0:")
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        status, _ = fetch(f"http://127.0.0.1:{port}/", "/api/checkpoint")
        assert status == 200
        _, err = stop(process)
    warnings = [line for line in err.splitlines() if line.startswith("Warning: ")]
    assert warnings == [
        f"Warning: listening at 0.0.0.0: anyone who can reach this machine's port {port} can read "
        "the checkpoint (the viewer has no login); without --host it listens at 127.0.0.1 only"
    ]


def test_a_port_in_use_is_one_error_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("view", CKPT, "--port", str(port), "--no-open")
    assert_one_error(result)
    assert f"127.0.0.1:{port} is in use by another program" in result.stderr


def test_a_missing_checkpoint_and_a_bad_port_are_refused(tmp_path: Path) -> None:
    assert_one_error(run("view", tmp_path / "nope", "--no-open"))
    result = run("view", CKPT, "--port", "65536", "--no-open")
    assert result.exit_code == 2 and result.stdout == ""


def test_help_says_how_to_reach_it_over_ssh() -> None:
    result = run("view", "--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "ssh -L 8000:127.0.0.1:8000 HOST" in text and "127.0.0.1 only" in text


# ------------------------------------------------------------------ in a real browser
IMAGES_LOADED = """(() => {
  const images = [...document.querySelectorAll('#player img')];
  return images.length === 2 && images.every((i) => i.complete && i.naturalWidth > 0);
})()"""

FIRST_IMAGE_PIXELS = """(() => {
  const img = document.querySelector('#player img');
  const canvas = document.createElement('canvas');
  canvas.width = img.naturalWidth;
  canvas.height = img.naturalHeight;
  const ctx = canvas.getContext('2d');
  ctx.drawImage(img, 0, 0);
  return Array.from(ctx.getImageData(0, 0, canvas.width, canvas.height).data);
})()"""

# How many pixel columns of a canvas hold a colour near `rgb`, and how many columns it has.
COLOR_COLUMNS = """((selector, rgb) => {
  const canvas = document.querySelector(selector);
  const { width, height } = canvas;
  const data = canvas.getContext('2d').getImageData(0, 0, width, height).data;
  const columns = new Set();
  for (let i = 0; i < data.length; i += 4) {
    const off = Math.abs(data[i] - rgb[0]) + Math.abs(data[i + 1] - rgb[1]) + Math.abs(data[i + 2] - rgb[2]);
    const near = off < 40;
    if (near && data[i + 3] > 200) columns.add((i / 4) % width);
  }
  return [columns.size, width];
})"""
BLUE, ORANGE, GREEN = (21, 112, 239), (224, 79, 22), (18, 183, 106)


def rgba(frame: np.ndarray) -> list[int]:
    """A uint8 [H, W, 3] frame as the flat RGBA list a canvas gives."""
    alpha = np.full((*frame.shape[:2], 1), 255, dtype=np.uint8)
    return np.concatenate([frame, alpha], axis=2).reshape(-1).tolist()  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"the browser tests drive Debian's {CHROMIUM}: absent"
)
def test_the_viewer_in_a_real_browser(tmp_path: Path) -> None:
    from rbtool.view.frames import open_checkpoint

    with open_checkpoint(CKPT) as checkpoint:
        expected = [checkpoint.frames(1, env, None, [0, 1]) for env in (0, 1)]
        series = checkpoint.series(1, 0)
    assert any(series.dones or []), "the fixture's trajectory 1, env 0, ends an episode"

    with viewing(str(CKPT)) as (process, url):
        browser = Browser(tmp_path / "profile")
        try:
            browser.navigate(url)
            # the list, from the index; return and episodes filled in from the files
            browser.wait_for("document.querySelectorAll('#trajectories tbody tr').length === 5")
            browser.wait_for(
                "[...document.querySelectorAll('#trajectories tbody td:nth-child(6)')]"
                ".every((td) => /^[0-9]+$/.test(td.textContent))"
            )
            rows = browser.evaluate(
                "[...document.querySelectorAll('#trajectories tbody tr')]"
                ".map((tr) => [...tr.children].map((td) => td.textContent))"
            )
            assert rows[1][:4] == [
                "1",
                "4\N{MULTIPLICATION SIGN}2",
                "8",
                "72086d87-727d-50d0-a552-1fd008b5a413",
            ]

            # a trajectory, opened as the user opens it: a click on its row
            browser.evaluate("document.querySelector('tr.row[data-id=\"1\"]').click()")
            browser.wait_for("location.hash === '#/t/1'")
            browser.wait_for(IMAGES_LOADED)
            assert re.search(
                r"&run=[0-9a-f]{16}$", browser.evaluate("document.querySelector('#player img').src")
            )
            assert browser.evaluate(FIRST_IMAGE_PIXELS) == rgba(expected[0][0])

            browser.press("ArrowRight", 39)  # the next step
            browser.wait_for("document.querySelector('#player').dataset.step === '1'")
            browser.wait_for(
                IMAGES_LOADED + " && document.querySelector('#player img').src.includes('step=1')"
            )
            assert browser.evaluate("document.querySelector('#step-text').textContent") == "step 1 of 3"
            assert browser.evaluate(FIRST_IMAGE_PIXELS) == rgba(expected[0][1])

            # the plots: rewards a line across the steps, dones as bars, actions one line per dim
            browser.wait_for(
                "document.querySelector('#plots').closest('main').textContent.includes('env 0:')"
            )
            used, width = browser.evaluate(f"{COLOR_COLUMNS}('canvas[data-plot=\"rewards\"]', {list(BLUE)})")
            assert used > width / 2
            used, _ = browser.evaluate(f"{COLOR_COLUMNS}('canvas[data-plot=\"dones\"]', {list(ORANGE)})")
            assert used > 10
            used, _ = browser.evaluate(f"{COLOR_COLUMNS}('canvas[data-plot=\"actions\"]', {list(GREEN)})")
            assert used > width / 4  # one of seven lines: the others cross it

            browser.press("ArrowDown", 40)  # the next env column, same step
            browser.wait_for("document.querySelector('#player').dataset.env === '1'")
            browser.wait_for(
                IMAGES_LOADED + " && document.querySelector('#player img').src.includes('env=1')"
            )
            assert browser.evaluate(FIRST_IMAGE_PIXELS) == rgba(expected[1][1])

            # with the slider focused an arrow moves it one step, not two (its own and the page's)
            browser.evaluate("document.querySelector('#step').focus()")
            browser.press("ArrowRight", 39)
            browser.wait_for("document.querySelector('#player').dataset.step === '2'")
            time.sleep(0.2)
            assert browser.evaluate("document.querySelector('#player').dataset.step") == "2"

            # the stats page: index, model_weights_ids and the draw spread
            browser.navigate(url + "#/stats")
            browser.wait_for("document.querySelectorAll('#weights tbody tr').length === 5")
            browser.wait_for("document.querySelector('#draws') !== null")
            deadline = time.monotonic() + 10
            while True:
                used, width = browser.evaluate(f"{COLOR_COLUMNS}('#draws', {list(BLUE)})")
                if used > width / 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert used > width / 2
        finally:
            browser.close()
        stop(process)
