"""The attack suite: seeded hostile inputs, file kinds, faults, locks and live buffers, per class.

Every case is generated from a fixed seed (`random.Random(f"{SEED}:{class}:{n}")`), so a run
is the same on every machine, and runs the real commands that read what it plants. Each
command must:

- exit 0 or 1 (1 with exactly one `Error:` line on stderr), never with an uncaught exception
  or a traceback, and never exit 2 for a problem with a file;
- leave its inputs as they were (a digest of every entry: file bytes, link targets, kinds);
- publish nothing half-written: a failed writer leaves no output and no staging beside it, a
  buffer it added to keeps only whole, checked trajectories;
- stay within a memory bound: the peak resident set size of the command, less the size before
  it, may exceed what the same command uses on a benign copy of the input by at most
  `MEMORY_SLACK` plus `MEMORY_PER_BYTE` times the bytes the input files hold on disk. (The
  attacks this guards against -- expanded tensors, zip bombs, views past their storage -- ask
  for gigabytes from kilobytes; a file's declared sizes are never trusted for the bound.)

Most commands run in this process (Typer's CliRunner, deep passes on one job so that all their
work is here); their peak is the process's VmHWM, reset before each command through
/proc/self/clear_refs. One case per class also runs in a child process (forked by a launcher
that has imported torch once, with the default worker processes) whose own peak RSS comes
back from os.wait4 (test_child_peak_rss_is_bounded).

`CLASSES` below is the table of classes; `pytest -s -k counts tests/test_attack_suite.py`
prints how many cases each holds.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from conftest import make_traj, run, staging_left
from typer.testing import Result

from rbtool import TrajectoryReplayBuffer
from rbtool.errors import RbtoolError
from rbtool.files import ptheader, trajfile
from rbtool.files.index import read_index

SEED = 20260110
ROOT = os.geteuid() == 0
MiB = 1 << 20
MEMORY_SLACK = 64 * MiB
MEMORY_PER_BYTE = 8


def rng_for(kind: str, n: int) -> random.Random:
    return random.Random(f"{SEED}:{kind}:{n}")


# ------------------------------------------------------------------ snapshots of inputs
def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root` (not following links): kind, mode and bytes or link target."""
    out: dict[str, str] = {}
    if not os.path.lexists(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            info = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISREG(info.st_mode):
                out[rel] = f"f{info.st_mode:o}:{hashlib.sha256(path.read_bytes()).hexdigest()}"
            elif stat.S_ISLNK(info.st_mode):
                out[rel] = f"l:{os.readlink(path)}"
            else:
                out[rel] = f"{stat.S_IFMT(info.st_mode):o}:{info.st_mode:o}"
    return out


def disk_bytes(*roots: Path) -> int:
    """Bytes the regular files under `roots` hold on disk (links not followed)."""
    total = 0
    for root in roots:
        for dirpath, _, filenames in os.walk(root, followlinks=False):
            for name in filenames:
                try:
                    info = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:  # a live buffer's temporary file, renamed meanwhile
                    continue
                if stat.S_ISREG(info.st_mode):
                    total += info.st_size
    return total


# ------------------------------------------------------------------ peak memory of a command
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as handle:
        found = re.search(rf"^{key}:\s+(\d+) kB", handle.read(), re.M)
    assert found is not None
    return int(found.group(1))


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
        return True
    except OSError:
        return False


@dataclass
class Run:
    """One command's result and the bytes its peak RSS rose above the RSS before it."""

    argv: list[str]
    result: Result
    peak_rise: int


def measured(*argv: str | Path) -> Run:
    args = [str(a) for a in argv]
    if _reset_peak():
        before = _status_kib("VmRSS")
        result = run(*args)
        rise = (_status_kib("VmHWM") - before) * 1024
    else:  # no clear_refs: the process's high-water mark can only show rises past its old peak
        before = _status_kib("VmHWM")
        result = run(*args)
        rise = (_status_kib("VmHWM") - before) * 1024
    return Run(args, result, rise)


_BENIGN_RISE: dict[str, int] = {}


def benign_rise(key: str, fmt: str, tmp: Path) -> int:
    """The peak rise of command `key` on a benign copy of the base checkpoint (once per command)."""
    name = f"{key}:{fmt}"
    if name not in _BENIGN_RISE:
        where = tmp / f"benign-{key}-{fmt}"
        where.mkdir()
        ckpt = base_copy(where, fmt)
        argv, _ = ALL_COMMANDS[key](ckpt, ckpt / read_index(ckpt).file_name(1), where)
        ran = measured(*argv)
        assert ran.result.exit_code == 0, (argv, ran.result.stderr)
        _BENIGN_RISE[name] = max(ran.peak_rise, 0)
        shutil.rmtree(where, ignore_errors=True)
    return _BENIGN_RISE[name]


def memory_bound(baseline: int, *inputs: Path) -> int:
    return baseline + MEMORY_SLACK + MEMORY_PER_BYTE * disk_bytes(*inputs)


# ------------------------------------------------------------------ what every run must show
def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("Error:")]


def assert_clean(ran: Run, bound: int | None = None) -> None:
    result = ran.result
    exc = result.exception
    where = (ran.argv, result.exit_code, result.stderr[-2000:], repr(exc))
    assert exc is None or isinstance(exc, SystemExit), where  # an uncaught exception is a crash
    assert result.exit_code in (0, 1), where
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, where
    errors = error_lines(result)
    if ran.argv[0] == "diff" and result.exit_code == 1:
        assert len(errors) <= 1, where  # diff exits 1 when the two differ, after its report
    else:
        assert len(errors) == (1 if result.exit_code == 1 else 0), where
    if bound is not None:
        assert ran.peak_rise <= bound, (ran.argv, ran.peak_rise, bound)


def flat(text: str) -> str:
    """Text with all whitespace removed (Rich may wrap a long path)."""
    return "".join(text.split())


def names(result: Result, *words: str) -> bool:
    text = flat(result.stderr + result.stdout)
    return all(flat(w) in text for w in words)


# ------------------------------------------------------------------ base checkpoints
_BASE: dict[str, Path] = {}


@pytest.fixture(scope="module", autouse=True)
def _bases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    root = tmp_path_factory.mktemp("attack-bases")
    for fmt in ("pt", "pkl"):
        ckpt = root / fmt
        with TrajectoryReplayBuffer(sample_window_size=0, trajectory_format=fmt) as buffer:
            buffer.add_trajectories([make_traj(seed=0), make_traj(seed=1)])
            buffer.save_checkpoint(ckpt)
        _BASE[fmt] = ckpt
    yield
    _BASE.clear()


def base_copy(where: Path, fmt: str) -> Path:
    dst = where / "ckpt"
    shutil.copytree(_BASE[fmt], dst, symlinks=True)
    return dst


def forget_contents(ckpt: Path, trajectory_id: int) -> None:
    """Drop the recorded size and hash of one entry, so only the file's contents speak."""
    index_path = ckpt / "trajectory_index.json"
    doc = orjson.loads(index_path.read_bytes())
    for key in ("file_bytes", "sha256", "link"):
        doc["trajectory_index"][str(trajectory_id)].pop(key, None)
    index_path.write_bytes(orjson.dumps(doc))


# ------------------------------------------------------------------ the commands
# Each takes (checkpoint, bad file, scratch directory) and gives (argv, output path or None).
# Deep passes run on one job here, in this process, so that all their work is measured; the
# child-process runs below use the default number of worker processes.
J1 = ("--jobs", "1")
Command = Callable[[Path, Path, Path], tuple[list[Any], Path | None]]


def _other(fmt: str) -> str:
    return "pkl" if fmt == "pt" else "pt"


def _fmt_of(bad: Path) -> str:
    return "pkl" if bad.suffix == ".pkl" else "pt"


# Commands that must read every trajectory's contents: a hostile file makes them exit 1.
CONTENT_READERS: dict[str, Command] = {
    "verify-deep": lambda c, b, w: (["verify", c, "--deep", "--json", *J1], None),
    "stats": lambda c, b, w: (["stats", c, *J1], None),
    "sample": lambda c, b, w: (["sample", c, "--num-chunks", "64", "--window", "0"], None),
    "merge-format": lambda c, b, w: (
        ["merge", c, "--out", w / "out", "--format", _other(_fmt_of(b))],
        w / "out",
    ),
    "convert": lambda c, b, w: (
        ["convert", c, "--out", w / "out", "--format", _other(_fmt_of(b)), *J1],
        w / "out",
    ),
    "ingest": lambda c, b, w: (["ingest", c, "--buffer", w / "out"], w / "out"),
    "ingest-format": lambda c, b, w: (
        ["ingest", c, "--buffer", w / "out", "--format", _other(_fmt_of(b))],
        w / "out",
    ),
    "ingest-loose": lambda c, b, w: (["ingest", b, "--buffer", w / "out"], w / "out"),
    "diff-deep": lambda c, b, w: (["diff", _BASE[_fmt_of(b)], c, "--deep"], None),
}
# Commands that read only the JSON files (and link or copy trajectory files as they are).
INDEX_READERS: dict[str, Command] = {
    "verify": lambda c, b, w: (["verify", c, *J1], None),
    "stats-index": lambda c, b, w: (["stats", c, "--index-only"], None),
    "load": lambda c, b, w: (["checkpoint", "load", c], None),
    "load-buffer": lambda c, b, w: (["checkpoint", "load", c, "--buffer", w / "out"], w / "out"),
    "merge": lambda c, b, w: (["merge", c, "--out", w / "out"], w / "out"),
    "shard": lambda c, b, w: (["shard", c, "-n", "2", "--out", w / "out"], w / "out"),
    "reshard": lambda c, b, w: (["reshard", c, "-n", "2", "--out", w / "out"], w / "out"),
    "filter": lambda c, b, w: (["filter", c, "--out", w / "out", "--min-id", "0"], w / "out"),
}
REPAIR: Command = lambda c, b, w: (["repair", c, "--out", w / "out", *J1], w / "out")  # noqa: E731
ALL_COMMANDS: dict[str, Command] = {**CONTENT_READERS, **INDEX_READERS, "repair": REPAIR}


def assert_output(ran: Run, out: Path | None, parent_before: set[str]) -> None:
    """A failed writer publishes nothing (a buffer keeps only whole, checked trajectories)."""
    if out is None:
        return
    assert staging_left(out.parent) == [], ran.argv
    if ran.result.exit_code == 0:
        assert out.is_dir(), ran.argv
        return
    if ran.argv[0] == "ingest" or (ran.argv[:2] == ["checkpoint", "load"]):
        if out.exists():  # what a buffer published before the failure must be whole
            deep = run("verify", out, "--deep")
            assert deep.exit_code == 0, (ran.argv, deep.stdout, deep.stderr)
        return
    left = {p.name for p in out.parent.iterdir()} - parent_before
    assert left == set(), (ran.argv, left)


