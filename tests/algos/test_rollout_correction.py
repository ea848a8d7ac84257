"""Rollout correction: verl 0.9.1's own outputs on random inputs (stored by make_verl_rollout_corr_cases.py), a plain
per-token loop for the weights and the filters, hand-derived cases, and the settings' refusals."""

import json
import math
from pathlib import Path

import pytest
import torch

from rl_core.algos.rollout_correction import rollout_correction
from rl_core.correction_settings import RolloutCorrection, RolloutCorrectionError
from tests.algos.cases import make_mask

CASES = json.loads((Path(__file__).parent / "data" / "verl_rollout_corr_cases.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{json.dumps(c['settings'])}" for i, c in enumerate(CASES)])
def test_equals_verl_on_random_inputs(case):
    settings = RolloutCorrection.from_config(case["settings"])
    tensors = [torch.tensor(case[k]) for k in ("log_prob", "rollout_log_prob", "response_mask")]
    weights, mask, metrics = rollout_correction(*tensors, settings)
    assert (weights is None) == (case["weights"] is None)
    if weights is not None:
        torch.testing.assert_close(weights, torch.tensor(case["weights"]), rtol=1e-5, atol=1e-6)
    assert mask.tolist() == case["mask"]
    assert set(metrics) == set(case["metrics"])
    for key, value in case["metrics"].items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def loop_weights(log_prob, rollout, mask, level, upper, lower=None):
    """Per row, per token: exp of the (summed, for a sequence) log-ratio, clamped at +-20, truncated or zeroed."""
    out = []
    for lp_row, ro_row, m_row in zip(log_prob, rollout, mask):
        total = sum((a - b) for a, b, m in zip(lp_row, ro_row, m_row) if m)
        row = []
        for a, b, m in zip(lp_row, ro_row, m_row):
            log_w = total if level == "sequence" else a - b
            w = math.exp(max(-20.0, min(20.0, log_w))) * m
            if lower is None:
                w = min(w, upper)
            elif not lower <= w <= upper:
                w = 0.0
            row.append(w)
        out.append(row)
    return out


def loop_rejection(log_prob, rollout, mask, option, lower, upper):
    """Keep a token when its filter's statistic (its own, or its response's sum/mean/max) is within the bounds."""
    level, k = option.rsplit("_", 1)
    out = []
    for lp_row, ro_row, m_row in zip(log_prob, rollout, mask):
        div = []
        for a, b in zip(lp_row, ro_row):
            r = max(-20.0, min(20.0, a - b))
            div.append({"k1": -r, "k2": 0.5 * r * r, "k3": math.exp(r) - 1 - r}[k])
        valid = [d for d, m in zip(div, m_row) if m]
        whole = {
            "seq_sum": sum(valid),
            "seq_mean": sum(valid) / (len(valid) + 1e-8),
            "seq_max": max(valid) if valid else 0.0,
        }.get(level)
        row = []
        for d, m in zip(div, m_row):
            stat = d if level == "token" else whole
            ok = math.log(lower) <= stat <= math.log(upper) if k == "k1" else stat <= upper
            row.append(m * float(ok))
        out.append(row)
    return out


def random_log_probs(seed, shape, padding, spread):
    """(trained, rollout, mask): trained log-probs in [-2, 0], the rollout's off by N(0, spread) per token."""
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(g, *shape, padding)
    log_prob = -torch.rand(*shape, generator=g) * 2
    return log_prob, log_prob + torch.randn(*shape, generator=g) * spread, mask


