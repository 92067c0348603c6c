"""The writers' rules, the same for every command that writes: --dry-run writes nothing and fails
where the real run fails; an existing output needs --force; missing parents are created."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES, assert_one_error, run

CKPT = FIXTURES / "autosave_pt" / "autosave"


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` (directories too) -> its kind and, for a file, its sha256 and mode."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = f"link {os.readlink(path)}"
        elif path.is_dir():
            found[rel] = f"dir {path.stat().st_mode:o}"
        else:
            found[rel] = f"file {path.stat().st_mode:o} {hashlib.sha256(path.read_bytes()).hexdigest()}"
    return found


def writers(src: Path, loose: Path, out: Path) -> dict[str, list[str | Path]]:
    """Every command that writes, reading `src` (a checkpoint) or `loose` (a trajectory file)."""
    return {
        "ingest": ["ingest", loose, src, "--buffer", out],
        "checkpoint-save": ["checkpoint", "save", src, out, "--window", "2"],
        "checkpoint-save-in-memory": ["checkpoint", "save", loose, src, out, "--mode", "in-memory"],
        "checkpoint-load-buffer": ["checkpoint", "load", src, "--buffer", out],
        "shard": ["shard", src, "-n", "2", "-o", out],
        "merge": ["merge", src, "-o", out],
        "reshard": ["reshard", src, "-n", "2", "-o", out],
        "filter": ["filter", src, "-o", out, "--last", "2"],
        "convert": ["convert", src, "-o", out, "--format", "pkl"],
        "repair": ["repair", src, "-o", out],
        "sample-out": ["sample", src, "--num-chunks", "4", "--out", out],
        "export": ["export", src, out, "--to", "lerobot", "--fps", "10"],
        "import-lerobot": ["import", "lerobot", src.parent / "dataset", "--buffer", out],
    }


LEROBOT = {"export", "import-lerobot"}


def needs(name: str, src: Path) -> None:
    """Skip the LeRobot writers without the optional extra; give import a dataset to read."""
    if name in LEROBOT:
        pytest.importorskip("pyarrow")
        pytest.importorskip("PIL")
        dataset = src.parent / "dataset"
        if name == "import-lerobot" and not dataset.exists():
            made = run("export", src, dataset, "--to", "lerobot", "--fps", "10")
            assert made.exit_code == 0, made.stderr


NAMES = list(writers(Path("a"), Path("b"), Path("c")))


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A writable copy of a checkpoint, one loose trajectory file, and where outputs go."""
    src = tmp_path / "in" / "ckpt"
    shutil.copytree(CKPT, src)
    loose = tmp_path / "in" / "loose.pt"
    shutil.copy(next(src.glob("trajectory_0_*.pt")), loose)
    (tmp_path / "outs").mkdir()
    return src, loose, tmp_path / "outs"


@pytest.mark.parametrize("json_mode", [False, True], ids=["human", "json"])
@pytest.mark.parametrize("name", NAMES)
def test_dry_run_writes_nothing(
    tree: tuple[Path, Path, Path], tmp_path: Path, columns: int, name: str, json_mode: bool
) -> None:
    src, loose, outs = tree
    needs(name, src)
    out = outs / "new" / "deeper" / "out"
    before = snapshot(tmp_path)
    args = [*writers(src, loose, out)[name], "--dry-run", *(["--json"] if json_mode else [])]
    result = run(*args)
    assert result.exit_code == 0, result.stderr
    assert snapshot(tmp_path) == before  # byte-identical: nothing made, changed or removed
    if json_mode:
        doc = json.loads(result.stdout)
        assert doc["dry_run"] is True
        assert doc.get("files") is None
    else:
        last = result.stdout.rstrip("\n").splitlines()[-1]
        assert last.startswith(f"dry run: would write {out} (") and last.endswith("); nothing written")


