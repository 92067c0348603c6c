"""The options that several commands share, each declared once as an `Annotated` alias, and the
checks of how they combine.

A command lists the aliases it takes in its signature; the group (`_app`) adds the options of
every command (-q, -v, --no-progress, --color) itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from rbtool.errors import UsageError

# Lists that grow with a checkpoint are cut to their first SUMMARY_ITEMS items unless --all.
SUMMARY_ITEMS = 20


def summary_limit(all_items: bool) -> int | None:
    """How many items a summarised list keeps: None (all) with --all."""
    return None if all_items else SUMMARY_ITEMS


class TrajectoryFormat(str, enum.Enum):
    """How trajectory files are serialised."""

    pt = "pt"
    pkl = "pkl"


JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print exactly one JSON document on stdout (compact; see --pretty).")
]
PrettyOpt = Annotated[bool, typer.Option("--pretty", help="With --json: indent the document for reading.")]
JsonlOpt = Annotated[
    bool,
    typer.Option(
        "--jsonl", help="Print JSON Lines on stdout: one compact object per trajectory or problem, streamed."
    ),
]
AllOpt = Annotated[
    bool,
    typer.Option(
        "--all", help=f"List everything (default: counts, id ranges and the first {SUMMARY_ITEMS} items)."
    ),
]
JobsOpt = Annotated[
    int | None,
    typer.Option(
        "--jobs",
        "-j",
        min=1,
        help="Files worked on at once (default: the number of cores).",
        show_default=False,
    ),
]
JournalOpt = Annotated[
    Path | None,
    typer.Option(
        "--journal",
        help="Record each file read in DIR as it is done; a rerun with the same DIR skips the recorded "
        "files whose files are unchanged (resume after a crash or a lost rank).",
        metavar="DIR",
        show_default=False,
    ),
]
CopyOpt = Annotated[
    bool,
    typer.Option(
        "--copy",
        help="Write trajectory files of the output's own: reflinked (copy-on-write) where the file "
        "system can, else copied; never hard links to the input's files.",
    ),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Replace OUT if it is an existing checkpoint directory.")
]
RanksForceOpt = Annotated[
    bool,
    typer.Option("--force", help="Replace OUT if it is empty, a checkpoint or an earlier rank tree output."),
]
SourceArg = Annotated[
    str, typer.Argument(metavar="IN", help="A checkpoint, or a folder of rank_* checkpoints (or a URL).")
]
WorldSizeOpt = Annotated[int, typer.Option("--world-size", "-n", min=1, help="Number of ranks.")]
WindowOpt = Annotated[
    int, typer.Option("--window", "-w", min=0, help="Sampling window: the last N trajectories (0 = all).")
]
StrictOpt = Annotated[
    bool,
    typer.Option(
        "--strict/--non-strict",
        help="Refuse a checkpoint whose index names missing files (--non-strict keeps what exists).",
    ),
]
FormatOpt = Annotated[
    TrajectoryFormat | None,
    typer.Option(
        "--format",
        help="Trajectory file format (default: the format the buffer or input already has, else pt).",
        show_default=False,
    ),
]
PathsArg = Annotated[
    list[str],
    typer.Argument(
        metavar="PATH",
        help="Checkpoints or buffer directories, or folders of rank_* checkpoints (or URLs); each is "
        "reported.",
        show_default=False,
    ),
]
WideOpt = Annotated[
    bool,
    typer.Option(
        "--wide",
        help="At a terminal, keep every column and whole model_weights_ids even where lines get "
        "longer than the terminal (piped output always has them).",
    ),
]


DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Check the inputs and the output path, show what would be written, and write nothing.",
    ),
]
StorageOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        metavar="KEY=VALUE",
        help="For URLs (s3://, gs://, ...): an fsspec storage option, e.g. endpoint_url=http://host:9000 "
        "(repeatable; a value that parses as JSON is that value, else a string). URLs are read through "
        "a local cache of the user's own: RBTOOL_CACHE_DIR (default ~/.cache/rbtool/remote), "
        "RBTOOL_CACHE_BYTES (default 20 GiB), RBTOOL_CACHE_SHARED=1 for a shared (sticky) one.",
        show_default=False,
    ),
]
DirArg = Annotated[str, typer.Argument(metavar="PATH", help="A checkpoint or buffer directory, or a URL.")]


class Strategy(str, enum.Enum):
    """How sample positions are drawn from the window."""

    uniform = "uniform"
    topk = "topk"


StrategyOpt = Annotated[
    Strategy,
    typer.Option(
        "--strategy",
        help="uniform: every sample of the window alike; topk: among the K highest-reward samples.",
    ),
]
KOpt = Annotated[
    int | None, typer.Option("--k", min=1, help="topk: how many highest-reward samples are candidates.")
]
TemperatureOpt = Annotated[
    float,
    typer.Option(
        "--temperature", help="topk: weights are softmax(reward / T); larger T spreads draws more evenly."
    ),
]
SeedOpt = Annotated[
    int | None, typer.Option("--seed", help="Generator seed (default: the checkpoint's seed, else 1234).")
]


def refuse_k_without_topk(strategy: Strategy, k: int | None) -> None:
    """--k means nothing to uniform draws (the library ignores it), and topk needs it: usage errors,
    exit 2, in the options' words."""
    if strategy is Strategy.uniform and k is not None:
        raise typer.BadParameter("applies only to --strategy topk", param_hint="--k")
    if strategy is Strategy.topk and k is None:
        raise UsageError("--strategy topk needs --k K (how many highest-reward samples are candidates)")


