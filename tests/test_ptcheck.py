"""The deep pass's fast path (rbtool.files.ptcheck) gives the torch path's verdicts, file by file.

Every variant below, intact or damaged, is checked twice by `verify`'s deep check of one file:
as it runs (the fast path where it accepts the file) and with the fast path turned off (torch.load
and check_loaded, the path it replaces); the problems, the schema and the bytes read must be the
same. Variants the fast path accepts must be ones torch loads without a problem of its own.
"""

from __future__ import annotations

import io
import random
import struct
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rbtool.files import ptcheck, trajfile
from rbtool.ops import verify as verify_op
from rbtool.ops.verify import CheckpointReport, verify

WEIGHTS = "w0"
ENTRY = {"shape": [1, 1, 7], "model_weights_id": WEIGHTS, "max_episode_length": 1, "sha256": None}


def tiny(seed: int = 0, **extra: Any) -> dict[str, Any]:
    """A one-transition trajectory like the ones real buffers hold by the hundred thousand."""
    g = torch.Generator().manual_seed(seed)
    traj: dict[str, Any] = {
        "max_episode_length": 1,
        "model_weights_id": WEIGHTS,
        "actions": torch.randn(1, 1, 7, generator=g),
        "rewards": torch.randn(1, 1, 1, generator=g),
        "dones": torch.rand(2, 1, 1, generator=g) < 0.5,
        "prev_logprobs": torch.randn(1, 1, 7, generator=g),
        "curr_obs": {"states": torch.randn(1, 1, 8, generator=g), "img": torch.zeros(1, 1, 4, 4, 3).byte()},
    }
    traj.update(extra)
    return traj


