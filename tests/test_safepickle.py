"""Tests for rbtool.files.safepickle: restricted loading of RLinf trajectory pickles."""

from __future__ import annotations

import builtins
import os
import pickle
import pickletools
import random
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES as REFERENCE

from rbtool.errors import TrajectoryFileError, UnsafePickleError
from rbtool.files.safepickle import dump_pickle_trajectory, load_pickle_trajectory

FIXTURE_DIR = REFERENCE / "nosave_window2_pkl" / "ckpt"
FIXTURES = sorted(FIXTURE_DIR.glob("trajectory_*.pkl"))
NAME = "trajectory_3_x.pkl"

needs_fixtures = pytest.mark.skipif(not FIXTURES, reason="RLinf fixtures not present")


# --------------------------------------------------------------------------- helpers


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts into {"a.b": leaf}."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _assert_same(got: dict, want: dict) -> None:
    """Assert two trajectory dicts hold equal tensors (dtype, shape, values) and scalars."""
    flat_got, flat_want = _flatten(got), _flatten(want)
    assert flat_got.keys() == flat_want.keys()
    for key, expected in flat_want.items():
        actual = flat_got[key]
        if isinstance(expected, torch.Tensor):
            assert type(actual) is torch.Tensor, key
            assert actual.dtype == expected.dtype, key
            assert actual.shape == expected.shape, key
            assert torch.equal(actual, expected), key
        else:
            assert type(actual) is type(expected), key
            assert actual == expected, key


def _assert_one_line(exc: BaseException, *parts: str) -> None:
    """Assert the error message is one line naming the file and each part."""
    message = str(exc)
    assert "\n" not in message
    assert message.startswith(f"{NAME}: ")
    for part in parts:
        assert part in message, (part, message)


def _legacy_header() -> bytes:
    """The three small pickles (magic, protocol, sys info) that open a legacy blob."""
    blob = _storage_blob(torch.arange(3, dtype=torch.float32))
    end = 0
    for _ in range(3):
        end += next(p or 0 for op, _, p in pickletools.genops(blob[end:]) if op.name == "STOP")
        end += 1
    return blob[:end]


def _storage_blob(tensor: torch.Tensor) -> bytes:
    """The inner `_load_from_bytes` blob torch writes for a tensor's storage."""
    data = pickle.dumps(tensor, protocol=4)
    return next(arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, bytes))


