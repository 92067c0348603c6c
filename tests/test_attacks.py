"""Hostile files: every tensor and JSON file is checked before use, through every reader.

Each case puts one hostile file into a valid two-trajectory checkpoint (or replaces one of
its JSON files) and runs the readers a user would: `verify --deep`, `checkpoint load` +
`sample`, `merge --format pkl` (which rewrites every file) and `repair`. Each must exit 0
or 1 with at most one `Error:` line, never a traceback, never change the input, and never
write an unchecked tensor into an output.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_traj, run, staging_left, tree_digest

from rbtool.errors import RbtoolError, TrajectoryFileError, UnsafePickleError
from rbtool.files import trajfile
from rbtool.files.index import read_index

# ------------------------------------------------------------------ building blocks


class _Reduce:
    """Pickles as `func(*args)`, then (with `state`) a BUILD that calls __setstate__(state)."""

    def __init__(self, func: Any, args: tuple[Any, ...], state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        if self.state is None:
            return self.func, self.args
        return self.func, self.args, self.state


def _storage_blob(tensor: torch.Tensor) -> bytes:
    """The `_load_from_bytes` blob torch writes for a tensor's storage in a plain pickle."""
    data = pickle.dumps(tensor, protocol=4)
    return next(arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, bytes))


def _tensor(
    values: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...], state: Any = None
) -> _Reduce:
    storage = _Reduce(torch.storage._load_from_bytes, (_storage_blob(values),))
    args = (storage, 0, size, stride, False, OrderedDict())
    return _Reduce(torch._utils._rebuild_tensor_v2, args, state)


def _grown_by_setstate() -> _Reduce:
    """A 4-element tensor that a BUILD re-points at 1000 elements (heap bytes, in torch's set_)."""
    small = torch.arange(4, dtype=torch.float32)
    grow = (_Reduce(torch.storage._load_from_bytes, (_storage_blob(small),)), 0, (1000,), (1,))
    return _tensor(small, (4,), (1,), state=grow)


def _zip_with(path: Path, transform: Callable[[str, bytes], bytes], *, deflate: bool = False) -> None:
    """Rewrite the zip of a `.pt` file record by record."""
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info)) for info in archive.infolist()]
    method = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=method) as archive:
        for name, data in records:
            archive.writestr(name, transform(name, data))


def _with_build(name: str, data: bytes) -> bytes:
    """data.pkl with a BUILD on the top dict just before STOP (the set_ route, in a .pt)."""
    if not name.endswith("data.pkl"):
        return data
    assert data.endswith(b".")
    return data[:-1] + b"}b."  # EMPTY_DICT as state, BUILD, STOP


def _deep(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"x": torch.zeros(4, 2, 1)}
    for _ in range(levels):
        node = {"n": node}
    return node


def _cyclic() -> dict[str, Any]:
    inner: dict[str, Any] = {"a": torch.zeros(4, 2, 1)}
    inner["self"] = inner
    return inner


# ------------------------------------------------------------------ the cases
def _pt(**fields: Any) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        torch.save({**make_traj(), **fields}, path)

    return write


def _pt_then(transform: Callable[[str, bytes], bytes], deflate: bool = False) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        torch.save(make_traj(), path)
        _zip_with(path, transform, deflate=deflate)

    return write


def _pkl(payload: Any) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.write_bytes(pickle.dumps({**make_traj(), "extra": payload}, protocol=4))

    return write


def _quantized() -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated: that is the point
        return torch.quantize_per_tensor(torch.zeros(4, 2, 1), 0.1, 0, torch.qint8)


PT_CASES: dict[str, Callable[[Path], None]] = {
    "expanded_stride0": _pt(big=torch.zeros(1, 1, 1).expand(4, 2, 1 << 20)),
    "overlapping_view": _pt(overlap=torch.zeros(16).as_strided((4, 2, 8), (1, 1, 1))),
    "deep_nesting": _pt(obs=_deep(40)),
    "cycle": _pt(obs=_cyclic()),
    "int_key": _pt(obs={1: torch.zeros(4, 2, 1)}),
    "int_beyond_int64": _pt(max_episode_length=2**64),
    "sparse_tensor": _pt(sparse=torch.zeros(4, 2).to_sparse()),
    "quantized_tensor": _pt(q=_quantized()),
    "float8_tensor": _pt(f8=torch.zeros(4, 2, 1, dtype=torch.float8_e4m3fn)),
    "uint32_tensor": _pt(u32=torch.zeros(4, 2, 1, dtype=torch.uint32)),
    "compressed_record": _pt_then(lambda n, d: d, deflate=True),
    "build_in_data_pkl": _pt_then(_with_build),
}
PKL_CASES: dict[str, Callable[[Path], None]] = {
    "setstate_grows_tensor": _pkl(_grown_by_setstate()),
    "pkl_deep_nesting": _pkl(_deep(40)),
    "pkl_int_key": _pkl({7: torch.zeros(4, 2, 1)}),
    "pkl_stride0": _pkl(_tensor(torch.zeros(1), (4, 2, 1000), (0, 0, 0))),
    "pkl_overlap": _pkl(_tensor(torch.zeros(16), (4, 2, 8), (1, 1, 1))),
    "pkl_big_int": _pkl(2**70),
}


