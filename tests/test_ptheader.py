"""rbtool.files.ptheader: a `.pt` file's structure from its header agrees with torch's loader, and
hostile headers are refused the way torch's path refuses them."""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES, make_traj

from rbtool.errors import TrajectoryFileError
from rbtool.files import trajfile
from rbtool.files.ptheader import TensorSpec, UnusualLayout, iter_specs, read_header
from rbtool.format.layout import describe, iter_tensors

FIXTURE_FILES = sorted(FIXTURES.rglob("trajectory_*.pt"))


def tensor_of(path: Path, spec: TensorSpec) -> torch.Tensor:
    data = bytearray(path.read_bytes()[spec.start : spec.start + spec.nbytes])
    raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return raw.view(getattr(torch, spec.dtype)).as_strided(spec.shape, spec.stride, spec.offset)


def assert_matches_torch(path: Path) -> None:
    header = read_header(path)
    loaded = torch.load(path, weights_only=True)
    specs = dict(iter_specs(header))
    tensors = dict(iter_tensors(loaded))
    assert list(specs) == list(tensors)
    for name, tensor in tensors.items():
        spec = specs[name]
        want = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.stride())
        assert (spec.dtype, spec.shape, spec.stride) == want
        assert torch.equal(tensor_of(path, spec), tensor), name
    plain = {k: v for k, v in loaded.items() if not isinstance(v, (torch.Tensor, dict))}
    assert {k: v for k, v in header.items() if k in plain} == plain
    assert describe(header, str(path), TensorSpec) == describe(loaded, str(path))
    assert read_header(path, path.read_bytes()) == header


@pytest.mark.parametrize("path", FIXTURE_FILES[:40], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_headers_of_rlinf_files_match_what_torch_loads(path: Path) -> None:
    assert_matches_torch(path)


@pytest.mark.parametrize("seed", range(12))
def test_headers_of_generated_files_match_what_torch_loads(tmp_path: Path, seed: int) -> None:
    traj = make_traj(t=2 + seed % 4, b=1 + seed % 3, seed=seed, image=8 * (seed % 2), extra_rows=seed % 2)
    t, b = traj["rewards"].shape[:2]
    wide = torch.arange(t * b * 10.0).reshape(t, b, 10)
    traj["views"] = {"a": wide[:, :, ::2], "b": torch.zeros(t + 1, b, 3)[1:]}
    traj["tags"] = [1, "x", 2.5, None, True]
    path = tmp_path / "trajectory_0_x.pt"
    torch.save(traj, path)
    assert_matches_torch(path)


def test_large_files_are_read_by_ranges(tmp_path: Path) -> None:
    traj = make_traj(t=8, b=4, seed=3, image=96)  # a few hundred KB: not read whole
    path = tmp_path / "trajectory_0_x.pt"
    torch.save(traj, path)
    assert path.stat().st_size > 256 << 10
    assert_matches_torch(path)


# ---------------------------------------------------------------- hostile headers
def pt_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def rewrite(data: bytes, change: Any) -> bytes:
    """A `.pt` zip with its records rewritten by `change(name, bytes) -> bytes | None` (None drops)."""
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            body = change(info.filename, source.read(info))
            if body is not None:
                target.writestr(info.filename, body)
    return out.getvalue()


def with_pickle(data: bytes, payload: bytes) -> bytes:
    return rewrite(data, lambda name, body: payload if name.endswith("/data.pkl") else body)


def header_error(tmp_path: Path, data: bytes) -> str:
    path = tmp_path / "trajectory_0_x.pt"
    path.write_bytes(data)
    with pytest.raises(TrajectoryFileError) as caught:
        read_header(path)
    return str(caught.value)


BASE = {"rewards": torch.zeros(4, 2), "model_weights_id": "v"}


def test_a_storage_record_shorter_than_declared_is_refused(tmp_path: Path) -> None:
    data = rewrite(pt_bytes(BASE), lambda name, body: body[:8] if name.endswith("/data/0") else body)
    assert "storage record holds 8 bytes" in header_error(tmp_path, data)


def test_a_compressed_record_is_refused(tmp_path: Path) -> None:
    source = zipfile.ZipFile(io.BytesIO(pt_bytes(BASE)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info), zipfile.ZIP_DEFLATED)
    assert "is compressed" in header_error(tmp_path, out.getvalue())


def test_views_past_their_storage_and_expanded_views_are_refused(tmp_path: Path) -> None:
    grown = pt_bytes({"rewards": torch.zeros(4, 2)}).replace(b"K\x04K\x02\x86", b"K\x40K\x02\x86", 1)
    assert "storage holds 8" in header_error(tmp_path, grown)
    expanded = torch.zeros(4, 1).expand(4, 2)
    assert "stride-0" in header_error(tmp_path, pt_bytes({"rewards": expanded}))


def test_contents_are_checked_as_loaded_trajectories_are(tmp_path: Path) -> None:
    assert "not a string" in header_error(tmp_path, pt_bytes({"rewards": torch.zeros(2, 1), 3: 1}))
    assert "outside int64" in header_error(tmp_path, pt_bytes({"rewards": torch.zeros(2, 1), "n": 1 << 70}))
    deep: dict[str, Any] = {"rewards": torch.zeros(2, 1)}
    node = deep
    for _ in range(40):
        node["d"] = {}
        node = node["d"]
    assert "nests deeper" in header_error(tmp_path, pt_bytes(deep))


def test_a_build_instruction_cannot_change_a_declared_storage(tmp_path: Path) -> None:
    data = pt_bytes(BASE)
    pkl = zipfile.ZipFile(io.BytesIO(data)).read("archive/data.pkl")
    # after the persistent id is loaded, BUILD {'numel': 1000} onto the storage placeholder
    patched = pkl.replace(b"Q", b"Q}q\x63X\x05\x00\x00\x00numelM\xe8\x03sb", 1)
    assert "not a readable .pt trajectory" in header_error(tmp_path, with_pickle(data, patched))


def test_globals_beyond_tensors_are_left_to_torch(tmp_path: Path) -> None:
    path = tmp_path / "trajectory_0_x.pt"
    path.write_bytes(pt_bytes({"rewards": torch.zeros(2, 1, dtype=torch.uint16)}))
    with pytest.raises(UnusualLayout):
        read_header(path)
    path.write_bytes(pickle.dumps({"rewards": 1}))  # not a zip: a legacy file
    with pytest.raises(UnusualLayout):
        read_header(path)


def test_truncated_and_damaged_files_are_named(tmp_path: Path) -> None:
    data = pt_bytes(BASE)
    for cut in (len(data) // 3, len(data) - 30, 10):
        path = tmp_path / f"trajectory_{cut}_x.pt"
        path.write_bytes(data[:cut])
        with pytest.raises((TrajectoryFileError, UnusualLayout)) as caught:
            read_header(path)
        if isinstance(caught.value, TrajectoryFileError):
            assert str(caught.value).startswith(str(path))
    at = data.rfind(b"PK\x05\x06")
    bad = data[:at] + b"PK\x05\x06" + struct.pack("<4xHHII", 9, 9, 1 << 30, 0) + data[at + 20 :]
    assert "zip directory" in header_error(tmp_path, bad)


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "trajectory_0_x.pt"
    os.mkfifo(fifo)
    with pytest.raises(TrajectoryFileError, match="not a regular file"):
        read_header(fifo)
    with pytest.raises(TrajectoryFileError, match="no such file or directory"):
        read_header(tmp_path / "missing.pt")


def test_what_the_header_accepts_torch_loads_with_the_same_checks(tmp_path: Path) -> None:
    path = tmp_path / "trajectory_0_x.pt"
    path.write_bytes(trajfile.to_bytes(make_traj(t=3, b=2, seed=9, image=4), "pt"))
    header = read_header(path)
    loaded = trajfile.load(path)
    assert [p for p, _ in iter_specs(header)] == [p for p, _ in iter_tensors(loaded)]


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same_value, a, b))
    return type(a) is type(b) and a == b


