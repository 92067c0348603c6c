"""Import of an rbtool export: the exported trajectories rebuilt from their frames and the
sidecar, each checked against its digest.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rbtool.errors import CheckpointError, RbtoolError
from rbtool.interop.lerobot.columns import column_numpy
from rbtool.interop.lerobot.extras import require_arrow
from rbtool.interop.lerobot.features import RB_ENV, RB_T, RB_TRAJECTORY_ID, view_names
from rbtool.interop.lerobot.limits import within_budget
from rbtool.interop.lerobot.reader import LeRobotSource
from rbtool.interop.lerobot.sidecar import (
    SIDECAR_FILE,
    SIDECAR_TENSORS,
    blob_tensor,
    decode_value,
    trajectory_digest,
)
from rbtool.interop.lerobot.tensors import AS_BITS, from_numpy, np_dtype

if TYPE_CHECKING:
    import numpy as np
    import torch


def rebuild(
    dataset: LeRobotSource, sidecar: dict[str, Any]
) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None, int]]:
    """The exported trajectories, rebuilt from their frames and the sidecar, checked against their digests."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    try:
        schemas = sidecar["schemas"]
        records = sidecar["trajectories"]
        columns = sidecar["columns"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{dataset.root / SIDECAR_FILE}: incomplete sidecar") from None
    tensors = dataset.tensors_file(sidecar)
    blob_path = tensors or dataset.root / SIDECAR_TENSORS

    def blob_rows() -> Iterator[dict[str, Any]]:
        if tensors is not None:
            pa = require_arrow()
            try:
                for batch in pq.ParquetFile(str(tensors)).iter_batches(batch_size=64):
                    within_budget(batch.nbytes, f"{tensors}: 64 rows")
                    yield from batch.to_pylist()
            except (OSError, pa.ArrowInvalid) as exc:
                raise CheckpointError(f"{tensors}: not a readable Parquet file ({exc})") from None

    # The sidecar's tensors are in trajectory order: read them along, one trajectory at a time.
    stream = blob_rows()
    pending = next(stream, None)
    all_episodes = dataset.episodes()
    features = dataset.features

    def stored_as(base: str) -> list[str]:
        return view_names(base, int(columns[base].get("views") or 0))

    # Video features are not decoded: the sidecar holds their exact rows.
    in_video = {base for base in columns if columns[base].get("video")}
    names = [
        *(name for base in columns if base not in in_video for name in stored_as(base)),
        RB_TRAJECTORY_ID,
        RB_ENV,
        RB_T,
    ]
    pending_box = [pending]

    def build(record: dict[str, Any]) -> tuple[dict[str, Any], int]:
        pending = pending_box[0]
        tid, t, b = int(record["trajectory_id"]), int(record["T"]), int(record["B"])
        where = f"{blob_path}: trajectory {tid}"
        nodes = schemas[int(record["schema"])]
        first, count = record.get("episodes", [0, 0])
        parts = [part for _, part in dataset.frames(all_episodes[first : first + count], names)]
        frames = sum(p.num_rows for p in parts)
        if frames != t * b:
            raise CheckpointError(
                f"{dataset.root}: trajectory {tid} has {frames} frames; the sidecar says {t} x {b}"
            )
        rows: dict[str, np.ndarray] = {}
        if parts:
            import pyarrow as pa

            table = pa.concat_tables(parts)
            tt = table.column(RB_T).to_numpy()
            bb = table.column(RB_ENV).to_numpy()
        mine: list[dict[str, Any]] = []
        while pending is not None and int(pending["trajectory_id"]) == tid:
            mine.append(pending)
            pending = next(stream, None)

        def need(rows: dict[int, dict[str, Any]], node: int, tid: int = tid) -> dict[str, Any]:
            if node not in rows:
                raise CheckpointError(f"{blob_path}: holds no tensor {node} of trajectory {tid}")
            return rows[node]

        own = {int(r["node"]): r for r in mine if r["kind"] not in ("next_obs", "frames")}
        exact = {int(r["node"]): r for r in mine if r["kind"] == "frames"}
        nxt = {int(r["node"]): r for r in mine if r["kind"] == "next_obs"}
        traj: dict[str, Any] = {}
        values = iter(record.get("values", []))
        built: dict[tuple[str, ...], torch.Tensor] = {}
        for i, node in enumerate(nodes):
            # Interned keys: equal keys are one string object, as in a loaded file, so the
            # pickle torch.save writes memoizes them alike and the file comes back byte for byte.
            path = tuple(sys.intern(key) for key in node["path"])
            parent = traj
            for key in path[:-1]:
                parent = parent[key]
            kind = node["kind"]
            if kind == "dict":
                parent[path[-1]] = {}
                continue
            if kind == "value":
                parent[path[-1]] = decode_value(next(values))
                continue
            if kind == "tensor":
                tensor = blob_tensor(need(own, i), where)
            elif kind == "column" and node["feature"] in in_video:
                tensor = blob_tensor(need(exact, i), where)
            elif kind == "column":
                feature = node["feature"]
                stored = stored_as(feature) if feature in columns else [feature]
                arr = None
                if parts:
                    per_view = [column_numpy(table.column(name), features[name], name) for name in stored]
                    arr = (
                        np.stack(per_view, axis=1) if len(stored) > 1 or stored[0] != feature else per_view[0]
                    )
                shape = tuple(node["shape"])
                dtype = node["dtype"]
                out = np.zeros((t, b, *shape), dtype=np_dtype(AS_BITS.get(dtype, dtype)))
                if arr is not None:
                    out[tt, bb] = arr.reshape(len(tt), *shape)
                tensor = from_numpy(out, dtype).reshape(t, b, *shape)
                extra = int(node.get("extra_rows") or 0)
                if extra:
                    boot_rows = blob_tensor(need(own, i), where)
                    per = t // extra
                    pieces = []
                    for e in range(extra):
                        pieces.append(boot_rows[e : e + 1])
                        pieces.append(tensor[e * per : (e + 1) * per])
                    tensor = torch.cat(pieces)
                rows[feature] = out
            else:  # derived next_obs
                src = built[tuple(node["source"])]
                tensor = torch.empty_like(src)
                if t > 1:
                    tensor[:-1] = src[1:]
                blob = need(nxt, i)
                fixes = blob_tensor(blob, where)
                if blob["t"]:
                    tensor[list(blob["t"]), list(blob["b"])] = fixes
            built[path] = tensor
            parent[path[-1]] = tensor
        if trajectory_digest(traj) != record.get("digest"):
            raise CheckpointError(
                f"{dataset.root}: trajectory {tid} does not rebuild to what was exported (its frames or "
                "the sidecar were changed)"
            )
        pending_box[0] = pending
        check_entry(record, traj)
        return traj, frames

    def check_entry(record: dict[str, Any], traj: dict[str, Any]) -> None:
        """The sidecar's entry agrees with the trajectory rebuilt (its digest is the sidecar's own)."""
        from rbtool.format.layout import describe

        entry, tid = record["entry"], record["trajectory_id"]
        try:
            info = describe(traj, f"{dataset.root}: trajectory {tid}")
        except RbtoolError as exc:
            raise CheckpointError(str(exc)) from None
        if list(entry["shape"]) != list(info.shape) or entry["num_samples"] != info.num_samples:
            raise CheckpointError(
                f"{dataset.root / SIDECAR_FILE}: trajectory {tid}: entry shape {entry['shape']} and "
                f"num_samples {entry['num_samples']}; the trajectory rebuilt has {list(info.shape)}"
            )

    def iterate() -> Iterator[tuple[dict[str, Any], dict[str, Any] | None, int]]:
        for record in records:
            yield rebuilt(record)

    def rebuilt(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
        try:
            traj, frames = build(record)
        except RbtoolError:
            raise
        except (
            KeyError,
            TypeError,
            ValueError,
            IndexError,
            RuntimeError,
            AttributeError,
            OverflowError,
            StopIteration,
        ) as exc:
            raise CheckpointError(
                f"{dataset.root / SIDECAR_FILE}: trajectory {record.get('trajectory_id')} cannot be rebuilt "
                f"({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
        return traj, record["entry"], frames

    dataset.check(all_episodes, names)
    return iterate()
