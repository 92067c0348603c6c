"""What every command shares: -V, -h, completion, -q/-v/--no-progress/--color before or after the
command, RBTOOL_* environment defaults, and one line saying what was kept on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from conftest import at_terminal, make_traj, screen, sigint_default
from typer.testing import CliRunner

import rbtool
from rbtool.cli import app
from rbtool.cli._app import OPTION_ENVVARS, shared_params

ANSI = re.compile(r"\x1b\[[0-9;]*m")
WIDTHS = (80, 200)
SHARED = ("--quiet", "--verbose", "--no-progress", "--color")
ROOT_ONLY = ("--version", "--install-completion", "--show-completion")


def invoke(*args: str | Path, width: int = 80, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    """Run the command line in-process at `width` columns; stdout and stderr are pipes, not terminals."""
    environment = {"COLUMNS": str(width), "NO_COLOR": "", "FORCE_COLOR": None, **(env or {})}
    return CliRunner().invoke(app, [str(a) for a in args], env=environment, terminal_width=width)


def commands() -> list[tuple[list[str], object]]:
    """Every command and group as typed after `rbtool` (the root is [])."""
    found: list[tuple[list[str], object]] = []

    def walk(path: list[str], command: object) -> None:
        found.append((path, command))
        for name, child in getattr(command, "commands", {}).items():
            walk([*path, name], child)

    walk([], typer.main.get_command(app))
    return found


def opts(command: object) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)}  # type: ignore[attr-defined]


@pytest.fixture
def ckpt(rlinf_copy) -> Path:  # type: ignore[no-untyped-def]
    return rlinf_copy("varying_shapes_pt/ckpt")


# ------------------------------------------------------------------ version, help, completion
@pytest.mark.parametrize("flag", ["-V", "--version"])
def test_version_flag_prints_the_version_line_like_the_command(flag: str) -> None:
    result = invoke(flag)
    assert result.exit_code == 0 and result.stderr == ""
    assert result.stdout == f"rbtool {rbtool.__version__}\n" == invoke("version").stdout


@pytest.mark.parametrize("width", WIDTHS)
def test_dash_h_is_help_on_every_command_and_group(width: int) -> None:
    for path, _command in commands():
        short, long = invoke(*path, "-h", width=width), invoke(*path, "--help", width=width)
        assert short.exit_code == 0 and long.exit_code == 0, path
        assert short.stdout == long.stdout and "Usage:" in short.stdout, path
        assert short.stderr == "", path


@pytest.mark.parametrize("width", WIDTHS)
def test_shared_options_exist_on_every_command_and_group_and_show_their_variables(width: int) -> None:
    for path, command in commands():
        assert set(SHARED) <= opts(command), path
        assert (set(ROOT_ONLY) <= opts(command)) == (path == []), path
        text = " ".join(invoke(*path, "--help", width=width).stdout.split())
        for variable in ("RBTOOL_QUIET", "RBTOOL_VERBOSE", "RBTOOL_NO_PROGRESS", "RBTOOL_COLOR"):
            assert variable in text, (path, variable)


def test_the_common_options_read_their_rbtool_variable_wherever_they_appear() -> None:
    seen = dict.fromkeys(OPTION_ENVVARS, 0)
    for path, command in commands():
        text = " ".join(invoke(*path, "--help").stdout.split())  # lines wrap anywhere
        for param in command.params:  # type: ignore[attr-defined]
            for option, variable in OPTION_ENVVARS.items():
                if option in param.opts:
                    assert param.envvar == variable and param.show_envvar, (path, option)
                    assert f"env var: {variable}" in text, (path, option)
                    seen[option] += 1
    assert all(seen.values()), seen


def test_completion_script_is_shown_without_importing_torch() -> None:
    code = (
        "import runpy, sys\n"
        "sys.argv = ['rbtool', '--show-completion']\n"
        "try:\n    runpy.run_module('rbtool', run_name='__main__')\n"
        "except SystemExit as exit:\n    assert exit.code in (0, None), exit.code\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    # The shell is found among the parent processes, as when a user types it: run under bash
    # (a second command keeps bash from replacing itself with the first).
    script = f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    probe = subprocess.run(["bash", "-c", f"{script}; exit $?"], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert probe.stderr.strip() == "False"
    assert "complete -o default -F" in probe.stdout and "_RBTOOL_COMPLETE=complete_bash" in probe.stdout


@pytest.mark.parametrize(
    ("words", "expected"), [("rbtool sta", "stats"), ("rbtool stats --ind", "--index-only")]
)
def test_completion_completes_commands_and_options_without_importing_torch(words: str, expected: str) -> None:
    code = (
        "import sys\n"
        "sys.argv = ['rbtool']\n"
        "from rbtool.cli import main\n"
        "try:\n    main()\n"
        "except SystemExit as exit:\n    assert exit.code in (0, None), exit.code\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    env = {**os.environ, "_RBTOOL_COMPLETE": "complete_bash", "COMP_WORDS": words}
    env["COMP_CWORD"] = str(len(words.split()) - 1)
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert probe.returncode == 0, probe.stderr
    assert probe.stderr.strip() == "False"
    assert expected in probe.stdout.split()


# ------------------------------------------------------------------ -q, -v, --no-progress
def published_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("added trajectory ids ")]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_prints_the_result_only(tmp_path: Path, five_files: list[Path], where: str, width: int) -> None:
    plain = invoke("ingest", *five_files, "-b", tmp_path / "plain", width=width)
    assert plain.exit_code == 0 and published_lines(plain.stderr)  # not a terminal: a line per batch
    args = ["ingest", *five_files, "-b", tmp_path / "quiet"]
    quiet = invoke(*(["-q", *args] if where == "before" else [*args, "-q"]), width=width)
    assert quiet.exit_code == 0 and quiet.stderr == ""
    assert quiet.stdout == plain.stdout.replace(str(tmp_path / "plain"), str(tmp_path / "quiet"))


def test_quiet_still_prints_errors(tmp_path: Path) -> None:
    result = invoke("stats", tmp_path / "missing", "-q")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith("Error: ") and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("option", ["--no-progress", "-q"])
def test_no_progress_drops_the_progress_lines(tmp_path: Path, five_files: list[Path], option: str) -> None:
    result = invoke("ingest", *five_files, "-b", tmp_path / "b", option)
    assert result.exit_code == 0 and published_lines(result.stderr) == []


@pytest.mark.parametrize("width", WIDTHS)
def test_verbose_names_phases_and_the_time_taken(ckpt: Path, width: int) -> None:
    plain = invoke("verify", ckpt, "--deep", width=width)
    verbose = invoke("-v", "verify", ckpt, "--deep", width=width)
    assert verbose.exit_code == plain.exit_code == 0
    digits = re.compile(r"\d+(\.\d+)?")  # verify's report names its own read rate
    assert digits.sub("N", verbose.stdout) == digits.sub("N", plain.stdout) and plain.stderr == ""
    lines = verbose.stderr.splitlines()
    assert lines[-1].startswith("rbtool verify: done in ") and lines[-1].endswith(" s")
    assert any(line.endswith(" ...") for line in lines)  # a phase begins
    assert any(re.search(r": (\d+ done )?in \d+\.\d\d s$", line) for line in lines[:-1])  # and ends


def test_verbose_shows_each_published_batch(tmp_path: Path, five_files: list[Path]) -> None:
    result = invoke("ingest", *five_files, "-b", tmp_path / "b", "-v", "--no-progress")
    assert result.exit_code == 0 and published_lines(result.stderr)


def test_quiet_and_verbose_together_is_a_usage_error(ckpt: Path) -> None:
    result = invoke("stats", ckpt, "-q", "-v")
    assert result.exit_code == 2 and result.stdout == "" and "not both" in result.stderr


def test_a_flag_on_the_command_line_beats_the_environment(tmp_path: Path, five_files: list[Path]) -> None:
    quiet = invoke("ingest", *five_files, "-b", tmp_path / "a", env={"RBTOOL_QUIET": "1"})
    assert quiet.exit_code == 0 and quiet.stderr == ""
    verbose = invoke("ingest", *five_files, "-b", tmp_path / "b", "-v", env={"RBTOOL_QUIET": "1"})
    assert verbose.exit_code == 0 and verbose.stderr.splitlines()[-1].startswith("rbtool ingest: done in ")


def test_settings_do_not_leak_into_the_next_command_line(ckpt: Path) -> None:
    assert invoke("-v", "stats", ckpt, "--index-only").stderr
    assert invoke("stats", ckpt, "--index-only").stderr == ""


# ------------------------------------------------------------------ colour
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize(
    ("args", "env", "coloured"),
    [
        ([], {}, False),  # piped: auto means none
        (["--color", "always"], {}, True),
        (["--color", "never"], {"FORCE_COLOR": "1"}, False),
        (["--color", "auto"], {"FORCE_COLOR": "1"}, True),
        ([], {"NO_COLOR": "1", "FORCE_COLOR": "1"}, False),
        (["--color", "always"], {"NO_COLOR": "1"}, True),  # the flag beats the variable
        ([], {"RBTOOL_COLOR": "always"}, True),
    ],
)
def test_color_mode_and_no_color(
    ckpt: Path, tmp_path: Path, args: list[str], env: dict[str, str], coloured: bool, width: int
) -> None:
    result = invoke("shard", ckpt, "-n", "2", "-o", tmp_path / "out", *args, width=width, env=env)
    assert result.exit_code == 0, result.stderr
    assert bool(ANSI.search(result.stdout)) is coloured
    assert "rank_0" in ANSI.sub("", result.stdout)


def test_color_reaches_the_consoles_commands_make(ckpt: Path) -> None:
    """stats draws piped output on a console of its own: it follows --color like stdout's."""
    assert ANSI.search(invoke("stats", ckpt, "--color", "always").stdout)
    assert not ANSI.search(invoke("stats", ckpt, "--color", "never", env={"FORCE_COLOR": "1"}).stdout)


