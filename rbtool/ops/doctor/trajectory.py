"""The checks on one trajectory file, run on a worker process: everything doctor can tell
from the file alone, plus what the buffer-wide checks need of it (`Traits`).

Steps are stored rows of the field named (for done-like fields, rows of `[T + E, B]`);
env columns are indices along B.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any

from rbtool.errors import RbtoolError
from rbtool.format import one_line
from rbtool.ops.doctor.findings import ERROR, INFO, WARNING, Finding
from rbtool.passes.ranks import FileTask


@dataclass(frozen=True)
class Options:
    """What the checks are told: which run, the fields `frozen` looks at, the reward range."""

    checks: tuple[str, ...]
    frozen_fields: tuple[str, ...] = ("actions",)
    reward_range: tuple[float, float] | None = None


@dataclass(frozen=True)
class Task(FileTask):
    """One file of the pass."""

    options: Options


@dataclass
class Traits:
    """What the buffer-wide checks need of one trajectory: its content fingerprint and its newest
    policy version (None without a finite `versions`)."""

    fingerprint: str | None = None
    newest_version: float | None = None
    unpaired: bool = False  # next_obs never equals the following curr_obs, nor a shifted one

    def __reduce__(self) -> Any:  # a worker sends one a file: its fields, not its __dict__
        return Traits, (self.fingerprint, self.newest_version, self.unpaired)


@dataclass
class Result:
    findings: list[Finding] = field(default_factory=list)
    traits: Traits = field(default_factory=Traits)
    size: int = 0

    def __reduce__(self) -> Any:
        return Result, (self.findings, self.traits, self.size)


def weights_id_of(versions: Any) -> str:
    """The model_weights_id RLinf's `get_model_weights_id` derives: uuid5 of the DNS namespace and
    the hex of the tensor's bytes (`versions`, or a float32 zero `[1]` when there is none)."""
    if versions is None:
        return NO_VERSIONS_ID
    import torch

    return weights_id_of_bytes(versions.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def weights_id_of_bytes(data: Any) -> str:
    """RLinf's model_weights_id of a versions tensor whose bytes, in order, are `data`."""
    return str(uuid.uuid5(uuid.NAMESPACE_DNS, bytes(data).hex()))


# the id of a trajectory without versions: of a float32 zero's four bytes
NO_VERSIONS_ID = weights_id_of_bytes(bytes(4))


def _equal(a: Any, b: Any) -> Any:
    """Where rows of two `[rows, B, n]` tensors are equal (NaN equal to NaN), `[rows, B]`."""
    same = a == b
    if a.is_floating_point():
        same |= a.isnan() & b.isnan()
    return same.all(-1)


def _numpy(tensor: Any) -> Any:
    """The tensor as a numpy array sharing its memory, or None where numpy cannot hold it
    (bfloat16, a conjugate or negative bit, a tensor that needs grad). A check asks numpy
    first whether there is anything to report: one numpy call on a small array costs a
    microsecond, each torch call several, and a tiny trajectory's checks are many calls."""
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError):
        return None


def _nonzero(mask: Any) -> list[int]:
    return [int(i) for i in mask.nonzero().flatten().tolist()]


def _columns(mask: Any, b: int) -> tuple[list[int], list[int]]:
    """(env columns, rows) where a `[rows, B, ...]` bool mask holds anywhere."""
    cells = mask.reshape(mask.shape[0], b, -1).any(-1)
    return _nonzero(cells.any(0)), _nonzero(cells.any(1))


def finding(task: Task, check: str, level: str, message: str, advice: str, **where: Any) -> Finding:
    """A finding of one trajectory file, its message after the file's name."""
    return Finding(check, level, [task.tid], f"{task.path.name}: {message}", advice, **where)


def index_findings(task: Task, shape: Any, weights_id: str, mel: Any) -> list[Finding]:
    """The file's disagreements with its index entry (none without an entry)."""
    from rbtool.format.agreement import entry_disagreements

    if task.entry is None:
        return []
    return [
        Finding(
            "index",
            ERROR,
            [task.tid],
            message,
            "rewrite the entry from the file (`rbtool repair`) or restore the file",
            field=key,
        )
        for key, message in entry_disagreements(task.path.name, shape, weights_id, mel, task.entry)
    ]


def done_flags_finding(task: Task, count: int, envs: list[int], steps: list[int]) -> Finding:
    """dones differs from terminations | truncations at `count` values, in those columns and rows."""
    return finding(
        task,
        "done-flags",
        ERROR,
        f"dones differs from terminations | truncations at {count} value(s) "
        f"(stored rows {steps} of [T + E, B])",
        "fix the collector so that dones = terminations | truncations; returns and bootstrap "
        "values computed from these flags are wrong",
        field="dones",
        envs=envs,
        steps=steps,
    )


