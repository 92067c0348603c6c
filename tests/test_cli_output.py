"""The output layer (rbtool/cli/_output.py): sizes, counts, id runs, numbers and id prefixes;
layouts at an 80-, 120- and 200-column terminal and piped; plain help; several paths for
verify and stats."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import typer
from conftest import FIXTURES
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner, Result

from rbtool.cli import app
from rbtool.cli._output import count, id_runs, number, size, unique_prefixes
from rbtool.files.index import Index, write_index

DAMAGED = FIXTURES / "nosave_window2_pt" / "ckpt"
AUTOSAVE = FIXTURES / "autosave_pt" / "autosave"
RANKS = FIXTURES / "ranks"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def terminal(columns: int) -> dict[str, str]:
    return {"TTY_COMPATIBLE": "1", "COLUMNS": str(columns)}


PIPED = {"TTY_COMPATIBLE": "0", "COLUMNS": "80"}


def invoke(env: dict[str, str], *args: str | Path) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def lines(result: Result) -> list[str]:
    return ANSI.sub("", result.stdout).split("\n")


def write_entries(directory: Path, entries: list[tuple[int, int, str]]) -> Path:
    """A checkpoint whose index lists (id, num_samples, model_weights_id) with no trajectory file."""
    directory.mkdir(parents=True)
    index = Index(trajectory_format="pt", seed=5)
    for tid, samples, weights in entries:
        index.entries[tid] = {
            "num_samples": samples,
            "trajectory_id": tid,
            "max_episode_length": 4,
            "shape": [samples, 1],
            "model_weights_id": weights,
        }
    index.id_list = [tid for tid, _, _ in entries]
    index.trajectory_counter = max(index.id_list) + 1
    write_index(directory, index)
    return directory


# ------------------------------------------------------------ words and numbers
def test_sizes_are_iec_units() -> None:
    assert [size(n) for n in (0, 1023, 1024, 99_017, 5 * 1024**3)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "96.7 KiB",
        "5.0 GiB",
    ]
    assert size(None) == "-" and size(-1) == "-"


def test_counts_agree_in_number() -> None:
    assert count(1, "trajectory", "trajectories") == "1 trajectory"
    assert count(0, "trajectory", "trajectories") == "0 trajectories"
    assert count(2, "job") == "2 jobs" and count(1, "job") == "1 job"


def test_id_runs_name_gaps_and_what_is_left_out() -> None:
    ids = [0, 1, 2, 3, 4, 7, 9, 10, 11, 12]
    assert id_runs(ids) == "0-4, 7, 9-12"
    assert id_runs([5, 3, 4]) == "5, 3-4"  # list order, not sorted
    assert id_runs([]) == "(none)"
    assert id_runs(ids, 2) == "0-4, 7, ... 4 more ids in 1 run"


def test_small_numbers_keep_significant_digits() -> None:
    assert number(1e-06) == "1e-06" and number(0.5) == "0.5" and number(0.123456) == "0.1235"
    assert number(None) == "-"


@given(st.lists(st.text(alphabet="ab-", min_size=0, max_size=12), max_size=12))
def test_unique_prefixes_keep_distinct_ids_distinct(ids: list[str]) -> None:
    shown = unique_prefixes(ids, shortest=2)
    assert len(set(shown.values())) == len(set(ids))
    for full, short in shown.items():
        assert short == full or (short.endswith("…") and full.startswith(short[:-1]))


def test_ids_sharing_a_long_prefix_keep_enough_to_tell_apart() -> None:
    a, b = "run-2026-12-01-policy-0001-abcdef", "run-2026-12-01-policy-0002-abcdef"
    shown = unique_prefixes([a, b, "other"])
    assert shown[a] == "run-2026-12-01-policy-0001…" and shown[b] == "run-2026-12-01-policy-0002…"
    uuids = ["87a64d8e-0f54-5c7c-a19d-0b3753cad97c", "72086d87-727d-50d0-a552-1fd008b5a413"]
    assert unique_prefixes(uuids) == {u: u[:8] + "…" for u in uuids}


# ------------------------------------------------------------ layouts
@pytest.mark.parametrize("columns", [80, 120])
def test_stats_at_a_terminal_fits_without_cutting(columns: int) -> None:
    result = invoke(terminal(columns), "stats", DAMAGED, "--jobs", "1")
    assert result.exit_code == 0, result.stderr
    shown = lines(result)
    assert all(len(line) <= columns for line in shown), max(shown, key=len)
    text = "\n".join(shown)
    # the only ellipses end unique prefixes of model_weights_ids (8 hex digits here)
    assert all(
        re.fullmatch(r"[0-9a-f]{8}", text[i - 8 : i]) for i in [m.start() for m in re.finditer("…", text)]
    )
    for whole in ("float32", "int64", "forward_inputs.action_tokens", "[16, 16, 3]", "12.0 KiB", "-0.06487"):
        assert whole in text
    # header lines wrap between words: the same words as the one piped line
    piped = lines(invoke(PIPED, "stats", DAMAGED, "--jobs", "1"))
    header = piped[0].split()
    assert " ".join(shown[: len(shown)]).split()[: len(header)] == header


def test_a_narrow_terminal_names_the_columns_it_left_out() -> None:
    result = invoke(terminal(80), "stats", DAMAGED, "--jobs", "1")
    assert "(left out to fit 80 columns: histogram; --wide shows them)" in result.stdout
    wide = invoke(terminal(200), "stats", DAMAGED, "--jobs", "1")
    assert "left out" not in wide.stdout.replace("left out of the window", "") and "histogram" in wide.stdout


def test_wide_keeps_every_column_and_whole_ids() -> None:
    result = invoke(terminal(80), "stats", DAMAGED, "--jobs", "1", "--wide")
    assert result.exit_code == 0
    assert "histogram" in result.stdout and "left out to fit" not in result.stdout
    assert " 87a64d8e-0f54-5c7c-a19d-0b3753cad97c " in result.stdout.split("field")[0]


def test_piped_output_is_unwrapped_whole_and_has_no_trailing_spaces() -> None:
    for args in (["stats", DAMAGED, "--jobs", "1"], ["verify", DAMAGED]):
        result = invoke(PIPED, *args)
        shown = lines(result)
        assert all(line == line.rstrip() for line in shown)
        assert "left out to fit" not in result.stdout and "…" not in result.stdout
    verify = lines(invoke(PIPED, "verify", DAMAGED))
    names = [f.name for f in [DAMAGED / "trajectory_0_87a64d8e-0f54-5c7c-a19d-0b3753cad97c.pt"]]
    grep = [line for line in verify if names[0] in line]
    assert len(grep) == 1 and grep[0].startswith("error") and grep[0].endswith("has no file")
    stats = lines(invoke(PIPED, "stats", DAMAGED, "--jobs", "1"))
    assert stats[0].startswith(str(DAMAGED)) and stats[0].endswith("5 model_weights_ids")


def test_model_weights_ids_sharing_a_prefix_do_not_look_the_same(tmp_path: Path) -> None:
    a, b = "run-2026-12-01-policy-0001-abcdef", "run-2026-12-01-policy-0002-abcdef"
    ckpt = write_entries(tmp_path / "c", [(0, 8, a), (1, 8, b)])
    result = invoke(terminal(80), "stats", ckpt, "--index-only")
    rows = [line.split()[3] for line in lines(result) if re.match(r" *[01] +8x1 ", line)]  # trajectory table
    assert rows == ["run-2026-12-01-policy-0001…", "run-2026-12-01-policy-0002…"]
    piped = lines(invoke(PIPED, "stats", ckpt, "--index-only"))
    assert [line.split()[3] for line in piped if re.match(r" *[01] +8x1 ", line)] == [a, b]


def test_a_one_in_a_million_draw_is_not_zero(tmp_path: Path) -> None:
    ckpt = write_entries(tmp_path / "c", [(0, 1, "p"), (1, 999_999, "p")])
    for env in (terminal(80), terminal(200), PIPED):
        result = invoke(env, "stats", ckpt, "--index-only")
        assert result.exit_code == 0, result.stderr
        assert "1e-06" in result.stdout and "0.000" not in result.stdout
        assert "p(draw) 1e-06 to 1 per trajectory" in " ".join(result.stdout.split())


def test_counts_ids_and_sizes_read_right_in_the_views(tmp_path: Path) -> None:
    one = write_entries(tmp_path / "one", [(0, 8, "p")])
    text = invoke(PIPED, "stats", one, "--index-only").stdout
    assert "1 trajectory, 8 samples" in text and "1 trajectories" not in text
    gaps = write_entries(tmp_path / "gaps", [(i, 8, "p") for i in (0, 1, 2, 3, 4, 7, 9, 10, 11, 12)])
    text = invoke(PIPED, "stats", gaps, "--index-only").stdout
    assert "ids 0-4, 7, 9-12" in text and ".." not in text
    assert re.search(r"^p +10 +80 +80 +0-4, 7, 9-12$", text, flags=re.M)  # the weights table's runs
    shard = invoke(PIPED, "shard", AUTOSAVE, "--world-size", "2", "--out", tmp_path / "out")
    assert shard.exit_code == 0 and "96.7 KiB" in shard.stdout and "bytes" not in shard.stdout


# ------------------------------------------------------------ help
def commands() -> list[list[str]]:
    root = typer.main.get_command(app)
    found = []
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        subs = getattr(command, "commands", None)
        found += [[name, sub] for sub in subs] if subs else [[name]]
    return found


@pytest.mark.parametrize("argv", commands(), ids=" ".join)
def test_help_names_values_plainly(argv: list[str]) -> None:
    result = invoke({"COLUMNS": "80"}, *argv, "--help")
    assert result.exit_code == 0
    python_types = r"<(list\[[^>]*|[a-z]+ range|int|float|path|str|text|bool|[a-z-]+(\|[a-z-]+)+)>"
    assert not re.search(python_types, result.stdout), result.stdout  # no <list[Path]>, <int range>


def test_choices_and_defaults_are_shown() -> None:
    ingest = " ".join(invoke({"COLUMNS": "80"}, "ingest", "--help").stdout.split())
    assert "Usage: root ingest [OPTIONS] SOURCE..." in ingest or "ingest [OPTIONS] SOURCE..." in ingest
    assert "--format [pt|pkl] Trajectory file format (default:" in ingest
    stats = " ".join(invoke({"COLUMNS": "80"}, "stats", "--help").stdout.split())
    assert "stats [OPTIONS] PATH..." in stats and "--window N" in stats and "--temperature X" in stats
    assert "--strategy [uniform|topk]" in stats and "[default: uniform]" in stats


def test_top_level_help_shows_whole_descriptions() -> None:
    text = " ".join(invoke({"COLUMNS": "80"}, "--help").stdout.split())
    root = typer.main.get_command(app)
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        first = " ".join((command.help or "").split("\n\n")[0].split())
        assert f"{name} {first}" in text, name
    assert "..." not in text.split("Commands:")[1]


# ------------------------------------------------------------ several paths
def copies(tmp_path: Path) -> tuple[Path, Path]:
    good, bad = tmp_path / "good", tmp_path / "bad"
    shutil.copytree(AUTOSAVE, good)
    shutil.copytree(DAMAGED, bad)
    return good, bad


def test_verify_reports_each_path_and_fails_if_any_fails(tmp_path: Path) -> None:
    good, bad = copies(tmp_path)
    ok = invoke(PIPED, "verify", good, RANKS)
    assert ok.exit_code == 0 and ok.stderr == ""
    assert [line.split()[:2] for line in lines(ok) if line.startswith("OK")] == [
        ["OK", str(good)],
        ["OK", str(RANKS / "rank_0")],
        ["OK", str(RANKS / "rank_1")],
    ]
    mixed = invoke(PIPED, "verify", good, bad, tmp_path / "nothing")
    assert mixed.exit_code == 1
    assert f"OK {good}" in mixed.stdout and f"FAILED {bad}" in mixed.stdout
    errors = mixed.stderr.strip().split("\n")
    assert len(errors) == 2 and all(e.startswith("Error: ") for e in errors)
    assert str(tmp_path / "nothing") in errors[0]
    assert errors[1].startswith("Error: verification failed for 2 of 3 paths: ")


def test_verify_json_is_one_document_with_one_entry_per_path(tmp_path: Path) -> None:
    good, bad = copies(tmp_path)
    single = json.loads(invoke(PIPED, "verify", good, "--json").stdout)
    assert single["path"] == str(good) and single["ok"] and len(single["checkpoints"]) == 1
    result = invoke(PIPED, "verify", good, bad, tmp_path / "nothing", "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and [p["path"] for p in doc["paths"]] == [
        str(good),
        str(bad),
        str(tmp_path / "nothing"),
    ]
    assert doc["paths"][0] == {**single, "seconds": doc["paths"][0]["seconds"]}
    assert doc["paths"][1]["ok"] is False and doc["paths"][2]["ok"] is False and "error" in doc["paths"][2]
    rows = [json.loads(line) for line in invoke(PIPED, "verify", good, bad, "--jsonl").stdout.splitlines()]
    assert {r["path"] for r in rows} == {str(good), str(bad)}


def test_stats_shows_each_path_and_fails_if_any_fails(tmp_path: Path) -> None:
    good, bad = copies(tmp_path)
    result = invoke(PIPED, "stats", good, bad, "--index-only")
    assert result.exit_code == 0 and result.stderr == ""
    sections = result.stdout.split("\n\n")
    assert (
        len(sections) == 2 and sections[0].startswith(f"{good}  pt") and sections[1].startswith(f"{bad}  pt")
    )
    missing = invoke(PIPED, "stats", good, tmp_path / "nothing", bad, "--index-only")
    assert missing.exit_code == 1 and missing.stdout == result.stdout
    assert missing.stderr.count("Error: ") == 2 and "1 of 3 paths could not be read" in missing.stderr


def test_stats_json_and_jsonl_of_several_paths(tmp_path: Path) -> None:
    good, bad = copies(tmp_path)
    single: dict[str, Any] = json.loads(invoke(PIPED, "stats", good, "--index-only", "--json").stdout)
    assert single["path"] == str(good) and "paths" not in single
    doc = json.loads(invoke(PIPED, "stats", good, bad, "--index-only", "--json").stdout)
    assert doc["ok"] is True and [d["path"] for d in doc["paths"]] == [str(good), str(bad)]
    assert doc["paths"][0] == single
    failed = invoke(PIPED, "stats", good, tmp_path / "nothing", "--index-only", "--json")
    assert failed.exit_code == 1
    message = failed.stderr.split("\n")[0].removeprefix("Error: ")
    assert json.loads(failed.stdout)["paths"][1] == {"path": str(tmp_path / "nothing"), "error": message}
    rows = [json.loads(line) for line in invoke(PIPED, "stats", good, bad, "--jsonl").stdout.splitlines()]
    assert [r["path"] for r in rows] == [str(good)] * 5 + [str(bad)] * 5