def _checkpoint(tmp_path: Path, fmt: str) -> Path:
    """Two trajectories written by rbtool, in `fmt`."""
    from rbtool import TrajectoryReplayBuffer

    ckpt = tmp_path / "ckpt"
    with TrajectoryReplayBuffer(sample_window_size=0, trajectory_format=fmt) as buffer:
        buffer.add_trajectories([make_traj(seed=0), make_traj(seed=1)])
        buffer.save_checkpoint(ckpt)
    return ckpt


def _plant(ckpt: Path, write: Callable[[Path], None]) -> Path:
    """Replace trajectory 1's file; drop its recorded size and hash so only the contents speak."""
    import orjson

    index = read_index(ckpt)
    path = ckpt / index.file_name(1)
    write(path)
    doc = orjson.loads((ckpt / "trajectory_index.json").read_bytes())
    for key in ("file_bytes", "sha256"):
        doc["trajectory_index"]["1"].pop(key, None)
    (ckpt / "trajectory_index.json").write_bytes(orjson.dumps(doc))
    return path


def _assert_clean(result: Any) -> None:
    assert result.exit_code in (0, 1), (result.exit_code, result.stderr, result.exception)
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) <= 1, result.stderr
    if result.exit_code == 1:
        assert len(errors) == 1, result.stderr


def _every_reader_refuses(tmp_path: Path, ckpt: Path, bad: Path, other_format: str) -> None:
    before = tree_digest(ckpt)
    with pytest.raises((TrajectoryFileError, UnsafePickleError)) as caught:
        trajfile.load(bad)
    message = str(caught.value)
    assert "\n" not in message and str(bad) in message

    verified = run("verify", ckpt, "--deep", "--json")
    _assert_clean(verified)
    assert verified.exit_code == 1
    assert {"file_unreadable", "file_unsafe"} & {
        p["code"] for c in __import__("json").loads(verified.stdout)["checkpoints"] for p in c["problems"]
    }
    sampled = run("sample", ckpt, "--num-chunks", "64", "--window", "0")
    _assert_clean(sampled)
    assert sampled.exit_code == 1  # every draw of 64 from two trajectories reaches trajectory 1

    # rewriting into the other format must read (and so check) every tensor
    merged = run("merge", ckpt, "--out", tmp_path / "merged", "--format", other_format)
    _assert_clean(merged)
    assert merged.exit_code == 1 and not (tmp_path / "merged").exists()

    repaired = run("repair", ckpt, "--out", tmp_path / "repaired", "--json")
    _assert_clean(repaired)
    assert repaired.exit_code == 0
    assert read_index(tmp_path / "repaired").id_list == [0]  # the hostile file is dropped, not copied
    assert run("verify", tmp_path / "repaired", "--deep").exit_code == 0

    assert tree_digest(ckpt) == before
    assert staging_left(tmp_path) == []


@pytest.mark.parametrize("case", sorted(PT_CASES))
def test_hostile_pt_files_are_refused_by_every_reader(tmp_path: Path, case: str) -> None:
    ckpt = _checkpoint(tmp_path, "pt")
    _every_reader_refuses(tmp_path, ckpt, _plant(ckpt, PT_CASES[case]), "pkl")


@pytest.mark.parametrize("case", sorted(PKL_CASES))
def test_hostile_pkl_files_are_refused_by_every_reader(tmp_path: Path, case: str) -> None:
    ckpt = _checkpoint(tmp_path, "pkl")
    _every_reader_refuses(tmp_path, ckpt, _plant(ckpt, PKL_CASES[case]), "pt")


def test_the_setstate_route_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.pkl"
    PKL_CASES["setstate_grows_tensor"](path)
    with pytest.raises(UnsafePickleError, match="BUILD"):
        trajfile.load(path)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (torch.zeros(1).expand(8), "stride-0"),
        (torch.zeros(10).as_strided((3, 3), (1, 1)), "overlapping"),
        (torch.zeros(2, 3).t(), None),  # a transposed view is dense: fine
        (torch.zeros(0, 5), None),
        (torch.zeros(3, dtype=torch.bfloat16), None),
    ],
)
def test_tensor_checks(value: torch.Tensor, words: str | None) -> None:
    if words is None:
        trajfile.check_loaded({"t": value}, "f")
    else:
        with pytest.raises(TrajectoryFileError, match=words):
            trajfile.check_loaded({"t": value}, "f")