# ------------------------------------------------------------------ hostile contents, one file
@dataclass
class Hostile:
    """One planted trajectory file: how to write it, and what the readers must do."""

    name: str
    fmt: str  # "pt" or "pkl": the checkpoint it goes into
    write: Callable[[Path], None]
    refused: bool = True  # False: a random mutation that may still be a valid trajectory
    marker: Path | None = None  # a file the payload would create if it ran
    words: tuple[str, ...] = ()  # what the library's message must say
    extra: dict[str, Any] = field(default_factory=dict)


def run_hostile(tmp_path: Path, case: Hostile, commands: list[str]) -> None:
    work = tmp_path / "w"
    work.mkdir()
    ckpt = base_copy(work, case.fmt)
    bad = ckpt / read_index(ckpt).file_name(1)
    if case.fmt != _fmt_of(bad):
        raise AssertionError(bad)
    case.write(bad)
    forget_contents(ckpt, 1)
    before = snapshot(ckpt)
    if case.marker is not None:
        case.marker.unlink(missing_ok=True)

    # the library refuses with one line naming the file (or, for a mutation, may load it),
    # read at once (verify --deep, rewrites) or memory-mapped (sample, ingest)
    for mmap in (False, True):
        try:
            trajfile.load(bad, mmap=mmap)
        except RbtoolError as exc:
            message = str(exc)
            assert "\n" not in message and str(bad) in message, message
            for word in case.words:
                assert word in message, (word, message)
        except Exception as exc:  # anything else escaping the library is a defect
            raise AssertionError(f"{case.name}: {type(exc).__name__}: {exc}") from exc
        else:
            assert not case.refused, f"{case.name}: loaded (mmap={mmap})"
    if case.fmt == "pt":  # the header-only reader (sampling, ingest) refuses it or leaves it to torch
        try:
            header = ptheader.read_header(bad)
        except ptheader.UnusualLayout:
            pass
        except RbtoolError as exc:
            assert "\n" not in str(exc) and str(bad) in str(exc), str(exc)
        except Exception as exc:
            raise AssertionError(f"{case.name}: ptheader: {type(exc).__name__}: {exc}") from exc
        else:
            assert not case.refused, f"{case.name}: the header reader accepted it"
            with contextlib.suppress(RbtoolError):
                assert_header_reads_what_torch_loads(bad, header, trajfile.load(bad))

    for key in commands:
        scratch = work / f"run-{key}"
        scratch.mkdir()
        argv, out = ALL_COMMANDS[key](ckpt, bad, scratch)
        baseline = benign_rise(key, case.fmt, tmp_path)
        parent_before = {p.name for p in scratch.iterdir()}
        ran = measured(*argv)
        assert_clean(ran, memory_bound(baseline, ckpt))
        assert_output(ran, out, parent_before)
        if case.refused and key in CONTENT_READERS:
            assert ran.result.exit_code == 1, (key, ran.result.stdout, ran.result.stderr)
            assert names(ran.result, bad.name), (key, ran.result.stdout, ran.result.stderr)
            if key == "verify-deep":
                problems = json.loads(ran.result.stdout)["checkpoints"][0]["problems"]
                assert {(p["trajectory_id"], p["file"]) for p in problems} == {(1, bad.name)}, problems
        if key == "repair" and case.refused:
            assert ran.result.exit_code == 0, ran.result.stderr
            assert out is not None and read_index(out).id_list == [0]  # dropped, never copied
        if case.marker is not None:
            assert not case.marker.exists(), f"{case.name}: the payload ran"
    assert snapshot(ckpt) == before, case.name


def pick_commands(rng: random.Random, content: int = 1, other: int = 1) -> list[str]:
    """verify --deep, plus seeded picks among the content readers and the other commands."""
    readers = sorted(k for k in CONTENT_READERS if k != "verify-deep")
    others = sorted([*INDEX_READERS, "repair"])
    return ["verify-deep", *rng.sample(readers, content), *rng.sample(others, other)]


# ------------------------------------------------------------------ building hostile pickles
class Reduce:
    """Pickles as `func(*args)`, then (with `state`) a BUILD that calls __setstate__(state)."""

    def __init__(self, func: Any, args: tuple[Any, ...], state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        if self.state is None:
            return self.func, self.args
        return self.func, self.args, self.state


def storage_blob(values: torch.Tensor) -> bytes:
    """The `_load_from_bytes` blob torch writes for a tensor's storage in a plain pickle."""
    import pickletools

    data = pickle.dumps(values, protocol=4)
    return next(arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, bytes))


def pkl_tensor(
    values: torch.Tensor,
    size: Any,
    stride: Any,
    *,
    offset: Any = 0,
    state: Any = None,
    grad: Any = False,
    hooks: Any = None,
    blob: Any = None,
    extra: tuple[Any, ...] = (),
) -> Reduce:
    """A tensor as a plain pickle spells it: _rebuild_tensor_v2 over a `_load_from_bytes` storage."""
    storage = Reduce(torch.storage._load_from_bytes, (storage_blob(values) if blob is None else blob,))
    args = (storage, offset, size, stride, grad, OrderedDict() if hooks is None else hooks, *extra)
    return Reduce(torch._utils._rebuild_tensor_v2, args, state)


def place(rng: random.Random, payload: Any) -> dict[str, Any]:
    """A benign trajectory with `payload` at a seeded place: a new top field or inside an obs dict."""
    traj = make_traj()
    key = rng.choice(["extra", "zz", "aux", "info"])
    where = rng.choice(["top", "curr_obs", "next_obs", "forward_inputs"])
    if where == "top":
        traj[key] = payload
    else:
        traj[where] = {**traj[where], key: payload}
    return traj


def write_pkl(obj: Any) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_bytes(pickle.dumps(obj, protocol=4))

    return write


def write_pkl_bytes(data: bytes) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_bytes(data)

    return write


def splice_pkl(rng: random.Random, ops: bytes) -> bytes:
    """A benign trajectory pickle with one more item whose value is the raw opcodes `ops`."""
    data = pickle.dumps(make_traj(), protocol=2)
    assert data.endswith(b".")
    key = rng.choice(["extra", "zz"]).encode()
    return data[:-1] + b"X" + len(key).to_bytes(4, "little") + key + ops + b"s."


def _legacy_numel_at(blob: bytes, values: torch.Tensor) -> int:
    """Where a legacy storage blob records its element count (an int64 before the raw bytes)."""
    raw = values.numpy().tobytes()
    at = blob.rindex(raw) - 8
    assert int.from_bytes(blob[at : at + 8], "little") == values.numel()
    return at


_DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool, torch.float16]


