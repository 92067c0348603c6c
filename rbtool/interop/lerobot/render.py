"""An export's rows (pass 2): one trajectory's data table, its sidecar rows and its episodes'
statistics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rbtool.files import trajfile
from rbtool.format.layout import drop_bootstrap_rows, with_stored_defaults
from rbtool.interop.lerobot.columns import arrow_type, column_array, image_array
from rbtool.interop.lerobot.extras import require_arrow
from rbtool.interop.lerobot.features import (
    RB_ENV,
    RB_MODEL_WEIGHTS_ID,
    RB_T,
    RB_TRAJECTORY_ID,
    Column,
    field_name,
)
from rbtool.interop.lerobot.plan import Write
from rbtool.interop.lerobot.sidecar import blob_row, blob_schema, trajectory_digest, trajectory_entries
from rbtool.interop.lerobot.stats import frame_stats

if TYPE_CHECKING:
    import numpy as np
    import torch


class Render:
    """A trajectory's rows: its data table, its sidecar rows, its episodes' statistics."""

    def __init__(
        self,
        schemas: list[list[dict[str, Any]]],
        by_path: dict[tuple[str, ...], Column],
        columns: list[Column],
        features: dict[str, dict[str, Any]],
        in_data: list[str],
        schema: Any,
        fps: int,
        task: str,
        bounds_of: list[list[tuple[int, int]]],
    ) -> None:
        self.schemas, self.by_path, self.columns = schemas, by_path, columns
        self.features, self.in_data, self.schema = features, in_data, schema
        self.fps, self.task, self.bounds_of = fps, task, bounds_of

    def __call__(self, job: Write, position: int) -> tuple[dict[str, Any], Any, Any]:
        import numpy as np

        pa = require_arrow()
        tid, t, b, fps = job.tid, job.t, job.b, self.fps
        nodes = self.schemas[job.schema]
        traj = with_stored_defaults(trajfile.load(job.path, mmap=True), job.path.name)
        digest = trajectory_digest(traj)
        mwid = str(traj.get("model_weights_id") or "")
        tensors = {p: v for kind, p, v in trajectory_entries(traj) if kind == "tensor"}
        n = t * b
        blob_rows: list[dict[str, Any]] = []
        sidecar_fields: list[str] = []
        frame_cols: dict[str, np.ndarray] = {}
        for i, node in enumerate(nodes):
            kind = node.get("kind")
            npath = tuple(node["path"])
            if kind == "column":
                tensor = tensors[npath]
                if node["extra_rows"]:
                    e = node["extra_rows"]
                    starts = [k * (1 + t // e) for k in range(e)]
                    blob_rows.append(blob_row(tid, i, "bootstrap", tensor[starts], [], []))
                    tensor = drop_bootstrap_rows(tensor, t)
                col = self.by_path[npath]
                if col.video:  # the exact rows: the video is lossy
                    blob_rows.append(blob_row(tid, i, "frames", tensor, [], []))
                frame_cols[col.feature] = col.in_frame_order(tensor, t, b)
            elif kind == "derived":
                nxt, cur = tensors[npath], tensors[tuple(node["source"])]
                same = _rows_equal(nxt[:-1], cur[1:])
                pos = [(ti, bi) for ti in range(t) for bi in range(b) if ti == t - 1 or not same[ti, bi]]
                rows = nxt[[p[0] for p in pos], [p[1] for p in pos]]
                blob_rows.append(blob_row(tid, i, "next_obs", rows, [p[0] for p in pos], [p[1] for p in pos]))
            elif kind == "tensor":
                blob_rows.append(blob_row(tid, i, "tensor", tensors[npath], [], []))
                sidecar_fields.append(field_name(npath))

        bounds = self.bounds_of[position]
        env = np.repeat(np.arange(b, dtype=np.int64), t)
        step = np.tile(np.arange(t, dtype=np.int64), b)
        frame_index = np.zeros(n, dtype=np.int64)
        episode_index = np.zeros(n, dtype=np.int64)
        for k, (lo, hi) in enumerate(bounds):
            frame_index[lo:hi] = np.arange(hi - lo)
            episode_index[lo:hi] = job.first_episode + k
        arrays: dict[str, Any] = {}
        for col in self.columns:
            if col.video:
                continue
            if col.feature in frame_cols:
                for name, frames in col.split(frame_cols[col.feature]).items():
                    spec = self.features[name]
                    arrays[name] = image_array(frames) if col.image else column_array(frames, spec)
            else:
                for name, spec in col.specs().items():
                    arrays[name] = pa.nulls(n, arrow_type(spec))
        numeric: dict[str, np.ndarray] = {
            RB_TRAJECTORY_ID: np.full(n, tid, dtype=np.int64),
            RB_ENV: env,
            RB_T: step,
            "timestamp": (frame_index / fps).astype(np.float32),
            "frame_index": frame_index,
            "episode_index": episode_index,
            "index": np.arange(job.first_frame, job.first_frame + n, dtype=np.int64),
            "task_index": np.zeros(n, dtype=np.int64),
        }
        for name, values in numeric.items():
            arrays[name] = pa.array(values)
        arrays[RB_MODEL_WEIGHTS_ID] = pa.array([mwid] * n, pa.string())
        table = pa.Table.from_arrays([arrays[name] for name in self.in_data], schema=self.schema)
        stats: list[dict[str, dict[str, np.ndarray]]] = []
        for lo, hi in bounds:
            episode: dict[str, dict[str, np.ndarray]] = {}
            for col in self.columns:
                if col.feature in frame_cols:
                    for name, frames in col.split(frame_cols[col.feature][lo:hi]).items():
                        episode[name] = frame_stats(frames, col.image)
            for name, series in numeric.items():
                episode[name] = frame_stats(series[lo:hi].reshape(-1, 1), False)
            stats.append(episode)
        meta = {
            "digest": digest,
            "sidecar_fields": sidecar_fields,
            "per_row": table.nbytes / max(n, 1),
            "stats": stats,
        }
        return meta, table, pa.Table.from_pylist(blob_rows, schema=blob_schema())


def _rows_equal(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """[T-1, B] bool: rows of `a` and `b` equal bit for bit."""
    import numpy as np
    import torch

    lead = (int(a.shape[0]), int(a.shape[1]))
    if a.numel() == 0:
        return np.ones(lead, dtype=bool)
    bits_a = a.contiguous().reshape(*lead, -1).view(torch.uint8)
    bits_b = b.contiguous().reshape(*lead, -1).view(torch.uint8)
    return (bits_a == bits_b).all(dim=2).numpy()