# ------------------------------------------------------------------ files that are not files
@pytest.mark.parametrize("name", ["metadata.json", "trajectory_index.json"])
def test_json_fifos_and_devices_do_not_hang(tmp_path: Path, name: str) -> None:
    ckpt = _checkpoint(tmp_path, "pt")
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)  # reading it would wait for a writer forever
    for argv in (["verify", ckpt], ["stats", ckpt, "--index-only"], ["checkpoint", "load", ckpt]):
        result = run(*argv)
        _assert_clean(result)
        assert result.exit_code == 1 and "not a regular file" in result.stderr + result.stdout
    (ckpt / name).unlink()
    (ckpt / name).symlink_to("/dev/zero")  # reading it would never end
    result = run("checkpoint", "load", ckpt)
    _assert_clean(result)
    assert result.exit_code == 1 and "/dev/zero, outside the checkpoint" in result.stderr
    if os.geteuid() == 0:  # a device node inside the checkpoint itself (making one needs root)
        import stat

        (ckpt / name).unlink()
        os.mknod(ckpt / name, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # what /dev/zero is
        result = run("checkpoint", "load", ckpt)
        _assert_clean(result)
        assert result.exit_code == 1 and "not a regular file" in result.stderr


def test_a_trajectory_fifo_does_not_hang(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, "pt")
    path = ckpt / read_index(ckpt).file_name(1)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(TrajectoryFileError, match="not a regular file"):
        trajfile.load(path)
    result = run("verify", ckpt, "--deep")
    _assert_clean(result)
    assert result.exit_code == 1


def test_old_torch_is_refused_before_any_file_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.pt"
    torch.save(make_traj(), path)
    trajfile.require_torch.cache_clear()
    monkeypatch.setattr(torch, "__version__", "2.9.1+cpu")
    try:
        with pytest.raises(RbtoolError, match=r"torch 2\.9\.1\+cpu is older than 2\.10"):
            trajfile.load(path)
    finally:
        monkeypatch.undo()
        trajfile.require_torch.cache_clear()
    assert trajfile.load(path)["rewards"].shape == (4, 2, 1)


def test_reference_and_rbtool_files_pass_the_checks(tmp_path: Path) -> None:
    from conftest import FIXTURES

    for path in sorted(FIXTURES.rglob("trajectory_*.p*")):
        trajfile.load(path)  # every reference file, .pt and .pkl
    buffer_bytes = io.BytesIO()
    torch.save(make_traj(), buffer_bytes)
    assert buffer_bytes.tell() > 0


# ------------------------------------------------------------------ links that leave the checkpoint
def _secret(tmp_path: Path) -> Path:
    """A file outside the checkpoint that happens to load as a trajectory."""
    secret = tmp_path / "elsewhere" / "secret.pt"
    secret.parent.mkdir()
    torch.save(make_traj(seed=99), secret)
    return secret


def test_a_listed_symlink_out_of_the_checkpoint_is_refused_everywhere(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, "pt")
    name = read_index(ckpt).file_name(1)
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(_secret(tmp_path))
    before = tree_digest(ckpt)
    verified = run("verify", ckpt, "--json")
    _assert_clean(verified)
    assert verified.exit_code == 1 and '"file_outside"' in verified.stdout
    for argv in (
        ["verify", ckpt, "--deep"],
        ["checkpoint", "load", ckpt],
        ["stats", ckpt],
        ["sample", ckpt, "--num-chunks", "4"],
        ["merge", ckpt, "--out", tmp_path / "merged", "--format", "pkl"],
        ["shard", ckpt, "--world-size", "2", "--out", tmp_path / "shards"],
        ["ingest", ckpt, "--buffer", tmp_path / "buf"],
    ):
        result = run(*argv)
        _assert_clean(result)
        assert result.exit_code == 1, argv
        text = " ".join((result.stderr + result.stdout).split())
        assert "outside the checkpoint" in text or "file_outside" in text, argv
    assert not (tmp_path / "merged").exists() and not (tmp_path / "shards").exists()
    repaired = run("repair", ckpt, "--out", tmp_path / "repaired", "--json")
    assert repaired.exit_code == 0 and read_index(tmp_path / "repaired").id_list == [0]
    assert "outside the checkpoint" in repaired.stdout
    assert tree_digest(ckpt) == before


def test_a_json_symlink_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, "pt")
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((ckpt / "metadata.json").read_bytes())
    (ckpt / "metadata.json").unlink()
    (ckpt / "metadata.json").symlink_to(outside)
    result = run("checkpoint", "load", ckpt)
    _assert_clean(result)
    assert result.exit_code == 1 and "outside the checkpoint" in result.stderr


def test_a_symlink_inside_the_checkpoint_is_fine(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, "pt")
    index = read_index(ckpt)
    real = ckpt / "kept_aside.bin"
    (ckpt / index.file_name(1)).rename(real)
    (ckpt / index.file_name(1)).symlink_to(real.name)  # relative, within the directory
    assert run("checkpoint", "load", ckpt).exit_code == 0
    assert run("sample", ckpt, "--num-chunks", "4").exit_code == 0
