"""rbtool.format.layout: the [T + E, B] rule, bootstrap rows, describe."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from rbtool.errors import InvalidTrajectoryError
from rbtool.format.layout import (
    DONE_LIKE,
    SAMPLED_TOP_FIELDS,
    describe,
    describe_stored,
    done_extra_rows,
    done_rows,
    drop_bootstrap_rows,
)


def test_importing_layout_does_not_import_torch() -> None:
    code = "import sys, rbtool.format.layout; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("rows", "extra"), [(4, 0), (5, 1), (6, 2), (8, 4)])
def test_done_extra_rows_accepts_divisors(rows: int, extra: int) -> None:
    assert done_extra_rows(rows, 4, 2, 2) == extra


@pytest.mark.parametrize(("rows", "b_rows"), [(3, 2), (7, 2), (5, 3)])
def test_done_extra_rows_refuses(rows: int, b_rows: int) -> None:
    with pytest.raises(ValueError, match=r"\[T \+ E, B\] = \[4 \+ E, 2\] where E divides T=4"):
        done_extra_rows(rows, 4, b_rows, 2)


@pytest.mark.parametrize("extra", [1, 2, 4])
def test_drop_bootstrap_rows_numpy_and_torch_agree(extra: int) -> None:
    t, b = 4, 3
    values = np.arange((t + extra) * b * 2).reshape(t + extra, b, 2)
    epoch = 1 + t // extra
    want = np.concatenate([values[e * epoch + 1 : (e + 1) * epoch] for e in range(extra)])
    assert np.array_equal(drop_bootstrap_rows(values, t), want)
    assert torch.equal(drop_bootstrap_rows(torch.from_numpy(values), t), torch.from_numpy(want))


def test_drop_bootstrap_rows_without_extra_is_identity() -> None:
    values = torch.zeros(4, 2)
    assert drop_bootstrap_rows(values, 4) is values


@pytest.mark.parametrize("extra", [0, 1, 2, 4])
def test_done_rows_maps_sample_rows_to_stored_rows(extra: int) -> None:
    t, b = 4, 3
    stored = np.arange((t + extra) * b)  # flat stored row numbers
    flat = drop_bootstrap_rows(stored.reshape(t + extra, b), t).reshape(-1)
    local = np.arange(t * b)
    n = local.size
    got = done_rows(local, np.full(n, t), np.full(n, b), np.full(n, extra))
    assert np.array_equal(got, flat)


def _traj(**extra: object) -> dict[str, object]:
    return {"rewards": torch.zeros(4, 2, 1), "dones": torch.zeros(5, 2, 1), **extra}


def test_describe_reports_the_done_rule() -> None:
    with pytest.raises(InvalidTrajectoryError, match=r"'dones'.*\[4 \+ E, 2\]"):
        describe({"rewards": torch.zeros(4, 2, 1), "dones": torch.zeros(7, 2, 1)}, "t")
    info = describe(_traj(model_weights_id="v1"), "t")
    assert (info.shape, info.num_samples, info.model_weights_id) == ((4, 2, 1), 8, "v1")


def test_describe_stored_takes_the_weights_id_from_the_file_name() -> None:
    assert describe_stored(_traj(), "trajectory_3_abc.pt", "f").model_weights_id == "abc"
    assert (
        describe_stored(_traj(model_weights_id="own"), "trajectory_3_abc.pt", "f").model_weights_id == "own"
    )
    assert describe_stored(_traj(), "odd.pt", "f").model_weights_id == ""


def test_field_roles() -> None:
    assert set(DONE_LIKE) <= set(SAMPLED_TOP_FIELDS)
    assert SAMPLED_TOP_FIELDS[0] == "actions" and SAMPLED_TOP_FIELDS[-1] == "versions"
