"""rbtool.files.trajfile: cleaning trajectory dicts, serializing them, loading them safely, hashes."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_traj

from rbtool.errors import InvalidTrajectoryError, TrajectoryFileError, UnsafePickleError
from rbtool.files import trajfile
from rbtool.format import layout


def assert_same_tree(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Same keys in the same order, same plain values, torch.equal and same dtype on every tensor."""
    assert list(actual) == list(expected)
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, dict):
            assert isinstance(got, dict), key
            assert_same_tree(got, want)
        elif isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), key
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(got, want), key
        else:
            assert got == want and type(got) is type(want), key


# ------------------------------------------------------------------ normalize
def test_normalize_drops_none_and_clones_contiguous_cpu_tensors() -> None:
    transposed = torch.randn(2, 4, 3).transpose(0, 1)  # [4, 2, 3], not contiguous
    assert not transposed.is_contiguous()
    raw = {
        "rewards": transposed,
        "prev_values": None,
        "curr_obs": {"states": torch.randn(4, 2, 5), "gone": None},
        "task_ids": torch.arange(2),
        "model_weights_id": "v1",
    }
    traj, info = trajfile.normalize(raw, "t")
    assert "prev_values" not in traj and "gone" not in traj["curr_obs"]
    for path, tensor in layout.iter_tensors(traj):
        source = raw[path[0]] if len(path) == 1 else raw[path[0]][path[1]]
        assert tensor.is_contiguous() and tensor.device.type == "cpu", path
        assert tensor.untyped_storage().data_ptr() != source.untyped_storage().data_ptr(), path
        assert torch.equal(tensor, source), path
    assert info.shape == (4, 2, 3) and info.num_samples == 8 and info.model_weights_id == "v1"
    # the caller's dict is left as it was
    assert "max_episode_length" not in raw and raw["prev_values"] is None


def test_normalize_does_not_share_memory_with_the_input() -> None:
    rewards = torch.zeros(3, 2, 1)
    traj, _ = trajfile.normalize({"rewards": rewards}, "t")
    rewards += 1
    assert torch.equal(traj["rewards"], torch.zeros(3, 2, 1))


def test_normalize_fills_the_scalar_fields() -> None:
    traj, info = trajfile.normalize({"rewards": torch.zeros(5, 3)}, "t")
    assert traj["model_weights_id"] == "" and info.model_weights_id == ""
    assert traj["max_episode_length"] == 5 and info.max_episode_length == 5
    traj, info = trajfile.normalize({"rewards": torch.zeros(5, 3), "max_episode_length": 9}, "t")
    assert traj["max_episode_length"] == 9 and info.max_episode_length == 9


def test_normalize_keeps_numbers_strings_and_lists_of_them() -> None:
    raw = {"rewards": torch.zeros(2, 1), "flag": True, "scale": 0.5, "tags": ("a", "b"), "ns": [1, 2]}
    traj, _ = trajfile.normalize(raw, "t")
    assert traj["flag"] is True and traj["scale"] == 0.5
    assert traj["tags"] == ["a", "b"] and traj["ns"] == [1, 2]


@dataclasses.dataclass
class DataclassTrajectory:
    rewards: Any
    actions: Any = None
    model_weights_id: str = "dc"


class ObjectTrajectory:
    def __init__(self) -> None:
        self.rewards = torch.ones(3, 2, 1)
        self.dones = torch.zeros(4, 2, 1, dtype=torch.bool)
        self.prev_values = None
        self._private = object()  # not a field: never reaches the file


def test_normalize_accepts_dataclasses_and_objects() -> None:
    traj, info = trajfile.normalize(DataclassTrajectory(rewards=torch.ones(3, 2)), "dc")
    assert set(traj) == {"rewards", "model_weights_id", "max_episode_length"}
    assert info.model_weights_id == "dc" and info.shape == (3, 2)

    traj, info = trajfile.normalize(ObjectTrajectory(), "obj")
    assert set(traj) == {"rewards", "dones", "model_weights_id", "max_episode_length"}
    assert info.shape == (3, 2, 1)