def refuse_link_with_copy(link: bool, copy: bool) -> None:
    """--link and --copy say opposite things about loose files (a usage error, exit 2)."""
    if link and copy:
        raise UsageError("--link and --copy exclude each other; give one of them")


def refuse_output_mix(json: bool, jsonl: bool = False, pretty: bool = False) -> None:
    """--json and --jsonl exclude each other; --pretty indents --json only (usage errors, exit 2)."""
    if json and jsonl:
        raise typer.BadParameter("give --json or --jsonl, not both", param_hint="--jsonl")
    if pretty and not json:
        raise typer.BadParameter("applies only with --json", param_hint="--pretty")


# ------------------------------------------------------------ option groups
# Options that go together on many commands, taken as one parameter: a command declares
# `output: Report = Report()` and gets --all, --json and --pretty (`_app.Typer` spells a group
# out as its options for the parser and gathers their values back into the group).


@dataclass(frozen=True)
class Json:
    """--json and --pretty: a command that prints one JSON document."""

    json: JsonOpt = False
    pretty: PrettyOpt = False


@dataclass(frozen=True)
class Report:
    """--all, --json and --pretty: a command whose view summarises lists that grow with a checkpoint."""

    all_items: AllOpt = False
    json: JsonOpt = False
    pretty: PrettyOpt = False

    @property
    def limit(self) -> int | None:
        """How many items a summarised list keeps (`summary_limit`)."""
        return summary_limit(self.all_items)


@dataclass(frozen=True)
class Lines(Report):
    """A `Report` that can also stream JSON Lines (--jsonl)."""

    jsonl: JsonlOpt = False


@dataclass(frozen=True)
class BufferWrites:
    """--copy and --dry-run: a command that adds to (or restores) a buffer directory."""

    copy: CopyOpt = False
    dry_run: DryRunOpt = False


@dataclass(frozen=True)
class Replacing(BufferWrites):
    """--copy, --dry-run and --force: how a command treats the checkpoint OUT it writes."""

    force: ForceOpt = False


@dataclass(frozen=True)
class LocalWrites(Report, Replacing):
    """The options of a command that writes a checkpoint OUT from other checkpoints' files:
    `Replacing`'s, then `Report`'s."""


@dataclass(frozen=True)
class Writes(LocalWrites):
    """`LocalWrites` whose input and output may be URLs (--storage-option)."""

    storage_option: StorageOpt = None


@dataclass(frozen=True)
class RankWrites(Writes):
    """`Writes` of a command that may write a rank tree: --force also replaces an empty directory
    or an earlier rank tree."""

    force: RanksForceOpt = False


@dataclass(frozen=True)
class Pass:
    """--jobs and --journal: how a pass over a checkpoint's files runs."""

    jobs: JobsOpt = None
    journal: JournalOpt = None
