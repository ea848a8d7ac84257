"""Advantage estimators: hand-derived cases, and the vectorised code against plain per-sample loops."""

import math

import numpy as np
import pytest
import torch

from rl_core.algos import ADVANTAGE_ESTIMATORS, call_adv_estimator, get_adv_estimator_fn, register_adv_est
from tests.algos import reference as ref
from tests.algos.cases import CASES, make_groups, make_mask, outcome_rewards

EXPECTED = {
    "gae",
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
}


def close(actual, expected, atol=1e-5):
    assert torch.allclose(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol), f"\n{actual}\n!=\n{expected}"


def test_every_estimator_is_registered():
    assert set(ADVANTAGE_ESTIMATORS) >= EXPECTED


# ------------------------------------------------------------------ hand-derived cases
def test_grpo_by_hand():
    # group a: scores 1, 0 -> mean .5, sample std sqrt(.5); group b: a single sample keeps its score (mean 0, std 1)
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    adv, ret = get_adv_estimator_fn("grpo")(
        token_level_rewards=rewards, response_mask=mask, index=np.array(["a", "a", "b"])
    )
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(adv, [[s, s], [-s, -s], [3 / (1 + 1e-6), 0.0]])
    assert torch.equal(adv, ret)
    dr_grpo, _ = get_adv_estimator_fn("grpo")(
        token_level_rewards=rewards, response_mask=mask, index=["a", "a", "b"], norm_adv_by_std_in_grpo=False
    )
    close(dr_grpo, [[0.5, 0.5], [-0.5, -0.5], [3.0, 0.0]])


def test_rloo_by_hand():
    # scores 1, 2, 6 in one group: each minus the mean of the other two
    rewards = torch.tensor([[1.0], [2.0], [6.0]])
    adv, _ = get_adv_estimator_fn("rloo")(token_level_rewards=rewards, response_mask=torch.ones(3, 1), index=[0, 0, 0])
    close(adv, [[1 - 4.0], [2 - 3.5], [6 - 1.5]])


def test_gae_by_hand():
    # one sample, gamma = lam = 1: A_t = sum of future rewards - V_t; returns = A + V = reward-to-go
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 0.1], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    _, returns = get_adv_estimator_fn("gae")(
        token_level_rewards=rewards, values=values, response_mask=mask, gamma=1.0, lam=1.0
    )
    close(returns[0], [1.0, 1.0, 1.0])


def test_passk_by_hand():
    # group scores 3, 1, 2: only the best (3) gets 3 - 2 = 1, divided by the std (1.0)
    rewards = torch.tensor([[3.0], [1.0], [2.0]])
    adv, _ = get_adv_estimator_fn("grpo_passk")(
        token_level_rewards=rewards, response_mask=torch.ones(3, 1), index=["g"] * 3, epsilon=0.0
    )
    close(adv, [[1.0], [0.0], [0.0]])


def test_remax_by_hand():
    rewards = torch.tensor([[0.0, 2.0, 0.0]])
    adv, ret = get_adv_estimator_fn("remax")(
        token_level_rewards=rewards, reward_baselines=torch.tensor([0.5]), response_mask=torch.tensor([[1.0, 1.0, 0.0]])
    )
    close(ret, [[2.0, 2.0, 0.0]])
    close(adv, [[1.5, 1.5, 0.0]])


def test_opo_by_hand():
    # lengths 1 and 3, scores 1 and 0: baseline (1*1 + 3*0) / 4 = .25
    rewards = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv, _ = get_adv_estimator_fn("opo")(token_level_rewards=rewards, response_mask=mask, index=["p", "p"])
    close(adv, [[0.75, 0.0, 0.0], [-0.25, -0.25, -0.25]])


def test_gpg_by_hand():
    # 4 samples, 2 with non-zero score -> alpha = 2; group means 0.5 and 0.5
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    adv, _ = get_adv_estimator_fn("gpg")(
        token_level_rewards=rewards, response_mask=torch.ones(4, 1), index=["a", "a", "b", "b"]
    )
    close(adv, [[1.0], [-1.0], [-1.0], [1.0]])


