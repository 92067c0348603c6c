"""Hostile and damaged input: every command fails cleanly, never runs code, never changes its input.

Part one feeds crafted pickles (reaching for os.system, subprocess, builtins.eval, or hiding
code in a tensor storage blob) to `ingest` and `verify --deep` and proves nothing ran. Part two
mutates copies of the reference fixtures at random (seeded): truncated and bit-flipped
trajectory files, JSON values of the wrong type, deleted and renamed files. Each command must
exit 0 or 1, never with a traceback, with exactly one `Error: ` line on stderr when it fails
(nothing on stderr when it succeeds), and whatever `repair` writes must verify.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import random
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from conftest import FIXTURES, RLINF_DIRS, make_traj, tree_digest
from typer.testing import CliRunner, Result

from rbtool.cli import app
from rbtool.files import trajfile
from rbtool.ops.verify import verify

runner = CliRunner()
SEED = 4242
CASES_PER_FIXTURE = 43  # 7 fixtures -> 301 mutated checkpoints (at least 300)


# ------------------------------------------------------------------ crafted pickles
class Reduce:
    """Pickles as `func(*args)`: what an attacker's pickle calls while it is being loaded."""

    def __init__(self, func: Callable[..., Any], *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def payloads(marker: Path) -> dict[str, Any]:
    """Objects whose unpickling would create `marker`, one per way of reaching for code."""
    command = f"touch {marker}"
    storage_blob = pickle.dumps(Reduce(os.system, command), protocol=2)
    return {
        "os.system": Reduce(os.system, command),
        "subprocess": Reduce(subprocess.call, ["touch", str(marker)]),
        "builtins.eval": Reduce(builtins.eval, f"__import__('os').system({command!r})"),
        "storage blob": Reduce(torch.storage._load_from_bytes, storage_blob),
    }


PAYLOADS = ["os.system", "subprocess", "builtins.eval", "storage blob"]


def hostile_trajectory(marker: Path, kind: str) -> dict[str, Any]:
    """A trajectory that looks right (real tensors first) with the payload in one field."""
    traj = make_traj(t=2, b=1, image=2)
    traj["zz_payload"] = payloads(marker)[kind]
    return traj


def write_hostile(path: Path, marker: Path, kind: str) -> None:
    """A .pkl pickled as RLinf writes them (plain pickle), or a .pt written by torch.save."""
    traj = hostile_trajectory(marker, kind)
    if path.suffix == ".pkl":
        path.write_bytes(pickle.dumps(traj, protocol=4))
    else:
        torch.save(traj, path)


def assert_one_error(result: Result) -> str:
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("suffix", [".pkl", ".pt"])
@pytest.mark.parametrize("kind", PAYLOADS)
def test_ingest_refuses_hostile_pickles(tmp_path: Path, kind: str, suffix: str) -> None:
    marker = tmp_path / "MARKER"
    good = tmp_path / f"good{suffix}"
    good.write_bytes(trajfile.to_bytes(make_traj(t=2, b=1, image=2), suffix[1:]))
    evil = tmp_path / f"evil{suffix}"
    write_hostile(evil, marker, kind)
    buffer = tmp_path / "buffer"
    result = runner.invoke(app, ["ingest", str(good), str(evil), "--buffer", str(buffer)])
    line = assert_one_error(result)
    assert result.stdout == ""
    assert str(evil) in line and "refused" in line
    assert not marker.exists()
    assert not buffer.exists()  # every source is checked before anything is written


@pytest.mark.parametrize("kind", PAYLOADS)
@pytest.mark.parametrize("rel", ["nosave_window2_pkl/ckpt", "autosave_pt/autosave"])
def test_verify_deep_refuses_hostile_pickles(rlinf_copy: Any, tmp_path: Path, rel: str, kind: str) -> None:
    ckpt = rlinf_copy(rel)
    marker = tmp_path / "MARKER"
    (target,) = ckpt.glob("trajectory_4_*")
    write_hostile(target, marker, kind)
    before = tree_digest(ckpt)
    result = runner.invoke(app, ["verify", str(ckpt), "--deep", "--json"])
    assert result.exit_code == 1
    assert result.exception is None or isinstance(result.exception, SystemExit)
    problems = [p for c in orjson.loads(result.stdout)["checkpoints"] for p in c["problems"]]
    (unsafe,) = [p for p in problems if p["trajectory_id"] == 4]
    assert unsafe["code"] == "file_unsafe" and unsafe["file"] == target.name
    assert "\n" not in unsafe["message"] and "refused" in unsafe["message"]
    assert not marker.exists()
    assert tree_digest(ckpt) == before


# ----------------------------------------------------------------------- mutations
JUNK_VALUES: list[Any] = [
    None,
    -1,
    0,
    2**63,
    2**70,
    -(2**63),
    1.5,
    True,
    "x",
    "../../etc",
    [],
    [1, "a"],
    {},
    {"a": 1},
]


def json_paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path in a JSON document (dict keys and list positions)."""
    paths = [prefix] if prefix else []
    if isinstance(doc, dict):
        for key, value in doc.items():
            paths.extend(json_paths(value, (*prefix, key)))
    elif isinstance(doc, list):
        for pos, value in enumerate(doc):
            paths.extend(json_paths(value, (*prefix, pos)))
    return paths


def edit_json(path: Path, rng: random.Random) -> str:
    """Replace, delete or add one value somewhere in a JSON file."""
    try:
        doc = json.loads(path.read_bytes())
    except ValueError:  # an earlier mutation broke its syntax
        doc = None
    paths = json_paths(doc)
    if not paths:
        path.write_text(json.dumps(rng.choice(JUNK_VALUES)))
        return f"replace {path.name}"
    where = rng.choice(paths)
    parent = doc
    for key in where[:-1]:
        parent = parent[key]
    action = rng.choice(["replace", "replace", "nudge", "delete", "add"])
    value = parent[where[-1]]
    if action == "nudge" and type(value) is int:  # a plausible number that no longer adds up
        parent[where[-1]] = rng.choice([value + 1, value - 1, value * 2, 0, 10**6])
    elif action in ("replace", "nudge"):
        parent[where[-1]] = rng.choice(JUNK_VALUES)
    elif action == "delete":
        del parent[where[-1]]
    elif isinstance(parent, dict):
        parent[rng.choice(["9", "-1", "01", "extra"])] = rng.choice(JUNK_VALUES)
    else:
        parent.append(rng.choice(JUNK_VALUES))
    path.write_text(json.dumps(doc))  # json, not orjson: it writes integers beyond 64 bits
    return f"{action} {path.name}:{'/'.join(map(str, where))}"


def mutate(ckpt: Path, rng: random.Random) -> list[str]:
    """Apply one to three random mutations to a checkpoint directory; returns what was done."""
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        files = sorted(p for p in ckpt.iterdir() if p.is_file())
        trajs = [p for p in files if p.suffix in (".pt", ".pkl")]
        jsons = [p for p in files if p.suffix == ".json"]
        kind = rng.choice(["truncate", "flip", "edit", "edit", "syntax", "delete", "rename"])
        if kind in ("truncate", "flip") and trajs:
            target = rng.choice(trajs)
            data = bytearray(target.read_bytes())
            if kind == "truncate":
                data = data[: rng.randrange(len(data))]
            else:
                for _ in range(rng.randint(1, 8)):
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            target.write_bytes(bytes(data))
            done.append(f"{kind} {target.name}")
        elif kind == "edit" and jsons:
            done.append(edit_json(rng.choice(jsons), rng))
        elif kind == "syntax" and jsons:
            target = rng.choice(jsons)
            data = target.read_bytes()
            target.write_bytes(data[: rng.randrange(len(data))] + rng.choice([b"", b"\xff", b"}", b"{{"]))
            done.append(f"syntax {target.name}")
        elif kind == "delete" and files:
            target = rng.choice(files)
            target.unlink()
            done.append(f"delete {target.name}")
        elif kind == "rename" and files:
            target = rng.choice(files)
            new = rng.choice(
                [
                    "trajectory_7_renamed.pt",
                    "trajectory_1_other.pkl",
                    "trajectory_01_x.pt",
                    "notes.pt",
                    ".hidden.pt",
                    target.name.replace(".pt", ".pkl") if target.suffix == ".pt" else target.stem + ".pt",
                    "trajector_index.json",
                ]
            )
            target.rename(ckpt / new)
            done.append(f"rename {target.name} -> {new}")
    return done


def commands(ckpt: Path, out: Path, rng: random.Random) -> list[list[str]]:
    """The commands run on each mutated checkpoint (options varied by the seed)."""
    path = str(ckpt)
    strict = rng.choice([[], ["--non-strict"]])
    cmds = [
        ["verify", path, *rng.choice([[], ["--deep"]]), *rng.choice([[], ["--json"]])],
        [
            "checkpoint",
            "load",
            path,
            *strict,
            *rng.choice([[], ["--world-size", "3"], ["-n", "2", "-r", "1"]]),
        ],
        ["shard", path, "--world-size", str(rng.randint(1, 3)), "--out", str(out), *strict],
    ]
    cmds.append(["stats", path, *rng.choice([[], ["--index-only"], ["--json"], ["--sample-draws", "50"]])])
    return cmds


def check_run(cmd: list[str], result: Result, context: str) -> None:
    """No traceback; exit 0 or 1; a failure is one `Error: ` line (verify prints its report too)."""
    where = f"{context}: rbtool {' '.join(cmd)}"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        trace = "".join(traceback.format_exception(result.exception))
        raise AssertionError(f"{where} raised\n{trace}")
    assert result.exit_code in (0, 1), (where, result.exit_code, result.stderr)
    if result.exit_code == 0:
        assert result.stderr == "", (where, result.stderr)  # no stray warnings either
    else:
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), (where, result.stderr)
        if cmd[0] != "verify":
            assert result.stdout == "", (where, result.stdout)


@pytest.mark.parametrize("rel", RLINF_DIRS)
def test_mutated_checkpoints_never_crash_a_command(tmp_path: Path, rel: str) -> None:
    rng = random.Random(f"{SEED}-{rel}")
    exits: dict[int, int] = {0: 0, 1: 0}
    for case in range(CASES_PER_FIXTURE):
        ckpt = tmp_path / f"case{case}" / "ckpt"
        shutil.copytree(FIXTURES / rel, ckpt)
        for p in [ckpt, *ckpt.iterdir()]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        done = mutate(ckpt, rng)
        before = tree_digest(ckpt)
        for cmd in commands(ckpt, tmp_path / f"case{case}" / "shards", rng):
            result = runner.invoke(app, cmd)
            check_run(cmd, result, f"{rel} case {case} ({'; '.join(done)})")
            exits[result.exit_code] += 1
        if case % 3 == 0:  # repair too: whatever it writes must verify
            repaired = tmp_path / f"case{case}" / "repaired"
            cmd = ["repair", str(ckpt), "--out", str(repaired)]
            result = runner.invoke(app, cmd)
            check_run(cmd, result, f"{rel} case {case} ({'; '.join(done)})")
            if result.exit_code == 0:
                report = verify(repaired)
                assert report.ok, (
                    rel,
                    case,
                    done,
                    [p.message for c in report.checkpoints for p in c.problems],
                )
        assert tree_digest(ckpt) == before, (rel, case, done)
        shutil.rmtree(tmp_path / f"case{case}")
    assert exits[0] and exits[1]  # the mutations are neither all harmless nor all fatal