def policy_finding(task: Task, actual: Any, expected: str, has_versions: bool) -> Finding:
    """model_weights_id `actual` is not `expected`, the id derived from versions (or their absence)."""
    source = "versions" if has_versions else "a float32 zero (no versions)"
    return finding(
        task,
        "policy",
        WARNING,
        f"model_weights_id {actual!r} is not {expected!r}, the id RLinf derives from {source}",
        "the data and its policy tag disagree: check which policy collected it before weighting "
        "or filtering by model_weights_id",
        field="model_weights_id",
    )


def never_ending_finding(task: Task, never: list[int]) -> Finding:
    """The env columns `never` have no episode end while others of the trajectory end."""
    return finding(
        task,
        "episodes",
        INFO,
        f"env column(s) {never} have no episode end in this trajectory while others end",
        "nothing to do if those episodes are long; if they never end, check the env's "
        "termination and time limit",
        field="dones",
        envs=never,
    )


def rewards_finding(
    task: Task,
    count: int,
    limits: tuple[float, float],
    span: tuple[float, float],
    envs: list[int],
    steps: list[int],
) -> Finding:
    """`count` rewards outside `limits`, the rewards ranging over `span` (min, max)."""
    (low, high), (least, most) = limits, span
    return finding(
        task,
        "rewards",
        WARNING,
        f"{count} reward(s) outside [{low:g}, {high:g}] (from {least:g} to {most:g})",
        "check the reward function and its scaling, or widen the range if it is right",
        field="rewards",
        envs=envs,
        steps=steps,
    )


def newest_version(newest: float) -> float | None:
    """A trajectory's newest version as the staleness check takes it: None unless finite."""
    return newest if newest == newest and abs(newest) != float("inf") else None


