"""doctor on random clean buffers: whatever their shapes and fields, never an error or a warning.

Each case draws T, B, E (bootstrap rows, a divisor of T), K (values per done row), which of
the optional fields are present, and the episode ends, then records the trajectory the way
RLinf's env worker does (dones = terminations | truncations, next_obs[t] = curr_obs[t + 1]
unless an episode ended at t or an epoch begins, model_weights_id from versions).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from test_doctor import write

import rbtool
from rbtool.ops.doctor import ERROR, WARNING, weights_id_of

CASES = 24


def random_clean(rng: random.Random, seed: int) -> dict[str, Any]:
    import torch

    from rbtool.format.layout import drop_bootstrap_rows

    g = torch.Generator().manual_seed(seed)
    t, b, k = rng.randint(1, 8), rng.randint(1, 4), rng.randint(1, 3)
    extra = rng.choice([0, *[e for e in range(1, t + 1) if t % e == 0]])
    epoch = t // extra if extra else t
    rows = t + extra
    p_end = rng.choice([0.0, 0.1, 0.5])
    terms = torch.rand(rows, b, k, generator=g) < p_end
    truncs = torch.rand(rows, b, k, generator=g) < p_end / 2
    dones = terms | truncs
    ends = drop_bootstrap_rows(dones, t).reshape(t, b, k).any(-1)
    traj: dict[str, Any] = {
        "max_episode_length": 0 if rng.random() < 0.3 else t * k,
        "actions": torch.randn(t, b, rng.randint(1, 7), generator=g),
        "rewards": torch.randn(t, b, 1, generator=g),
        "prev_logprobs": torch.randn(t, b, 2, generator=g),
    }
    flags = {"dones": dones, "terminations": terms, "truncations": truncs}
    kept = rng.choice(
        [("dones", "terminations", "truncations"), ("dones",), ("terminations", "truncations"), ()]
    )
    traj.update({name: flags[name] for name in kept})
    if rng.random() < 0.7:
        traj["versions"] = torch.full((t, b, 1), float(rng.randint(0, 5)))
    if rng.random() < 0.8:
        shape = (t + 1, b, 3, 3, 3)
        states = torch.randn(t + 1, b, 5, generator=g)
        images = torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
        nxt_states, nxt_images = states[1:].clone(), images[1:].clone()
        for step in range(t):
            for env in range(b):
                # a final observation where an episode ended or an epoch ends, when the flags say so
                if (kept and ends[step, env]) or (step + 1) % epoch == 0:
                    nxt_states[step, env] = torch.randn(5, generator=g)
                    nxt_images[step, env] = torch.randint(0, 255, (3, 3, 3), generator=g, dtype=torch.uint8)
        traj["curr_obs"] = {"states": states[:-1].clone(), "main_images": images[:-1].clone()}
        traj["next_obs"] = {"states": nxt_states, "main_images": nxt_images}
    traj["model_weights_id"] = weights_id_of(traj.get("versions"))
    return traj


@pytest.mark.parametrize("case", range(CASES))
def test_a_random_clean_buffer_reports_no_error_or_warning(tmp_path: Path, case: int) -> None:
    rng = random.Random(case)
    trajs = [random_clean(rng, 1000 * case + i) for i in range(rng.randint(1, 5))]
    report = rbtool.doctor(write(tmp_path / "ck", trajs), jobs=1)
    assert [f.as_json() for f in report.findings if f.level in (ERROR, WARNING)] == []