def test_normalize_refuses_what_is_not_a_trajectory() -> None:
    with pytest.raises(InvalidTrajectoryError, match="must be a dict or an object with attributes, got int"):
        trajfile.normalize(3, "t")
    with pytest.raises(InvalidTrajectoryError, match="cannot determine the trajectory shape"):
        trajfile.normalize({"actions": torch.zeros(2, 2)}, "trajectory #4")


def test_normalize_refuses_non_string_keys_naming_the_field() -> None:
    with pytest.raises(InvalidTrajectoryError, match=r"trajectory #2: field names must be strings, got 7"):
        trajfile.normalize({"rewards": torch.zeros(2, 1), 7: torch.zeros(2, 1)}, "trajectory #2")
    with pytest.raises(
        InvalidTrajectoryError, match=r"field curr_obs\.deep: nested keys must be strings, got 1"
    ):
        trajfile.normalize({"rewards": torch.zeros(2, 1), "curr_obs": {"deep": {1: torch.zeros(2, 1)}}}, "t")


@pytest.mark.parametrize(
    ("value", "field", "kind"),
    [
        ({"extra": object()}, "extra", "object"),
        ({"curr_obs": {"img": b"raw"}}, "curr_obs.img", "bytes"),
        ({"mixed": [1, torch.zeros(1)]}, "mixed", "list"),
        ({"curr_obs": {"s": {1.5}}}, "curr_obs.s", "set"),
    ],
)
def test_normalize_refuses_unsupported_values_naming_the_field(
    value: dict[str, Any], field: str, kind: str
) -> None:
    with pytest.raises(InvalidTrajectoryError, match=rf"field '{field}' holds a {kind};"):
        trajfile.normalize({"rewards": torch.zeros(2, 1), **value}, "t")


def test_normalize_refuses_inconsistent_shapes_with_describe_s_message() -> None:
    raw = make_traj(t=4, b=2, actions=torch.zeros(3, 2, 7))
    with pytest.raises(InvalidTrajectoryError, match=r"trajectory #0: field 'actions' has shape \[3, 2, 7\]"):
        trajfile.normalize(raw, "trajectory #0")


# --------------------------------------------------------- to_bytes and load
def rich_traj() -> dict[str, Any]:
    """Every dtype family a trajectory carries, nested dicts, plain values, a 1-dim field."""
    return make_traj(
        t=3,
        b=2,
        seed=5,
        half=torch.randn(3, 2, 2).half(),
        bf16=torch.randn(3, 2, 2).bfloat16(),
        doubles=torch.randn(3, 2, 1, dtype=torch.float64),
        ints=torch.randint(-5, 5, (3, 2, 2), dtype=torch.int32),
        task_ids=torch.arange(2),
        empty=torch.zeros(3, 2, 0),
        note="text",
        tags=["a", "b"],
        extra={"deeper": {"x": torch.randn(3, 2, 1)}},
    )


@pytest.mark.parametrize("fmt", ["pt", "pkl"])
@pytest.mark.parametrize("mmap", [False, True])
def test_to_bytes_then_load_round_trips(tmp_path: Path, fmt: str, mmap: bool) -> None:
    traj, _ = trajfile.normalize(rich_traj(), "t")
    path = tmp_path / f"trajectory_0_x.{fmt}"
    path.write_bytes(trajfile.to_bytes(traj, fmt))
    assert_same_tree(trajfile.load(path, mmap=mmap), traj)


def test_pt_bytes_are_what_torch_save_writes() -> None:
    traj, _ = trajfile.normalize(make_traj(seed=1), "t")
    buffer = io.BytesIO()
    torch.save(traj, buffer)
    assert trajfile.to_bytes(traj, "pt") == buffer.getvalue()


def test_pkl_bytes_load_with_plain_pickle_like_the_reference_does() -> None:
    traj, _ = trajfile.normalize(make_traj(seed=2), "t")
    assert_same_tree(pickle.loads(trajfile.to_bytes(traj, "pkl")), traj)