def test_a_bad_color_lists_the_choices(ckpt: Path) -> None:
    result = invoke("stats", ckpt, "--color", "sometimes")
    assert result.exit_code == 2 and "auto" in result.stderr and "never" in result.stderr


# ------------------------------------------------------------------ environment defaults
def test_rbtool_format_sets_the_format_of_a_new_buffer(tmp_path: Path, five_files: list[Path]) -> None:
    result = invoke("ingest", *five_files, "-b", tmp_path / "b", "--json", env={"RBTOOL_FORMAT": "pkl"})
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["trajectory_format"] == "pkl"
    assert sorted(p.suffix for p in (tmp_path / "b").glob("trajectory_*_*")) == [".pkl"] * 5


def test_rbtool_window_and_jobs_are_defaults_the_command_line_overrides(ckpt: Path) -> None:
    def window(*args: str, env: dict[str, str]) -> object:
        result = invoke("stats", ckpt, "--index-only", "--json", *args, env=env)
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)["window"]

    two, three = window(env={"RBTOOL_WINDOW": "2"}), window("--window", "3", env={"RBTOOL_WINDOW": "2"})
    assert two != three and two == window("--window", "2", env={})
    bad = invoke("verify", ckpt, env={"RBTOOL_JOBS": "0"})
    assert bad.exit_code == 2 and "RBTOOL_JOBS" in bad.stderr
    assert invoke("verify", ckpt, "--deep", env={"RBTOOL_JOBS": "1"}).exit_code == 0


