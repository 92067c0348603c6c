"""What doctor reports: the checks it knows, its findings and the report that holds them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import UsageError

ERROR, WARNING, INFO = "error", "warning", "info"
LEVELS = (ERROR, WARNING, INFO)

# Every check, in report order, with what it looks for (docs/cli.md gives each exact rule).
CHECKS: dict[str, str] = {
    "index": "a file that disagrees with its index entry, or a trajectory that cannot be checked",
    "non-finite": "NaN or +-Inf in a float field",
    "frozen": "an action field (or a named field) constant over a trajectory's env column",
    "blank-camera": "an image field constant over a trajectory's env column",
    "done-flags": "dones != terminations | truncations on some row",
    "pairing": "next_obs[t] differs from curr_obs[t + 1] where no episode ended at t",
    "policy": "model_weights_id not derived from versions; versions far behind the newest",
    "duplicates": "trajectories whose tensors are equal byte for byte",
    "rewards": "rewards outside the given range",
    "episodes": "episodes longer than max_episode_length; env columns that never end",
}


def select_checks(checks: Iterable[str] | None = None, skip: Iterable[str] = ()) -> tuple[str, ...]:
    """The checks to run, in report order: `checks` (default all) less `skip`; unknown names refused."""
    chosen = list(CHECKS) if checks is None else list(checks)
    skipped = list(skip)
    unknown = [c for c in [*chosen, *skipped] if c not in CHECKS]
    if unknown:
        raise UsageError(f"unknown check {unknown[0]!r}; the checks are {', '.join(CHECKS)}")
    return tuple(c for c in CHECKS if c in chosen and c not in skipped)


def runs(ids: Sequence[int], limit: int | None = None) -> str:
    """Ids as runs, `0-4, 7`, in ascending order; past `limit` runs, how many runs are left out."""
    parts: list[str] = []
    ordered = sorted(set(ids))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    if limit is not None and len(parts) > limit:
        return ", ".join(parts[:limit]) + f", ... ({len(parts) - limit} more runs)"
    return ", ".join(parts)


# A finding's --json keys, in order.
JSON_KEYS = ("check", "level", "checkpoint", "ids", "field", "envs", "steps", "message", "advice")


@dataclass
class Finding:
    """One thing doctor found: which check, how bad, where (trajectory ids, field, env columns,
    steps, i.e. stored rows) and one sentence on what to do."""

    check: str
    level: str
    ids: list[int]
    message: str
    advice: str
    field: str | None = None
    envs: list[int] | None = None
    steps: list[int] | None = None
    checkpoint: str = ""

    def as_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in JSON_KEYS}

    def __reduce__(self) -> Any:  # workers send a million of them: fields, not a __dict__ each
        fields = (self.check, self.level, self.ids, self.message, self.advice)
        return Finding, (*fields, self.field, self.envs, self.steps, self.checkpoint)


_LEVEL_RANK = {level: rank for rank, level in enumerate(LEVELS)}
_CHECK_RANK = {check: rank for rank, check in enumerate(CHECKS)}


def _order(f: Finding) -> tuple[int, int, str, list[int], str]:
    """Report order: level, check, then where (directory, ids, field)."""
    return _LEVEL_RANK[f.level], _CHECK_RANK[f.check], *_where(f)


def _where(f: Finding) -> tuple[str, list[int], str]:
    return f.checkpoint, f.ids, f.field or ""


@dataclass
class Report:
    """doctor's result on one path: every finding, and what the pass read."""

    path: Path
    checks: tuple[str, ...]
    findings: list[Finding] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    trajectories: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    jobs: int = 1
    journal: dict[str, int] | None = None

    def sort(self) -> None:
        """Findings in `_order`: grouped by level and check first, then each group sorted by
        where (its findings came file by file, so mostly in order already: a million files'
        findings sort in a few passes, not in a comparison of whole keys each)."""
        groups: dict[tuple[int, int], list[Finding]] = {}
        for f in self.findings:
            groups.setdefault((_LEVEL_RANK[f.level], _CHECK_RANK[f.check]), []).append(f)
        ordered: list[Finding] = []
        for rank in sorted(groups):
            ordered += sorted(groups[rank], key=_where)
        self.findings = ordered

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(LEVELS, 0)
        for f in self.findings:
            counts[f.level] += 1
        return counts

    def fails(self, fail_on: str = ERROR) -> bool:
        """True when a finding reaches `fail_on` (error, or warning: warnings and errors)."""
        if fail_on not in (ERROR, WARNING):
            raise UsageError(f"fail_on must be error or warning, not {fail_on!r}")
        worst = LEVELS.index(fail_on)
        return any(LEVELS.index(f.level) <= worst for f in self.findings)

    @property
    def ok(self) -> bool:
        return not self.fails(ERROR)

    def as_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "ok": self.ok,
            "checks": list(self.checks),
            "checkpoints": self.checkpoints,
            "trajectories": self.trajectories,
            "counts": self.counts(),
            "findings": [f.as_json() for f in self.findings],
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 6),
            "jobs": self.jobs,
            "journal": self.journal,
        }
