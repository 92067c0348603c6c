"""The examples at the end of every command's --help, the same as in docs/cli.md.

Each command's examples are (what it does, command line) pairs. They name these paths, which
tests/test_cli_examples.py creates from fixtures/rlinf/ before running every example, in order,
in one directory: `ckpt` (a checkpoint, six trajectories), `buffer` (a buffer directory),
`ranks` (a folder of rank_0 and rank_1), `broken` (a checkpoint whose index names missing
files) and `trajs` (a folder of loose trajectory files). Other paths are written by an earlier
example. A command line may begin with `NAME=value` environment settings.
"""

from __future__ import annotations

EXAMPLES: dict[str, tuple[tuple[str, str], ...]] = {
    "": (
        ("print the version", "rbtool -V"),
        ("results only, no progress or notes", "rbtool -q stats ckpt"),
        (
            "the same options after the command, and an environment default",
            "RBTOOL_JOBS=2 rbtool verify ckpt -v",
        ),
        ("no colour, as NO_COLOR=1 does", "rbtool stats ckpt --color never"),
    ),
    "ingest": (
        ("add a folder of trajectory files to a buffer directory", "rbtool ingest trajs --buffer buffer"),
        (
            "add two ranks' checkpoints, in order, into a new buffer",
            "rbtool ingest ranks/rank_0 ranks/rank_1 -b all-ranks",
        ),
        ("hard-link loose files instead of copying them, quietly", "rbtool ingest trajs -b linked --link -q"),
    ),
    "checkpoint": (("save a buffer directory as a checkpoint", "rbtool checkpoint save buffer saved"),),
    "checkpoint save": (
        (
            "save the last 3 trajectories of a buffer directory",
            "rbtool checkpoint save buffer last3 --window 3",
        ),
        (
            "save loose files in pkl format instead, replacing that save",
            "rbtool checkpoint save trajs last3 --format pkl --force",
        ),
    ),
    "checkpoint load": (
        (
            "what rank 1 of 2 loads in a distributed run",
            "rbtool checkpoint load ckpt --world-size 2 --rank 1",
        ),
        (
            "restore a checkpoint into a buffer directory, for ingest",
            "rbtool checkpoint load ckpt --buffer restored",
        ),
    ),
    "shard": (("split a checkpoint over 4 ranks", "rbtool shard ckpt -n 4 -o ckpt-4ranks"),),
    "merge": (("merge two ranks' checkpoints into one", "rbtool merge ranks/rank_0 ranks/rank_1 -o merged"),),
    "reshard": (
        ("show how 2 ranks would become 3, writing nothing", "rbtool reshard ranks -n 3 -o ranks3 --dry-run"),
        ("write 3 ranks of about equal samples", "rbtool reshard ranks -n 3 -o ranks3 --balance samples"),
    ),
    "filter": (
        ("keep the trajectories of at least 8 samples", "rbtool filter ckpt -o long --min-samples 8"),
        ("keep the last 2 trajectories", "rbtool filter ckpt -o recent --last 2"),
    ),
    "diff": (("compare a rank folder with its merge", "rbtool diff ranks merged"),),
    "convert": (
        (
            "rewrite every trajectory file as pkl, 2 at a time",
            "rbtool convert ckpt -o ckpt-pkl --format pkl -j 2",
        ),
    ),
    "export": (
        (
            "export to a LeRobot dataset at 10 frames per second",
            "rbtool export ckpt dataset --to lerobot --fps 10 --task 'pick the cube'",
        ),
    ),
    "import": (("import a LeRobot dataset", "rbtool import lerobot dataset --buffer from-lerobot"),),
    "import lerobot": (
        (
            "import episodes 0 to 2 of a LeRobot dataset",
            "rbtool import lerobot dataset --buffer first3 --episodes 0-2",
        ),
    ),
    "stats": (
        ("summarise a checkpoint", "rbtool stats ckpt"),
        ("only what the index records (no trajectory file is opened)", "rbtool stats ckpt --index-only"),
        ("one JSON object per trajectory, for another tool", "rbtool stats ckpt --jsonl"),
    ),
    "sample": (
        ("draw 8 rows from the last 4 trajectories", "rbtool sample ckpt --num-chunks 8 --window 4 --seed 1"),
        (
            "draw among the 3 highest-reward samples and save the batch",
            "rbtool sample ckpt --num-chunks 4 --strategy topk --k 3 --out batch.pt",
        ),
    ),
    "render": (
        (
            "a contact sheet of trajectory 1, env 1, with plots",
            "rbtool render ckpt --id 1 --env 1 --out t1.png",
        ),
        ("its frames over time as a GIF", "rbtool render ckpt --id 1 --out t1.gif --fps 4"),
    ),
    "report": (
        ("one self-contained HTML page, for a CI artifact", "rbtool report ckpt --out report.html"),
        ("Markdown for a pull request, images beside it", "rbtool report ranks --out ranks.md --markdown"),
    ),
    "view": (
        ("look at a checkpoint in the web browser", "rbtool view ckpt"),
        (
            "serve at port 9000 for an SSH tunnel, opening no browser",
            "rbtool view ckpt --port 9000 --no-open",
        ),
    ),
    "verify": (
        ("check a checkpoint's index and files", "rbtool verify ckpt"),
        ("also read every trajectory file, 2 at a time", "rbtool verify ckpt --deep -j 2"),
    ),
    "doctor": (
        ("check what a checkpoint's trajectories hold", "rbtool doctor ckpt"),
        (
            "a CI gate: fail on warnings too, with a Markdown summary",
            "rbtool doctor ranks --fail-on warning --markdown",
        ),
        ("two checks only, as JSON", "rbtool doctor ckpt --check non-finite --check done-flags --json"),
    ),
    "repair": (
        ("write a consistent copy of a checkpoint with missing files", "rbtool repair broken --out repaired"),
    ),
    "version": (("the version as JSON", "rbtool version --json"),),
}


def epilog(path: str) -> str | None:
    """The `Examples:` text of a command's --help (`path` as typed: "checkpoint save"; "" for rbtool)."""
    examples = EXAMPLES.get(path)
    if not examples:
        return None
    # \b keeps Click from rewrapping the lines that follow it.
    lines = ["Examples:", "", "\b"]
    for what, command in examples:
        lines += [f"  # {what}", f"  {command}"]
    return "\n".join(lines)
