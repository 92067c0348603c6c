"""The layout of a trajectory: field roles, the `[T + E, B]` rule for done-like fields, describe.

Every module that needs to know how a trajectory's tensors line up asks here: the buffer
when it adds, the samplers when they map a drawn row to a stored row, verify, stats and
repair when they read a file. torch is imported inside the functions that need tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from rbtool.errors import CheckpointError, InvalidTrajectoryError
from rbtool.format.names import check_weights_id, parse_trajectory_file_name

if TYPE_CHECKING:
    import numpy as np

DONE_LIKE = ("dones", "terminations", "truncations")
# The nested dicts the reference sampler keeps, in the order its batches list them.
NESTED_ORDER = ("curr_obs", "next_obs", "forward_inputs")
# The reference Trajectory's top-level tensor fields, in its declaration order: the only
# top-level fields its sampler puts into a batch.
SAMPLED_TOP_FIELDS = (
    "actions",
    "intervene_flags",
    "rewards",
    "terminations",
    "truncations",
    "dones",
    "prev_logprobs",
    "prev_values",
    "versions",
)
SCALAR_FIELDS = ("max_episode_length", "model_weights_id")
# The fields whose shape gives an index entry's `shape`, first present wins.
SHAPE_FIELDS = ("prev_logprobs", "rewards")

Rows = TypeVar("Rows")


def is_done_like(path: tuple[str, ...] | list[str]) -> bool:
    """True for a done-like field (`dones`, `terminations`, `truncations` at the top level):
    the fields stored `[T + E, B, ...]`, E bootstrap rows ahead of the T steps."""
    return len(path) == 1 and path[0] in DONE_LIKE


def done_extra_rows(rows: int, t: int, b_rows: int, b: int) -> int:
    """E for a done-like field whose leading dims are `[rows, b_rows]` in a `[T, B]` trajectory.

    The field holds E epochs of `1 + T/E` rows, the first of each a bootstrap row, so
    `rows = T + E` with E dividing T (E = 0: no bootstrap rows). Raises ValueError otherwise.
    """
    extra = rows - t
    if b_rows != b or extra < 0 or (extra > 0 and t % extra != 0):
        raise ValueError(
            f"a done-like field must start with [T + E, B] = [{t} + E, {b}] where E divides T={t}"
        )
    return extra


def drop_bootstrap_rows(values: Rows, t: int) -> Rows:
    """`[T + E, B, ...]` -> `[T, B, ...]`: drop the first row of each epoch (numpy or torch)."""
    shape = tuple(values.shape)  # type: ignore[attr-defined]
    extra = shape[0] - t
    if extra == 0:
        return values
    epochs = values.reshape(extra, shape[0] // extra, *shape[1:])  # type: ignore[attr-defined]
    return epochs[:, 1:].reshape(t, *shape[1:])  # type: ignore[no-any-return]


def episode_ends(
    dones: np.ndarray | None, terminations: np.ndarray | None, truncations: np.ndarray | None
) -> np.ndarray | None:
    """Where episodes end, from a trajectory's `[T, B]` done flags (numpy bool arrays, bootstrap
    rows dropped): `dones` where it has them, else `terminations | truncations` (those present),
    None without any. RLinf's collector writes `dones = terminations | truncations`; a file
    with only one of the two still ends its episodes there."""
    if dones is not None:
        return dones
    present = [f for f in (terminations, truncations) if f is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else present[0] | present[1]


def done_rows(local: np.ndarray, t: np.ndarray, b: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """Stored rows of done-like fields (`[(T + E) * B]` flat) for flat sample rows `local`.

    Arguments are per-draw vectors (T, B and E of each draw's trajectory); where E is 0
    the stored row is the sample row.
    """
    import numpy as np

    t_idx = local // b
    epoch_len = np.where(extra > 0, t // np.maximum(extra, 1), t + 1)
    shifted = (t_idx + t_idx // epoch_len + 1) * b + local % b
    return np.where(extra > 0, shifted, local)


@dataclasses.dataclass(frozen=True)
class TrajectoryInfo:
    """What the index records of a trajectory, derived from its contents."""

    shape: tuple[int, ...]
    max_episode_length: int | None
    model_weights_id: str

    @property
    def num_samples(self) -> int:
        return self.shape[0] * self.shape[1]


def _tensor_type() -> type:
    import torch

    return torch.Tensor


def iter_tensors(
    traj: dict[str, Any], prefix: tuple[str, ...] = (), kind: type | None = None
) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, tensor) for every tensor in a trajectory dict, depth first in dict order.

    `kind`: what counts as a tensor (default torch.Tensor; rbtool.files.ptheader.TensorSpec for a
    header read without the data).
    """
    kind = kind or _tensor_type()
    for key, value in traj.items():
        if isinstance(value, kind):
            yield (*prefix, key), value
        elif isinstance(value, dict):
            yield from iter_tensors(value, (*prefix, key), kind)


def describe(traj: dict[str, Any], where: str, kind: type | None = None) -> TrajectoryInfo:
    """Check a trajectory dict's tensors agree on [T, B] and return its index information.

    Raises InvalidTrajectoryError naming `where` and the offending field. `kind` as for
    iter_tensors: describe works on a header's TensorSpecs as on tensors.
    """
    kind = kind or _tensor_type()
    ref_name = next((n for n in SHAPE_FIELDS if isinstance(traj.get(n), kind)), None)
    if ref_name is None or traj[ref_name].dim() < 2:
        raise InvalidTrajectoryError(
            f"{where}: cannot determine the trajectory shape: it needs a 'prev_logprobs' or "
            "'rewards' tensor of shape [T, B, ...]"
        )
    shape = tuple(int(d) for d in traj[ref_name].shape)
    t, b = shape[0], shape[1]
    for path, tensor in iter_tensors(traj, kind=kind):
        if tensor.dim() < 2:
            continue
        name = ".".join(path)
        lead = (int(tensor.shape[0]), int(tensor.shape[1]))
        if is_done_like(path):
            try:
                done_extra_rows(lead[0], t, lead[1], b)
            except ValueError as exc:
                raise InvalidTrajectoryError(
                    f"{where}: field {name!r} has shape {list(tensor.shape)}; {exc}"
                ) from None
        elif lead != (t, b):
            raise InvalidTrajectoryError(
                f"{where}: field {name!r} has shape {list(tensor.shape)} but {ref_name} gives "
                f"[T, B] = [{t}, {b}]"
            )
    mwid = traj.get("model_weights_id", "")
    try:
        mwid = check_weights_id("" if mwid is None else mwid, where)
    except CheckpointError as exc:
        raise InvalidTrajectoryError(str(exc)) from None
    mel = traj.get("max_episode_length")
    if mel is not None and (isinstance(mel, bool) or not isinstance(mel, int)):
        raise InvalidTrajectoryError(f"{where}: max_episode_length must be an integer, got {mel!r}")
    return TrajectoryInfo(shape=shape, max_episode_length=mel, model_weights_id=mwid)


def field_schema(traj: dict[str, Any], t: int, kind: type | None = None) -> list[list[Any]]:
    """A trajectory's field schema as the index records it: `[path, dtype, per-sample shape, E]`
    for every tensor of >= 2 dims, depth first in dict order (E: a done-like field's extra rows).

    Enough to work out a batch's fields (SPEC §3 steps 5-6) without opening the file.
    """
    fields: list[list[Any]] = []
    for path, tensor in iter_tensors(traj, kind=kind):
        if tensor.dim() < 2:
            continue
        shape = [int(d) for d in tensor.shape]
        extra = shape[0] - t if is_done_like(path) else 0
        dtype = tensor.dtype if isinstance(tensor.dtype, str) else str(tensor.dtype).removeprefix("torch.")
        fields.append([list(path), dtype, shape[2:], extra])
    return fields


def schema_digest(fields: list[list[Any]]) -> str:
    """The name an index entry gives its field schema: a digest of the schema's JSON."""
    import hashlib

    import orjson

    return hashlib.sha256(orjson.dumps(fields)).hexdigest()[:16]


def name_weights_id(file_name: str) -> str:
    """The model_weights_id a trajectory file's name carries ("" when the name has none)."""
    parsed = parse_trajectory_file_name(file_name)
    return parsed[1] if parsed else ""


def with_stored_defaults(traj: dict[str, Any], file_name: str) -> dict[str, Any]:
    """A dict loaded from a file, its missing model_weights_id taken from the file's name."""
    if traj.get("model_weights_id") is not None:
        return traj
    return {**traj, "model_weights_id": name_weights_id(file_name)}


def describe_stored(
    traj: dict[str, Any], file_name: str, where: str, kind: type | None = None
) -> TrajectoryInfo:
    """describe() a dict loaded from the file `file_name` (or its header, with `kind`).

    Files written without a model_weights_id (older writers) take the one in their name.
    """
    return describe(with_stored_defaults(traj, file_name), where, kind)