def _values(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(_DTYPES)
    return torch.zeros(rng.randint(1, 8), dtype=dtype)


def _forbidden(rng: random.Random, marker: Path) -> Any:
    """A call the unpickler must never make: each would create `marker` (or worse)."""
    import builtins
    import importlib
    import operator

    touch = f"touch {marker}"
    choices: list[Any] = [
        Reduce(os.system, (touch,)),
        Reduce(subprocess.call, (["touch", str(marker)],)),
        Reduce(subprocess.Popen, (["touch", str(marker)],)),
        Reduce(builtins.eval, (f"__import__('pathlib').Path({str(marker)!r}).touch()",)),
        Reduce(builtins.exec, (f"open({str(marker)!r}, 'w').close()",)),
        Reduce(builtins.open, (str(marker), "w")),
        Reduce(torch.save, (0, str(marker))),
        Reduce(pickle.loads, (pickle.dumps(Reduce(os.system, (touch,))),)),
        Reduce(importlib.import_module, ("antigravity",)),
        Reduce(builtins.getattr, (Reduce(importlib.import_module, ("os",)), "system")),
        Reduce(operator.attrgetter, ("system",)),
        Reduce(shutil.copyfile, (__file__, str(marker))),
        Reduce(torch.nn.Parameter, (torch.zeros(2),)),
        Reduce(torch._utils._rebuild_parameter, (torch.zeros(2), False, OrderedDict())),
        Reduce(torch.tensor, ([1, 2],)),
        Reduce(OrderedDict.fromkeys, (["a"],)),
        Reduce(torch.storage._load_from_bytes, (pickle.dumps(Reduce(os.system, (touch,)), protocol=2),)),
    ]
    return rng.choice(choices)


def _raw_ops(rng: random.Random, marker: Path) -> tuple[str, bytes]:
    """Opcodes a trajectory pickle never holds, or values whose declared lengths lie."""
    huge = rng.choice([1 << 31, 1 << 40, (1 << 62) + rng.randint(0, 99)])
    options = [
        ("persid", b"Pfoo\n"),
        ("binpersid", b"X\x03\x00\x00\x00fooQ"),
        ("inst", b"(S'" + f"touch {marker}".encode() + b"'\nios\nsystem\n"),
        ("obj", b"(cos\nsystem\nS'" + f"touch {marker}".encode() + b"'\no"),
        ("newobj", b"cbuiltins\nobject\n)\x81"),
        ("stack_global", b"X\x02\x00\x00\x00osX\x06\x00\x00\x00system\x93X\x02\x00\x00\x00id\x85R"),
        ("ext1", b"\x82\x01"),
        ("ext4", b"\x84\xff\xff\xff\x7f"),
        ("build_on_dict", b"}}b"),
        ("global_torch_load", b"ctorch\nload\n"),
        ("binunicode8_lies", b"\x8d" + huge.to_bytes(8, "little") + b"abc"),
        ("binbytes8_lies", b"\x8e" + huge.to_bytes(8, "little") + b"abc"),
        ("long4_lies", b"\x8b" + min(huge, (1 << 31) - 1).to_bytes(4, "little") + b"\x01"),
        ("get_missing_memo", b"h\xfe"),
    ]
    return rng.choice(options)


PICKLE_KINDS = [
    "setstate",
    "setstate_chain",
    "forbidden_global",
    "rebuild_args",
    "blob",
    "opcodes",
    "truncated",
    "not_a_dict",
    "flipped",
]
PICKLE_CASES = 72


def pickle_case(n: int, marker: Path) -> Hostile:
    """Case `n` of the hostile pickles (a `.pkl` trajectory file), seeded."""
    rng = rng_for("pickles", n)
    kind = PICKLE_KINDS[n % len(PICKLE_KINDS)]
    case = Hostile(f"pickles-{n:02d}-{kind}", "pkl", write_pkl(None), marker=marker)
    if kind == "setstate":
        values = _values(rng)
        size = values.numel() + rng.choice([0, 1, rng.randint(2, 1 << 20)])
        storage = Reduce(torch.storage._load_from_bytes, (storage_blob(values),))
        state = rng.choice([(storage, 0, (size,), (1,)), (storage, rng.randint(0, 9), (size, 1), (1, 1))])
        payload = pkl_tensor(values, (values.numel(),), (1,), state=state)
        case.write, case.words = write_pkl(place(rng, payload)), ("BUILD",)
    elif kind == "setstate_chain":
        # several tensors re-pointed by BUILD, one growing the storage the next one views
        chain: list[Any] = []
        values = _values(rng)
        for _ in range(rng.randint(2, 5)):
            storage = Reduce(torch.storage._load_from_bytes, (storage_blob(values),))
            grow = (storage, 0, (rng.randint(values.numel(), 4096),), (1,))
            chain.append(pkl_tensor(values, (values.numel(),), (1,), state=grow))
        target = rng.choice([Reduce(OrderedDict, (), state={"x": 1}), chain])
        case.write, case.words = write_pkl(place(rng, [*chain, target])), ("BUILD",)
    elif kind == "forbidden_global":
        case.write = write_pkl(place(rng, _forbidden(rng, marker)))
    elif kind == "rebuild_args":
        values = _values(rng)
        k = values.numel()
        mutations: list[dict[str, Any]] = [
            {"size": (k + rng.randint(1, 1 << 30),), "stride": (1,)},
            {"size": (k,), "stride": (1,), "offset": rng.randint(1, 1 << 40)},
            {"size": (4, 2, 1 << rng.randint(4, 30)), "stride": (0, 0, 0)},
            {"size": (4, 2, k), "stride": (1, 1, 1)},
            {"size": (1 << 40, 1 << 40), "stride": (0, 0)},
            {"size": (k,), "stride": (-1,)},
            {"size": (-k,), "stride": (1,)},
            {"size": [k], "stride": [1]},
            {"size": (True,), "stride": (1,)},
            {"size": (float(k),), "stride": (1,)},
            {"size": (k, 1), "stride": (1,)},
            {"size": (1,) * 65, "stride": (1,) * 65},
            {"size": (k,), "stride": (1,), "grad": "yes"},
            {"size": (k,), "stride": (1,), "hooks": {"h": 1}},
            {"size": (k,), "stride": (1,), "extra": ({"meta": 1},)},
            {"size": (k,), "stride": (1,), "extra": (1, 2, 3)},
            {"size": (k,), "stride": (1,), "offset": -1},
        ]
        payload = pkl_tensor(values, **rng.choice(mutations))
        case.write = write_pkl(place(rng, payload))
    elif kind == "blob":
        values = _values(rng)
        if values.dtype == torch.bool:
            values = values.to(torch.uint8)
        blob = storage_blob(values)
        at = _legacy_numel_at(blob, values)
        variants = [
            b"PK\x03\x04" + blob,
            blob[: rng.randint(1, len(blob) - 1)],
            blob[:at] + (values.numel() + rng.randint(1, 1 << 40)).to_bytes(8, "little") + blob[at + 8 :],
            blob[:at] + (values.numel() - 1).to_bytes(8, "little") + blob[at + 8 :],
            pickle.dumps({"not": "a storage"}, protocol=2),
            pickle.dumps(Reduce(os.system, (f"touch {marker}",)), protocol=2),
            "a string, not bytes",
        ]
        chosen = rng.choice(variants)
        numel = values.numel()
        case.write = write_pkl(place(rng, pkl_tensor(values, (numel,), (1,), blob=chosen)))
    elif kind == "opcodes":
        label, ops = _raw_ops(rng, marker)
        case.name += f"-{label}"
        case.write = write_pkl_bytes(splice_pkl(rng, ops))
    elif kind == "truncated":
        data = pickle.dumps(make_traj(seed=n), protocol=rng.choice([2, 4]))
        case.write = write_pkl_bytes(data[: rng.randint(1, len(data) - 1)])
    elif kind == "not_a_dict":
        top = rng.choice([[make_traj()], torch.zeros(4, 2), 7, "trajectory", (make_traj(),), None])
        case.write = write_pkl(top)
    else:  # random byte flips: the result may still load, but must never crash a reader
        flipped = bytearray(pickle.dumps(make_traj(seed=n), protocol=4))
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        case.write, case.refused = write_pkl_bytes(bytes(flipped)), False
    return case


# ------------------------------------------------------------------ class: hostile pickles
@pytest.mark.parametrize("n", range(PICKLE_CASES))
def test_hostile_pickles(tmp_path: Path, n: int) -> None:
    case = pickle_case(n, tmp_path / "payload-ran")
    run_hostile(tmp_path, case, pick_commands(rng_for("pickles-commands", n)))


# ------------------------------------------------------------------ building hostile .pt zips
def pt_records(path: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


def write_zip(
    path: Path,
    records: list[tuple[str, bytes]],
    *,
    deflate: set[str] = frozenset(),  # type: ignore[assignment]
    comment: bytes = b"",
    prefix: bytes = b"",
) -> None:
    """A zip as torch writes it (stored records, data aligned to 64 bytes), or with `deflate`d ones."""
    buffer = io.BytesIO()
    buffer.write(prefix)
    with zipfile.ZipFile(buffer, "w") as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a duplicate name is one of the attacks
        for name, data in records:
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED if name in deflate else zipfile.ZIP_STORED
            start = buffer.tell() + 30 + len(name.encode())
            pad = (-(start + 4)) % 64
            info.extra = (0x4246).to_bytes(2, "little") + pad.to_bytes(2, "little") + b"Z" * pad
            archive.writestr(info, data)
        archive.comment = comment
    path.write_bytes(buffer.getvalue())


def set_record_sizes(
    path: Path, name: str, *, file_size: int | None = None, compress_size: int | None = None
) -> None:
    """Make the central directory lie about one record's sizes (the bytes stay as they are)."""
    data = bytearray(path.read_bytes())
    entry = data.index(
        b"PK\x01\x02" + bytes(data[data.index(b"PK\x01\x02") + 4 : data.index(b"PK\x01\x02") + 4])
    )
    while True:
        length = int.from_bytes(data[entry + 28 : entry + 30], "little")
        if data[entry + 46 : entry + 46 + length].decode() == name:
            break
        entry = data.index(b"PK\x01\x02", entry + 4)
    if compress_size is not None:
        data[entry + 20 : entry + 24] = compress_size.to_bytes(4, "little")
    if file_size is not None:
        data[entry + 24 : entry + 28] = file_size.to_bytes(4, "little")
    path.write_bytes(bytes(data))


class FakeStorage:
    """Stands for a storage in a hand-made data.pkl: its persistent id is whatever we say."""

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _DataPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, FakeStorage) else None


def data_pkl(obj: Any) -> bytes:
    out = io.BytesIO()
    _DataPickler(out, protocol=2).dump(obj)
    return out.getvalue()


def pt_tensor(
    key: str,
    numel: int,
    size: Any,
    stride: Any,
    *,
    offset: Any = 0,
    storage_type: Any = None,
    location: Any = "cpu",
    typename: Any = "storage",
) -> Reduce:
    """A tensor over storage record `key` as data.pkl spells it, with any persistent id."""
    pid = (typename, torch.FloatStorage if storage_type is None else storage_type, key, location, numel)
    return Reduce(
        torch._utils._rebuild_tensor_v2, (FakeStorage(pid), offset, size, stride, False, OrderedDict())
    )


def pt_with(rng: random.Random, payload: Any, records: dict[str, bytes]) -> Callable[[Path], None]:
    """A benign trajectory .pt plus one field `payload` (spelled by data_pkl, so FakeStorage
    stands for any persistent id) whose storage records are `records` (name -> bytes)."""
    key = rng.choice(["extra", "zz", "aux"]).encode()

    def write(path: Path) -> None:
        torch.save(make_traj(), path)
        old = pt_records(path)
        prefix = old[0][0].split("/", 1)[0]
        out = []
        for name, data in old:
            if name == f"{prefix}/data.pkl":
                ops = data_pkl(payload)
                assert data.endswith(b".") and ops.startswith(b"\x80\x02") and ops.endswith(b".")
                data = data[:-1] + b"X" + len(key).to_bytes(4, "little") + key + ops[2:-1] + b"s."
            out.append((name, data))
        out += [(f"{prefix}/data/{k}", v) for k, v in records.items()]
        write_zip(path, out)

    return write


def place_key(rng: random.Random, payload: Any) -> dict[str, Any]:
    return {rng.choice(["extra", "zz", "aux"]): payload}


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def assert_header_reads_what_torch_loads(path: Path, header: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Sampling reads a tensor's bytes where the header says they are: the bytes torch loads."""
    data = path.read_bytes()
    for keys, spec in ptheader.iter_specs(header):
        value: Any = loaded
        for key in keys:
            value = value[key]
        raw = bytearray(data[spec.start : spec.start + spec.nbytes])
        dtype = getattr(torch, spec.dtype)
        storage = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        view = storage.as_strided(spec.shape, spec.stride, spec.offset)
        assert view.dtype == value.dtype and tuple(view.shape) == tuple(value.shape), keys
        assert _as_bytes(view) == _as_bytes(value), (path, keys)


def _central_entries(data: bytes) -> list[tuple[int, str, int]]:
    """(position, name, local header offset) of each central directory entry of a zip."""
    out = []
    pos = data.find(b"PK\x01\x02")
    while pos >= 0:
        length = int.from_bytes(data[pos + 28 : pos + 30], "little")
        offset = int.from_bytes(data[pos + 42 : pos + 46], "little")
        out.append((pos, data[pos + 46 : pos + 46 + length].decode(), offset))
        pos = data.find(b"PK\x01\x02", pos + 4)
    return out


def _directory_edit(rng: random.Random, action: str) -> Callable[[Path], None]:
    """A benign .pt whose zip directory (not its records) is edited: both readers must agree."""

    def write(path: Path) -> None:
        torch.save(make_traj(), path)
        data = bytearray(path.read_bytes())
        entries = _central_entries(bytes(data))
        storages = [e for e in entries if "/data/" in e[1]]
        eocd = bytes(data).rfind(b"PK\x05\x06")
        if action == "offset_of_another":  # a record's local header offset is another record's
            a, b = rng.sample(storages, 2)
            data[a[0] + 42 : a[0] + 46] = b[2].to_bytes(4, "little")
        elif action == "count_lies":
            count = len(entries) + rng.randint(1, 1000)
            data[eocd + 8 : eocd + 12] = (count.to_bytes(2, "little")) * 2
        elif action == "directory_beyond":
            data[eocd + 16 : eocd + 20] = (len(data) + rng.randint(1, 1 << 20)).to_bytes(4, "little")
        elif action == "local_name_differs":
            _, name, offset = rng.choice(storages)
            at = offset + 30 + len(name) - 1
            data[at] = ord("9") if data[at] != ord("9") else ord("8")
        elif action == "offset_beyond":
            a = rng.choice(storages)
            data[a[0] + 42 : a[0] + 46] = (len(data) + rng.randint(0, 1 << 16)).to_bytes(4, "little")
        else:  # a second zip appended: its directory is the one both readers find
            other = io.BytesIO()
            torch.save(make_traj(seed=7), other)
            data += other.getvalue()
        path.write_bytes(bytes(data))

    return write


PT_KINDS = [
    "view",
    "numel_mismatch",
    "record_key",
    "persistent_id",
    "compressed",
    "bomb",
    "size_lies",
    "records",
    "global",
    "build",
    "not_a_zip",
    "flipped",
    "directory",
]
PT_CASES = 65


def _floats(rng: random.Random) -> tuple[int, bytes]:
    k = rng.randint(1, 16)
    return k, torch.arange(k, dtype=torch.float32).numpy().tobytes()


def _rewrite(
    transform: Callable[[list[tuple[str, bytes]], str], tuple[list[tuple[str, bytes]], dict[str, Any]]],
) -> Callable[[Path], None]:
    """A benign trajectory .pt whose zip records `transform` rewrites (given records and prefix)."""

    def write(path: Path) -> None:
        torch.save(make_traj(), path)
        records = pt_records(path)
        new, options = transform(records, records[0][0].split("/", 1)[0])
        write_zip(path, new, **options)

    return write


def pt_case(n: int, marker: Path) -> Hostile:
    """Case `n` of the hostile `.pt` zips and size mismatches, seeded."""
    rng = rng_for("pt", n)
    kind = PT_KINDS[n % len(PT_KINDS)]
    case = Hostile(f"pt-{n:02d}-{kind}", "pt", lambda p: None, marker=marker)
    k, raw = _floats(rng)
    if kind == "view":
        size, stride, offset = rng.choice(
            [
                ((k + rng.randint(1, 1 << 30),), (1,), 0),
                ((k,), (1,), rng.randint(1, 1 << 40)),
                ((4, 2, 1 << rng.randint(4, 30)), (0, 0, 0), 0),
                ((4, 2, k), (1, 1, 1), 0),
                ((1 << 40, 1 << 40), (0, 0), 0),
                ((1 << 62,), (1,), 0),
                ((k,), (-1,), 0),
                ((-k,), (1,), 0),
                ((k,), (1,), -1),
                ((k, 1), (1,), 0),
                ((k,), (1,), 1 << 70),
            ]
        )
        case.write = pt_with(rng, pt_tensor("p0", k, size, stride, offset=offset), {"p0": raw})
    elif kind == "numel_mismatch":
        numel = rng.choice([k + 1, k - 1 if k > 1 else 0, rng.randint(k + 2, 1 << 40), 1 << 62, -1])
        case.write = pt_with(rng, pt_tensor("p0", numel, (k,), (1,)), {"p0": raw})
    elif kind == "record_key":
        key = rng.choice(
            [
                "missing",
                "../data.pkl",
                "../../../../etc/passwd",
                "",
                "/etc/passwd",
                7,
                None,
                "../version",
                "b" * 300,
            ]
        )
        case.write = pt_with(rng, pt_tensor(key, k, (k,), (1,)), {"p0": raw})  # type: ignore[arg-type]
    elif kind == "persistent_id":
        import builtins

        stype, location, typename = rng.choice(
            [
                (torch.FloatStorage, "cuda:0", "storage"),
                (torch.FloatStorage, "meta", "storage"),
                (torch.FloatStorage, "../../x", "storage"),
                (torch.FloatStorage, "cpu", "module"),
                (torch.FloatStorage, "cpu", "obj"),
                (builtins.eval, "cpu", "storage"),
                (os.system, "cpu", "storage"),
                (torch.Tensor, "cpu", "storage"),
                (torch.FloatStorage, 0, "storage"),
            ]
        )
        tensor = pt_tensor("p0", k, (k,), (1,), storage_type=stype, location=location, typename=typename)
        case.write = pt_with(rng, tensor, {"p0": raw})
        case.refused = (
            not isinstance(location, str) or typename != "storage" or stype is not torch.FloatStorage
        )
        case.name += f"-{typename}-{location}"  # any location string is mapped to the CPU
    elif kind == "compressed":
        pick = rng.choice(["data.pkl", "data/", "version", "byteorder"])

        def deflate_one(
            records: list[tuple[str, bytes]], prefix: str
        ) -> tuple[list[tuple[str, bytes]], dict[str, Any]]:
            chosen = {name for name, _ in records if pick in name}
            return records, {"deflate": {sorted(chosen)[0]} if rng.random() < 0.7 else chosen}

        case.write, case.words = _rewrite(deflate_one), ("compressed",)
    elif kind == "bomb":
        megabytes = rng.randint(1, 16)
        zeros = bytes(megabytes * MiB)

        def bomb(
            records: list[tuple[str, bytes]], prefix: str
        ) -> tuple[list[tuple[str, bytes]], dict[str, Any]]:
            return [*records, (f"{prefix}/data/bomb", zeros)], {"deflate": {f"{prefix}/data/bomb"}}

        case.write, case.words = _rewrite(bomb), ("compressed",)
    elif kind == "size_lies":
        inner = _rewrite(lambda records, prefix: (records, {}))
        lie = rng.choice(["bigger", "huge", "smaller", "compress"])

        def lying(path: Path) -> None:
            inner(path)
            name = next(n for n, _ in pt_records(path) if "/data/" in n)
            size = dict(pt_records(path))[name].__len__()
            if lie == "bigger":
                set_record_sizes(path, name, file_size=size + rng.randint(1, 4096), compress_size=size)
            elif lie == "huge":
                set_record_sizes(path, name, file_size=(1 << 32) - 1, compress_size=(1 << 32) - 1)
            elif lie == "smaller":
                set_record_sizes(path, name, file_size=max(size - rng.randint(1, 8), 0), compress_size=size)
            else:
                set_record_sizes(path, name, compress_size=size + rng.randint(1, 64))

        case.write = lying
    elif kind == "records":
        action = rng.choice(
            [
                "drop_pkl",
                "drop_data",
                "drop_version",
                "drop_byteorder",
                "big_endian",
                "version_99",
                "duplicate_pkl",
                "prefix_garbage",
                "truncate",
                "empty",
            ]
        )
        case.name += f"-{action}"

        def edit(
            records: list[tuple[str, bytes]], prefix: str
        ) -> tuple[list[tuple[str, bytes]], dict[str, Any]]:
            options: dict[str, Any] = {}
            if action == "drop_pkl":
                records = [r for r in records if not r[0].endswith("data.pkl")]
            elif action == "drop_data":
                data = [r for r in records if "/data/" in r[0]]
                records = [r for r in records if r is not rng.choice(data)]
            elif action == "drop_version":
                records = [r for r in records if not r[0].endswith("/version")]
            elif action == "drop_byteorder":
                records = [r for r in records if not r[0].endswith("/byteorder")]
            elif action == "big_endian":
                records = [(nm, b"big" if nm.endswith("/byteorder") else d) for nm, d in records]
            elif action == "version_99":
                records = [(nm, b"99\n" if nm.endswith("/version") else d) for nm, d in records]
            elif action == "duplicate_pkl":
                pkl = next(r for r in records if r[0].endswith("data.pkl"))
                records = [*records, (pkl[0], data_pkl(Reduce(os.system, (f"touch {marker}",))))]
            elif action == "prefix_garbage":
                options["prefix"] = os.urandom(rng.randint(1, 4096))
            return records, options

        inner = _rewrite(edit)

        def write_records(path: Path) -> None:
            inner(path)
            if action == "truncate":
                data = path.read_bytes()
                path.write_bytes(data[: rng.randint(1, len(data) - 1)])
            elif action == "empty":
                path.write_bytes(b"")

        case.write = write_records
        case.refused = action not in ("drop_version", "drop_byteorder", "prefix_garbage")
    elif kind == "global":
        case.write = pt_with(rng, _forbidden(rng, marker), {})
    elif kind == "build":
        target = rng.choice(
            [
                Reduce(OrderedDict, (), state={"x": 1}),
                Reduce(
                    torch._utils._rebuild_tensor_v2,
                    (
                        FakeStorage(("storage", torch.FloatStorage, "p0", "cpu", k)),
                        0,
                        (k,),
                        (1,),
                        False,
                        OrderedDict(),
                    ),
                    state=(
                        FakeStorage(("storage", torch.FloatStorage, "p0", "cpu", k)),
                        0,
                        (k * 1000,),
                        (1,),
                    ),
                ),
            ]
        )
        case.write, case.words = pt_with(rng, target, {"p0": raw}), ("BUILD",)
    elif kind == "not_a_zip":
        variant = rng.choice(["legacy", "plain_pickle", "random", "zip_of_nothing", "tar"])
        case.name += f"-{variant}"

        def other(path: Path) -> None:
            if variant == "legacy":
                torch.save(make_traj(), path, _use_new_zipfile_serialization=False)
            elif variant == "plain_pickle":
                path.write_bytes(pickle.dumps({**make_traj(), "x": Reduce(os.system, (f"touch {marker}",))}))
            elif variant == "random":
                path.write_bytes(random.Random(n).randbytes(rng.randint(1, 4096)))
            elif variant == "zip_of_nothing":
                write_zip(path, [("archive/readme.txt", b"nothing here")])
            else:
                import tarfile

                with tarfile.open(path, "w") as archive:
                    archive.add(__file__, arcname="data.pkl")

        case.write, case.refused = other, variant != "legacy"
    elif kind == "directory":
        action = rng.choice(
            [
                "offset_of_another",
                "count_lies",
                "directory_beyond",
                "local_name_differs",
                "offset_beyond",
                "appended_zip",
            ]
        )
        case.name += f"-{action}"
        case.write, case.refused = _directory_edit(rng, action), False
    else:  # byte flips in one record: may still load (a flipped float is a float), never a crash

        def flip(
            records: list[tuple[str, bytes]], prefix: str
        ) -> tuple[list[tuple[str, bytes]], dict[str, Any]]:
            i = rng.randrange(len(records))
            name, original = records[i]
            data = bytearray(original)
            for _ in range(rng.randint(1, 3)):
                if data:
                    data[rng.randrange(len(data))] = rng.randrange(256)
            return [*records[:i], (name, bytes(data)), *records[i + 1 :]], {}

        case.write, case.refused = _rewrite(flip), False
    return case


@pytest.mark.parametrize("n", range(PT_CASES))
def test_hostile_pt_zips(tmp_path: Path, n: int) -> None:
    case = pt_case(n, tmp_path / "payload-ran")
    run_hostile(tmp_path, case, pick_commands(rng_for("pt-commands", n)))


# ------------------------------------------------------------------ class: tensor contents
class SubTensor(torch.Tensor):
    """A tensor subclass (a weights-only load cannot name it; a plain pickle would run it)."""


def _quantized(rng: random.Random) -> torch.Tensor:

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated: that is the point
        values = torch.rand(4, 2, 3)
        if rng.random() < 0.5:
            return torch.quantize_per_tensor(
                values, 0.1, 0, rng.choice([torch.qint8, torch.quint8, torch.qint32])
            )
        return torch.quantize_per_channel(
            values, torch.rand(4) + 0.1, torch.zeros(4, dtype=torch.int64), 0, torch.qint8
        )


def _nested_dicts(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"x": torch.zeros(4, 2, 1)}
    for i in range(depth):
        node = {f"n{i % 3}": node}
    return node


def _nested_lists(depth: int) -> list[Any]:
    node: list[Any] = [torch.zeros(1)]
    for _ in range(depth):
        node = [node]
    return node


def _cycle(rng: random.Random) -> Any:
    length = rng.randint(1, 5)
    nodes: list[dict[str, Any]] = [{"t": torch.zeros(4, 2, 1)} for _ in range(length)]
    for a, b in zip(nodes, nodes[1:] + nodes[:1], strict=True):
        a[rng.choice(["next", "back", "up"])] = b
    if rng.random() < 0.3:
        loop: list[Any] = [nodes[0]]
        loop.append(loop)
        return loop
    return nodes[0]


TENSOR_KINDS = [
    "expanded",
    "overlapping",
    "sparse",
    "meta",
    "quantized",
    "nested",
    "narrow_dtype",
    "huge_dims",
    "deep",
    "cycle",
    "key",
    "big_int",
    "other_value",
    "zero_size",
    "benign_odd",
]
TENSOR_CASES = 75


def tensor_value(rng: random.Random, kind: str, fmt: str) -> tuple[Any, bool, str]:
    """(value to place, whether the readers must refuse it, a label)."""
    value: Any
    if kind == "expanded":
        dims = rng.randint(1, 4)
        base = torch.zeros(*([1] * dims))
        sizes = [rng.choice([1, 2, 4, 1 << rng.randint(8, 22)]) for _ in range(dims)]
        sizes[rng.randrange(dims)] = max(2, sizes[0])  # at least one expanded dim
        return base.expand(*sizes), True, f"expand{tuple(sizes)}"
    if kind == "overlapping":
        n = rng.randint(4, 64)
        size = (rng.randint(2, 8), rng.randint(2, 8))
        stride = (1, rng.randint(0, 1))
        return torch.zeros(n + 64).as_strided(size, stride), True, f"as_strided{size}{stride}"
    if kind == "sparse":
        dense = torch.zeros(4, 4)
        dense[1, 2] = 1
        layout = rng.choice(["coo", "csr", "csc", "bsr"])
        makers: dict[str, Callable[[], torch.Tensor]] = {
            "coo": dense.to_sparse,
            "csr": dense.to_sparse_csr,
            "csc": dense.to_sparse_csc,
            "bsr": lambda: dense.to_sparse_bsr((2, 2)),
        }
        value = makers[layout]()
        return value, True, layout
    if kind == "meta":
        return torch.empty(4, 2, rng.randint(1, 1 << 30), device="meta"), True, "meta"
    if kind == "quantized":
        return _quantized(rng), True, "quantized"
    if kind == "nested":
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), True, "nested"
    if kind == "narrow_dtype":
        names = [
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
            "float8_e8m0fnu",
            "uint16",
            "uint32",
            "uint64",
            "complex32",
            "float4_e2m1fn_x2",
            "bits8",
        ]
        name = rng.choice([n for n in names if hasattr(torch, n)])
        return (
            torch.zeros(4, 2, 2, dtype=torch.uint8).view(getattr(torch, name))
            if name.startswith(("float4", "bits"))
            else torch.zeros(4, 2, 1).to(getattr(torch, name)),
            True,
            name,
        )
    if kind == "huge_dims":
        huge: tuple[int, ...] = rng.choice(
            [(1 << 31, 1 << 31), (1 << 40,), ((1 << 62) - 1,), (1 << 20, 1 << 20, 1 << 20), (4, 2, 1 << 50)]
        )
        return torch.zeros(1).expand(*huge), True, f"dims{huge}"
    if kind == "deep":
        depth = rng.randint(33, 300)
        value = _nested_dicts(depth) if rng.random() < 0.7 else _nested_lists(depth)
        return value, True, f"depth{depth}"
    if kind == "cycle":
        return _cycle(rng), True, "cycle"
    if kind == "key":
        key = rng.choice([1, -7, 2.5, True, None, (1, 2), b"bytes", 1 << 70])
        return {key: torch.zeros(4, 2, 1)}, True, f"key-{type(key).__name__}"
    if kind == "big_int":
        value = rng.choice(
            [1 << 63, 1 << 64, -(1 << 63) - 1, 1 << rng.randint(65, 400), -(1 << rng.randint(64, 300))]
        )
        return (value if rng.random() < 0.6 else [0, value]), True, "big_int"
    if kind == "other_value":
        options: list[Any] = [
            {1, 2},
            frozenset({3}),
            b"raw bytes",
            bytearray(b"x"),
            complex(1, 2),
            slice(1, 2),
            torch.nn.Parameter(torch.zeros(4, 2, 1)),
            torch.zeros(4, 2, 1).as_subclass(SubTensor),
            torch.float32,
            torch.device("cpu"),
            torch.Size([4, 2]),
        ]
        value = rng.choice(options)
        return value, True, type(value).__name__
    if kind == "zero_size":
        shape = rng.choice([(0,), (0, 2, 1), (4, 0, 1), (4, 2, 0)])
        return torch.zeros(shape), False, f"zeros{shape}"
    # values that are odd but fine: readers may take them, and must not crash on them
    value = rng.choice(
        [
            torch.zeros(4, 2, 3).transpose(0, 2),
            torch.zeros(4, 2).t(),
            float("nan"),
            float("inf"),
            -(1 << 63),
            (1 << 63) - 1,
            torch.zeros(4, 2, dtype=torch.complex64),
            torch.zeros(4, 2, requires_grad=True),
            "é" * 100,
            torch.zeros(4, 2)[:, 1],
        ]
    )
    return value, False, "odd"


def tensor_case(n: int, marker: Path) -> Hostile:
    rng = rng_for("tensors", n)
    kind = TENSOR_KINDS[n % len(TENSOR_KINDS)]
    fmt = "pt" if n % 3 else "pkl"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # beta layouts and dtypes warn as they are made
        value, refused, label = tensor_value(rng, kind, fmt)
    traj = place(rng, value)
    if kind in ("big_int", "key") and rng.random() < 0.3:  # in a field the index reads too
        traj = make_traj(max_episode_length=value) if kind == "big_int" else {**make_traj(), **value}

    def write(path: Path) -> None:
        if fmt == "pt":
            torch.save(traj, path)
        else:
            path.write_bytes(pickle.dumps(traj, protocol=4))

    return Hostile(f"tensors-{n:02d}-{kind}-{fmt}-{label}"[:80], fmt, write, refused=refused, marker=marker)


def _tensor_case_writable(case: Hostile, tmp: Path) -> bool:
    """Some values cannot be saved at all by this torch (nothing to attack then)."""
    try:
        case.write(tmp / f"probe.{case.fmt}")
    except Exception:
        return False
    return True


@pytest.mark.parametrize("n", range(TENSOR_CASES))
def test_hostile_tensor_contents(tmp_path: Path, n: int) -> None:
    case = tensor_case(n, tmp_path / "payload-ran")
    if not _tensor_case_writable(case, tmp_path):
        pytest.skip(f"{case.name}: torch cannot save this value")
    run_hostile(tmp_path, case, pick_commands(rng_for("tensor-commands", n)))


# ------------------------------------------------------------------ class: file kinds
@contextlib.contextmanager
def no_hang(root: Path, seconds: float = 60.0) -> Iterator[list[str]]:
    """Fail instead of hanging: past `seconds`, open every FIFO under `root` for writing (and
    close it), which gives a reader blocked on one its end of file; the list names them."""
    hung: list[str] = []
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        for dirpath, _, filenames in os.walk(root):
            for name in filenames:
                path = os.path.join(dirpath, name)
                if stat.S_ISFIFO(os.lstat(path).st_mode):
                    with contextlib.suppress(OSError):
                        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                        hung.append(path)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield hung
    finally:
        done.set()
        watcher.join()


FILE_TARGETS = ["metadata.json", "trajectory_index.json", "trajectory"]
FILE_KINDS = [
    "fifo",
    "dev_zero",
    "dev_null",
    "char_device",
    "socket",
    "directory",
    "empty",
    "link_outside",
    "link_dir_outside",
    "dangling",
    "loop",
    "proc_self",
    "link_inside",
    "hardlink_outside",
]
CKPT_KINDS = ["fifo", "regular_file", "dangling", "dev_null", "char_device", "empty_dir", "link_to_ckpt"]
FILE_CASES = [(t, k) for t in FILE_TARGETS for k in FILE_KINDS] + [("checkpoint", k) for k in CKPT_KINDS]
BENIGN_KINDS = {"link_inside", "hardlink_outside", "link_to_ckpt"}


def make_kind(path: Path, kind: str, outside: Path) -> None:
    """Put an entry of `kind` at `path` (which exists: its contents may be copied outside first)."""
    original = path.read_bytes() if path.is_file() else None
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    outside.mkdir(exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "dev_null":
        path.symlink_to("/dev/null")
    elif kind == "char_device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # what /dev/zero is
    elif kind == "socket":
        import tempfile

        short = Path(tempfile.mkdtemp(prefix="rbs")) / "s"  # a socket's path is at most 107 bytes
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(short))
        short.rename(path)
        short.parent.rmdir()
    elif kind in ("directory", "empty_dir"):
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "regular_file":
        path.write_bytes(b"{}")
    elif kind == "link_outside":
        secret = outside / f"secret{path.suffix}"
        secret.write_bytes(original if original is not None else b"{}")  # a file that would read fine
        path.symlink_to(secret)
    elif kind == "link_dir_outside":
        path.symlink_to(outside)
    elif kind == "dangling":
        path.symlink_to(outside / "nothing-here")
    elif kind == "loop":
        path.symlink_to(path.name)
    elif kind == "proc_self":
        path.symlink_to("/proc/self/environ")
    elif kind == "link_inside":
        kept = path.with_name(f"kept-{path.name}")
        kept.write_bytes(original or b"")
        path.symlink_to(kept.name)
    elif kind == "hardlink_outside":
        twin = outside / f"twin-{path.name}"
        twin.write_bytes(original or b"")
        os.link(twin, path)
    else:
        raise AssertionError(kind)


FILE_COMMANDS = sorted(ALL_COMMANDS)


@pytest.mark.parametrize(("target", "kind"), FILE_CASES)
def test_file_kinds(tmp_path: Path, target: str, kind: str) -> None:
    if kind == "char_device" and not ROOT:
        pytest.skip("making a device node needs root")
    n = FILE_CASES.index((target, kind))
    rng = rng_for("files", n)
    fmt = rng.choice(["pt", "pkl"])
    work = tmp_path / "w"
    work.mkdir()
    ckpt = base_copy(work, fmt)
    bad = ckpt / read_index(ckpt).file_name(1)
    if target == "checkpoint":
        if kind == "link_to_ckpt":  # a checkpoint reached through a link: fine
            (work / "real").mkdir()
            shutil.rmtree(ckpt)
            ckpt.symlink_to(base_copy(work / "real", fmt))
        else:
            make_kind(ckpt, kind, work / "outside")
        bad = ckpt
    else:
        where = bad if target == "trajectory" else ckpt / target
        make_kind(where, kind, work / "outside")
    benign = kind in BENIGN_KINDS
    before = snapshot(work)
    commands = ["verify", *rng.sample([c for c in FILE_COMMANDS if c != "verify"], 3)]
    for key in commands:
        scratch = work / f"run-{key}"
        scratch.mkdir()
        argv, out = ALL_COMMANDS[key](ckpt, bad, scratch)
        if key == "ingest-loose" and target != "trajectory":
            argv, out = ALL_COMMANDS["ingest"](ckpt, bad, scratch)
        baseline = benign_rise(key, fmt, tmp_path)
        with no_hang(work) as hung:
            ran = measured(*argv)
        assert hung == [], (argv, "hung on", hung)
        assert_clean(ran, memory_bound(baseline, work / "outside" if (work / "outside").exists() else ckpt))
        assert_output(ran, out, set())
        status = ran.result.exit_code
        if benign:
            assert status == 0 or (key == "diff-deep" and target == "checkpoint"), (argv, ran.result.stderr)
        elif target == "trajectory":
            # stats reports a listed file that is not a regular file as missing (exit 0)
            refusers = set(CONTENT_READERS) - {"stats"}
            if kind in ("link_outside", "link_dir_outside", "proc_self"):
                refusers |= set(INDEX_READERS) - {"stats-index", "verify"}
            if key in refusers:
                assert status == 1, (argv, ran.result.stdout)
            if key == "repair":
                assert status == 0 and out is not None and read_index(out).id_list == [0], ran.result.stderr
        elif key != "repair":  # a JSON file (or the checkpoint) that is not a file of the checkpoint
            assert status == 1, (argv, ran.result.stdout, ran.result.stderr)
    assert snapshot(work) == {**before, **{k: v for k, v in snapshot(work).items() if k.startswith("run-")}}


# ------------------------------------------------------------------ class: faults
@contextlib.contextmanager
def tmpfs(where: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=False, capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextlib.contextmanager
def without_dac_override() -> Iterator[None]:
    """Permission bits bind root too, in this thread (and the threads it starts), for a while.

    Drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from this thread's effective set (the
    permitted set keeps them, so they come back); a non-root user is bound by them anyway.
    """
    if not ROOT:
        yield
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    saved = (Data * 2)()
    if libc.capget(ctypes.byref(header), saved) != 0:
        pytest.skip("capget failed")
    dropped = (Data * 2)(*[Data(d.effective, d.permitted, d.inheritable) for d in saved])
    dropped[0].effective &= ~((1 << 1) | (1 << 2))  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
    if libc.capset(ctypes.byref(header), dropped) != 0:
        pytest.skip("capset failed")
    try:
        yield
    finally:
        assert libc.capset(ctypes.byref(header), saved) == 0


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four trajectories of about 600 KB each (more than the small file systems below hold)."""
    ckpt = tmp_path_factory.mktemp("big") / "ckpt"
    with TrajectoryReplayBuffer(sample_window_size=0) as buffer:
        buffer.add_trajectories([make_traj(seed=i, t=8, b=4, image=48) for i in range(4)])
        buffer.save_checkpoint(ckpt)
    loose = ckpt.parent / "loose"
    loose.mkdir()
    for i, name in enumerate(sorted(p.name for p in ckpt.glob("trajectory_*_*.pt"))):
        shutil.copy(ckpt / name, loose / f"t{i}.pt")
    return ckpt


# writer -> (source checkpoint, output) -> argv; the output is the last path in argv
FAULT_WRITERS: dict[str, Callable[[Path, Path], list[Any]]] = {
    "shard": lambda s, o: ["shard", s, "-n", "2", "--out", o],
    "merge": lambda s, o: ["merge", s, "--out", o],
    "merge-pkl": lambda s, o: ["merge", s, "--out", o, "--format", "pkl"],
    "convert": lambda s, o: ["convert", s, "--out", o, "--format", "pkl", *J1],
    "reshard": lambda s, o: ["reshard", s, "-n", "3", "--out", o],
    "filter": lambda s, o: ["filter", s, "--out", o, "--min-id", "1"],
    "checkpoint-save": lambda s, o: ["checkpoint", "save", s, o, "--window", "0"],
    "load-buffer": lambda s, o: ["checkpoint", "load", s, "--buffer", o],
    "repair": lambda s, o: ["repair", s, "--out", o, *J1],
    "ingest": lambda s, o: ["ingest", s, "--buffer", o],
    "ingest-pkl": lambda s, o: ["ingest", s, "--buffer", o, "--format", "pkl"],
    "ingest-loose": lambda s, o: ["ingest", *sorted((s.parent / "loose").iterdir()), "--buffer", o],
    "sample-out": lambda s, o: ["sample", s, "--num-chunks", "512", "--window", "0", "--out", o],
}
FAULTS = ["enospc", "erofs", "eacces_out", "eio_fsync", "enametoolong", "enotdir"]
FAULT_CASES = [(f, w) for f in FAULTS for w in FAULT_WRITERS]
READ_FAULT_TARGETS = ["trajectory", "metadata.json", "trajectory_index.json", "checkpoint_dir"]
READ_FAULT_READERS = ["verify-deep", "sample", "merge-format", "load"]
READ_FAULT_CASES = [(t, r) for t in READ_FAULT_TARGETS for r in READ_FAULT_READERS]
FAULT_WORDS = {
    "enospc": "No space left on device",
    "erofs": "Read-only file system",
    "eacces_out": "Permission denied",
    "eio_fsync": "Input/output error",
    "enametoolong": "File name too long",
    "enotdir": "Not a directory",
}
_FAULT_BASELINE: dict[str, int] = {}


def _fault_baseline(writer: str, src: Path, tmp: Path) -> int:
    if writer not in _FAULT_BASELINE:
        out = tmp / f"benign-{writer}"
        out.mkdir()
        ran = measured(*FAULT_WRITERS[writer](src, out / "o"))
        assert ran.result.exit_code == 0, ran.result.stderr
        _FAULT_BASELINE[writer] = max(ran.peak_rise, 0)
        shutil.rmtree(out, ignore_errors=True)
    return _FAULT_BASELINE[writer]


def _published_nothing(parent: Path, out: Path, writer: str) -> None:
    assert staging_left(parent) == [] if parent.is_dir() else True
    if not os.path.lexists(out):
        return
    if writer.startswith(("ingest", "load-buffer")) and out.is_dir():  # a buffer keeps whole batches
        index = read_index(out)
        assert all((out / index.file_name(i)).is_file() for i in index.id_list)
        assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".rbtool.lock"]
        return
    raise AssertionError(f"{writer}: {out} was published after a failure")


@pytest.mark.parametrize(("fault", "writer"), FAULT_CASES)
def test_write_faults(
    tmp_path: Path, big_checkpoint: Path, fault: str, writer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = FAULT_CASES.index((fault, writer))
    rng = rng_for("faults", n)
    src = big_checkpoint
    before = snapshot(src.parent)
    baseline = _fault_baseline(writer, src, tmp_path)
    bound = memory_bound(baseline, src.parent)
    parent = tmp_path / "out"
    with contextlib.ExitStack() as stack:
        if fault in ("enospc", "erofs"):
            if not ROOT:
                pytest.skip("mounting a tmpfs needs root")
            size = f"{rng.randint(8, 1600)}k" if fault == "enospc" else "1m"
            stack.enter_context(tmpfs(parent, size, read_only=fault == "erofs"))
            out = parent / "o"
        elif fault == "eacces_out":
            parent.mkdir()
            deeper = rng.random() < 0.5
            (parent / "ro").mkdir()
            (parent / "ro").chmod(0o555)
            out = parent / "ro" / ("sub/o" if deeper and writer != "sample-out" else "o")
            stack.callback((parent / "ro").chmod, 0o755)
            stack.enter_context(without_dac_override())
        elif fault == "eio_fsync":
            parent.mkdir()
            out = parent / "o"

            def failing_fsync(fd: int) -> None:
                raise OSError(errno.EIO, os.strerror(errno.EIO))

            monkeypatch.setattr(os, "fsync", failing_fsync)
        elif fault == "enametoolong":
            parent.mkdir()
            length = rng.choice([256, 300, 1000, 5000])
            out = parent / ("n" * length) if length < 4096 else parent.joinpath(*["d" * 200] * 25)
        else:
            parent.mkdir()
            (parent / "afile").write_text("not a directory")
            out = parent / "afile" / ("o" if writer == "sample-out" else rng.choice(["o", "deeper/o"]))
        ran = measured(*FAULT_WRITERS[writer](src, out))
        monkeypatch.undo()
        if fault == "eacces_out":
            stack.close()
        assert_clean(ran, bound)
        assert ran.result.exit_code == 1, (fault, writer, ran.result.stdout, ran.result.stderr)
        (line,) = error_lines(ran.result)
        words = [FAULT_WORDS[fault]]
        assert any(w.lower() in line.lower() for w in words), line
        if fault in ("enospc", "eio_fsync", "eacces_out"):
            _published_nothing(out.parent if out.parent.is_dir() else parent, out, writer)
    assert snapshot(src.parent) == before
    if fault == "enotdir":
        assert (parent / "afile").read_text() == "not a directory"


@pytest.mark.parametrize(("target", "reader"), READ_FAULT_CASES)
def test_unreadable_inputs(tmp_path: Path, target: str, reader: str) -> None:
    """An input rbtool may not read: one line naming it, "Permission denied", exit 1."""
    fmt = rng_for("read-faults", READ_FAULT_CASES.index((target, reader))).choice(["pt", "pkl"])
    work = tmp_path / "w"
    work.mkdir()
    ckpt = base_copy(work, fmt)
    bad = ckpt / read_index(ckpt).file_name(1)
    denied = {"trajectory": bad, "checkpoint_dir": ckpt}.get(target, ckpt / target)
    baseline = benign_rise(reader, fmt, tmp_path)
    (work / "run").mkdir()
    argv, out = ALL_COMMANDS[reader](ckpt, bad, work / "run")
    mode = denied.stat().st_mode & 0o777
    before = snapshot(ckpt)
    denied.chmod(0o000 if target != "checkpoint_dir" else 0o300)  # a directory that cannot be listed
    try:
        with without_dac_override():
            ran = measured(*argv)
    finally:
        denied.chmod(mode)
    assert_clean(ran, memory_bound(baseline, ckpt))
    assert_output(ran, out, set())
    if target == "checkpoint_dir" and reader in ("verify-deep", "merge-format", "load", "sample"):
        # listing is not needed to read files by name: what the index names may still be read
        assert ran.result.exit_code in (0, 1)
    elif target == "trajectory" and reader == "load":
        assert ran.result.exit_code == 0  # checkpoint load reads only the JSON files
    else:
        assert ran.result.exit_code == 1, (argv, ran.result.stdout, ran.result.stderr)
        assert names(ran.result, "Permission denied"), (ran.result.stdout, ran.result.stderr)
    assert snapshot(ckpt) == before


# ------------------------------------------------------------------ class: locks vs --force
def _src() -> Path:
    return _BASE["pt"]


LOCK_REPLACERS: dict[str, Callable[[Path], list[Any]]] = {
    "load-buffer": lambda held: ["checkpoint", "load", _src(), "--buffer", held, "--force"],
    "checkpoint-save": lambda held: ["checkpoint", "save", _src(), held, "--force"],
    "merge": lambda held: ["merge", _src(), "--out", held, "--force"],
    "merge-pkl": lambda held: ["merge", _src(), "--out", held, "--force", "--format", "pkl"],
    "repair": lambda held: ["repair", _src(), "--out", held, "--force", *J1],
    "convert": lambda held: ["convert", _src(), "--out", held, "--format", "pkl", "--force", *J1],
    "filter": lambda held: ["filter", _src(), "--out", held, "--force", "--min-id", "0"],
    "shard-over": lambda held: ["shard", _src(), "-n", "2", "--out", held, "--force"],
    "reshard-over": lambda held: ["reshard", _src(), "-n", "2", "--out", held, "--force"],
    "shard-rank": lambda held: ["shard", _src(), "-n", "3", "--out", held.parent, "--force"],
    "reshard-rank": lambda held: ["reshard", _src(), "-n", "3", "--out", held.parent, "--force"],
}
LOCK_HOLDERS = ["live", "live-pkl", "dirlock", "resumed"]
LOCK_CASES = [(r, h) for r in LOCK_REPLACERS for h in LOCK_HOLDERS]


@contextlib.contextmanager
def holding(kind: str, held: Path) -> Iterator[Any]:
    """`held` held by this process as a training job or an ingest would hold it."""
    from rbtool.files.fsutil import DirLock

    if kind in ("live", "live-pkl"):
        buffer = TrajectoryReplayBuffer(
            sample_window_size=0,
            auto_save=True,
            auto_save_path=str(held),
            trajectory_format="pkl" if kind == "live-pkl" else "pt",
        )
        buffer.add_trajectories([make_traj(seed=5), make_traj(seed=6)])
        buffer.flush()
        try:
            yield buffer
        finally:
            buffer.close()
    elif kind == "resumed":
        assert run("checkpoint", "load", _src(), "--buffer", held).exit_code == 0
        buffer = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(held))
        buffer.load_checkpoint(held)
        try:
            yield buffer
        finally:
            buffer.close()
    else:
        assert run("checkpoint", "load", _src(), "--buffer", held).exit_code == 0
        with DirLock(held, wait=False):
            yield None


@pytest.mark.parametrize(("replacer", "holder"), LOCK_CASES)
def test_force_never_replaces_a_held_directory(tmp_path: Path, replacer: str, holder: str) -> None:
    held = tmp_path / "tree" / "rank_1" if replacer.endswith("-rank") else tmp_path / "held"
    if replacer.endswith("-rank"):
        assert run("shard", _src(), "-n", "2", "--out", held.parent).exit_code == 0
        shutil.rmtree(held)  # the holder makes it again
    baseline = benign_rise("verify", "pt", tmp_path)  # the replacers fail before reading much
    with holding(holder, held) as buffer:
        before = snapshot(held.parent)
        ran = measured(*LOCK_REPLACERS[replacer](held))
        assert_clean(ran, memory_bound(baseline, _src(), held.parent))
        assert ran.result.exit_code == 1, (replacer, holder, ran.result.stdout)
        (line,) = error_lines(ran.result)
        assert f"in use by another rbtool process (pid {os.getpid()})" in line, line
        assert names(ran.result, str(held)), line
        assert snapshot(held.parent) == before
        assert staging_left(held.parent) == [] and staging_left(tmp_path) == []
        if buffer is not None:  # the holder goes on writing where it was
            size = read_index(held).size
            buffer.add_trajectories([make_traj(seed=9)])
            buffer.flush()
            assert read_index(held).size == size + 1
    assert run("verify", held, "--deep", *J1).exit_code == 0


# ------------------------------------------------------------------ class: live-buffer readers
LIVE_READERS = [*sorted(k for k in ALL_COMMANDS if k not in ("ingest-loose", "diff-deep")), "diff"]
LIVE_CASES = [(r, f) for r in LIVE_READERS for f in ("pt", "pkl")]


@contextlib.contextmanager
def live_writer(path: Path, fmt: str) -> Iterator[threading.Event]:
    """A buffer that keeps adding (and publishing) trajectories to `path` while the body runs."""
    buffer = TrajectoryReplayBuffer(
        sample_window_size=0, auto_save=True, auto_save_path=str(path), trajectory_format=fmt
    )
    buffer.add_trajectories([make_traj(seed=0), make_traj(seed=1)])
    buffer.flush()
    stop = threading.Event()
    published = threading.Event()
    failures: list[BaseException] = []

    def keep_adding() -> None:
        seed = 2
        try:
            while not stop.is_set():
                buffer.add_trajectories([make_traj(seed=seed)])
                buffer.flush()
                published.set()
                seed += 1
        except BaseException as exc:  # reported below
            failures.append(exc)

    thread = threading.Thread(target=keep_adding, daemon=True)
    thread.start()
    try:
        yield published
    finally:
        stop.set()
        thread.join()
        buffer.close()
    assert failures == []


@pytest.mark.parametrize(("reader", "fmt"), LIVE_CASES)
def test_live_buffer_readers(tmp_path: Path, reader: str, fmt: str) -> None:
    """Every reader of a buffer that is being written reads one consistent index and succeeds."""
    live = tmp_path / "live"
    scratch = tmp_path / "run"
    scratch.mkdir()
    baseline = benign_rise(reader if reader != "diff" else "diff-deep", fmt, tmp_path)
    with live_writer(live, fmt) as published:
        assert published.wait(30)
        if reader == "diff":
            argv: list[Any] = ["diff", live, live]
            out: Path | None = None
        else:
            argv, out = ALL_COMMANDS[reader](live, live / read_index(live).file_name(0), scratch)
        ran = measured(*argv)
        # the writer's own trajectories of a few KB each count towards the input
        assert_clean(ran, memory_bound(baseline, live) + 16 * MiB)
        if reader == "diff":  # its two sides are read one after the other: the buffer may have grown
            assert ran.result.exit_code in (0, 1) and error_lines(ran.result) == [], ran.result.stderr
        else:
            assert ran.result.exit_code == 0, (argv, ran.result.stdout, ran.result.stderr)
    if out is not None:
        assert run("verify", out, "--deep", *J1).exit_code == 0, argv
        assert staging_left(scratch) == []
    final = run("verify", live, "--deep", "--json", *J1)
    assert final.exit_code == 0, final.stdout  # and the reader wrote nothing into the buffer
    assert sorted(p.name for p in live.iterdir() if p.name.startswith(".")) == [".rbtool.lock"]


# ------------------------------------------------------------------ one case per class in a child process
@dataclass(eq=False)
class Child:
    name: str
    argv: list[str]
    out: Path
    err: Path
    status: int | None = None
    peak: int = 0  # bytes: the child's peak RSS (and its waited-for workers'), from os.wait4
    seconds: float = 0.0

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    @property
    def stdout(self) -> str:
        return self.out.read_text()


# A launcher process imports torch and rbtool once, then forks one child per command and
# reaps it with os.wait4, whose rusage gives that child's own peak RSS (and its waited-for
# workers'): the same measure as a fresh `python -m rbtool` less ~1.5 s of imports per run.
_LAUNCHER = r"""
import json, os, sys, time, traceback
import torch
from rbtool.cli import main
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, job["out"]), (2, job["err"])):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = ["rbtool", *job["argv"]]
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    started, status, usage = time.monotonic(), None, None
    while status is None:
        done, raw, usage = os.wait4(pid, os.WNOHANG)
        if done == pid:
            status = os.waitstatus_to_exitcode(raw)
        elif time.monotonic() - started > job["timeout"]:
            os.kill(pid, 9)
            _, raw, usage = os.wait4(pid, 0)
            status = "timeout"
        else:
            time.sleep(0.01)
    print(json.dumps({"status": status, "peak": usage.ru_maxrss * 1024,
                      "seconds": time.monotonic() - started}), flush=True)