def quick_and_full(path: Path) -> tuple[Any, Any]:
    """load_bytes_quick's and load_bytes' outcome on a file: the trajectory, or the error's text."""
    data = path.read_bytes()
    out = []
    for load in (trajfile.load_bytes_quick, trajfile.load_bytes):
        try:
            out.append(load(data, path))
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out[0], out[1]


def test_a_quick_load_is_the_full_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = FIXTURE_FILES[:20]
    for seed in range(6):
        traj = make_traj(t=2 + seed % 3, b=1 + seed % 2, seed=seed, image=4 * (seed % 2), extra_rows=seed % 2)
        t, b = traj["rewards"].shape[:2]
        wide = torch.arange(t * b * 10.0).reshape(t, b, 10)
        traj["views"] = {"a": wide[:, :, ::2], "e": torch.zeros(t, b, 0)}
        traj["half"] = torch.ones(t, b, 3, dtype=torch.bfloat16)
        traj["tags"] = [1, "x", 2.5, None, True, torch.ones(2)]
        paths.append(tmp_path / f"trajectory_{seed}_x.pt")
        torch.save(traj, paths[-1])
    for path in paths:
        quick, full = quick_and_full(path)
        assert isinstance(full, dict) and same_value(quick, full), path
    with monkeypatch.context() as patch:  # and no file went to torch's loader
        patch.setattr(trajfile, "load_bytes", lambda data, path: pytest.fail(f"{path}: loaded by torch"))
        for path in paths:
            trajfile.load_bytes_quick(path.read_bytes(), path)


def test_a_quick_load_refuses_what_the_full_load_refuses(tmp_path: Path) -> None:
    data = pt_bytes(BASE)
    at = data.rfind(b"PK\x05\x06")
    pkl = zipfile.ZipFile(io.BytesIO(data)).read("archive/data.pkl")
    damaged = [
        rewrite(data, lambda name, body: body[:8] if name.endswith("/data/0") else body),
        pt_bytes({"rewards": torch.zeros(4, 2)}).replace(b"K\x04K\x02\x86", b"K\x40K\x02\x86", 1),
        pt_bytes({"rewards": torch.zeros(4, 1).expand(4, 2)}),
        pt_bytes({"rewards": torch.zeros(2, 1), "n": 1 << 70}),
        pt_bytes({"rewards": torch.zeros(2, 1, dtype=torch.uint16)}),
        with_pickle(data, pkl.replace(b"Q", b"Q}q\x63X\x05\x00\x00\x00numelM\xe8\x03sb", 1)),
        data[:at] + b"PK\x05\x06" + struct.pack("<4xHHII", 9, 9, 1 << 30, 0) + data[at + 20 :],
        data[: len(data) // 3],
        data[:-30],
        pickle.dumps({"rewards": 1}),
    ]
    for k, body in enumerate(damaged):
        path = tmp_path / f"trajectory_{k}_x.pt"
        path.write_bytes(body)
        quick, full = quick_and_full(path)
        if isinstance(full, str):
            assert quick == full, k
        else:
            assert same_value(quick, full), k