def test_every_shared_option_is_declared_once() -> None:
    names = [o for p in shared_params() for o in p.opts]
    assert len(names) == len(set(names)) and set(SHARED) <= set(names)


# ------------------------------------------------------------------ Ctrl-C
def loose_sources(directory: Path, n: int) -> list[Path]:
    """n distinct small .pkl trajectory files (one trajectory, its rewards changed per file)."""
    import torch

    from rbtool.files import trajfile

    directory.mkdir(parents=True)
    traj = make_traj(t=2, b=1, seed=0)
    paths = []
    for i in range(n):
        traj["rewards"] = torch.full_like(traj["rewards"], float(i))
        path = directory / f"s{i:04d}.pkl"
        path.write_bytes(trajfile.to_bytes(traj, "pkl"))
        paths.append(path)
    return paths


def interrupt(argv: list[str | Path], ready: object, cwd: Path) -> tuple[int, list[str]]:
    """Start `python -m rbtool ARGV`, send SIGINT to its process group (as Ctrl-C at a terminal
    does, workers included) once `ready` says so, and return the exit status and stderr lines.

    `ready` is "first line" (after the first stderr line) or a function polled until true."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rbtool", *map(str, argv)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(Path(rbtool.__file__).parents[1])},
        start_new_session=True,
        preexec_fn=sigint_default,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    if ready == "first line":
        lines.append(proc.stderr.readline().rstrip("\n"))
    else:
        deadline = time.monotonic() + 120
        while not ready() and proc.poll() is None and time.monotonic() < deadline:  # type: ignore[operator]
            time.sleep(0.001)
    os.killpg(proc.pid, signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    return proc.returncode, lines + rest.splitlines()


def test_ctrl_c_mid_ingest_says_which_ids_the_buffer_holds(tmp_path: Path) -> None:
    from rbtool.files.index import read_index
    from rbtool.ops.verify import verify_checkpoint

    loose_sources(tmp_path / "src", 600)
    buffer = tmp_path / "buffer"
    status, lines = interrupt(["ingest", "src", "-b", buffer, "--format", "pkl"], "first line", tmp_path)
    assert re.fullmatch(r"added trajectory ids 0(-\d+)?", lines[0]), lines  # a batch was published
    assert status == 130, lines
    held = read_index(buffer).id_list
    assert 0 < len(held) < 600  # interrupted between the first batch and the last
    ids = "0" if len(held) == 1 else f"0-{held[-1]}"  # a loaded machine may publish a batch of one first
    assert lines[-1] == f"interrupted: the buffer {buffer} holds ids {ids}; nothing half-written"
    assert held == list(range(len(held)))
    assert not [p for p in verify_checkpoint(buffer).problems if p.severity == "error"]
    assert len(list(buffer.glob("trajectory_*_*"))) == len(held)  # no file beyond the index


def test_ctrl_c_mid_convert_writes_nothing_to_out(tmp_path: Path) -> None:
    from rbtool.ops.ingestion import ingest

    ingest(loose_sources(tmp_path / "src", 400), tmp_path / "ckpt")
    before = sorted(p.name for p in tmp_path.iterdir())

    def staging() -> bool:
        return any(p.name not in before for p in tmp_path.iterdir())

    status, lines = interrupt(
        ["convert", "ckpt", "-o", "out", "--format", "pkl", "-j", "2"], staging, tmp_path
    )
    assert status == 130, lines
    assert lines == ["interrupted: nothing was written to out"]  # and no worker's traceback
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUT, no staging left


def test_ctrl_c_before_force_replaces_out_leaves_it_as_it_was(tmp_path: Path) -> None:
    from conftest import tree_digest

    from rbtool.ops.ingestion import ingest

    ingest(loose_sources(tmp_path / "src", 400), tmp_path / "ckpt")
    ingest(loose_sources(tmp_path / "other", 3), tmp_path / "out")
    before, digest = sorted(p.name for p in tmp_path.iterdir()), tree_digest(tmp_path / "out")

    def staging() -> bool:
        return any(p.name not in before for p in tmp_path.iterdir())

    argv = ["convert", "ckpt", "-o", "out", "--format", "pkl", "--force", "-j", "1"]
    status, lines = interrupt(argv, staging, tmp_path)
    assert status == 130, lines
    assert lines == ["interrupted: out is left as it was"]
    assert tree_digest(tmp_path / "out") == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_force_color_colours_a_log_but_shows_no_progress_bar(ckpt: Path) -> None:
    result = invoke("verify", ckpt, "--deep", "-j", "1", env={"FORCE_COLOR": "1"})
    assert result.exit_code == 0 and result.stderr == ""  # no bar: stderr is not a terminal


@pytest.mark.parametrize("width", WIDTHS)
def test_quiet_leaves_out_warnings_that_only_inform(ckpt: Path, tmp_path: Path, width: int) -> None:
    def leftover() -> None:  # what a writer killed earlier (a pid that no longer runs) left
        (tmp_path / f".out.rbtool-staging-999999999@{socket.gethostname()}-0123456789ab").mkdir()

    leftover()
    plain = invoke("shard", ckpt, "-n", "2", "-o", tmp_path / "out", width=width)
    assert plain.exit_code == 0 and plain.stderr.startswith("Warning: ") and "removed 1" in plain.stderr
    leftover()
    quiet = invoke("shard", ckpt, "-n", "2", "-o", tmp_path / "out", "--force", "-q", width=width)
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout
    assert not list(tmp_path.glob(".out.rbtool-staging-*"))


def test_what_the_interrupt_line_says_for_each_kind_of_command(tmp_path: Path, ckpt: Path) -> None:
    from rbtool.cli._app import _state, interrupted_line

    assert interrupted_line(None, None, None) == "interrupted: nothing was written"
    new = tmp_path / "new"
    assert interrupted_line(new, None, None) == f"interrupted: nothing was written to {new}"
    assert interrupted_line(ckpt, _state(ckpt), None) == f"interrupted: {ckpt} is left as it was"
    new.mkdir()  # published (renamed into place) just before the interrupt
    assert interrupted_line(new, None, None) == f"interrupted: {new} had been written in full"
    assert interrupted_line(None, None, tmp_path / "nobuffer") == (
        f"interrupted: nothing was written to {tmp_path / 'nobuffer'}"
    )
    index = _state(ckpt / "trajectory_index.json")
    assert interrupted_line(None, None, ckpt, index) == f"interrupted: the buffer {ckpt} is left as it was"
    assert interrupted_line(None, None, ckpt, None) == (  # the index was published meanwhile
        f"interrupted: the buffer {ckpt} holds ids 0-5; nothing half-written"
    )


# ------------------------------------------------------------------ at a terminal
@pytest.mark.parametrize("argv", [["stats"], ["verify", "--deep"], ["stats", "--window", "0"]])
def test_a_report_at_a_terminal_leaves_no_bar_behind(argv: list[str], ckpt: Path, tmp_path: Path) -> None:
    """The bar is gone before the report is printed: the screen holds the report alone, its
    first line not glued onto a bar."""
    status, shown = at_terminal([argv[0], ckpt, *argv[1:]], tmp_path)
    lines = screen(shown)
    assert status == 0 and "eta" in shown  # a bar was shown ...
    assert not [line for line in lines if "eta" in line or "\u2501" in line], lines  # ... and cleared
    assert lines[0].startswith(("OK ", str(ckpt)[:30])), lines[:3]


def test_the_screen_player_plays_what_a_bar_does() -> None:
    bar = "\x1b[?25lreading \x1b[32m1/5\x1b[0m eta\r\x1b[2Kreading 5/5 eta\r\n\x1b[?25h\r\x1b[1A\x1b[2K"
    assert screen(bar + "report\nmore\n") == ["report", "more"]
    assert screen("reading 5/5 eta" + "report\n") == ["reading 5/5 etareport"]  # glued: seen as such
    assert screen("x" * 85 + "\n", width=80) == ["x" * 80, "x" * 5]


def test_a_terminal_gets_a_progress_bar_and_no_progress_lines(tmp_path: Path) -> None:
    loose_sources(tmp_path / "src", 70)  # two batches (64 a batch)
    status, shown = at_terminal(["ingest", "src", "-b", "a", "--format", "pkl"], tmp_path)
    assert status == 0 and "checking sources" in shown and "eta" in shown
    assert "added trajectory ids" not in shown  # the bar is the progress
    status, shown = at_terminal(["ingest", "src", "-b", "b", "--format", "pkl", "--no-progress"], tmp_path)
    assert status == 0 and "eta" not in shown and "added trajectory ids" not in shown
    assert "\x1b[" in shown  # colour at a terminal ...
    argv = ["--color", "never", "ingest", "src", "-b", "c", "--format", "pkl", "--no-progress"]
    status, shown = at_terminal(argv, tmp_path)
    assert status == 0 and "\x1b[" not in shown and "ingest into c" in shown  # ... unless never


def test_ctrl_c_at_a_terminal_clears_the_bar_and_says_what_was_kept(tmp_path: Path) -> None:
    loose_sources(tmp_path / "src", 600)
    status, shown = at_terminal(["ingest", "src", "-b", "buffer"], tmp_path, interrupt_on=b"checking sources")
    assert status == 130
    last = shown.replace("\r", "\n").strip().splitlines()[-1]
    # interrupted while every source is being checked, before anything is written
    assert re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", last) == "interrupted: nothing was written to buffer", shown[
        -500:
    ]
    assert "Traceback" not in shown and not (tmp_path / "buffer").exists()


def test_verbose_names_the_options_set_by_the_environment_once(ckpt: Path) -> None:
    env = {"RBTOOL_JOBS": "1", "RBTOOL_COLOR": "never"}
    lines = invoke("-v", "verify", ckpt, "--deep", env=env).stderr.splitlines()
    assert (
        lines.count("--jobs from RBTOOL_JOBS=1") == 1 and lines.count("--color from RBTOOL_COLOR=never") == 1
    )
    lines = invoke("verify", ckpt, "--deep", "-v", "-j", "2", env=env).stderr.splitlines()
    assert not [line for line in lines if line.startswith("--jobs from")]  # the command line's -j