def saved(traj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(traj, buffer)
    return buffer.getvalue()


def members(data: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


def rezip(items: list[tuple[str, bytes]], compress: frozenset[str] = frozenset()) -> bytes:
    """A zip of `items` as Python's zipfile writes it (no data descriptors, no alignment)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a record twice is one of the variants
        for name, body in items:
            method = zipfile.ZIP_DEFLATED if name in compress else zipfile.ZIP_STORED
            archive.writestr(zipfile.ZipInfo(name), body, compress_type=method)
    return buffer.getvalue()


def with_pickle(data: bytes, pickled: bytes) -> bytes:
    return rezip([(n, pickled if n.endswith("/data.pkl") else b) for n, b in members(data)])


def central(data: bytes) -> tuple[int, int, int]:
    """(central directory offset, its size, entries) from the end record."""
    _, _, _, _, count, size, offset, _ = struct.unpack_from("<4sHHHHIIH", data, len(data) - 22)
    return offset, size, count


def central_entries(data: bytes) -> Iterator[tuple[int, str]]:
    offset, _, count = central(data)
    pos = offset
    for _ in range(count):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, pos + 28)
        yield pos, data[pos + 46 : pos + 46 + name_len].decode()
        pos += 46 + name_len + extra_len + comment_len


def patched(data: bytes, at: int, value: bytes) -> bytes:
    return data[:at] + value + data[at + len(value) :]


def flipped(data: bytes, at: int, bit: int = 0) -> bytes:
    return patched(data, at, bytes([data[at] ^ (1 << bit)]))


# ------------------------------------------------------------------ the variants
def pickle_variants(base: bytes) -> Iterator[tuple[str, bytes]]:
    (pickled,) = [b for n, b in members(base) if n.endswith("/data.pkl")]
    body = pickled[:-1]  # without STOP
    yield "rezipped", with_pickle(base, pickled)
    yield "build on the dict", with_pickle(base, body + b"}b.")
    yield "build with none", with_pickle(base, body + b"Nb.")
    yield "global os.system", with_pickle(base, body + b"cos\nsystem\n0.")
    yield (
        "py2 name for OrderedDict",
        with_pickle(base, pickled.replace(b"collections\nOrderedDict", b"UserDict\nOrderedDict")),
    )
    yield "empty list appended", with_pickle(base, body + b"0].")
    yield "setitem on a list", with_pickle(base, body.replace(b"}", b"]", 1) + b".")
    yield (
        "frame opcode",
        with_pickle(base, b"\x80\x04\x95" + struct.pack("<Q", len(pickled) - 2) + pickled[2:]),
    )
    yield "memo far away", with_pickle(base, body + b"r\xff\xff\xff\x7f.")
    yield "no stop", with_pickle(base, body)
    yield "stop only", with_pickle(base, b".")
    yield "trailing bytes", with_pickle(base, pickled + b"garbage")
    yield "short unicode", with_pickle(base, pickled.replace(b"X\x07\x00\x00\x00actions", b"\x8c\x07actions"))
    at = pickled.find(b"FloatStorage")
    if at > 0:
        yield "double storage", with_pickle(base, pickled.replace(b"FloatStorage", b"DoubleStorage", 1))
        yield "int storage", with_pickle(base, pickled.replace(b"FloatStorage", b"IntStorage", 1))
    for i in range(0, len(pickled), 3):
        yield f"pickle byte {i} flipped", with_pickle(base, flipped(pickled, i, i % 8))
    for n in (1, 2, len(pickled) // 2, len(pickled) - 1):
        yield f"pickle cut to {n}", with_pickle(base, pickled[:n])


def zip_variants(base: bytes) -> Iterator[tuple[str, bytes]]:
    items = members(base)
    prefix = items[0][0].split("/")[0]
    yield "intact", base
    for n in sorted({0, 1, 3, 4, 21, 22, 100, len(base) // 2, len(base) - 23, len(base) - 22, len(base) - 1}):
        yield f"cut to {n}", base[:n]
    yield "grown by a byte", base + b"\0"
    yield "prefixed by a byte", b"\0" + base
    for i in range(0, len(base), 5):
        yield f"byte {i} flipped", flipped(base, i, i % 8)
    for pos, name in central_entries(base):
        crc = struct.unpack_from("<I", base, pos + 16)[0]
        yield f"bad crc of {name}", patched(base, pos + 16, struct.pack("<I", crc ^ 1))
        yield f"huge size of {name}", patched(base, pos + 20, struct.pack("<II", 2**31, 2**31))
        yield f"huge offset of {name}", patched(base, pos + 42, struct.pack("<I", 2**31))
        yield f"{name} compressed", rezip(items, compress=frozenset({name}))
    _, _, count = central(base)
    yield "huge directory", patched(base, len(base) - 10, struct.pack("<I", 2**31))
    yield "directory count off", patched(base, len(base) - 12, struct.pack("<H", count + 1))
    yield "extra record", rezip([*items, (f"{prefix}/extra", b"x")])
    yield "extra storage record", rezip([*items, (f"{prefix}/data/99", b"\0" * 8)])
    yield "record in another archive", rezip([*items, ("other/data.pkl", b"x")])
    yield "record differing in case", rezip([*items, (f"{prefix}/DATA.PKL", b"x")])
    yield "record twice", rezip([*items, items[0]])
    yield "a storage named data.pkl", rezip([*items, (f"{prefix}/data/data.pkl", b"\0" * 8)])
    yield "no version", rezip([i for i in items if not i[0].endswith("/version")])
    yield "no byteorder", rezip([i for i in items if not i[0].endswith("/byteorder")])
    yield "big endian", rezip([(n, b"big" if n.endswith("/byteorder") else b) for n, b in items])
    yield "version 9", rezip([(n, b"9\n" if n.endswith("/version") else b) for n, b in items])
    yield "odd alignment", rezip([(n, b"x" if n.endswith("/.storage_alignment") else b) for n, b in items])
    yield ".data/version", rezip([*items, (f"{prefix}/.data/version", b"3\n")])
    yield "storage record short", rezip([(n, b[:-1] if n.endswith("/data/0") else b) for n, b in items])
    yield "storage record long", rezip([(n, b + b"\0" if n.endswith("/data/0") else b) for n, b in items])
    yield "storage record missing", rezip([i for i in items if not i[0].endswith("/data/0")])
    yield "no subdirectory", rezip([(n.split("/", 1)[1], b) for n, b in items])
    yield "legacy format", _legacy()
    yield "not a zip", b"hello world" * 10
    yield "empty", b""


def _legacy() -> bytes:
    buffer = io.BytesIO()
    torch.save(tiny(), buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def content_variants() -> Iterator[tuple[str, bytes, dict[str, Any] | None]]:
    """Files torch.save writes with other contents, and entries that disagree with them."""
    base = tiny()
    yield "tiny", saved(base), ENTRY
    yield "no entry", saved(base), None
    yield "shape differs", saved(base), {**ENTRY, "shape": [2, 1, 7]}
    yield "weights differ", saved(base), {**ENTRY, "model_weights_id": "other"}
    yield "episode length differs", saved(base), {**ENTRY, "max_episode_length": 5}
    yield "sha256 differs", saved(base), {**ENTRY, "sha256": "0" * 64}
    data = saved(base)
    yield "sha256 agrees", data, {**ENTRY, "sha256": trajfile.sha256_bytes(data)}
    nan = tiny(actions=torch.tensor([[[float("nan"), 1.0, float("inf"), 2.0, 3.0, 4.0, -float("inf")]]]))
    yield "nan and inf", saved(nan), ENTRY
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.complex128):
        values = torch.tensor([[[float("nan"), 1.0, float("inf"), 2.0, 3.0, 4.0, 5.0]]]).to(dtype)
        yield f"{dtype} with nan", saved(tiny(prev_logprobs=values)), ENTRY
        yield f"{dtype} finite", saved(tiny(prev_logprobs=torch.ones(1, 1, 7, dtype=dtype))), ENTRY
    complex_nan = torch.complex(torch.ones(1, 1, 7), torch.tensor([[[float("nan")] + [0.0] * 6]]))
    yield "complex nan in the imaginary part", saved(tiny(prev_logprobs=complex_nan)), ENTRY
    wide = torch.tensor([float("nan"), 1.0, 2.0] * 7).reshape(1, 1, 21)
    yield "a strided view with nan", saved(tiny(actions=wide[:, :, ::3])), ENTRY
    yield "a view past nan", saved(tiny(actions=wide[:, :, 1:8])), ENTRY
    yield "a transposed view", saved(tiny(actions=torch.randn(7, 1, 1).permute(2, 1, 0))), ENTRY
    shared = torch.randn(1, 1, 7)
    yield "two fields share a storage", saved(tiny(actions=shared, prev_logprobs=shared)), ENTRY
    yield "an expanded view", saved(tiny(actions=torch.randn(1, 1, 1).expand(1, 1, 7))), ENTRY
    yield "an empty tensor", saved(tiny(extra=torch.zeros(0, 3))), ENTRY
    yield "a 1-dim tensor", saved(tiny(extra=torch.ones(3))), ENTRY
    yield "a list value", saved(tiny(extra=[1, 2])), ENTRY
    yield "a tuple value", saved(tiny(extra=(1, "a"))), ENTRY
    yield (
        "an ordered dict",
        saved(tiny(curr_obs=__import__("collections").OrderedDict(a=torch.ones(1, 1)))),
        ENTRY,
    )
    yield "a big int", saved(tiny(extra=2**70)), ENTRY
    yield "weights id a tuple", saved(tiny(model_weights_id=("a", "b"))), ENTRY
    yield "weights id unsafe", saved(tiny(model_weights_id="../x")), ENTRY
    yield "no weights id", saved({k: v for k, v in base.items() if k != "model_weights_id"}), ENTRY
    yield "episode length a float", saved(tiny(max_episode_length=1.5)), ENTRY
    yield "episode length a bool", saved(tiny(max_episode_length=True)), ENTRY
    yield "no rewards", saved({k: v for k, v in base.items() if k not in ("rewards", "prev_logprobs")}), ENTRY
    yield "shapes disagree", saved(tiny(actions=torch.randn(2, 1, 7))), ENTRY
    yield "done rows wrong", saved(tiny(dones=torch.zeros(5, 1, 1, dtype=torch.bool))), ENTRY
    yield "requires grad", saved(tiny(actions=torch.randn(1, 1, 7, requires_grad=True))), ENTRY
    yield "not a dict", saved([torch.ones(1)]), ENTRY
    yield "int key", saved({**base, 3: torch.ones(1)}), ENTRY
    yield "uint16 tensor", saved(tiny(extra=torch.ones(1, 1, 2, dtype=torch.uint16))), ENTRY
    yield "deep nesting", saved(tiny(extra=_nested(40))), ENTRY
    large = torch.randn(1, 1, 300_000)
    large[0, 0, 12345] = float("nan")
    yield "a large file with nan", saved(tiny(actions=large)), ENTRY  # its layout is not remembered


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"x": torch.ones(1)}
    for _ in range(depth):
        value = {"x": value}
    return value


def all_variants() -> Iterator[tuple[str, bytes, dict[str, Any] | None]]:
    yield from content_variants()
    base = saved(tiny())
    for name, data in zip_variants(base):
        yield name, data, ENTRY
    for name, data in pickle_variants(base):
        yield name, data, ENTRY


# ------------------------------------------------------------------ the comparison
def deep_check(path: Path, entry: dict[str, Any] | None) -> tuple[list[Any], Any, int]:
    report = CheckpointReport(path.parent)
    schema, size = verify_op._deep_check_file(path, 0, entry, report, False)
    return [p.as_json() for p in report.problems], schema, size


def torch_path(monkeypatch: pytest.MonkeyPatch, path: Path, entry: dict[str, Any] | None) -> Any:
    with monkeypatch.context() as patch:
        patch.setattr(ptcheck, "check_pt", lambda path, data: None)
        return deep_check(path, entry)


def test_the_fast_path_gives_the_torch_paths_verdict_on_every_variant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / f"trajectory_0_{WEIGHTS}.pt"
    accepted, refused, names = 0, 0, set()
    for name, data, entry in all_variants():
        assert name not in names
        names.add(name)
        path.write_bytes(data)
        expected = torch_path(monkeypatch, path, entry)
        for _ in range(2):  # the second time, the layout is known
            assert deep_check(path, entry) == expected, name
        if ptcheck.check_pt(path, data) is not None:
            accepted += 1
            unreadable = {"file_unreadable", "file_unsafe"} & {p["code"] for p in expected[0]}
            assert not unreadable, name  # the fast path never passes what torch refuses
        else:
            refused += 1
    assert accepted >= 40 and refused >= 300  # both paths are exercised


def test_files_of_a_known_layout_are_recognised_and_their_damage_is_not(tmp_path: Path) -> None:
    first, second = saved(tiny(1)), saved(tiny(2))
    path = tmp_path / "trajectory_0_w0.pt"
    known = ptcheck.check_pt(path, first)
    assert known is not None and ptcheck.check_pt(path, second) is known
    offset, _, _ = central(second)
    for at in (0, 40, offset + 10, offset + 30, len(second) - 10):
        assert ptcheck.check_pt(path, flipped(second, at)) is not known


def test_a_file_torch_save_names_after_itself_keeps_its_layout(tmp_path: Path) -> None:
    a, b = tmp_path / "trajectory_1_w0.pt", tmp_path / "trajectory_2_w0.pt"
    torch.save(tiny(1), a)
    torch.save(tiny(2), b)
    data_a, data_b = a.read_bytes(), b.read_bytes()
    assert members(data_a)[0][0] != members(data_b)[0][0]  # the archive is named after the file
    known = ptcheck.check_pt(a, data_a)
    assert known is not None and ptcheck.check_pt(b, data_b) is known
    slash = data_b.index(b"/", 30)
    assert ptcheck.check_pt(b, patched(data_b, slash - 1, b"/")) is None  # not one archive any more


def test_verify_deep_reports_the_same_over_a_checkpoint_on_two_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import orjson

    rng = random.Random(7)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    variants = list(all_variants())
    chosen = variants[:6] + rng.sample(variants[6:], 60)
    entries = {}
    for tid, (_, data, entry) in enumerate(chosen):
        (ckpt / f"trajectory_{tid}_{WEIGHTS}.pt").write_bytes(data)
        recorded = {k: v for k, v in (entry or ENTRY).items() if v is not None}
        entries[str(tid)] = {"num_samples": 1, "trajectory_id": tid, **recorded}
    for tid in range(len(chosen), len(chosen) + 200):  # many intact files: chunks of several
        (ckpt / f"trajectory_{tid}_{WEIGHTS}.pt").write_bytes(saved(tiny(tid)))
        entries[str(tid)] = {"num_samples": 1, "trajectory_id": tid, **{k: v for k, v in ENTRY.items() if v}}
    n = len(entries)
    index = {"trajectory_index": entries, "trajectory_id_list": list(range(n))}
    (ckpt / "trajectory_index.json").write_bytes(orjson.dumps(index))
    meta = {"trajectory_format": "pt", "size": n, "total_samples": n, "trajectory_counter": n, "seed": 1}
    (ckpt / "metadata.json").write_bytes(orjson.dumps(meta))
    fast = verify(ckpt, deep=True, jobs=2).as_json()
    with monkeypatch.context() as patch:
        patch.setattr(ptcheck, "check_pt", lambda path, data: None)
        slow = verify(ckpt, deep=True, jobs=1).as_json()
    for doc in (fast, slow):
        doc.pop("seconds"), doc.pop("bytes_per_second"), doc.pop("jobs")
    assert fast == slow
    assert not fast["ok"]


def test_the_layouts_remembered_stay_within_their_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ptcheck, "_REMEMBERED_BYTES", 40_000)
    path = tmp_path / "trajectory_0_w0.pt"
    for width in range(1, 30):  # each a layout of its own
        data = saved(tiny(actions=torch.randn(1, 1, width)))
        assert ptcheck.check_pt(path, data) is not None
        assert ptcheck._remembered == sum(c.size for c in ptcheck._LAYOUTS.values()) <= 40_000
    big = saved(tiny(actions=torch.randn(1, 1, 300_000)))
    assert ptcheck.check_pt(path, big) is not None and len(big) not in {
        c.size for c in ptcheck._LAYOUTS.values()
    }
