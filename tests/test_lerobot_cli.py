"""`rbtool export --to lerobot` and `rbtool import lerobot`: JSON, human view, errors, exit statuses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import FIXTURES, assert_one_error, run, run_json, staging_left, tree_digest

pytest.importorskip("pyarrow")
pytest.importorskip("PIL")

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
SOURCE = FIXTURES / "autosave_pt/autosave"


def json_keys(doc: object) -> set[str]:
    keys: set[str] = set()
    if isinstance(doc, dict):
        for key, value in doc.items():
            keys |= {key} | json_keys(value)
    elif isinstance(doc, list):
        for value in doc:
            keys |= json_keys(value)
    return keys


def test_every_json_key_is_documented(tmp_path: Path) -> None:
    documented = {
        word for span in re.findall(r"`([^`\n]+)`", DOCS.read_text()) for word in re.findall(r"\w+", span)
    }
    exported = run_json("export", SOURCE, tmp_path / "ds", "--to", "lerobot", "--fps", "10")
    imported = run_json("import", "lerobot", tmp_path / "ds", "--buffer", tmp_path / "buf")
    episodes = run_json(
        "import", "lerobot", tmp_path / "ds", "-b", tmp_path / "b2", "--no-sidecar", "--drop", "terminations"
    )
    for doc in (exported, imported, episodes):
        assert json_keys(doc) <= documented, json_keys(doc) - documented


def test_export_then_import_gives_back_the_checkpoint(tmp_path: Path) -> None:
    before = tree_digest(SOURCE)
    doc = run_json(
        "export",
        SOURCE,
        tmp_path / "ds",
        "--to",
        "lerobot",
        "--fps",
        "10",
        "--task",
        "pick",
        "--robot-type",
        "panda",
    )
    assert doc["trajectories"] == 5 and doc["frames"] == 40 and doc["codebase_version"] == "v3.0"
    assert {"name": "image", "dtype": "image", "shape": [16, 16, 3], "field": "curr_obs.main_images"} in doc[
        "features"
    ]
    info = json.loads((tmp_path / "ds/meta/info.json").read_text())
    assert info["robot_type"] == "panda" and info["total_frames"] == 40
    result = run("import", "lerobot", tmp_path / "ds", "--buffer", tmp_path / "buf", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["mode"] == "rbtool" and doc["kept_ids"] and doc["trajectory_ids"] == [0, 1, 2, 3, 4]
    assert result.stderr == "added trajectory ids 0-4\n"
    assert tree_digest(SOURCE) == before
    verified = run_json("verify", tmp_path / "buf", "--deep")
    assert verified["ok"]
    diff = run("diff", SOURCE, tmp_path / "buf", "--deep", "--json")  # RLinf wrote other bytes
    assert diff.exit_code == 0, diff.stderr


def test_human_views(tmp_path: Path) -> None:
    result = run("export", SOURCE, tmp_path / "ds", "--to", "lerobot", "--fps", "5")
    assert result.exit_code == 0 and "curr_obs.main_images" in result.stdout and "episodes" in result.stdout
    result = run("import", "lerobot", tmp_path / "ds", "--buffer", tmp_path / "buf")
    assert result.exit_code == 0 and "rbtool export (sidecar)" in result.stdout


def test_export_errors_are_one_line(tmp_path: Path) -> None:
    assert_one_error(run("export", tmp_path / "nope", tmp_path / "ds", "--to", "lerobot", "--fps", "5"))
    missing = run(
        "export", FIXTURES / "nosave_window2_pt/ckpt", tmp_path / "ds", "--to", "lerobot", "--fps", "5"
    )
    assert_one_error(missing)
    assert missing.stderr.rstrip().endswith("pass --non-strict to keep only what exists")
    kept = run_json(
        "export",
        FIXTURES / "nosave_window2_pt/ckpt",
        tmp_path / "ds",
        "--to",
        "lerobot",
        "--fps",
        "5",
        "--non-strict",
    )
    assert kept["trajectories"] == 2
    again = run("export", SOURCE, tmp_path / "ds", "--to", "lerobot", "--fps", "5")
    assert_one_error(again)
    assert again.stderr.rstrip().endswith("choose another path or pass --force to replace it")
    assert run("export", SOURCE, tmp_path / "ds", "--to", "lerobot", "--fps", "5", "--force").exit_code == 0
    assert_one_error(run("export", SOURCE, tmp_path / "d2", "--to", "lerobot", "--fps", "5", "--map", "x"), 2)
    assert_one_error(
        run("export", SOURCE, tmp_path / "d3", "--to", "lerobot", "--fps", "5", "--map", "nope=y"), 2
    )
    usage = run("export", SOURCE, tmp_path / "d4", "--to", "lerobot", "--fps", "0")
    assert usage.exit_code == 2 and usage.stdout == ""
    assert run("export", SOURCE, tmp_path / "d5", "--to", "hdf5", "--fps", "5").exit_code == 2
    assert run("export", SOURCE, SOURCE / "inside", "--to", "lerobot", "--fps", "5").exit_code == 2
    assert not staging_left(tmp_path)


def test_import_errors_are_one_line(tmp_path: Path) -> None:
    run_json("export", SOURCE, tmp_path / "ds", "--to", "lerobot", "--fps", "5")
    assert_one_error(run("import", "lerobot", SOURCE, "--buffer", tmp_path / "buf"))
    assert_one_error(
        run("import", "lerobot", tmp_path / "ds", "--buffer", tmp_path / "buf", "--episodes", "99"), 2
    )
    bad = run("import", "lerobot", tmp_path / "ds", "--buffer", tmp_path / "buf", "--episodes", "2-1")
    assert bad.exit_code == 2 and bad.stdout == ""
    # A string feature has no tensor form: the line names it and the options that answer it.
    unmappable = run(
        "import",
        "lerobot",
        tmp_path / "ds",
        "--buffer",
        tmp_path / "buf",
        "--no-sidecar",
        "--map",
        "rb.model_weights_id=mwid",
    )
    assert_one_error(unmappable, 2)
    assert "'rb.model_weights_id'" in unmappable.stderr
    assert unmappable.stderr.rstrip().endswith("pass --drop rb.model_weights_id to leave it out")
    # Two features on one field: mapping one elsewhere answers it too.
    clash = run("import", "lerobot", tmp_path / "ds", "-b", tmp_path / "buf", "--map", "state=actions")
    assert_one_error(clash, 2)
    assert clash.stderr.rstrip().endswith("pass --map state=FIELD to place it elsewhere or --drop state")
    assert not (tmp_path / "buf").exists()


def test_import_selected_episodes(tmp_path: Path) -> None:
    run_json("export", SOURCE, tmp_path / "ds", "--to", "lerobot", "--fps", "5")
    doc = run_json(
        "import",
        "lerobot",
        tmp_path / "ds",
        "--buffer",
        tmp_path / "buf",
        "--episodes",
        "0,2-3",
        "--model-weights-id",
        "demo",
    )
    assert doc["mode"] == "episodes" and doc["episodes"] == 3 and doc["trajectory_ids"] == [0, 1, 2]
    assert {"feature": "image", "field": "curr_obs.main_images"} in doc["fields"]
    ckpt = run_json("checkpoint", "load", tmp_path / "buf")
    assert ckpt["size"] == 3


def test_export_video_json_round_trip_and_errors(tmp_path: Path) -> None:
    pytest.importorskip("av")
    documented = {
        word for span in re.findall(r"`([^`\n]+)`", DOCS.read_text()) for word in re.findall(r"\w+", span)
    }
    doc = run_json("export", SOURCE, tmp_path / "ds", "--to", "lerobot", "--fps", "10", "--video")
    assert json_keys(doc) <= documented, json_keys(doc) - documented
    assert doc["video_files"] == 1 and doc["frames"] == 40
    assert {"name": "image", "dtype": "video", "shape": [16, 16, 3], "field": "curr_obs.main_images"} in doc[
        "features"
    ]
    assert (tmp_path / "ds/videos/image/chunk-000/file-000.mp4").is_file()
    imported = run_json("import", "lerobot", tmp_path / "ds", "--buffer", tmp_path / "buf")
    assert imported["mode"] == "rbtool" and imported["kept_ids"]
    assert run("diff", SOURCE, tmp_path / "buf", "--deep", "--json").exit_code == 0  # the same data
    episodes = run_json("import", "lerobot", tmp_path / "ds", "-b", tmp_path / "b2", "--no-sidecar")
    assert episodes["mode"] == "episodes"
    human = run("export", SOURCE, tmp_path / "d2", "--to", "lerobot", "--fps", "10", "--video")
    assert human.exit_code == 0 and "1 video" in human.stdout
    refused = run(
        "export", SOURCE, tmp_path / "d3", "--to", "lerobot", "--fps", "10", "--video", "--no-images"
    )
    assert_one_error(refused, 2)
    assert "--video needs --images" in refused.stderr
    (tmp_path / "ds/videos/image/chunk-000/file-000.mp4").write_bytes(b"not a video")
    broken = run("import", "lerobot", tmp_path / "ds", "-b", tmp_path / "b3", "--no-sidecar")
    assert_one_error(broken)
    assert "not a readable video" in broken.stderr
    assert not staging_left(tmp_path)


def test_only_video_paths_import_pyav(tmp_path: Path) -> None:
    import subprocess
    import sys

    run_json("export", SOURCE, tmp_path / "ds", "--to", "lerobot", "--fps", "5")
    code = (
        "import sys\n"
        "from rbtool.cli import app\n"
        "for argv in (['--help'], ['verify', sys.argv[1]], ['export', '--help'],\n"
        "             ['export', sys.argv[1], sys.argv[2], '--to', 'lerobot', '--fps', '5'],\n"
        "             ['import', 'lerobot', sys.argv[3], '-b', sys.argv[4]]):\n"
        "    try:\n"
        "        app(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('av' in sys.modules, file=sys.stderr)\n"
    )
    args = [str(SOURCE), str(tmp_path / "d2"), str(tmp_path / "ds"), str(tmp_path / "buf")]
    probe = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert probe.stderr.strip().splitlines()[-1] == "False", probe.stderr
    assert (tmp_path / "d2/meta/info.json").is_file() and (tmp_path / "buf").is_dir()