class _Checker:
    def __init__(self, task: Task, traj: dict[str, Any], t: int, b: int) -> None:
        self.task, self.traj, self.t, self.b = task, traj, t, b
        self.name = task.path.name
        self.findings: list[Finding] = []

    def add(self, check: str, level: str, message: str, advice: str, **where: Any) -> None:
        self.findings.append(finding(self.task, check, level, message, advice, **where))

    def on(self, check: str) -> bool:
        return check in self.task.options.checks

    def columned(self, tensor: Any) -> bool:
        """A tensor laid out [T, B, ...] (not a per-env vector, not a done-like field)."""
        return tensor.dim() >= 2 and tensor.shape[0] == self.t and tensor.shape[1] == self.b

    # ------------------------------------------------------------ per field
    def non_finite(self, tensors: list[tuple[str, Any]], arrays: dict[str, Any]) -> None:
        """`arrays`: each path's _numpy of its tensor."""
        import numpy as np
        import torch

        for path, tensor in tensors:
            if not (tensor.is_floating_point() or tensor.is_complex()):
                continue
            array = arrays[path]
            if array is not None and bool(np.isfinite(array).all()):
                continue  # nothing to report
            bad = ~torch.isfinite(tensor)
            count = int(bad.sum())
            if not count:
                continue
            envs, steps = _columns(bad, tensor.shape[1]) if tensor.dim() >= 2 else (None, None)
            self.add(
                "non-finite",
                ERROR,
                f"field {path!r} holds {count} NaN/Inf value(s)",
                "find the step that produced them (env reset, reward or value overflow) and drop or "
                "recollect this trajectory before training on it",
                field=path,
                envs=envs,
                steps=steps,
            )

    def frozen(self, tensors: dict[str, Any]) -> None:
        if self.t < 2:
            return
        for path in self.task.options.frozen_fields:
            tensor = tensors.get(path)
            if tensor is None or not self.columned(tensor):
                continue
            flat = tensor.reshape(self.t, self.b, -1)
            constant = (flat == flat[:1]).all(-1).all(0)
            envs = _nonzero(constant)
            if envs:
                self.add(
                    "frozen",
                    WARNING,
                    f"field {path!r} is the same at all {self.t} steps of env column(s) {envs}",
                    "check the policy and the action path of those envs (a stuck policy, a dropped "
                    "action, a default action sent instead)",
                    field=path,
                    envs=envs,
                )

    def blank_camera(self, tensors: dict[str, Any]) -> None:
        import torch

        for path, tensor in tensors.items():
            if not self.columned(tensor) or not is_image(path, tensor):
                continue
            flat = tensor.reshape(self.t, self.b, -1)
            if not _maybe_blank(flat, self.t):
                continue
            if self.t >= 2:
                # only a column whose second frame is its first can hold the same frame throughout
                # (a one-value camera does too): the full comparison runs on those columns alone
                maybe = _nonzero((flat[1] == flat[0]).all(-1))
                if not maybe:
                    continue
                sub = flat[:, maybe]
                same = (sub == sub[:1]).all(-1).all(0)
                flat_one = (sub[0] == sub[0, :, :1]).all(-1) & same
                same_frames = torch.zeros(self.b, dtype=torch.bool)
                one_value = torch.zeros(self.b, dtype=torch.bool)
                same_frames[maybe] = same
                one_value[maybe] = flat_one
            else:
                one_value = (flat[0] == flat[0, :, :1]).all(-1)
                same_frames = one_value
            envs = _nonzero(one_value | same_frames)
            if not envs:
                continue
            blank = _nonzero(one_value)
            what = (
                "one value everywhere (a black or white camera)" if blank else "the same frame at every step"
            )
            self.add(
                "blank-camera",
                WARNING,
                f"image field {path!r} holds {what} in env column(s) {envs}",
                "check the camera and the renderer of those envs; a blank or frozen camera trains the "
                "policy on no observation",
                field=path,
                envs=envs,
            )

    # ------------------------------------------------------------ done flags and episodes
    def done_flags(self, dones: Any, terms: Any, truncs: Any) -> None:
        if dones.shape != terms.shape or dones.shape != truncs.shape:
            self.add(
                "done-flags",
                ERROR,
                f"dones {list(dones.shape)}, terminations {list(terms.shape)} and truncations "
                f"{list(truncs.shape)} differ in shape",
                "rewrite the trajectory with the three flags from the same steps",
                field="dones",
            )
            return
        bad = dones.bool() != (terms.bool() | truncs.bool())
        if bool(bad.any()):
            envs, steps = _columns(bad, self.b)
            self.findings.append(done_flags_finding(self.task, int(bad.sum()), envs, steps))

    def pairing(self, ends: Any, epoch_len: int) -> bool:
        """next_obs[t, b] == curr_obs[t + 1, b] wherever no episode ended at (t, b) and t + 1
        starts no new epoch (RLinf's env worker pairs each chunk step's observation with the
        observation after it, the final observation of an episode that just ended).

        When no compared pair holds: observations paired one step off (next_obs[t] equal to
        curr_obs[t] or to curr_obs[t + 2] on most steps) are an error; otherwise the trajectory
        was not recorded as transitions and True is returned (said once per checkpoint)."""
        import torch

        curr, nxt = self.traj.get("curr_obs"), self.traj.get("next_obs")
        if not isinstance(curr, dict) or not isinstance(nxt, dict) or self.t < 2:
            return False
        from rbtool.format.layout import iter_tensors

        currs = {".".join(p): v for p, v in iter_tensors(curr)}
        pairs = [
            (k, v.reshape(self.t, self.b, -1), currs[k].reshape(self.t, self.b, -1))
            for k, v in ((".".join(p), v) for p, v in iter_tensors(nxt))
            if k in currs and self.columned(v) and self.columned(currs[k]) and v.shape == currs[k].shape
        ]
        if not pairs:
            return False
        rows = torch.arange(self.t - 1)
        boundary = ((rows + 1) % epoch_len == 0).reshape(-1, 1)
        compared = ~ends[:-1] & ~boundary
        if not bool(compared.any()):
            return False
        equal_by_key = {key: _equal(n[:-1], c[1:]) for key, n, c in pairs}
        paired = torch.stack(list(equal_by_key.values())).all(0) & compared
        if not bool(paired.any()):
            return not self._paired_off_by_one(pairs, compared)
        for key, same in equal_by_key.items():
            broken = compared & ~same
            if bool(broken.any()):
                envs, steps = _nonzero(broken.any(0)), _nonzero(broken.any(1))
                self.add(
                    "pairing",
                    ERROR,
                    f"next_obs.{key}[t] differs from curr_obs.{key}[t + 1] at {int(broken.sum())} "
                    f"step(s) where no episode ended (t = {steps})",
                    "the collector paired observations wrongly; recollect or drop this trajectory",
                    field=f"next_obs.{key}",
                    envs=envs,
                    steps=steps,
                )
        return False

    def _paired_off_by_one(self, pairs: list[tuple[str, Any, Any]], compared: Any) -> bool:
        """An error when next_obs[t] equals curr_obs[t] (not advanced) or curr_obs[t + 2] (one
        step ahead) on more than half of the compared steps, each field alike."""
        import torch

        ahead = compared[:-1] & compared[1:]  # t and t + 1 both inside one episode and epoch
        shifts = [
            ("curr_obs[t]", compared, [_equal(n[:-1], c[:-1]) for _, n, c in pairs]),
            ("curr_obs[t + 2]", ahead, [_equal(n[:-2], c[2:]) for _, n, c in pairs]),
        ]
        for what, where, equal in shifts:
            held = torch.stack(equal).all(0) & where
            n, of = int(held.sum()), int(where.sum())
            if of and 2 * n > of:
                self.add(
                    "pairing",
                    ERROR,
                    f"next_obs[t] never equals curr_obs[t + 1] but equals {what} at {n} of {of} step(s) "
                    "where no episode ended: the observations are paired one step off",
                    "fix the collector's pairing (next_obs must be the observation after the step) and "
                    "recollect; transitions built from this trajectory are wrong",
                    field="next_obs",
                    envs=_nonzero(held.any(0)),
                    steps=_nonzero(held.any(1)),
                )
                return True
        return False

    def episodes(self, ends: Any, chunk: int) -> None:
        """Episodes longer than max_episode_length env steps (a row is `chunk` env steps), and env
        columns with no episode end where other columns end."""
        mel = self.traj.get("max_episode_length")
        steps_end = ends  # [T, B, chunk] in time order per column
        per_column = steps_end.permute(1, 0, 2).reshape(self.b, -1)
        ended = per_column.any(1)
        if type(mel) is int and mel > 0:
            long_envs: list[int] = []
            long_rows: list[int] = []
            for column in range(self.b):
                run = 0
                for i, flag in enumerate(per_column[column].tolist()):
                    run += 1
                    if run > mel:
                        long_envs.append(column)
                        long_rows.append(i // chunk)
                        break
                    if flag:
                        run = 0
            if long_envs:
                self.add(
                    "episodes",
                    WARNING,
                    f"an episode runs past max_episode_length {mel} env steps in env column(s) {long_envs}",
                    "check the env's time limit (truncation) and max_episode_length; an episode that "
                    "never truncates collects unbounded returns",
                    field="dones",
                    envs=long_envs,
                    steps=sorted(set(long_rows)),
                )
        if bool(ended.any()) and not bool(ended.all()):
            self.findings.append(never_ending_finding(self.task, _nonzero(~ended)))

    def rewards(self, rewards: Any) -> None:
        limits = self.task.options.reward_range
        if limits is None or rewards.dim() < 2:
            return
        low, high = limits
        out = (rewards < low) | (rewards > high)
        if bool(out.any()):
            envs, steps = _columns(out, rewards.shape[1])
            span = (float(rewards.min()), float(rewards.max()))
            self.findings.append(rewards_finding(self.task, int(out.sum()), limits, span, envs, steps))

    def policy(self) -> None:
        versions = self.traj.get("versions")
        expected = weights_id_of(versions)
        actual = self.traj.get("model_weights_id")
        if actual != expected:
            self.findings.append(policy_finding(self.task, actual, expected, versions is not None))


def _maybe_blank(flat: Any, t: int) -> bool:
    """False when no env column of a `[T, B, -1]` camera can be blank or frozen: its second
    frame is its first in none (T >= 2), or its one frame is not one value in any (T = 1)."""
    array = _numpy(flat)
    if array is None:
        return True
    if t >= 2:
        return bool((array[1] == array[0]).all(-1).any())
    return bool((array[0] == array[0, :, :1]).all(-1).any())


def is_image(path: str, tensor: Any) -> bool:
    """An image field: named like one (`image` in its last name) with H, W after [T, B], or any
    tensor with H, W, C after [T, B]."""
    name = path.rsplit(".", 1)[-1].lower()
    return tensor.dim() >= 5 or ("image" in name and tensor.dim() >= 4)


def fingerprint(tensors: list[tuple[str, Any]], arrays: dict[str, Any] | None = None) -> str:
    """sha256 over every tensor's path, dtype, shape and bytes, in path order (`arrays`: each
    path's _numpy of its tensor, where the caller has them)."""
    import torch

    digest = hashlib.sha256()
    for path, tensor in sorted(tensors, key=lambda item: item[0]):
        digest.update(f"{path}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        array = arrays[path] if arrays is not None else _numpy(tensor)
        if array is not None and array.flags.c_contiguous:
            digest.update(array)  # its bytes in order, as below
        else:
            digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def check_file(task: Task) -> Result:
    """Load one file safely and run every chosen check on it."""
    import torch

    from rbtool.errors import InvalidTrajectoryError
    from rbtool.files import trajfile
    from rbtool.format import layout

    result = Result()
    name = task.path.name
    try:
        data = trajfile.read_file_bytes(task.path)
        result.size = len(data)
        traj = trajfile.load_bytes_quick(data, task.path)
    except RbtoolError as exc:
        result.findings.append(_unchecked(task, one_line(str(exc))))
        return result
    traj = layout.with_stored_defaults(traj, name)
    plain = {k: v for k, v in traj.items() if k not in layout.DONE_LIKE}
    try:
        info = layout.describe(plain, name)
    except InvalidTrajectoryError as exc:
        result.findings.append(_unchecked(task, one_line(str(exc))))
        return result
    t, b = info.shape[0], info.shape[1]
    checker = _Checker(task, traj, t, b)
    tensors = [(".".join(p), v) for p, v in layout.iter_tensors(traj)]
    by_path = dict(tensors)
    arrays = (  # numpy's look at each tensor, made once for the checks that take it
        {path: _numpy(tensor) for path, tensor in tensors}
        if checker.on("non-finite") or checker.on("duplicates")
        else {}
    )
    if checker.on("index"):
        mel = traj.get("max_episode_length")
        checker.findings += index_findings(task, info.shape, info.model_weights_id, mel)
    if checker.on("non-finite"):
        checker.non_finite(tensors, arrays)
    if checker.on("frozen"):
        checker.frozen(by_path)
    if checker.on("blank-camera"):
        checker.blank_camera(by_path)
    flags = {k: traj.get(k) for k in layout.DONE_LIKE}
    present = {k: v for k, v in flags.items() if isinstance(v, torch.Tensor) and v.dim() >= 2}
    if checker.on("done-flags") and len(present) == 3:
        checker.done_flags(present["dones"], present["terminations"], present["truncations"])
    ends, epoch_len, chunk = _ends(present, t, b)
    if ends is not None:
        flat = ends.reshape(t, b, -1).any(-1)
        if checker.on("pairing"):
            result.traits.unpaired = checker.pairing(flat, epoch_len)
        if checker.on("episodes"):
            checker.episodes(ends.reshape(t, b, chunk), chunk)
    rewards = traj.get("rewards")
    if checker.on("rewards") and isinstance(rewards, torch.Tensor):
        checker.rewards(rewards)
    if checker.on("policy"):
        checker.policy()
        versions = traj.get("versions")
        if isinstance(versions, torch.Tensor) and versions.numel():
            result.traits.newest_version = newest_version(float(versions.max()))
    if checker.on("duplicates"):
        result.traits.fingerprint = fingerprint(tensors, arrays)
    result.findings.extend(checker.findings)
    return result


def done_extra(present: dict[str, Any], t: int, b: int) -> int | None:
    """E, the bootstrap rows of every done-like field in `present` (tensors or TensorSpecs,
    `[T + E, B, ...]`); None where one is not laid out so, or they disagree."""
    from rbtool.format import layout

    extra = None
    for value in present.values():
        try:
            e = layout.done_extra_rows(int(value.shape[0]), t, int(value.shape[1]), b)
        except ValueError:
            return None
        if extra is not None and e != extra:
            return None
        extra = e
    return extra


def _ends(present: dict[str, Any], t: int, b: int) -> tuple[Any, int, int]:
    """(episode ends `[T, B, K]` bool with bootstrap rows dropped, rows per epoch, K) or
    (None, t, 1) when the flags are absent or not laid out `[T + E, B, ...]` alike."""
    from rbtool.format import layout

    extra = done_extra(present, t, b)
    if extra is None:
        return None, t, 1
    arrays = {key: layout.drop_bootstrap_rows(v, t).bool().reshape(t, b, -1) for key, v in present.items()}
    shapes = {tuple(a.shape) for a in arrays.values()}
    if not arrays or len(shapes) != 1:
        return None, t, 1
    ends = layout.episode_ends(arrays.get("dones"), arrays.get("terminations"), arrays.get("truncations"))
    if ends is None:
        return None, t, 1
    epoch_len = t // extra if extra else t
    return ends, epoch_len, int(ends.shape[2])


def _unchecked(task: Task, why: str) -> Finding:
    return Finding(
        "index",
        ERROR,
        [task.tid],
        f"{task.path.name}: cannot be checked: {why}",
        "run `rbtool verify --deep` on the checkpoint and repair or drop this file",
    )