"""


class Launcher:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
        )

    def run(self, child: Child, timeout: float = 120.0) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        job = {"argv": child.argv, "out": str(child.out), "err": str(child.err), "timeout": timeout}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        assert answer["status"] != "timeout", f"{child.name}: {child.argv} ran past {timeout} s"
        child.status, child.peak, child.seconds = answer["status"], answer["peak"], answer["seconds"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


CHILD_CLASSES = {
    "pickles": "verify --deep of a .pkl whose BUILD grows a tensor past its storage",
    "pt": "merge --format pkl of a .pt holding a 16 MiB deflated zip-bomb record",
    "tensors": "sample of a .pt holding a stride-0 view of 4 x 2 x 2**20 elements",
    "files": "stats of a checkpoint whose metadata.json is a FIFO (or /dev/zero's device node)",
    "faults": "merge --format pkl onto a 256 KiB tmpfs (root), or into a directory it may not write",
    "locks": "checkpoint load --buffer B --force while a live buffer holds B",
    "live": "sample of a buffer that keeps adding and publishing trajectories",
}


@pytest.fixture(scope="module")
def child_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Child, Child, int]]:
    """class -> (hostile run, benign run of the same command, input bytes on disk)."""
    root = tmp_path_factory.mktemp("children")
    logs = root / "logs"
    logs.mkdir()

    def child(name: str, *argv: Any) -> Child:
        return Child(name, [str(a) for a in argv], logs / f"{name}.out", logs / f"{name}.err")

    def hostile_copy(name: str, case: Hostile) -> tuple[Path, Path]:
        (root / name).mkdir()
        ckpt = base_copy(root / name, case.fmt)
        bad = ckpt / read_index(ckpt).file_name(1)
        case.write(bad)
        forget_contents(ckpt, 1)
        return ckpt, bad

    inputs: dict[str, Path] = {}
    for fmt in ("pt", "pkl"):
        (root / f"benign-{fmt}").mkdir()
    benign_pt, benign_pkl = base_copy(root / "benign-pt", "pt"), base_copy(root / "benign-pkl", "pkl")
    pkl_ckpt, _ = hostile_copy("pickles", pickle_case(0, root / "ran"))
    bomb = next(n for n in range(PT_CASES) if PT_KINDS[n % len(PT_KINDS)] == "bomb")
    pt_ckpt, _ = hostile_copy("pt", pt_case(bomb, root / "ran"))
    expanded = Hostile(
        "expanded", "pt", lambda p: torch.save({**make_traj(), "x": torch.zeros(1).expand(4, 2, 1 << 20)}, p)
    )
    tensor_ckpt, _ = hostile_copy("tensors", expanded)
    (root / "files").mkdir()
    files_ckpt = base_copy(root / "files", "pt")
    make_kind(files_ckpt / "metadata.json", "char_device" if ROOT else "fifo", root / "outside")
    inputs.update(
        pickles=pkl_ckpt,
        pt=pt_ckpt,
        tensors=tensor_ckpt,
        files=files_ckpt,
        faults=benign_pt,
        locks=benign_pt,
        live=root / "live",
    )
    sample = ("--num-chunks", "64", "--window", "0")
    hostile = {
        "pickles": child("pickles", "verify", pkl_ckpt, "--deep"),
        "pt": child("pt", "merge", pt_ckpt, "--out", root / "pt-out", "--format", "pkl"),
        "tensors": child("tensors", "sample", tensor_ckpt, *sample),
        "files": child("files", "stats", files_ckpt),
    }
    benign = {
        "pickles": child("benign-verify", "verify", benign_pkl, "--deep"),
        "pt": child(
            "benign-merge", "merge", benign_pt, "--out", root / "benign-merge-out", "--format", "pkl"
        ),
        "tensors": child("benign-sample", "sample", benign_pt, *sample),
        "files": child("benign-stats", "stats", benign_pt),
        "locks": child(
            "benign-load", "checkpoint", "load", benign_pt, "--buffer", root / "benign-held", "--force"
        ),
    }
    benign["faults"], benign["live"] = benign["pt"], benign["tensors"]
    launcher = Launcher()
    with contextlib.ExitStack() as stack:
        stack.callback(launcher.close)
        if ROOT:
            small = stack.enter_context(tmpfs(root / "small", "256k"))
            hostile["faults"] = child(
                "faults", "merge", big_source(root), "--out", small / "o", "--format", "pkl"
            )
            inputs["faults"] = root / "bigsrc"
        else:
            (root / "ro").mkdir(mode=0o555)
            hostile["faults"] = child(
                "faults", "merge", benign_pt, "--out", root / "ro" / "o", "--format", "pkl"
            )
        for each in [*dict.fromkeys(benign.values()), *hostile.values()]:
            launcher.run(each)
        # the holder and the live writer are this process: both run while the two children do
        stack.enter_context(holding("live", root / "held"))
        published = stack.enter_context(live_writer(root / "live", "pt"))
        assert published.wait(30)
        hostile["locks"] = child(
            "locks", "checkpoint", "load", benign_pt, "--buffer", root / "held", "--force"
        )
        hostile["live"] = child("live", "sample", root / "live", *sample)
        launcher.run(hostile["locks"])
        launcher.run(hostile["live"])
    return {name: (hostile[name], benign[name], disk_bytes(inputs[name])) for name in CHILD_CLASSES}


def big_source(root: Path) -> Path:
    """Four trajectories of about 600 KB each: more than the small tmpfs holds."""
    ckpt = root / "bigsrc"
    with TrajectoryReplayBuffer(sample_window_size=0) as buffer:
        buffer.add_trajectories([make_traj(seed=i, t=8, b=4, image=48) for i in range(4)])
        buffer.save_checkpoint(ckpt)
    return ckpt


@pytest.mark.parametrize("name", sorted(CHILD_CLASSES))
def test_child_peak_rss_is_bounded(child_runs: dict[str, tuple[Child, Child, int]], name: str) -> None:
    """The child's own peak RSS (os.wait4; deep passes' worker processes included) stays within
    the same command's peak on a benign input + MEMORY_SLACK + MEMORY_PER_BYTE x input bytes."""
    hostile, benign, size = child_runs[name]
    assert benign.status == 0, (benign.argv, benign.stderr)
    assert hostile.status in (0, 1), (hostile.argv, hostile.status, hostile.stderr)
    assert "Traceback" not in hostile.stderr + hostile.stdout, hostile.stderr
    errors = [line for line in hostile.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == (1 if hostile.status == 1 else 0), hostile.stderr
    expected = 0 if name == "live" else 1
    assert hostile.status == expected, (CHILD_CLASSES[name], hostile.stdout, hostile.stderr)
    bound = benign.peak + MEMORY_SLACK + MEMORY_PER_BYTE * size
    mib = f"{hostile.peak >> 20} MiB (benign {benign.peak >> 20} MiB, bound {bound >> 20} MiB)"
    print(f"{name}: peak {mib} in {hostile.seconds:.2f} s")
    assert hostile.peak <= bound, (CHILD_CLASSES[name], hostile.peak >> 20, benign.peak >> 20, size)


# ------------------------------------------------------------------ defects the suite found
def test_a_mapped_load_checks_declared_storage_sizes(tmp_path: Path) -> None:
    """A storage declaring more bytes than its zip record: a mapped load read the next records."""
    path = tmp_path / "t.pt"
    k = 15
    raw = torch.arange(k, dtype=torch.float32).numpy().tobytes()
    pt_with(random.Random(0), pt_tensor("p0", k + 1, (k,), (1,)), {"p0": raw})(path)
    for mmap in (False, True):
        with pytest.raises(RbtoolError) as caught:
            trajfile.load(path, mmap=mmap)
        assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(RbtoolError, match="declares 64 bytes but its zip record holds 60"):
        trajfile.load_pt_template(path, mmap=True)
    pt_with(random.Random(0), pt_tensor("p0", k, (k,), (1,)), {"p0": raw})(path)  # sizes agree: fine
    loaded = trajfile.load(path, mmap=True)
    (field,) = {"extra", "zz", "aux"} & set(loaded)
    assert torch.equal(loaded[field], torch.arange(k, dtype=torch.float32))


LINK_PLACERS = ["shard", "merge", "reshard", "filter", "repair", "load-buffer", "ingest"]


@pytest.mark.parametrize("fmt", ["pt", "pkl"])
def test_every_writer_places_a_listed_link_inside_the_checkpoint(tmp_path: Path, fmt: str) -> None:
    """A listed file that is a relative symlink within its checkpoint (allowed) was hard-linked
    as the symlink itself, which dangled in the new directory."""
    work = tmp_path / "w"
    work.mkdir()
    ckpt = base_copy(work, fmt)
    make_kind(ckpt / read_index(ckpt).file_name(1), "link_inside", work / "outside")
    before = snapshot(ckpt)
    for key in [*LINK_PLACERS, "checkpoint-save"]:
        scratch = work / f"run-{key}"
        scratch.mkdir()
        argv: list[Any]
        out: Path | None
        if key == "checkpoint-save":
            argv, out = ["checkpoint", "save", ckpt, scratch / "out", "--window", "0"], scratch / "out"
        else:
            argv, out = ALL_COMMANDS[key](ckpt, ckpt, scratch)
        result = run(*argv)
        assert result.exit_code == 0, (key, result.stderr)
        assert out is not None
        for directory in [out] if key not in ("shard", "reshard") else sorted(out.iterdir()):
            assert not any(p.is_symlink() for p in directory.iterdir()), key
            assert run("verify", directory, "--deep", *J1).exit_code == 0, key
    assert snapshot(ckpt) == before


def test_the_peak_measure_sees_an_allocation() -> None:
    """The in-process measure: the peak after a reset shows memory taken and given back since."""
    if not _reset_peak():
        pytest.skip("no /proc/self/clear_refs")
    before = _status_kib("VmRSS")
    block = bytearray(128 * MiB)  # zero-filled: every page touched
    del block
    assert (_status_kib("VmHWM") - before) * 1024 >= 120 * MiB
    assert _reset_peak() and _status_kib("VmHWM") - _status_kib("VmRSS") < 16 * 1024


# ------------------------------------------------------------------ the classes and their counts
CLASSES: dict[str, tuple[str, list[str]]] = {
    "pickles": (
        "hostile .pkl files: BUILD/setstate chains, forbidden globals, bad rebuild arguments and "
        "storage blobs, raw opcodes and lying lengths, truncations, non-dicts, byte flips",
        ["test_hostile_pickles"],
    ),
    "pt zips": (
        "hostile .pt zips and size mismatches: views past storage, numel vs record, record keys, "
        "persistent ids, compressed records, zip bombs, lying sizes, missing or extra records, "
        "globals, BUILD, legacy and non-zip files, byte flips",
        ["test_hostile_pt_zips", "test_a_mapped_load_checks_declared_storage_sizes"],
    ),
    "tensor contents": (
        "stride-0, overlapping, sparse, meta, quantized, nested, float8 and other dtypes, "
        "huge dims, deep and cyclic containers, non-str keys, ints beyond int64, other "
        "values, zero-size and odd-but-fine values, in .pt and .pkl",
        ["test_hostile_tensor_contents"],
    ),
    "file kinds": (
        "FIFOs, /dev/zero and /dev/null, device nodes, sockets, directories, empty files, "
        "symlinks escaping (files, directories, /proc), dangling and looping links, links "
        "inside, hard links, as JSON files, trajectory files or the checkpoint itself",
        ["test_file_kinds", "test_every_writer_places_a_listed_link_inside_the_checkpoint"],
    ),
    "faults": (
        "ENOSPC on a small tmpfs and EROFS (root), EACCES on outputs and inputs, EIO on fsync, "
        "ENAMETOOLONG, ENOTDIR, for every writer and the readers",
        ["test_write_faults", "test_unreadable_inputs"],
    ),
    "locks vs --force": (
        "every replacing command with --force against live buffers (pt, pkl), a resumed "
        "buffer and a held lock, on the directory itself or one rank of a tree",
        ["test_force_never_replaces_a_held_directory"],
    ),
    "live-buffer readers": (
        "every reader of a buffer that keeps publishing, pt and pkl",
        ["test_live_buffer_readers"],
    ),
    "child peak RSS": (
        "one case per class run in a child process, its peak RSS from os.wait4",
        ["test_child_peak_rss_is_bounded"],
    ),
    "memory measure": ("the in-process peak measure itself", ["test_the_peak_measure_sees_an_allocation"]),
}
EXTRA = ("child peak RSS", "memory measure")  # not attack cases of their own


def case_count(test: Callable[..., Any]) -> int:
    count = 1
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize":
            count *= len(mark.args[1])
    return count


def test_counts() -> None:
    """Print the cases per class (`pytest -s -k counts`); the suite keeps at least 300 of them."""
    module = sys.modules[__name__]
    rows = [
        (name, sum(case_count(getattr(module, t)) for t in tests)) for name, (_, tests) in CLASSES.items()
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, count in rows:
        print(f"{name:<{width}}  {count:4d}  {CLASSES[name][0][:90]}")
    total = sum(count for name, count in rows if name not in EXTRA)
    print(f"{'total':<{width}}  {total:4d}  (+ {dict(rows)['child peak RSS']} in child processes)")
    tests = {t for _, names in CLASSES.values() for t in names}
    assert tests == {n for n in dir(module) if n.startswith("test_") and n != "test_counts"}
    assert total >= 300 and all(count >= 7 for name, count in rows if name not in EXTRA)