class _Reduce:
    """Pickles as `func(*args)`; lets a test build any REDUCE payload."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def _storage_from(blob: bytes) -> _Reduce:
    """A `torch.storage._load_from_bytes(blob)` call, as torch pickles a storage."""
    return _Reduce(torch.storage._load_from_bytes, blob)


def _tensor_from(blob: bytes, *rebuild_args: Any) -> _Reduce:
    """A `_rebuild_tensor_v2(storage(blob), ...)` call, as torch pickles a tensor."""
    args = rebuild_args or (0, (1,), (1,), False, OrderedDict())
    return _Reduce(torch._utils._rebuild_tensor_v2, _storage_from(blob), *args)


def _wait_and_assert_absent(marker: Path) -> None:
    """Give an asynchronous payload time to act, then assert it never did."""
    time.sleep(0.2)
    assert not marker.exists()


# --------------------------------------------------------------------------- fixtures


@needs_fixtures
@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.name[:12])
def test_fixture_loads_like_plain_pickle(path: Path) -> None:
    data = path.read_bytes()
    got = load_pickle_trajectory(data, name=path.name)
    want = pickle.loads(data)  # trusted fixture: plain pickle only as the reference
    assert isinstance(got, dict)
    _assert_same(got, want)
    assert got["curr_obs"]["main_images"].dtype == torch.uint8
    assert got["dones"].dtype == torch.bool


@needs_fixtures
def test_fixture_reload_after_dump_is_equal() -> None:
    data = FIXTURES[0].read_bytes()
    first = load_pickle_trajectory(data, name=FIXTURES[0].name)
    again = load_pickle_trajectory(dump_pickle_trajectory(first), name="re.pkl")
    _assert_same(again, first)


# --------------------------------------------------------------------------- round trip


def _sample_trajectory() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "max_episode_length": 4,
        "model_weights_id": "33f15aba-7be0-5674-b1ed-9616ef3bebc8",
        "actions": torch.randn(4, 2, 7),
        "dones": torch.tensor([[True], [False], [False], [True]]),
        "tokens": torch.randint(-(2**40), 2**40, (4, 2, 7), dtype=torch.int64),
        "forward_inputs": {"action_tokens": torch.arange(8, dtype=torch.int64)},
        "curr_obs": {
            "main_images": torch.randint(0, 256, (4, 2, 16, 16, 3), dtype=torch.uint8),
            "nested": {"states": torch.randn(4, 2, 8, dtype=torch.float64)},
        },
        "one_dim": torch.tensor([1.5, -2.0, 3.25]),
        "half": torch.randn(3, dtype=torch.float16),
        "bf16": torch.randn(3, dtype=torch.bfloat16),
        "scalar": torch.tensor(7),
        "empty": torch.zeros(0, 3),
        "transposed": base.t(),
        "offset_view": base.reshape(-1)[5:11],
        "ratio": 0.5,
        "flag": True,
        "nothing": None,
        "ids": [1, 2, 3],
    }


def test_round_trip_preserves_tensors() -> None:
    traj = _sample_trajectory()
    data = dump_pickle_trajectory(traj)
    got = load_pickle_trajectory(data, name=NAME)
    _assert_same(got, traj)
    assert got["transposed"].stride() == traj["transposed"].stride()
    assert got["offset_view"].tolist() == list(range(5, 11))


def test_dump_is_plain_protocol_4_pickle() -> None:
    traj = {"a": torch.arange(3), "n": 1, "s": "x"}
    data = dump_pickle_trajectory(traj)
    assert data[:2] == b"\x80\x04"
    _assert_same(pickle.loads(data), traj)  # what RLinf's plain pickle.load sees


def test_load_does_not_need_torch_at_import() -> None:
    code = "import sys, rbtool.files.safepickle; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], check=False)
    assert result.returncode == 0


# --------------------------------------------------------------------------- malicious


def _payloads(marker: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (pickle bytes, global the error must name); each would touch `marker`."""
    cmd = f"touch {marker}"
    py = f"open({str(marker)!r}, 'w').close()"
    argv = ["touch", str(marker)]
    q = cmd.encode()
    return {
        "reduce_os_system": (
            pickle.dumps({"actions": _Reduce(os.system, cmd)}),
            f"{os.system.__module__}.system",
        ),
        "reduce_popen": (
            pickle.dumps({"x": _Reduce(subprocess.Popen, argv)}),
            "subprocess.Popen",
        ),
        "reduce_run": (
            pickle.dumps({"x": _Reduce(subprocess.run, argv)}),
            "subprocess.run",
        ),
        "reduce_eval": (pickle.dumps(_Reduce(builtins.eval, py)), "builtins.eval"),
        "reduce_exec": (
            pickle.dumps({"a": {"b": _Reduce(builtins.exec, py)}}),
            "builtins.exec",
        ),
        "reduce_exec_protocol_0": (  # fix_imports writes the Python 2 module name
            pickle.dumps({"a": _Reduce(builtins.exec, py)}, protocol=0),
            "__builtin__.exec",
        ),
        "global_os_system": (b"cos\nsystem\n(S'" + q + b"'\ntR.", "os.system"),
        "global_posix_system": (b"cposix\nsystem\n(S'" + q + b"'\ntR.", "posix.system"),
        "stack_global_os_system": (
            b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c" + bytes([len(q)]) + q + b"\x85R.",
            "os.system",
        ),
        "inst_os_system": (b"(S'" + q + b"'\nios\nsystem\n.", "os.system"),
        "py2_builtin_eval": (
            b"c__builtin__\neval\n(S'" + py.encode() + b"'\ntR.",
            "__builtin__.eval",
        ),
        "getattr_chain": (
            b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR(S'" + q + b"'\ntR.",
            "builtins.getattr",
        ),
        "import_chain_after_dict": (
            b"(dp0\nS'ok'\np1\nI1\nscbuiltins\n__import__\n(S'os'\ntR.",
            "builtins.__import__",
        ),
        "torch_load_itself": (
            pickle.dumps({"x": _Reduce(torch.load, str(marker))}),
            "torch.serialization.load",
        ),
        "ordered_dict_lookalike": (b"ccollections\nnamedtuple\n(S'a'\nS'b'\ntR.", "collections.namedtuple"),
    }


@pytest.mark.parametrize("case", sorted(_payloads(Path("/m"))))
def test_malicious_pickle_is_refused_and_runs_nothing(case: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data, refused_global = _payloads(marker)[case]
    with pytest.raises(UnsafePickleError) as info:
        load_pickle_trajectory(data, name=NAME)
    _assert_one_line(info.value, f"'{refused_global}'", "refused to unpickle global")
    _wait_and_assert_absent(marker)


@pytest.mark.parametrize("case", ["reduce_os_system", "global_os_system", "reduce_exec"])
def test_payloads_are_live_under_plain_pickle(case: str, tmp_path: Path) -> None:
    """Control: the same bytes do run code under pickle.loads, so the test above means something."""
    marker = tmp_path / "pwned"
    data, _ = _payloads(marker)[case]
    pickle.loads(data)  # deliberately unsafe control: the payload only touches tmp_path
    assert marker.exists()


def test_example_message_format(tmp_path: Path) -> None:
    data = b"cos\nsystem\n(S'true'\ntR."
    with pytest.raises(UnsafePickleError) as info:
        load_pickle_trajectory(data, name=NAME)
    assert str(info.value) == (
        f"{NAME}: refused to unpickle global 'os.system' "
        "(only tensors, dicts, lists, numbers and strings are allowed)"
    )


def test_persistent_id_is_refused() -> None:
    with pytest.raises(UnsafePickleError) as info:
        load_pickle_trajectory(b"\x80\x02}Pstorage\ns.", name=NAME)
    _assert_one_line(info.value, "persistent id")


@pytest.mark.parametrize(
    ("tensor", "refused_global"),
    [
        (torch.nn.Parameter(torch.zeros(2)), "torch._utils._rebuild_parameter"),
        (torch.tensor([1, 2], dtype=torch.uint16), "torch._utils._rebuild_tensor_v3"),
        (torch.eye(2).to_sparse(), "torch._utils._rebuild_sparse_tensor"),
    ],
    ids=["parameter", "uint16_v3", "sparse"],
)
def test_non_plain_tensors_are_refused(tensor: torch.Tensor, refused_global: str) -> None:
    data = pickle.dumps({"x": tensor}, protocol=4)
    with pytest.raises(UnsafePickleError) as info:
        load_pickle_trajectory(data, name=NAME)
    _assert_one_line(info.value, f"'{refused_global}'")


def test_inner_storage_blob_reaching_for_os_system(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    inner = (
        _legacy_header()
        + pickle.dumps(_Reduce(os.system, f"touch {marker}"), protocol=2)
        + pickle.dumps([], protocol=2)
    )
    data = pickle.dumps({"actions": _tensor_from(inner)}, protocol=4)
    with pytest.raises(UnsafePickleError) as info:
        load_pickle_trajectory(data, name=NAME)
    _assert_one_line(info.value, f"'{os.system.__module__}.system'")
    _wait_and_assert_absent(marker)


def test_inner_plain_pickle_reaching_for_os_system(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    inner = pickle.dumps(_Reduce(os.system, f"touch {marker}"), protocol=2)
    data = pickle.dumps({"actions": _storage_from(inner)}, protocol=4)
    with pytest.raises(UnsafePickleError) as info:
        load_pickle_trajectory(data, name=NAME)
    _assert_one_line(info.value, "system'")
    _wait_and_assert_absent(marker)


def test_inner_storage_type_swapped_for_os_system(tmp_path: Path) -> None:
    blob = _storage_blob(torch.arange(3, dtype=torch.float32))
    evil = blob.replace(b"ctorch\nFloatStorage\n", b"cos\nsystem\n")
    assert evil != blob
    with pytest.raises(UnsafePickleError) as info:
        load_pickle_trajectory(pickle.dumps({"a": _tensor_from(evil)}), name=NAME)
    _assert_one_line(info.value, "'os.system'")


def test_inner_blob_holding_a_non_storage_is_rejected() -> None:
    inner = _legacy_header() + pickle.dumps({"a": 1}, protocol=2) + pickle.dumps([], 2)
    data = pickle.dumps({"a": _tensor_from(inner)})
    with pytest.raises(TrajectoryFileError) as info:
        load_pickle_trajectory(data, name=NAME)
    _assert_one_line(info.value, "dict")


def test_zip_storage_blob_is_rejected() -> None:
    data = pickle.dumps({"a": _storage_from(b"PK\x03\x04" + b"\0" * 40)})
    with pytest.raises(TrajectoryFileError):
        load_pickle_trajectory(data, name=NAME)


@pytest.mark.parametrize(
    "rebuild_args",
    [
        (0, (1000,), (1,), False, OrderedDict()),  # view larger than the storage
        (2, (2,), (1,), False, OrderedDict()),  # offset pushes it past the end
        (-1, (1,), (1,), False, OrderedDict()),
        (0, (2,), (-1,), False, OrderedDict()),
        (0, (1, 1), (1,), False, OrderedDict()),
        (0, [3], [1], False, OrderedDict()),
        (0, (3,), (1,), 1, OrderedDict()),
        (0, (3,), (1,), False, OrderedDict(a=1)),
        (0, (3,), (1,), False, OrderedDict(), {"neg": True}),
        (0, (3,), (1,)),
    ],
)
def test_bad_rebuild_arguments_are_rejected(rebuild_args: tuple) -> None:
    blob = _storage_blob(torch.arange(3, dtype=torch.float32))
    data = pickle.dumps({"a": _tensor_from(blob, *rebuild_args)})
    with pytest.raises(TrajectoryFileError) as info:
        load_pickle_trajectory(data, name=NAME)
    _assert_one_line(info.value, "bad tensor")


def test_good_rebuild_arguments_still_load() -> None:
    blob = _storage_blob(torch.arange(6, dtype=torch.float32))
    data = pickle.dumps({"a": _tensor_from(blob, 1, (2, 2), (2, 1), False, OrderedDict())})
    got = load_pickle_trajectory(data, name=NAME)
    assert got["a"].tolist() == [[1.0, 2.0], [3.0, 4.0]]


@pytest.mark.parametrize("top", [[1, 2], 3, "s", None, (1,)])
def test_top_level_must_be_a_dict(top: Any) -> None:
    with pytest.raises(TrajectoryFileError) as info:
        load_pickle_trajectory(pickle.dumps(top), name=NAME)
    _assert_one_line(info.value, "not a dict")


def test_bare_storage_in_result_is_rejected() -> None:
    blob = _storage_blob(torch.arange(3, dtype=torch.float32))
    with pytest.raises(TrajectoryFileError) as info:
        load_pickle_trajectory(pickle.dumps({"a": _storage_from(blob)}), name=NAME)
    _assert_one_line(info.value, "TypedStorage")


# --------------------------------------------------------------------------- corrupt data


def _trajectory_bytes() -> bytes:
    if FIXTURES:
        return FIXTURES[0].read_bytes()
    return dump_pickle_trajectory(_sample_trajectory())


def _load_or_clean_error(data: bytes) -> dict | None:
    """Load, returning None on TrajectoryFileError; any other exception fails the test."""
    try:
        result = load_pickle_trajectory(data, name=NAME)
    except TrajectoryFileError as exc:  # UnsafePickleError is a subclass
        _assert_one_line(exc)
        return None
    assert isinstance(result, dict)
    return result


def test_truncated_data_raises_trajectory_file_error() -> None:
    data = _trajectory_bytes()
    cuts = {0, 1, 2, 3, 10, 11, 12, 50, 150, 181, 200, 700, len(data) // 2}
    cuts |= set(range(0, len(data), 211)) | {len(data) - 2, len(data) - 1}
    for cut in sorted(cuts):
        with pytest.raises(TrajectoryFileError) as info:
            load_pickle_trajectory(data[:cut], name=NAME)
        _assert_one_line(info.value)


def test_empty_and_garbage_inputs() -> None:
    for data in (b"", b"\x80", b"not a pickle at all", b"\x80\x05\x95" + b"\xff" * 20):
        with pytest.raises(TrajectoryFileError):
            load_pickle_trajectory(data, name=NAME)


def _structural_offsets(data: bytes) -> list[int]:
    """Offsets of outer opcodes plus the first bytes of each inner storage blob."""
    offsets: list[int] = []
    for op, arg, pos in pickletools.genops(data):
        assert pos is not None
        offsets.append(pos)
        if op.name in ("BINBYTES", "SHORT_BINBYTES") and isinstance(arg, bytes):
            start = pos + 1 + (4 if op.name == "BINBYTES" else 1)
            offsets.extend(range(start, start + min(len(arg), 330)))
    return offsets


def test_flipped_bytes_never_escape_as_other_exceptions() -> None:
    data = _trajectory_bytes()
    rng = random.Random(20240601)
    structural = _structural_offsets(data)
    outcomes = {"loaded": 0, "rejected": 0}
    for i in range(300):
        mutated = bytearray(data)
        flips = 1 if i % 3 else rng.randint(2, 6)
        for _ in range(flips):
            pos = rng.choice(structural) if i % 2 else rng.randrange(len(data))
            mutated[pos] ^= rng.randint(1, 255)
        loaded = _load_or_clean_error(bytes(mutated))
        outcomes["loaded" if loaded is not None else "rejected"] += 1
    assert outcomes["rejected"] > 50  # the structural flips really exercise error paths


def test_flipped_inner_blob_bytes_never_escape() -> None:
    blob = _storage_blob(torch.arange(8, dtype=torch.float32))
    rng = random.Random(7)
    for _ in range(200):
        mutated = bytearray(blob)
        mutated[rng.randrange(len(blob))] ^= rng.randint(1, 255)
        _load_or_clean_error(pickle.dumps({"a": _tensor_from(bytes(mutated))}))
        cut = rng.randrange(len(blob))
        _load_or_clean_error(pickle.dumps({"a": _tensor_from(blob[:cut])}))
