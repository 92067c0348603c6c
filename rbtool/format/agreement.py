"""Whether a trajectory file agrees with its index entry: the comparison verify's deep pass and
doctor's index check both report, in the same words."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def entry_disagreements(
    name: str,
    shape: Sequence[int],
    model_weights_id: str,
    max_episode_length: Any,
    entry: Mapping[str, Any],
) -> list[tuple[str, str]]:
    """Every way the file `name` (its `[T, B, ...]` shape, model_weights_id and
    max_episode_length) disagrees with its index entry, as (key, one-line message), where key is
    the entry key that disagrees: `shape`, `num_samples`, `model_weights_id` or
    `max_episode_length`. An entry key that is absent is not compared."""
    found: list[tuple[str, str]] = []
    t, b = list(shape[:2])
    recorded = entry.get("shape")
    if recorded is not None and [t, b] != list(recorded[:2]):
        found.append(
            ("shape", f"{name}: tensors are [T, B] = {[t, b]} but the index entry says {list(recorded[:2])}")
        )
    num = entry.get("num_samples")
    if type(num) is int and num != t * b and (recorded is None or [t, b] == list(recorded[:2])):
        found.append(
            ("num_samples", f"{name}: tensors hold T * B = {t * b} samples but the index entry says {num}")
        )
    weights = entry.get("model_weights_id")
    if weights is not None and model_weights_id != weights:
        found.append(
            (
                "model_weights_id",
                f"{name}: model_weights_id {model_weights_id!r} but the index entry says {weights!r}",
            )
        )
    mel = entry.get("max_episode_length")
    if type(max_episode_length) is int and type(mel) is int and max_episode_length != mel:
        found.append(
            (
                "max_episode_length",
                f"{name}: max_episode_length {max_episode_length} but the index entry says {mel}",
            )
        )
    return found