@pytest.mark.parametrize("padding", ["right", "left", "holes"])
@pytest.mark.parametrize(
    "level,threshold,lower,upper",
    [("token", 2.0, None, 2.0), ("sequence", 4.0, None, 4.0), ("token", "0.5_1.5", 0.5, 1.5)],
)
def test_weights_equal_a_plain_loop(padding, level, threshold, lower, upper):
    log_prob, rollout, mask = random_log_probs(7, (9, 8), padding, spread=0.5)
    settings = RolloutCorrection.from_config({"rollout_is": level, "rollout_is_threshold": threshold})
    weights, kept, _ = rollout_correction(log_prob, rollout, mask, settings)
    expected = loop_weights(log_prob.tolist(), rollout.tolist(), mask.tolist(), level, upper, lower)
    torch.testing.assert_close(weights, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert torch.equal(kept, mask)  # weights alone reject nothing


@pytest.mark.parametrize("padding", ["right", "holes"])
@pytest.mark.parametrize(
    "option,threshold,lower,upper",
    [
        ("token_k1", "0.8_1.25", 0.8, 1.25),
        ("token_k3", 0.02, None, 0.02),
        ("seq_sum_k1", 3.0, 1 / 3.0, 3.0),
        ("seq_mean_k2", 0.05, None, 0.05),
        ("seq_max_k3", 0.2, None, 0.2),
    ],
)
def test_rejection_equals_a_plain_loop(padding, option, threshold, lower, upper):
    log_prob, rollout, mask = random_log_probs(11, (12, 7), padding, spread=0.3)
    settings = RolloutCorrection.from_config({"rollout_rs": option, "rollout_rs_threshold": threshold})
    weights, kept, metrics = rollout_correction(log_prob, rollout, mask, settings)
    expected = loop_rejection(log_prob.tolist(), rollout.tolist(), mask.tolist(), option, lower, upper)
    assert weights is None and kept.tolist() == expected
    rejected = 1 - sum(map(sum, expected)) / mask.sum().item()
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected, abs=1e-6)
    assert 0 < rejected < 1  # the case tests both outcomes


def test_hand_derived_two_tokens():
    """Log-ratios log 3 and log 0.5 on one response: token TIS at 2 gives [2, 0.5]; the sequence weight is
    exp(log 1.5) = 1.5 on both; a token_k1 filter at [0.4, 2.5] (-log r within [log 0.4, log 2.5]) rejects the
    first token only; the KL is -(log 3 + log 0.5) / 2."""
    rollout = torch.tensor([[math.log(0.1), math.log(0.4)]])
    log_prob = rollout + torch.tensor([[math.log(3.0), math.log(0.5)]])
    mask = torch.ones(1, 2)
    token, _, metrics = rollout_correction(log_prob, rollout, mask, RolloutCorrection(rollout_is="token"))
    torch.testing.assert_close(token, torch.tensor([[2.0, 0.5]]))
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.5
    assert metrics["rollout_corr/kl"] == pytest.approx(-(math.log(3.0) + math.log(0.5)) / 2)
    sequence, _, _ = rollout_correction(log_prob, rollout, mask, RolloutCorrection("sequence", is_upper=5.0))
    torch.testing.assert_close(sequence, torch.tensor([[1.5, 1.5]]))
    settings = RolloutCorrection.from_config({"rollout_rs": "token_k1", "rollout_rs_threshold": "0.4_2.5"})
    _, kept, _ = rollout_correction(log_prob, rollout, mask, settings)
    assert kept.tolist() == [[0.0, 1.0]]


@pytest.mark.parametrize(
    "section,message",
    [
        ({"rollout_is": "tokens"}, r"rollout_is='tokens': choose token, sequence or null"),
        ({"rollout_is": "token", "rollout_is_threshold": "2_1"}, "lower one at most the upper one"),
        ({"rollout_is": "token", "rollout_is_threshold": "high"}, "a number or a 'lower_upper' string"),
        ({"rollout_is": "token", "rollout_is_threshold": True}, "a number or a 'lower_upper' string"),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, "seq_max_k1 is not a filter"),
        ({"rollout_rs": "token_k2"}, "rollout_rs_threshold=null: rollout_rs needs a threshold"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_0.2"}, "token_k2 takes one upper bound"),
        ({"rollout_rs": "token_k2,seq_sum_k3", "rollout_rs_threshold": "1,2,3"}, "one threshold for all filters"),
        ({"loss_type": "ppo"}, "loss_type='ppo': choose ppo_clip or reinforce"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(section, message):
    with pytest.raises(RolloutCorrectionError, match=message):
        RolloutCorrection.from_config(section)


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="must have one shape"):
        rollout_correction(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), RolloutCorrection())
