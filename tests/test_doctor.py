"""rbtool.doctor: one seeded defect per copy of a clean RLinf-shaped checkpoint, found and named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES

import rbtool
from rbtool.ops.doctor import CHECKS, ERROR, INFO, WARNING, Report, runs, select_checks, weights_id_of

RLINF_CHECKPOINTS = [
    "autosave_pt/autosave",
    "nested_obs_pt",
    "nosave_window2_pt/ckpt",
    "nosave_window2_pkl/ckpt",
    "pkl_format_switch",
    "ranks",
    "seedless_pt",
    "varying_shapes_pt/autosave",
    "varying_shapes_pt/ckpt",
]


def clean_traj(t: int = 6, b: int = 3, seed: int = 0, version: float = 0.0, extra: int = 1) -> dict[str, Any]:
    """A trajectory as RLinf's env worker records it: dones = terminations | truncations,
    next_obs[t] = curr_obs[t + 1] unless an episode ended at t (then a final observation),
    model_weights_id derived from versions."""
    import torch

    g = torch.Generator().manual_seed(seed)
    epoch = t // extra if extra else t
    rows = t + extra
    terms = torch.rand(rows, b, 1, generator=g) < 0.15
    truncs = torch.rand(rows, b, 1, generator=g) < 0.1
    dones = terms | truncs
    from rbtool.format.layout import drop_bootstrap_rows

    ends = drop_bootstrap_rows(dones, t).reshape(t, b)
    states = torch.randn(t + 1, b, 8, generator=g)
    images = torch.randint(0, 255, (t + 1, b, 4, 4, 3), generator=g, dtype=torch.uint8)
    final_states = torch.randn(t, b, 8, generator=g)
    final_images = torch.randint(0, 255, (t, b, 4, 4, 3), generator=g, dtype=torch.uint8)
    next_states, next_images = states[1:].clone(), images[1:].clone()
    for step in range(t):
        for env in range(b):
            if ends[step, env] or (step + 1) % epoch == 0:
                next_states[step, env] = final_states[step, env]
                next_images[step, env] = final_images[step, env]
    versions = torch.full((t, b, 1), float(version))
    return {
        "max_episode_length": 4 * t,
        "model_weights_id": weights_id_of(versions),
        "actions": torch.randn(t, b, 7, generator=g),
        "rewards": torch.rand(t, b, 1, generator=g),
        "terminations": terms,
        "truncations": truncs,
        "dones": dones,
        "prev_logprobs": torch.randn(t, b, 7, generator=g),
        "prev_values": torch.randn(t, b, 1, generator=g),
        "versions": versions,
        "curr_obs": {"states": states[:-1].clone(), "main_images": images[:-1].clone()},
        "next_obs": {"states": next_states, "main_images": next_images},
    }


def write(directory: Path, trajs: list[dict[str, Any]]) -> Path:
    buffer = rbtool.TrajectoryReplayBuffer(seed=1, sample_window_size=0)
    buffer.add_trajectories(trajs)
    buffer.save_checkpoint(str(directory))
    buffer.close()
    return directory


def clean(tmp_path: Path, n: int = 4) -> list[dict[str, Any]]:
    return [clean_traj(seed=i, version=float(i)) for i in range(n)]


def serious(report: Report) -> list[Any]:
    return [f for f in report.findings if f.level in (ERROR, WARNING)]


def test_importing_rbtool_leaves_torch_alone_and_doctor_is_exported() -> None:
    import subprocess
    import sys

    code = "import rbtool, sys; rbtool.doctor; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("name", RLINF_CHECKPOINTS)
def test_every_rlinf_checkpoint_is_clean(name: str) -> None:
    report = rbtool.doctor(FIXTURES / name, jobs=1)
    assert serious(report) == []
    assert not report.fails("warning")
    assert report.trajectories > 0


def test_a_clean_checkpoint_has_no_finding_at_all(tmp_path: Path) -> None:
    path = write(tmp_path / "ck", clean(tmp_path))
    report = rbtool.doctor(path, jobs=1, reward_range=(0.0, 1.0), max_staleness=5)
    assert [f for f in report.findings if f.check != "episodes"] == []
    assert serious(report) == []


def _seeded(tmp_path: Path, change: Any, victim: int = 2) -> Path:
    trajs = clean(tmp_path)
    change(trajs[victim])
    trajs[victim]["model_weights_id"] = weights_id_of(trajs[victim]["versions"])
    return write(tmp_path / "ck", trajs)


def _nan(traj: dict[str, Any]) -> None:
    traj["rewards"][3, 1, 0] = float("nan")


def _frozen(traj: dict[str, Any]) -> None:
    traj["actions"][:, 2] = traj["actions"][0, 2]


def _black(traj: dict[str, Any]) -> None:
    traj["curr_obs"]["main_images"][:, 0] = 0
    traj["next_obs"]["main_images"][:, 0] = 0  # still paired: only the camera is blank


def _dones(traj: dict[str, Any]) -> None:
    # a termination that dones misses (episode ends, read from dones, stay as they were)
    row, env = (int(i) for i in (~traj["dones"][:, :, 0]).nonzero()[0])
    traj["terminations"][row, env, 0] = True


def _pairing(traj: dict[str, Any]) -> None:
    import torch

    from rbtool.format.layout import drop_bootstrap_rows

    ends = drop_bootstrap_rows(traj["dones"], 6).reshape(6, 3)
    t = next(s for s in range(4) if not bool(ends[s, 0]))
    traj["next_obs"]["states"][t, 0] = torch.full((8,), 7.0)


def _rewards(traj: dict[str, Any]) -> None:
    traj["rewards"][1, 0, 0] = 5.0


def _episodes(traj: dict[str, Any]) -> None:
    traj["max_episode_length"] = 1  # every episode of more than one step is too long


@pytest.mark.parametrize(
    ("check", "change", "field", "level"),
    [
        ("non-finite", _nan, "rewards", ERROR),
        ("frozen", _frozen, "actions", WARNING),
        ("blank-camera", _black, "curr_obs.main_images", WARNING),
        ("done-flags", _dones, "dones", ERROR),
        ("pairing", _pairing, "next_obs.states", ERROR),
        ("rewards", _rewards, "rewards", WARNING),
        ("episodes", _episodes, "dones", WARNING),
    ],
)
def test_one_seeded_defect_is_found_and_named(
    tmp_path: Path, check: str, change: Any, field: str, level: str
) -> None:
    path = _seeded(tmp_path, change)
    report = rbtool.doctor(path, jobs=1, reward_range=(0.0, 1.0))
    found = serious(report)
    assert {(f.check, f.level, tuple(f.ids)) for f in found} == {(check, level, (2,))}
    assert field in [f.field for f in found]
    assert found[0].advice and found[0].message.startswith("trajectory_2_")
    assert report.fails("warning") and report.fails("error") == (level == ERROR)


def test_a_model_weights_id_not_derived_from_versions(tmp_path: Path) -> None:
    trajs = clean(tmp_path)
    trajs[1]["model_weights_id"] = "v1"
    report = rbtool.doctor(write(tmp_path / "ck", trajs), jobs=1)
    assert [(f.check, f.field, f.ids) for f in serious(report)] == [("policy", "model_weights_id", [1])]


def test_weights_id_is_rlinfs_derivation() -> None:
    import torch

    # RLinf's fixtures name trajectory 0 (versions all zero) and the no-versions default alike.
    assert weights_id_of(torch.zeros(4, 2, 1)) != weights_id_of(None)
    assert weights_id_of(None) == weights_id_of(torch.zeros(1))
    loaded = torch.load(next((FIXTURES / "seedless_pt").glob("trajectory_2_*.pt")), weights_only=True)
    assert weights_id_of(loaded["versions"]) == loaded["model_weights_id"]


def test_staleness_names_the_old_trajectories(tmp_path: Path) -> None:
    path = write(tmp_path / "ck", clean(tmp_path))  # versions 0, 1, 2, 3
    report = rbtool.doctor(path, jobs=1, max_staleness=1.5)
    assert [(f.check, f.field, f.ids) for f in serious(report)] == [
        ("policy", "versions", [0]),
        ("policy", "versions", [1]),
    ]
    assert serious(rbtool.doctor(path, jobs=1)) == []


def test_duplicates_name_both_ids(tmp_path: Path) -> None:
    trajs = clean(tmp_path)
    trajs.append({k: v for k, v in trajs[1].items()})
    report = rbtool.doctor(write(tmp_path / "ck", trajs), jobs=1)
    assert [(f.check, f.ids) for f in serious(report)] == [("duplicates", [1, 4])]


def test_index_disagreement_is_reported_as_verify_words_it(tmp_path: Path) -> None:
    import json

    path = write(tmp_path / "ck", clean(tmp_path))
    index_file = path / "trajectory_index.json"
    doc = json.loads(index_file.read_text())
    doc["trajectory_index"]["3"]["max_episode_length"] = 99
    index_file.write_text(json.dumps(doc))
    report = rbtool.doctor(path, jobs=1)
    found = serious(report)
    assert [(f.check, f.level, f.field, f.ids) for f in found] == [
        ("index", ERROR, "max_episode_length", [3])
    ]
    from rbtool.ops.verify import verify

    verified = verify(path, deep=True, jobs=1)
    messages = [p.message for c in verified.checkpoints for p in c.problems if p.code == "field_mismatch"]
    assert messages == [found[0].message]


def test_an_unreadable_file_is_an_error_of_the_index_check(tmp_path: Path) -> None:
    path = write(tmp_path / "ck", clean(tmp_path))
    victim = next(path.glob("trajectory_1_*.pt"))
    victim.write_bytes(victim.read_bytes()[:100])
    found = serious(rbtool.doctor(path, jobs=1))
    assert [(f.check, f.level, f.ids) for f in found] == [("index", ERROR, [1])]
    # whatever checks were chosen: a file that could not be read was checked by none of them
    only = serious(rbtool.doctor(path, jobs=1, checks=["frozen"]))
    assert [(f.check, f.level, f.ids) for f in only] == [("index", ERROR, [1])]


def test_checks_and_skip_choose_what_runs(tmp_path: Path) -> None:
    path = _seeded(tmp_path, _nan)
    assert serious(rbtool.doctor(path, jobs=1, skip=["non-finite"])) == []
    assert rbtool.doctor(path, jobs=1, checks=["frozen"]).findings == []
    assert select_checks(None, ["pairing"]) == tuple(c for c in CHECKS if c != "pairing")
    with pytest.raises(rbtool.UsageError, match="unknown check 'nope'"):
        select_checks(["nope"])
    with pytest.raises(rbtool.UsageError, match="the low end is above the high end"):
        rbtool.doctor(path, reward_range=(1.0, 0.0))


def test_random_observations_are_info_not_a_broken_pairing(tmp_path: Path) -> None:
    import torch

    trajs = clean(tmp_path)
    for traj in trajs:
        traj["next_obs"] = {k: torch.rand_like(v.float()) for k, v in traj["next_obs"].items()}
        traj["curr_obs"] = {k: v.float() for k, v in traj["curr_obs"].items()}
    report = rbtool.doctor(write(tmp_path / "ck", trajs), jobs=1)
    pairing = [f for f in report.findings if f.check == "pairing"]
    assert pairing and all(f.level == INFO for f in pairing)


@pytest.mark.parametrize(("shift", "what"), [(0, "curr_obs[t]"), (2, "curr_obs[t + 2]")])
def test_observations_paired_one_step_off_are_an_error(tmp_path: Path, shift: int, what: str) -> None:
    """A collector that stores the observation before the step (or two steps on) as next_obs
    pairs nothing right: not the unrelated observations of a synthetic buffer, but an error."""
    import torch

    trajs = [clean_traj(t=12, seed=i, version=float(i)) for i in range(3)]
    victim = trajs[1]
    for key, curr in victim["curr_obs"].items():
        shifted = curr.clone() if shift == 0 else torch.cat([curr[2:], curr[-2:]])
        victim["next_obs"][key] = shifted
    found = serious(rbtool.doctor(write(tmp_path / "ck", trajs), jobs=1))
    assert [(f.check, f.level, f.ids, f.field) for f in found] == [("pairing", ERROR, [1], "next_obs")]
    assert f"equals {what}" in found[0].message and "one step off" in found[0].message


def test_a_rank_tree_and_workers_give_the_same_findings(tmp_path: Path) -> None:
    trajs = clean(tmp_path)
    _nan(trajs[0])
    a = write(tmp_path / "tree" / "rank_0", trajs[:2])
    write(tmp_path / "tree" / "rank_1", trajs[2:])
    one = rbtool.doctor(a.parent, jobs=1)
    two = rbtool.doctor(a.parent, jobs=2, journal=tmp_path / "journal")
    again = rbtool.doctor(a.parent, jobs=2, journal=tmp_path / "journal")
    assert [f.as_json() for f in one.findings] == [f.as_json() for f in two.findings]
    assert [f.as_json() for f in again.findings] == [f.as_json() for f in one.findings]
    assert again.journal is not None and again.journal["reused"] == 4
    assert len(one.checkpoints) == 2 and one.trajectories == 4


def test_ids_read_as_runs() -> None:
    assert runs([7, 0, 1, 2, 3, 4, 9, 10]) == "0-4, 7, 9-10"
    assert runs([0, 2, 4, 6], limit=2) == "0, 2, ... (2 more runs)"


def test_a_frozen_camera_is_told_from_a_blank_one(tmp_path: Path) -> None:
    def freeze(traj: dict[str, Any]) -> None:
        frame = traj["curr_obs"]["main_images"][0, 1].clone()
        traj["curr_obs"]["main_images"][:, 1] = frame
        traj["next_obs"]["main_images"][:, 1] = frame

    found = serious(rbtool.doctor(_seeded(tmp_path, freeze), jobs=1))
    assert {(f.check, f.field, tuple(f.envs or ())) for f in found} == {
        ("blank-camera", "curr_obs.main_images", (1,)),
        ("blank-camera", "next_obs.main_images", (1,)),
    }
    assert all("the same frame at every step" in f.message for f in found)


def test_unpaired_observations_are_one_info_per_checkpoint() -> None:
    report = rbtool.doctor(FIXTURES / "ranks", jobs=1)
    unpaired = [f for f in report.findings if f.check == "pairing"]
    assert [(f.level, f.ids, Path(f.checkpoint).name) for f in unpaired] == [
        (INFO, [0, 1, 2], "rank_0"),
        (INFO, [0, 1, 2, 3], "rank_1"),
    ]
    assert unpaired[1].message.startswith("4 trajectories (ids 0-3): next_obs never equals")


def _odd_dtypes(t: int, seed: int) -> dict[str, Any]:
    """A clean trajectory with fields numpy cannot hold (bfloat16) or holds apart (float16,
    complex), NaN/Inf in some env columns, and a blank camera of each kind."""
    import torch

    traj = clean_traj(t=t, b=3, seed=seed)
    g = torch.Generator().manual_seed(seed)
    half = torch.randn(t, 3, 2, generator=g).to(torch.float16)
    half[0, 1, 0] = float("inf")
    brain = torch.randn(t, 3, 2, generator=g).to(torch.bfloat16)
    brain[-1, 2, 1] = float("nan")
    cplx = torch.randn(t, 3, 2, generator=g, dtype=torch.complex64)
    cplx[0, 0, 1] = complex(0.0, float("nan"))
    traj.update(half_field=half, brain_field=brain, complex_field=cplx)
    traj["clean_bf16"] = torch.randn(t, 3, 2, generator=g).to(torch.bfloat16)
    traj["curr_obs"]["bf16_image"] = torch.zeros(t, 3, 2, 2, 3, dtype=torch.bfloat16)
    traj["next_obs"]["bf16_image"] = torch.zeros(t, 3, 2, 2, 3, dtype=torch.bfloat16)
    traj["curr_obs"]["main_images"][:, 2] = 7  # one value in env column 2
    traj["next_obs"]["main_images"][:, 2] = 7
    return traj


@pytest.mark.parametrize("t", [1, 3])
def test_numpys_first_look_never_changes_a_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, t: int
) -> None:
    from rbtool.ops.doctor import trajectory

    trajs = [_odd_dtypes(t, seed) for seed in range(3)]
    trajs.append(dict(trajs[1]))  # a duplicate: the fingerprints must agree
    path = write(tmp_path / "ck", trajs)
    quick = rbtool.doctor(path, jobs=1)
    monkeypatch.setattr(trajectory, "_numpy", lambda tensor: None)  # torch alone, as before
    alone = rbtool.doctor(path, jobs=1)
    assert [f.as_json() for f in quick.findings] == [f.as_json() for f in alone.findings]
    checks = {f.check for f in quick.findings}
    assert {"non-finite", "blank-camera", "duplicates"} <= checks
    fields = {f.field for f in quick.findings if f.check == "non-finite"}
    assert fields == {"half_field", "brain_field", "complex_field"}


def test_the_fingerprint_is_the_bytes_of_every_layout() -> None:
    import hashlib

    import torch

    from rbtool.ops.doctor.trajectory import fingerprint

    def reference(tensors: list[tuple[str, Any]]) -> str:
        digest = hashlib.sha256()
        for path, tensor in sorted(tensors, key=lambda item: item[0]):
            digest.update(f"{path}|{tensor.dtype}|{list(tensor.shape)}|".encode())
            digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        return digest.hexdigest()

    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    layouts = [
        base,
        base[:, :, :2],  # not contiguous
        base.transpose(0, 2),
        base.to(torch.bfloat16),
        base > 5,
        torch.tensor(3.5),
        torch.zeros(2, 0, 3),
        torch.ones(1, 3).expand(4, 3),
        base.to(torch.complex64),
        torch.tensor([-0.0, float("nan")]),
    ]
    for k, tensor in enumerate(layouts):
        tensors = [(f"f{k}", tensor), ("a", base)]
        assert fingerprint(tensors) == reference(tensors), tensor.dtype


def test_the_report_sorts_as_its_whole_key_would() -> None:
    """Report.sort groups by level and check before sorting each group: the same order (stable
    among equal keys) as one sort by the whole key."""
    import random

    from rbtool.ops.doctor.findings import CHECKS as KNOWN
    from rbtool.ops.doctor.findings import Finding, _order

    rng = random.Random(7)
    findings = [
        Finding(
            rng.choice(list(KNOWN)),
            rng.choice([ERROR, WARNING, INFO]),
            sorted(rng.sample(range(40), rng.randint(0, 2))),
            f"m{k}",
            "a",
            field=rng.choice([None, "dones", "rewards"]),
            checkpoint=rng.choice(["/a", "/b"]),
        )
        for k in range(3000)
    ]
    report = Report(Path("."), tuple(KNOWN), findings=list(findings))
    report.sort()
    assert [f.message for f in report.findings] == [f.message for f in sorted(findings, key=_order)]