def test_reinforce_plus_plus_carries_the_return_over_masked_tokens_as_verl_does():
    """An interior mask (tool output in a multi-turn response): verl 0.9.1 carries the running return past masked tokens
    (it does not reset it), so the reward at the end reaches the policy's first turn. gamma 0.5, reward 1 on the last
    token."""
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    _, returns = call_adv_estimator("reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask, gamma=0.5)
    assert returns.tolist() == [[0.25, 0.0, 0.5, 1.0]]


def test_passk_rejects_single_sample_groups():
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        get_adv_estimator_fn("grpo_passk")(
            token_level_rewards=torch.ones(3, 1), response_mask=torch.ones(3, 1), index=["a", "a", "b"]
        )


# ------------------------------------------------------------------ against plain loops, random inputs
@pytest.mark.parametrize("seed,padding", CASES)
def test_estimators_match_plain_loops(seed, padding):
    g = torch.Generator().manual_seed(seed)
    batch, length = 13, 6
    mask = make_mask(g, batch, length, padding)
    dense = torch.randn(batch, length, generator=g) * mask
    values = torch.randn(batch, length, generator=g)
    outcome = outcome_rewards(g, mask)
    index = make_groups(g, batch)
    index_pairs = make_groups(g, batch, min_size=2)
    baselines = torch.randn(batch, generator=g)
    m, idx = ref.rows(mask), list(index)
    scores = outcome.sum(-1).tolist()

    adv, ret = get_adv_estimator_fn("gae")(
        token_level_rewards=dense, values=values, response_mask=mask, gamma=0.95, lam=0.9
    )
    expected_adv, expected_ret = ref.gae(ref.rows(dense), ref.rows(values), m, 0.95, 0.9)
    close(
        adv * mask,
        ref.broadcast([1] * batch, [[a * mm for a, mm in zip(r, mr)] for r, mr in zip(expected_adv, m)]),
        atol=1e-4,
    )
    close(ret, expected_ret, atol=1e-5)

    for norm in (True, False):
        adv, _ = get_adv_estimator_fn("grpo")(
            token_level_rewards=outcome, response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm
        )
        close(adv, ref.grpo(scores, m, idx, norm_by_std=norm), atol=1e-4)

    pair_scores = outcome.sum(-1)
    adv, _ = get_adv_estimator_fn("grpo_passk")(token_level_rewards=outcome, response_mask=mask, index=index_pairs)
    close(adv, ref.grpo_passk(pair_scores.tolist(), m, list(index_pairs)), atol=1e-4)

    close(
        get_adv_estimator_fn("rloo")(token_level_rewards=outcome, response_mask=mask, index=index)[0],
        ref.rloo(scores, m, idx),
    )
    close(
        get_adv_estimator_fn("opo")(token_level_rewards=outcome, response_mask=mask, index=index)[0],
        ref.opo(scores, m, idx),
    )
    close(
        get_adv_estimator_fn("gpg")(token_level_rewards=outcome, response_mask=mask, index=index)[0],
        ref.gpg(scores, m, idx),
    )

    adv, ret = get_adv_estimator_fn("reinforce_plus_plus")(
        token_level_rewards=dense, response_mask=mask, config={"gamma": 0.9}
    )
    expected_adv, expected_ret = ref.reinforce_plus_plus(ref.rows(dense), m, 0.9)
    close(adv, expected_adv, atol=1e-4)
    close(ret, expected_ret)

    adv, _ = get_adv_estimator_fn("reinforce_plus_plus_baseline")(
        token_level_rewards=outcome, response_mask=mask, index=index
    )
    close(adv, ref.reinforce_plus_plus_baseline(scores, m, idx), atol=1e-4)

    adv, ret = get_adv_estimator_fn("remax")(token_level_rewards=dense, reward_baselines=baselines, response_mask=mask)
    expected_adv, expected_ret = ref.remax(ref.rows(dense), m, baselines.tolist())
    close(adv, expected_adv)
    close(ret, expected_ret)


def test_advantages_are_zero_outside_the_mask():
    g = torch.Generator().manual_seed(7)
    mask = make_mask(g, 10, 5, "holes")
    outcome = outcome_rewards(g, mask)
    for name in EXPECTED - {"gae", "remax", "grpo_passk"}:
        adv, _ = call_adv_estimator(
            name, token_level_rewards=outcome, response_mask=mask, index=make_groups(g, 10), config=None
        )
        assert torch.all(adv[mask == 0] == 0), name


# ------------------------------------------------------------------ registry and calling by config
def test_register_a_user_estimator_with_a_narrow_signature():
    @register_adv_est("test_constant_one")
    def constant_one(token_level_rewards, response_mask):  # a verl-style user function without **kwargs
        return response_mask.clone(), response_mask.clone()

    try:
        adv, _ = call_adv_estimator(
            "test_constant_one",
            token_level_rewards=torch.zeros(2, 3),
            response_mask=torch.ones(2, 3),
            index=["a", "b"],
            gamma=1.0,
        )
        assert torch.equal(adv, torch.ones(2, 3))
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est("test_constant_one")(lambda **kw: None)
    finally:
        del ADVANTAGE_ESTIMATORS["test_constant_one"]


def test_unknown_estimator_and_missing_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="not registered.*grpo"):
        get_adv_estimator_fn("grpoo")
    with pytest.raises(ValueError, match=r"needs \['values'\].*critic"):
        call_adv_estimator("gae", token_level_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2))
