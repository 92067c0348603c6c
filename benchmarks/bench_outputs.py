#!/usr/bin/env python
"""Outputs that stay readable at a million trajectories: `stats` and `verify` on bench.py's 1M-entry index.

The data is bench.py's index-only checkpoint (`index_<N>/`: metadata.json and a trajectory
index of N entries, no trajectory files; built once under --workdir and reused). Every
command runs as a fresh process through bench.py's launcher (wall time, its own peak RSS),
with stdout written to a file whose size is the output's size. Measured:

- `stats --index-only` (human view) and `stats --index-only --json`: goal < 3 s, and the JSON
  document < 1 MB (summarised by default);
- `verify` (quick; every file is missing, so it exits 1 by design) and `verify --json`:
  goal < 5 s, and the JSON < 1 MB;
- the complete listings, `stats --index-only --jsonl` against `stats --index-only --json --all`
  (and the same for verify): wall time, output size, peak RSS. Streaming is judged met when a
  listing's peak RSS exceeds the summary run's by less than half the size of what it printed
  (it does not hold the whole document in memory).

An option that `--help` does not offer shows `not available`. Page cache warm (the index is
read before the timed runs). Medians of --repeats runs; peak RSS is the largest.

    .venv/bin/python benchmarks/bench_outputs.py            # 1,000,000 entries
    .venv/bin/python benchmarks/bench_outputs.py --quick    # 100,000 entries
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench

HERE = Path(__file__).resolve().parent

MB = 1_000_000
GOAL_STATS_S = 3.0
GOAL_VERIFY_S = 5.0
GOAL_JSON_BYTES = MB
PARSE_LIMIT = 1 << 30  # JSON documents up to this size are parsed as a check that they are whole


def run(argv: list[str], out: Path) -> dict[str, Any]:
    """One fresh process with stdout to `out`: wall time, peak RSS, exit code, output size."""
    report = out.with_suffix(".report")
    with out.open("wb") as stdout:
        err = subprocess.run(
            [sys.executable, "-S", "-c", bench.LAUNCHER, str(report), *argv],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.PIPE,
            check=True,
        ).stderr
    result: dict[str, Any] = json.loads(report.read_text())
    report.unlink()
    lines = err.decode(errors="replace").strip().splitlines()
    result["stderr_tail"] = lines[-1] if lines else ""
    result["output_bytes"] = out.stat().st_size
    return result


def check_output(out: Path, kind: str) -> bool | None:
    """True if the output is whole (a JSON document / JSON lines), None when too large to parse."""
    try:
        if kind == "json":
            if out.stat().st_size > PARSE_LIMIT:
                return None
            orjson.loads(out.read_bytes())
            return True
        if kind == "jsonl":
            first, last = "", ""
            with out.open() as handle:
                for line in handle:
                    first = first or line
                    last = line
            orjson.loads(first)
            orjson.loads(last)
            return True
    except (orjson.JSONDecodeError, OSError):
        return False
    return True


def measure(argv: list[str], kind: str, repeats: int, scratch: Path) -> dict[str, Any]:
    out = scratch / "stdout"
    runs = [run(argv, out) for _ in range(repeats)]
    whole = check_output(out, kind)
    out.unlink()
    last = runs[-1]
    crashed = any(
        r["exit_code"] not in (0, 1) or (r["exit_code"] == 1 and not r["stderr_tail"].startswith("Error:"))
        for r in runs
    )
    return {
        "status": "crashed" if crashed else "ok",
        "argv": argv[len(bench.rbtool_argv()) :],
        "wall_s": bench.median([r["wall_s"] for r in runs]),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
        "output_bytes": last["output_bytes"],
        "output_whole": whole,
        "exit_code": last["exit_code"],
        "stderr_tail": last["stderr_tail"],
    }


def not_available(options: set[str] | None, needed: list[str]) -> dict[str, Any] | None:
    if options is None:
        return {"status": "not available", "reason": "command missing"}
    lacking = [o for o in needed if o not in options]
    if lacking:
        return {"status": "not available", "reason": f"option {' '.join(lacking)} missing"}
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON document instead of the table.")
    mine, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    cfg = bench.parse_args(rest)  # --quick, --workdir, --index-size, --repeats
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    index_dir = bench.ensure_index(cfg)
    warmed = sum(p.stat().st_size for p in index_dir.iterdir())
    for p in index_dir.iterdir():
        p.read_bytes()
    bench.log(f"page cache warmed: {warmed / 2**20:.0f} MiB read")
    scratch = cfg.workdir / ".outputs-scratch"
    bench.remove(scratch)
    scratch.mkdir()
    rb = bench.rbtool_argv()
    figures: dict[str, Any] = {}
    plan = [
        ("stats", "stats", ["--index-only"], "text"),
        ("stats_json", "stats", ["--index-only", "--json"], "json"),
        ("stats_jsonl", "stats", ["--index-only", "--jsonl"], "jsonl"),
        ("stats_json_all", "stats", ["--index-only", "--json", "--all"], "json"),
        ("verify", "verify", [], "text"),
        ("verify_json", "verify", ["--json"], "json"),
        ("verify_jsonl", "verify", ["--jsonl"], "jsonl"),
        ("verify_json_all", "verify", ["--json", "--all"], "json"),
    ]
    options = {cmd: bench.cli_options(cmd) for cmd in ("stats", "verify")}
    try:
        for name, cmd, extra, kind in plan:
            absent = not_available(options[cmd], extra)
            if absent is not None:
                figures[name] = {**absent, "wall_s": None, "peak_rss_bytes": None, "output_bytes": None}
                continue
            bench.log(f"{cmd} {' '.join(extra)} on {cfg.index_size:,} entries, {cfg.repeats} runs")
            figures[name] = measure([*rb, cmd, str(index_dir), *extra], kind, cfg.repeats, scratch)
    finally:
        bench.remove(scratch)

    def value(name: str, key: str) -> Any:
        return figures[name].get(key)

    def below(v: float | None, bound: float) -> bool | None:
        return None if v is None else v < bound

    streaming: dict[str, Any] = {}
    for cmd in ("stats", "verify"):
        for listing in ("jsonl", "json_all"):
            name = f"{cmd}_{listing}"
            peak, base, size = (
                value(name, "peak_rss_bytes"),
                value(cmd, "peak_rss_bytes"),
                value(name, "output_bytes"),
            )
            grown = None if peak is None or base is None else peak - base
            streaming[name] = {
                "extra_rss_bytes": grown,
                "output_bytes": size,
                "met": None if grown is None or size is None else grown < size / 2,
            }
    goals = [
        (
            "stats_s",
            f"< {GOAL_STATS_S:g} s",
            value("stats", "wall_s"),
            below(value("stats", "wall_s"), GOAL_STATS_S),
        ),
        (
            "stats_json_s",
            f"< {GOAL_STATS_S:g} s",
            value("stats_json", "wall_s"),
            below(value("stats_json", "wall_s"), GOAL_STATS_S),
        ),
        (
            "stats_json_bytes",
            "< 1 MB",
            value("stats_json", "output_bytes"),
            below(value("stats_json", "output_bytes"), GOAL_JSON_BYTES),
        ),
        (
            "verify_s",
            f"< {GOAL_VERIFY_S:g} s",
            value("verify", "wall_s"),
            below(value("verify", "wall_s"), GOAL_VERIFY_S),
        ),
        (
            "verify_json_s",
            f"< {GOAL_VERIFY_S:g} s",
            value("verify_json", "wall_s"),
            below(value("verify_json", "wall_s"), GOAL_VERIFY_S),
        ),
        (
            "verify_json_bytes",
            "< 1 MB",
            value("verify_json", "output_bytes"),
            below(value("verify_json", "output_bytes"), GOAL_JSON_BYTES),
        ),
    ]
    goals += [
        (f"{name}_streams", "extra RSS < output / 2", s["extra_rss_bytes"], s["met"])
        for name, s in streaming.items()
    ]
    doc = {
        "index": str(index_dir),
        "index_size": cfg.index_size,
        "index_bytes": warmed,
        "repeats": cfg.repeats,
        "figures": figures,
        "streaming": streaming,
        "goals": [{"name": n, "target": t, "value": v, "met": m} for n, t, v, m in goals],
    }
    if mine.json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        render(doc)
    return 0


def render(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    met = {g["name"]: g for g in doc["goals"]}
    table = Table(title=f"stats / verify outputs on {doc['index_size']:,} index entries (medians)")
    for column in ("command", "wall", "output", "peak RSS", "exit", "goal", "met"):
        table.add_column(column)
    labels = {
        "stats": ("stats --index-only", "stats_s"),
        "stats_json": ("stats --index-only --json", "stats_json_s"),
        "stats_jsonl": ("stats --index-only --jsonl", "stats_jsonl_streams"),
        "stats_json_all": ("stats --index-only --json --all", "stats_json_all_streams"),
        "verify": ("verify (quick)", "verify_s"),
        "verify_json": ("verify --json", "verify_json_s"),
        "verify_jsonl": ("verify --jsonl", "verify_jsonl_streams"),
        "verify_json_all": ("verify --json --all", "verify_json_all_streams"),
    }
    for name, (label, goal) in labels.items():
        f = doc["figures"][name]
        if f["status"] == "not available":
            table.add_row(label, f"not available ({f['reason']})", "", "", "", "", "")
            continue
        g = met[goal]
        whole = {True: "", False: " NOT WHOLE", None: " (not parsed)"}[f["output_whole"]]
        target, verdict = g["target"], bench.fmt_met(g["met"])
        peak = bench.fmt_bytes(f["peak_rss_bytes"])
        if name in ("stats_json", "verify_json"):
            size = met[f"{name}_bytes"]
            target += f"; {size['target']}"
            verdict += f"; {bench.fmt_met(size['met'])}"
        if goal.endswith("_streams"):
            extra = doc["streaming"][name]["extra_rss_bytes"]
            peak += f" ({'+' if extra >= 0 else '-'}{bench.fmt_bytes(abs(extra))})"
            target = "streams"
        table.add_row(
            label,
            bench.fmt_s(f["wall_s"]),
            f"{f['output_bytes'] / MB:,.3f} MB{whole}",
            peak,
            str(f["exit_code"]) + (" CRASHED" if f["status"] == "crashed" else ""),
            target,
            verdict,
        )
    console = Console(width=max(150, shutil.get_terminal_size((150, 40)).columns))
    console.print(
        f"index {doc['index']} ({bench.fmt_bytes(doc['index_bytes'])}), page cache warm; "
        f"{doc['repeats']} fresh processes per row\n"
        "verify exits 1 by design (no trajectory file exists)\nlistings: peak RSS (its excess over "
        "the summary run's); streams = that excess is under half the output's size",
        highlight=False,
        markup=False,
    )
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
