"""Policy losses: hand-derived cases, and each loss against a plain per-token loop on random inputs."""

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rl_core.algos import POLICY_LOSSES, get_policy_loss_fn, register_policy_loss
from tests.algos import reference as ref
from tests.algos.cases import CASES, make_mask

EXPECTED = {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo"}
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def actor_config(**overrides):
    base = dict(
        clip_ratio=0.2,
        clip_ratio_low=0.15,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        tau_pos=1.0,
        tau_neg=1.05,
        policy_loss=dict(clip_cov_ratio=0.2, clip_cov_lb=-1e9, clip_cov_ub=1e9, kl_cov_ratio=0.25, ppo_kl_coef=0.5),
    )
    base.update(overrides)
    return OmegaConf.create(base)


def random_inputs(seed, padding, batch=6, length=5):
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(g, batch, length, padding)
    old = -torch.rand(batch, length, generator=g) * 2
    new = old + torch.randn(batch, length, generator=g) * 0.4
    advantages = torch.randn(batch, length, generator=g)
    return old, new, advantages, mask


def test_every_loss_is_registered():
    assert set(POLICY_LOSSES) >= EXPECTED


# ------------------------------------------------------------------ hand-derived cases
def test_ppo_clip_by_hand():
    # r = 1.5 for every token; A = +1 -> clipped to 1.2 -> loss -1.2 ; A = -1 -> max(1.5, 1.2) = 1.5
    old = torch.zeros(2, 2)
    new = torch.full((2, 2), math.log(1.5))
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    loss, metrics = get_policy_loss_fn("vanilla")(
        old, new, advantages, mask, "token-mean", SimpleNamespace(clip_ratio=0.2)
    )
    assert loss.item() == pytest.approx((-1.2 * 2 + 1.5 * 2) / 4)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)  # the A > 0 tokens were clipped
    assert metrics["actor/ppo_kl"] == pytest.approx(-math.log(1.5))
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_dual_clip_caps_negative_advantage_losses():
    # r = e^2 = 7.39, A = -1: the PPO term is 7.39, dual-clip caps it at c = 3
    loss, metrics = get_policy_loss_fn("vanilla")(
        torch.zeros(1, 1),
        torch.full((1, 1), 2.0),
        -torch.ones(1, 1),
        torch.ones(1, 1),
        "token-mean",
        {"clip_ratio": 0.2, "clip_ratio_c": 3.0},
    )
    assert loss.item() == pytest.approx(3.0)
    assert metrics["actor/pg_clipfrac_lower"] == 1.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss_fn("vanilla")(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            torch.ones(1, 1),
            "token-mean",
            {"clip_ratio_c": 1.0},
        )


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    new = torch.full((1, 1), 1.0, requires_grad=True)  # r = e, clipped weight 1.28
    loss, metrics = get_policy_loss_fn("cispo")(
        torch.zeros(1, 1), new, torch.ones(1, 1), torch.ones(1, 1), "token-mean", actor_config()
    )
    loss.backward()
    assert new.grad.item() == pytest.approx(-1.28)
    assert metrics["actor/pg_clipfrac"] == 1.0


def test_every_builtin_loss_normalises_by_the_global_batch():
    """They read config.global_batch_info (the worker would otherwise treat them as micro-batch means)."""
    from rl_core.workers.policy_loss_call import reads_global_batch_info

    assert [name for name, fn in POLICY_LOSSES.items() if not reads_global_batch_info(fn, actor_config())] == []


def test_gspo_optimises_the_sequence_mean_whatever_the_aggregation_mode():
    """GSPO's objective weighs every sequence the same (seq-mean-token-mean): a 1-token and a 7-token response with
    different advantages give the same loss under token-mean as under the sequence mean."""
    mask = torch.zeros(2, 7)
    mask[0, 0], mask[1] = 1, 1
    advantages = torch.tensor([[2.0] * 7, [-1.0] * 7])
    old, new = torch.zeros(2, 7), torch.full((2, 7), 0.05)
    fn = get_policy_loss_fn("gspo")
    by_mode = {mode: fn(old, new, advantages, mask, mode, actor_config())[0].item() for mode in MODES}
    assert len({round(v, 6) for v in by_mode.values()}) == 1
    assert by_mode["token-mean"] == pytest.approx((-2.0 + 1.0) * math.exp(0.05) / 2, rel=1e-5)


def test_gspo_uses_the_sequence_ratio():
    # log r = [0.1, 0.3] -> sequence ratio exp(0.2) on both tokens, A = 1 -> loss -exp(0.2) (not clipped at 1.28)
    loss, _ = get_policy_loss_fn("gspo")(
        torch.zeros(1, 2), torch.tensor([[0.1, 0.3]]), torch.ones(1, 2), torch.ones(1, 2), "token-mean", actor_config()
    )
    assert loss.item() == pytest.approx(-math.exp(0.2), rel=1e-6)


