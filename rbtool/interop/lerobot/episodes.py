"""Import of any dataset: one trajectory per episode (B = 1), its features mapped to buffer
fields, observations as curr_obs / next_obs of consecutive frames.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rbtool.errors import CheckpointError, LeRobotFeatureError, UsageError
from rbtool.format.layout import is_done_like
from rbtool.interop.lerobot.columns import column_numpy
from rbtool.interop.lerobot.features import default_field
from rbtool.interop.lerobot.reader import Episode, LeRobotSource
from rbtool.interop.lerobot.results import ImportResult
from rbtool.interop.lerobot.tensors import NATIVE, TRAJECTORY_DTYPES

if TYPE_CHECKING:
    import torch


def _safe_id(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "dataset"
    return re.sub(r"\.{2,}", ".", cleaned)


def _column(table: Any, name: str, episode: Episode) -> Any:
    if name not in table.column_names:
        raise CheckpointError(f"{episode.file}: has no column {name!r} named in meta/info.json")
    return table.column(name)


def episodes_as_trajectories(
    dataset: LeRobotSource,
    selected: Sequence[int] | None,
    field_map: dict[str, str],
    drop: Sequence[str],
    model_weights_id: str | None,
    result: ImportResult,
) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None, int]]:
    """One trajectory per episode (B = 1): observations as curr_obs / next_obs of consecutive frames."""
    import numpy as np
    import torch

    features = dataset.features
    for name in [*field_map, *drop]:
        if name not in features:
            raise UsageError(f"{dataset.root}: has no feature {name!r}")
    cameras = [
        n
        for n, s in features.items()
        if s.get("dtype") in ("image", "video") and n.startswith("observation.images.")
    ]
    mapping: dict[str, tuple[str, ...]] = {}
    # RLinf's writer splits a multi-view camera field [N, H, W, C] into image features
    # `wrist_image-0`, `wrist_image-1`, ...: they are stacked back into one field.
    views: dict[tuple[str, ...], list[tuple[int, str]]] = {}
    for name, spec in features.items():
        if name in drop:
            result.dropped.append(name)
            continue
        split = re.fullmatch(r"(wrist_image|extra_view_image)-(\d+)", name)
        if split and name not in field_map and spec.get("dtype") in ("image", "video"):
            views.setdefault(("curr_obs", f"{split.group(1)}s"), []).append((int(split.group(2)), name))
            continue
        target = (
            tuple(field_map[name].split(".")) if name in field_map else default_field(name, spec, cameras)
        )
        if target is None:
            continue
        dtype = spec.get("dtype")
        if dtype == "string" or dtype not in (*NATIVE, "image", "video"):
            raise LeRobotFeatureError(
                f"feature {name!r} has dtype {dtype!r}, which is not a tensor dtype", name
            )
        if dtype not in (*TRAJECTORY_DTYPES, "image", "video"):
            raise LeRobotFeatureError(
                f"feature {name!r} has dtype {dtype!r}, which trajectory files do not hold", name
            )
        for other, taken in mapping.items():
            shorter = min(len(taken), len(target))
            if taken[:shorter] == target[:shorter]:
                where = "as" if taken == target else "inside or around the field of"
                raise LeRobotFeatureError(
                    f"feature {name!r} would become {'.'.join(target)}, {where} feature {other!r}",
                    name,
                    mappable=True,
                )
        mapping[name] = target
    for target, group in views.items():
        group.sort()
        if target in mapping.values():
            other = next(n for n, t in mapping.items() if t == target)
            raise LeRobotFeatureError(
                f"feature {other!r} would become {'.'.join(target)}, as the views {group[0][1]}... do",
                other,
                mappable=True,
            )
    result.fields = {name: ".".join(target) for name, target in mapping.items()}
    for target, group in views.items():
        result.fields.update({name: f"{'.'.join(target)}[{i}]" for i, (_, name) in enumerate(group)})
    episodes = dataset.episodes()
    if selected is not None:
        by_index = {e.index: e for e in episodes}
        missing = [i for i in selected if i not in by_index]
        if missing:
            raise UsageError(f"{dataset.root}: has no episode {missing[0]} (episodes 0-{len(episodes) - 1})")
        episodes = [by_index[i] for i in selected]
    mwid = model_weights_id if model_weights_id is not None else f"lerobot-{_safe_id(dataset.root.name)}"
    tasks = dataset.tasks()
    read = [*mapping, *(name for group in views.values() for _, name in group), "task_index"]
    dataset.check(episodes, read)

    def iterate() -> Iterator[tuple[dict[str, Any], dict[str, Any] | None, int]]:
        for episode, table in dataset.frames(episodes, read):
            try:
                yield one(episode, table)
            except CheckpointError as exc:
                if str(exc).startswith(str(dataset.root)):
                    raise
                raise CheckpointError(f"{episode.file}: episode {episode.index}: {exc}") from None

    def one(episode: Episode, table: Any) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
        t = table.num_rows
        fields: dict[tuple[str, ...], torch.Tensor] = {}
        for name, target in mapping.items():
            arr = column_numpy(_column(table, name, episode), features[name], name)
            tensor = torch.from_numpy(np.array(arr)).reshape(t, 1, *arr.shape[1:])
            if is_done_like(target):
                flags = tensor if tensor.dtype == torch.bool else tensor != 0
                tensor = torch.cat([torch.zeros((1, *flags.shape[1:]), dtype=torch.bool), flags])
            fields[target] = tensor
        for target, group in views.items():
            frames = [column_numpy(_column(table, name, episode), features[name], name) for _, name in group]
            fields[target] = torch.from_numpy(np.stack(frames, axis=1)).reshape(
                t, 1, len(group), *frames[0].shape[1:]
            )
        if ("rewards",) not in fields:
            fields[("rewards",)] = torch.zeros(t, 1, 1, dtype=torch.float32)
        dones = fields.get(("dones",))
        if dones is None:
            dones = torch.zeros(t + 1, 1, 1, dtype=torch.bool)
        if t:
            dones = dones.clone()
            dones[-1] = True
        fields[("dones",)] = dones
        for path in [p for p in fields if p[0] == "curr_obs"]:
            cur = fields[path]
            fields[("next_obs", *path[1:])] = torch.cat([cur[1:], cur[-1:]]) if t else cur.clone()
        traj: dict[str, Any] = {"max_episode_length": t, "model_weights_id": mwid}
        order = ["actions", "intervene_flags", "rewards", "terminations", "truncations", "dones"]
        ranked = sorted(
            fields,
            key=lambda p: (
                order.index(p[0]) if p[0] in order else len(order),
                p[0] in ("curr_obs", "next_obs"),
            ),
        )
        for path in ranked:
            parent = traj
            for key in path[:-1]:
                parent = parent.setdefault(key, {})
                if not isinstance(parent, dict):
                    raise UsageError(f"buffer field {'.'.join(path)} would be inside a tensor field")
            parent[path[-1]] = fields[path]
        task_ids = table.column("task_index").to_pylist() if "task_index" in table.column_names else []
        if task_ids and task_ids[0] is not None and 0 <= int(task_ids[0]) < len(tasks):
            traj["task"] = tasks[int(task_ids[0])]
        elif episode.tasks:
            traj["task"] = episode.tasks[0]
        result.episodes += 1
        return traj, None, t

    return iterate()
