#!/usr/bin/env python
"""`rbtool ingest` of 3,000 small `.pt` files, against rbtool 0.1's ingest of the same files, in one run.

The sources are 3,000 loose trajectory files (T=4, B=2, the reference fixtures' fields, one
`torch.save` each; built once under --workdir). Each run ingests the folder into a fresh
buffer directory on the same file system, as a fresh process:

- rbtool (this tree): `python -m rbtool ingest SRC --buffer OUT --json`, with `--link` when
  `rbtool ingest --help` offers it (files are then hard-linked, not copied);
- rbtool 0.1: the same command run from a worktree of version 0.1.0 (commit d8acc16, made with
  `git worktree add /work/rbtool-0.1 d8acc16`), on the same interpreter and packages, by
  putting that worktree first on PYTHONPATH;
- `cp -r SRC OUT`, for scale: what copying the files costs on this file system.

Runs alternate between the variants, the output is removed and dirty pages synced before each
(untimed), and every run is checked to have added every file. Figures are medians; the goal
is >= 5x faster than 0.1. Page cache warm (the sources are read before the timed runs).

    .venv/bin/python benchmarks/bench_ingest.py            # 3,000 files, 3 runs each
    .venv/bin/python benchmarks/bench_ingest.py --quick    # 300 files
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench

HERE = Path(__file__).resolve().parent

REPO = HERE.parent
OLD_TREE = Path("/work/rbtool-0.1")
OLD_COMMIT = "d8acc16"
GOAL = 5.0  # 0.1's median ingest time / this tree's, at least


def fmt_x(value: float | None) -> str:
    """A ratio; two decimals below 1, where one would round a slow-down to 0.0x."""
    return "n/a" if value is None else (f"{value:.2f}x" if value < 1 else f"{value:,.1f}x")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="300 files, 1 run each.")
    parser.add_argument("--json", action="store_true", help="Print one JSON document instead of the table.")
    parser.add_argument("--workdir", type=Path, default=bench.DEFAULT_WORKDIR, help="Where data is built.")
    parser.add_argument("--files", type=int, help="Trajectory files to ingest (default 3000; quick 300).")
    parser.add_argument("--t", type=int, default=4, help="Chunk steps per trajectory (default 4).")
    parser.add_argument("--b", type=int, default=2, help="Parallel environments per trajectory (default 2).")
    parser.add_argument("--image", type=int, default=16, help="Side of the uint8 images (default 16).")
    parser.add_argument("--repeats", type=int, help="Timed runs per variant (default 3; quick 1).")
    parser.add_argument(
        "--old-tree", type=Path, default=OLD_TREE, help=f"Worktree of rbtool 0.1 (default {OLD_TREE})."
    )
    args = parser.parse_args(argv)
    args.files = args.files if args.files is not None else (300 if args.quick else 3000)
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if args.files < 1 or args.repeats < 1:
        parser.error("--files and --repeats must be >= 1")
    args.workdir = args.workdir.resolve()
    return args


def ensure_sources(args: argparse.Namespace) -> Path:
    """A folder of `files` loose trajectory files, one torch.save each (built once, reused)."""
    import torch

    final = args.workdir / f"ingest_src_{args.files}x{args.t}x{args.b}_img{args.image}"
    if final.is_dir() and len(list(final.glob("*.pt"))) == args.files:
        bench.log(f"reusing {final}")
        return final
    bench.remove(final)
    partial = args.workdir / f".{final.name}.partial"
    bench.remove(partial)
    partial.mkdir(parents=True)
    bench.log(f"building {final} ({args.files:,} loose .pt files)")
    for i in range(args.files):
        traj = bench.synthetic_trajectory(args.t, args.b, args.image, i, bench.weights_id(i // 500))
        torch.save(traj, partial / f"traj_{i:05d}.pt")
    partial.rename(final)
    return final


def old_tree_state(tree: Path) -> str | None:
    """None when `tree` is a checkout of rbtool 0.1.0; else why it cannot be used."""
    pyproject = tree / "pyproject.toml"
    if not (tree / "rbtool" / "__init__.py").is_file() or not pyproject.is_file():
        return f"no rbtool 0.1 tree at {tree} (create it with: git worktree add {tree} {OLD_COMMIT})"
    if 'version = "0.1.0"' not in pyproject.read_text():
        return f"{tree} is not rbtool 0.1.0"
    return None


def env_for(tree: Path) -> dict[str, str]:
    """The environment that makes `python -m rbtool` import rbtool from `tree`.

    Run it with `tree` as the working directory too: `-m` puts the working directory first
    on sys.path, so started from another checkout it would import that checkout's rbtool.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def help_text(tree: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "rbtool", "ingest", "--help"],
        env={**env_for(tree), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"},
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout


def imported_from(tree: Path) -> str:
    """Where `python -m rbtool` run as this script runs it imports rbtool from (a check on env_for)."""
    done = subprocess.run(
        [sys.executable, "-c", "import rbtool; print(rbtool.__file__)"],
        env=env_for(tree),
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    return str(Path(done.stdout.strip()).parent.parent) if done.returncode == 0 else "import failed"


def timed(argv: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """Run argv through bench.py's launcher (wall time, peak RSS, exit code); stdout kept."""
    with (
        tempfile.NamedTemporaryFile() as report,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        subprocess.run(
            [sys.executable, "-S", "-c", bench.LAUNCHER, report.name, *argv],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            check=True,
        )
        result: dict[str, Any] = json.loads(Path(report.name).read_text())
        out.seek(0)
        err.seek(0)
        result["stdout"] = out.read().decode(errors="replace")
        lines = err.read().decode(errors="replace").strip().splitlines()
        result["stderr_tail"] = lines[-1] if lines else ""
    return result


def held(buffer: Path) -> int | None:
    try:
        return int(json.loads((buffer / "metadata.json").read_text())["size"])
    except (OSError, ValueError, KeyError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = ensure_sources(args)
    bench.log(f"page cache warmed: {sum(len(p.read_bytes()) for p in src.iterdir()) / 2**20:.0f} MiB read")
    out = args.workdir / "ingest_out"
    # an option line of the help (`  --link  Hard-link ...`), not a mention in the description
    link = re.search(r"^\s+(?:-\w,\s*)?--link\b", help_text(REPO), re.MULTILINE) is not None
    problem = old_tree_state(args.old_tree)
    py = [sys.executable, "-m", "rbtool", "ingest", str(src), "--buffer", str(out)]
    variants: dict[str, tuple[list[str], dict[str, str], Path] | None] = {
        "rbtool": ([*py, *(["--link"] if link else []), "--json"], env_for(REPO), REPO),
        "rbtool_0_1": None if problem else ([*py, "--json"], env_for(args.old_tree), args.old_tree),
        "cp_r": (["cp", "-r", str(src), str(out)], dict(os.environ), REPO),
    }
    if problem:
        bench.log(f"0.1 not measured: {problem}")
    elif imported_from(args.old_tree) != str(args.old_tree.resolve()):
        problem = f"python -m rbtool under {args.old_tree} imports {imported_from(args.old_tree)}"
        variants["rbtool_0_1"] = None
        bench.log(f"0.1 not measured: {problem}")
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k, v in variants.items() if v is not None}
    bench.log(f"ingest of {args.files:,} files: {', '.join(runs)}; {args.repeats} runs each, alternating")
    for _ in range(args.repeats):
        for name, variant in variants.items():
            if variant is None:
                continue
            bench.remove(out)
            os.sync()
            run = timed(*variant)
            run["added"] = held(out) if name != "cp_r" else args.files
            if name == "rbtool" and run["exit_code"] == 0:
                try:
                    files = json.loads(run["stdout"]).get("files") or {}
                    run["placement"] = {k: v for k, v in files.items() if k != "bytes" and v}
                except ValueError:
                    run["placement"] = None
            del run["stdout"]
            runs[name].append(run)
    bench.remove(out)

    def summary(name: str) -> dict[str, Any] | None:
        if name not in runs:
            return None
        rs = runs[name]
        ok = all(r["exit_code"] == 0 and r["added"] == args.files for r in rs)
        return {
            "ok": ok,
            "wall_s": bench.median([r["wall_s"] for r in rs]),
            "runs": [r["wall_s"] for r in rs],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
            "exit_code": rs[-1]["exit_code"],
            "added": rs[-1]["added"],
            "stderr_tail": rs[-1]["stderr_tail"],
        }

    doc: dict[str, Any] = {
        "files": args.files,
        "source": str(src),
        "source_bytes": bench.dir_bytes(src),
        "repeats": args.repeats,
        "link_option": link,
        "old_tree": str(args.old_tree),
        "old_tree_problem": problem,
        "rbtool": summary("rbtool"),
        "rbtool_0_1": summary("rbtool_0_1"),
        "cp_r": summary("cp_r"),
    }
    doc["placement"] = runs["rbtool"][-1].get("placement")
    new, old = doc["rbtool"], doc["rbtool_0_1"]
    doc["ratio"] = bench.ratio(old["wall_s"], new["wall_s"]) if old and new["ok"] and old["ok"] else None
    doc["goal"] = GOAL
    doc["met"] = None if doc["ratio"] is None else doc["ratio"] >= GOAL
    if args.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    render(doc)
    return 0


def render(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(s: dict[str, Any] | None, why: str | None = None) -> str:
        if s is None:
            return f"n/a ({why})" if why else "n/a"
        text = f"{bench.fmt_s(s['wall_s'])}, peak {bench.fmt_bytes(s['peak_rss_bytes'])}"
        return (
            text
            if s["ok"]
            else f"{text}, FAILED (exit {s['exit_code']}, {s['added']} added: {s['stderr_tail']})"
        )

    console = Console(width=max(150, shutil.get_terminal_size((150, 40)).columns))
    console.print(
        f"ingest of {doc['files']:,} small .pt files ({bench.fmt_bytes(doc['source_bytes'])}) "
        f"into a new buffer; median of {doc['repeats']} fresh processes each, alternating, "
        "page cache warm; --link "
        + ("used" if doc["link_option"] else "not offered by rbtool ingest --help (default placement)"),
        highlight=False,
        markup=False,
    )
    table = Table(title="rbtool ingest (medians; ratio = 0.1 / this tree)")
    for column in ("figure", "time", "ratio", "goal", "met"):
        table.add_column(column, justify="right" if column == "ratio" else "left")
    placed = doc["placement"] or {}
    placement = f" ({', '.join(f'{v:,} {k}' for k, v in placed.items())})" if placed else ""
    table.add_row(
        f"rbtool ingest{' --link' if doc['link_option'] else ''}{placement}",
        cell(doc["rbtool"]),
        fmt_x(doc["ratio"]),
        f">= {GOAL:g}x",
        bench.fmt_met(doc["met"]),
    )
    table.add_row("rbtool 0.1 ingest", cell(doc["rbtool_0_1"], doc["old_tree_problem"]), "", "", "")
    cp = doc["cp_r"]
    scale = bench.ratio(doc["rbtool"]["wall_s"], cp["wall_s"]) if cp else None
    table.add_row("cp -r (for scale)", cell(cp), f"rbtool takes {fmt_x(scale)}", "", "")
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