# ------------------------------------------------------------------ against plain loops, random inputs
@pytest.mark.parametrize("seed,padding", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_losses_match_plain_loops(seed, padding, mode):
    old, new, advantages, mask = random_inputs(seed, padding)
    config = actor_config()
    o, n, a, m = ref.rows(old), ref.rows(new), ref.rows(advantages), ref.rows(mask)

    loss, metrics = get_policy_loss_fn("vanilla")(old, new, advantages, mask, mode, config)
    expected_loss, clipfrac, kl, lower = ref.vanilla(o, n, a, m, mode, 0.15, 0.28, 3.0)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    assert (metrics["actor/pg_clipfrac"], metrics["actor/ppo_kl"], metrics["actor/pg_clipfrac_lower"]) == pytest.approx(
        (clipfrac, kl, lower), abs=1e-6
    )

    loss, metrics = get_policy_loss_fn("gspo")(old, new, advantages, mask, mode, config)
    expected_loss, clipfrac = ref.gspo(o, n, a, m, mode, 0.15, 0.28)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(clipfrac, abs=1e-6)

    loss, _ = get_policy_loss_fn("sapo")(old, new, advantages, mask, mode, config)
    assert loss.item() == pytest.approx(ref.sapo(o, n, a, m, 1.0, 1.05), rel=1e-5, abs=1e-6)

    loss, metrics = get_policy_loss_fn("gpg")(old, new, advantages, mask, mode, config)
    assert loss.item() == pytest.approx(ref.gpg_loss(n, a, m, mode), rel=1e-5, abs=1e-6) and metrics == {}

    loss, _ = get_policy_loss_fn("geo_mean")(old, new, advantages, mask, mode, config)
    assert loss.item() == pytest.approx(ref.geo_mean(o, n, a, m, 0.15, 0.28), rel=1e-5, abs=1e-6)

    loss, _ = get_policy_loss_fn("cispo")(old, new, advantages, mask, mode, config)
    assert loss.item() == pytest.approx(ref.cispo(o, n, a, m, mode, 0.15, 0.28), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("seed,padding", CASES)
def test_kl_cov_penalises_the_top_covariance_tokens(seed, padding):
    old, new, advantages, mask = random_inputs(seed, padding)
    loss, metrics = get_policy_loss_fn("kl_cov")(old, new, advantages, mask, "token-mean", actor_config())
    # plain loop: rank the valid tokens by covariance, penalise the top int(N * 0.25) (at least 1)
    valid = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    adv_mean = sum(advantages[i, t].item() for i, t in valid) / len(valid)
    lp_mean = sum(new[i, t].item() for i, t in valid) / len(valid)
    cov = {(i, t): (advantages[i, t].item() - adv_mean) * (new[i, t].item() - lp_mean) for i, t in valid}
    top = set(sorted(valid, key=lambda k: -cov[k])[: max(1, int(len(valid) * 0.25))])
    losses = [
        [
            -advantages[i, t].item() * math.exp(new[i, t].item() - old[i, t].item())
            + (0.5 * abs(new[i, t].item() - old[i, t].item()) if (i, t) in top else 0.0)
            for t in range(mask.shape[1])
        ]
        for i in range(mask.shape[0])
    ]
    assert loss.item() == pytest.approx(ref.agg(losses, ref.rows(mask), "token-mean"), rel=1e-5, abs=1e-6)
    assert metrics["actor/ppo_kl"] == pytest.approx(
        ref.masked_mean([[abs(x) for x in r] for r in ref.rows(new - old)], ref.rows(mask)), rel=1e-5
    )


@pytest.mark.parametrize("seed,padding", CASES)
def test_clip_cov_cuts_the_gradient_of_a_share_of_unclipped_tokens(seed, padding):
    old, new, advantages, mask = random_inputs(seed, padding)
    new = new.clone().requires_grad_()
    torch.manual_seed(seed)
    loss, metrics = get_policy_loss_fn("clip_cov")(old, new, advantages, mask, "token-sum", actor_config())
    loss.backward()
    ratio = torch.exp(new.detach() - old)
    clipped = -advantages * torch.clamp(ratio, 0.85, 1.28) > -advantages * ratio
    cut = (new.grad == 0) & (mask > 0) & ~clipped
    expected_cut = max(int(0.2 * mask.sum().item()), 1)
    assert int(cut.sum()) == min(expected_cut, int(((mask > 0) & ~clipped).sum()))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(cut.sum().item() / mask.sum().item(), abs=1e-6)
    # every other valid token keeps its PPO loss value: recompute with the cut tokens removed from the mask
    kept = mask * (~cut).float()
    expected = sum(
        max(-a * r, -a * min(max(r, 0.85), 1.28))
        for a, r, k in zip(advantages.flatten().tolist(), ratio.flatten().tolist(), kept.flatten().tolist())
        if k
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_losses_accept_dataclass_dict_and_omegaconf_configs():
    old, new, advantages, mask = random_inputs(0, "right")
    as_dict = {"clip_ratio": 0.2}
    results = [
        get_policy_loss_fn("vanilla")(old, new, advantages, mask, "token-mean", c)[0].item()
        for c in (as_dict, OmegaConf.create(as_dict), SimpleNamespace(**as_dict), None)
    ]
    assert max(results) - min(results) < 1e-7  # None falls back to verl's default clip_ratio 0.2


def test_register_a_user_loss():
    @register_policy_loss("test_zero")
    def zero(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        return (log_prob * 0).sum(), {}

    try:
        assert get_policy_loss_fn("test_zero")(*random_inputs(0, "left"))[0].item() == 0.0
    finally:
        del POLICY_LOSSES["test_zero"]
    with pytest.raises(ValueError, match="not registered"):
        get_policy_loss_fn("test_zero")