@pytest.mark.parametrize("name", NAMES)
def test_dry_run_reports_what_the_real_run_writes(
    tree: tuple[Path, Path, Path], columns: int, name: str
) -> None:
    src, loose, outs = tree
    needs(name, src)
    planned = run(*writers(src, loose, outs / "out")[name], "--dry-run", "--json")
    real = run(*writers(src, loose, outs / "out")[name], "--json")
    assert planned.exit_code == 0 and real.exit_code == 0, (planned.stderr, real.stderr)
    plan, done = json.loads(planned.stdout), json.loads(real.stdout)
    assert plan["dry_run"] is True and done["dry_run"] is False
    volatile = {"dry_run", "files", "seconds", "bytes_per_second", "bytes_read", "restored_to"}
    if name == "sample-out":
        assert plan["out_bytes"] == done["out_bytes"] == (outs / "out").stat().st_size
        volatile |= {"out_bytes"}
    if name == "repair":  # the real run reports what it placed; the plan what it would keep
        assert plan["checkpoints"][0]["trajectory_id_list"] == done["checkpoints"][0]["trajectory_id_list"]
        return
    if name == "export":  # files are counted as they are written
        volatile |= {"data_files", "video_files", "episode_files", "bytes"}
    assert {k: v for k, v in plan.items() if k not in volatile} == {
        k: v for k, v in done.items() if k not in volatile
    }


@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("ingest", "import-lerobot")])
def test_an_existing_output_needs_force_and_the_dry_run_says_so_too(
    tree: tuple[Path, Path, Path], tmp_path: Path, columns: int, name: str
) -> None:
    src, loose, outs = tree
    needs(name, src)
    out = outs / "out"
    first = run(*writers(src, loose, out)[name])
    assert first.exit_code == 0, first.stderr
    before = snapshot(tmp_path)
    for extra in ([], ["--dry-run"]):
        again = run(*writers(src, loose, out)[name], *extra)
        assert_one_error(again)
        assert again.stderr.strip() == (
            f"Error: {out}: already exists; choose another path or pass --force to replace it"
        )
        assert snapshot(tmp_path) == before
    assert run(*writers(src, loose, out)[name], "--force", "--dry-run").exit_code == 0
    assert snapshot(tmp_path) == before
    forced = run(*writers(src, loose, out)[name], "--force")
    assert forced.exit_code == 0, forced.stderr
    assert out.exists() and not [p for p in outs.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("name", NAMES)
def test_missing_parents_are_created(tree: tuple[Path, Path, Path], columns: int, name: str) -> None:
    src, loose, outs = tree
    needs(name, src)
    out = outs / "a" / "b" / "out"
    result = run(*writers(src, loose, out)[name])
    assert result.exit_code == 0, result.stderr
    assert out.exists()


def test_force_replaces_only_its_own_kind(tree: tuple[Path, Path, Path], columns: int) -> None:
    src, _, outs = tree
    notes = outs / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    result = run("shard", src, "-n", "2", "-o", notes, "--force")
    assert_one_error(result)
    assert "is not a checkpoint directory; refusing to replace it" in result.stderr
    a_dir = outs / "batch.pt"
    a_dir.mkdir()
    result = run("sample", src, "--num-chunks", "2", "--out", a_dir, "--force")
    assert_one_error(result)
    assert result.stderr.strip() == f"Error: {a_dir}: is a directory; give a file name"
    assert (notes / "todo.txt").read_text() == "mine" and a_dir.is_dir()


@pytest.mark.parametrize(
    "args",
    [["sample", str(CKPT), "--num-chunks", "2", "--dry-run"],
     ["sample", str(CKPT), "--num-chunks", "2", "--force"],
     ["checkpoint", "load", str(CKPT), "--dry-run"]],
    ids=["sample-dry-run", "sample-force", "checkpoint-load-dry-run"],
)  # fmt: skip
def test_writer_options_without_an_output_are_usage_errors(args: list[str]) -> None:
    result = run(*args)
    assert result.exit_code == 2 and "nothing else writes" in result.stderr
