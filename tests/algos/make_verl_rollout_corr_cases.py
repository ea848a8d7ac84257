"""Writes tests/algos/data/verl_rollout_corr_cases.json: verl 0.9.1's rollout correction on random inputs.

Run it with verl importable (ppoflow does not depend on verl; a scratch install: ``pip install --no-deps verl==0.9.1
--target X`` plus ``tensordict pyvers codetiming`` the same way), from the repository root:

    PYTHONPATH=.:X python tests/algos/make_verl_rollout_corr_cases.py

CI reads the stored inputs and verl's outputs (IS weights, the mask after rejection, every ``rollout_corr/`` metric)
and checks ppoflow's functions against them (tests/algos/test_rollout_correction.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

from tests.algos.cases import PADDINGS, make_mask

OUT = Path(__file__).parent / "data" / "verl_rollout_corr_cases.json"
SETTINGS = [
    {},
    {"rollout_is": "token", "rollout_is_threshold": 2.0},
    {"rollout_is": "sequence", "rollout_is_threshold": 5.0},
    {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0"},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.1_10"},
    {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_is_batch_normalize": True},
    {"rollout_is": "sequence", "rollout_is_threshold": 3.0, "rollout_is_batch_normalize": True},
    {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"},
    {"rollout_rs": "token_k2", "rollout_rs_threshold": 0.02},
    {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": 2.0},
    {"rollout_rs": "seq_sum_k2", "rollout_rs_threshold": 0.5},
    {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.8_1.25"},
    {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    {"rollout_rs": "seq_max_k3", "rollout_rs_threshold": 0.1},
    {"rollout_rs": "token_k3,seq_max_k2", "rollout_rs_threshold": "0.05,0.1"},
    {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.02},
]


def main() -> None:
    generator = torch.Generator().manual_seed(35)
    cases = []
    for index, settings in enumerate(SETTINGS):
        for padding in PADDINGS:
            batch, length = int(torch.randint(2, 9, (1,), generator=generator)), 11
            mask = make_mask(generator, batch, length, padding)
            log_prob = -torch.rand(batch, length, generator=generator) * 3
            scale = (0.05, 0.3, 1.0)[index % 3]
            rollout_log_prob = log_prob + torch.randn(batch, length, generator=generator) * scale
            weights, new_mask, metrics = compute_rollout_correction_and_rejection_mask(
                old_log_prob=log_prob,
                rollout_log_prob=rollout_log_prob,
                response_mask=mask,
                rollout_is=settings.get("rollout_is"),
                rollout_is_threshold=settings.get("rollout_is_threshold", 2.0),
                rollout_is_batch_normalize=settings.get("rollout_is_batch_normalize", False),
                rollout_rs=settings.get("rollout_rs"),
                rollout_rs_threshold=settings.get("rollout_rs_threshold"),
            )
            cases.append(
                {
                    "settings": settings,
                    "log_prob": log_prob.tolist(),
                    "rollout_log_prob": rollout_log_prob.tolist(),
                    "response_mask": mask.tolist(),
                    "weights": None if weights is None else weights.batch["rollout_is_weights"].tolist(),
                    "mask": new_mask.tolist(),
                    "metrics": metrics,
                }
            )
    OUT.write_text(json.dumps(cases, indent=None))
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    main()