def test_legacy_pt_files_load_even_when_mapping_is_asked(tmp_path: Path) -> None:
    traj, _ = trajfile.normalize(make_traj(seed=3), "t")
    path = tmp_path / "legacy.pt"
    torch.save(traj, path, _use_new_zipfile_serialization=False)
    assert_same_tree(trajfile.load(path, mmap=True), traj)


def test_suffix_gives_the_format_of_a_file_without_one(tmp_path: Path) -> None:
    traj, _ = trajfile.normalize(make_traj(seed=4), "t")
    for fmt in ("pt", "pkl"):
        path = tmp_path / f"noname{fmt}"
        path.write_bytes(trajfile.to_bytes(traj, fmt))
        assert_same_tree(trajfile.load(path, suffix=f".{fmt}"), traj)
        with pytest.raises(TrajectoryFileError, match=r"expected \.pt or \.pkl"):
            trajfile.load(path)


def test_load_refuses_other_suffixes_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "trajectory_0_x.npz"
    path.write_bytes(trajfile.to_bytes(make_traj(), "pt"))
    with pytest.raises(TrajectoryFileError) as caught:
        trajfile.load(path)
    assert str(caught.value) == f"{path}: not a trajectory file (expected .pt or .pkl)"


@pytest.mark.parametrize("fmt", ["pt", "pkl"])
def test_load_refuses_a_non_dict_naming_the_file(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"t.{fmt}"
    if fmt == "pt":
        torch.save([torch.zeros(2)], path)
    else:
        path.write_bytes(pickle.dumps([1, 2], protocol=2))
    with pytest.raises(TrajectoryFileError, match=rf"^{re.escape(str(path))}: .*list"):
        trajfile.load(path)


@pytest.mark.parametrize("fmt", ["pt", "pkl"])
@pytest.mark.parametrize("keep", [0.0, 0.3, 0.9])
def test_load_refuses_a_truncated_file_naming_it(tmp_path: Path, fmt: str, keep: float) -> None:
    data = trajfile.to_bytes(trajfile.normalize(make_traj(), "t")[0], fmt)
    path = tmp_path / f"trajectory_1_x.{fmt}"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(TrajectoryFileError) as caught:
        trajfile.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message


@pytest.mark.parametrize("fmt", ["pt", "pkl"])
def test_load_of_a_missing_file_names_it(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"gone.{fmt}"
    with pytest.raises(TrajectoryFileError, match=rf"^{re.escape(str(path))}: "):
        trajfile.load(path)


class Payload:
    """An object no trajectory holds: loading it would run its reduce."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("code ran",))


@pytest.mark.parametrize("fmt", ["pt", "pkl"])
def test_load_refuses_objects_other_than_tensors(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"evil.{fmt}"
    obj = {"rewards": torch.zeros(2, 1), "payload": Payload()}
    if fmt == "pt":
        torch.save(obj, path)
    else:
        path.write_bytes(pickle.dumps(obj, protocol=2))
    with pytest.raises(UnsafePickleError, match=rf"^{re.escape(str(path))}: "):
        trajfile.load(path)
    assert "code ran" not in capsys.readouterr().out


def test_load_pt_template_returns_any_weights_only_object(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save([torch.arange(3)], path)
    got = trajfile.load_pt_template(path, mmap=True)
    assert isinstance(got, list) and torch.equal(got[0], torch.arange(3))


# ---------------------------------------------------------------------- hashes
@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 1, 1 << 20, (2 << 20) + 7])
def test_sha256_of_bytes_and_of_file_agree(tmp_path: Path, size: int) -> None:
    data = bytes(i * 31 % 251 for i in range(size))
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert trajfile.sha256_file(path) == trajfile.sha256_bytes(data) == hashlib.sha256(data).hexdigest()


def test_sha256_of_written_trajectory_bytes_matches_the_file(tmp_path: Path) -> None:
    data = trajfile.to_bytes(trajfile.normalize(make_traj(), "t")[0], "pkl")
    (tmp_path / "t.pkl").write_bytes(data)
    assert trajfile.sha256_file(tmp_path / "t.pkl") == trajfile.sha256_bytes(data)
