"""KL penalties and controllers, the value loss, entropy, aggregation and masked statistics."""

import math

import numpy as np
import pytest
import torch

from rl_core.algos import (
    KL_PENALTIES,
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_value_loss,
    entropy_from_logits,
    get_kl_controller,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
)
from tests.algos import reference as ref
from tests.algos.cases import CASES, make_mask


# ------------------------------------------------------------------ KL
def test_kl_estimators_by_hand():
    lp, ref_lp = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # d = ln 2
    d = math.log(2)
    assert kl_penalty(lp, ref_lp, "k1").item() == pytest.approx(d)
    assert kl_penalty(ref_lp, lp, "abs").item() == pytest.approx(d)
    assert kl_penalty(lp, ref_lp, "k2").item() == pytest.approx(d * d / 2)
    assert kl_penalty(lp, ref_lp, "k3").item() == pytest.approx(0.5 + d - 1)  # exp(-d) + d - 1


@pytest.mark.parametrize("name", KL_PENALTIES)
def test_kl_values_and_gradients(name):
    g = torch.Generator().manual_seed(3)
    lp = (torch.randn(4, 6, generator=g) - 1).requires_grad_()
    ref_lp = torch.randn(4, 6, generator=g) - 1
    value = kl_penalty(lp, ref_lp, name)
    base = name.rstrip("+")
    expected = [[ref.kl_value(a, b, base) for a, b in zip(ra, rb)] for ra, rb in zip(lp.tolist(), ref_lp.tolist())]
    assert torch.allclose(value, torch.tensor(expected), atol=1e-5)
    value.sum().backward()
    d = (lp - ref_lp).detach()
    # d/d(log_prob) of each estimator, by hand; the "+" variants take k2's gradient (straight-through)
    expected_grad = {
        "kl": torch.ones_like(d),
        "k1": torch.ones_like(d),
        "abs": torch.sign(d),
        "mse": d,
        "k2": d,
        "low_var_kl": torch.where((torch.exp(-d) + d - 1).abs() < 10, 1 - torch.exp(-d), torch.zeros_like(d)),
    }
    expected_grad["k3"] = expected_grad["low_var_kl"]
    assert torch.allclose(lp.grad, d if name.endswith("+") else expected_grad[base], atol=1e-5)


def test_unknown_kl_penalty():
    with pytest.raises(ValueError, match="Unknown KL penalty 'k4'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_apply_kl_penalty_subtracts_beta_kl_and_reports_the_mean_sequence_kl():
    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    reference = torch.tensor([[-1.0, -3.0], [-2.0, 5.0]])  # k1 = [[1, 3], [2, -5]]
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rewards, metrics = apply_kl_penalty(scores, old, reference, mask, FixedKLController(0.1), "kl")
    assert torch.allclose(rewards, torch.tensor([[-0.1, 0.7], [-0.2, 0.0]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((2.0 + 2.0) / 2)  # sequence means 2 and 2
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1


def test_adaptive_controller_follows_the_formula_and_restores_its_state():
    controller = get_kl_controller({"type": "adaptive", "kl_coef": 0.2, "target_kl": 0.1, "horizon": 100})
    controller.update(current_kl=0.5, n_steps=10)  # error clipped to 0.2 -> x 1.02
    assert controller.value == pytest.approx(0.2 * 1.02)
    controller.update(current_kl=0.09, n_steps=10)  # error -0.1 -> x 0.99
    assert controller.value == pytest.approx(0.2 * 1.02 * 0.99)
    restored = AdaptiveKLController(1.0, 0.1, 100)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    fixed = get_kl_controller({"type": "fixed", "kl_coef": 0.05})
    fixed.update(current_kl=10.0, n_steps=100)
    assert fixed.value == 0.05
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller({"type": "adaptive", "horizon": 0})
    with pytest.raises(ValueError, match="fixed' or 'adaptive"):
        get_kl_controller({"type": "pid"})


# ------------------------------------------------------------------ value loss
def test_value_loss_by_hand():
    # V_old = 0, clip 0.5: V = 2 -> clipped 0.5; R = 1 -> max((2-1)^2, (0.5-1)^2) = 1 ; 0.5 * 1
    loss, clipfrac = compute_value_loss(
        torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), 0.5
    )
    assert loss.item() == pytest.approx(0.5) and clipfrac.item() == 0.0
    # R = 3: clipped error (0.5-3)^2 = 6.25 beats 1 -> counted as clipped
    loss, clipfrac = compute_value_loss(
        torch.tensor([[2.0]]), torch.tensor([[3.0]]), torch.tensor([[0.0]]), torch.ones(1, 1), 0.5
    )
    assert loss.item() == pytest.approx(3.125) and clipfrac.item() == 1.0


@pytest.mark.parametrize("seed,padding", CASES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_and_aggregation_match_plain_loops(seed, padding, mode):
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(g, 5, 7, padding)
    vpreds, returns, values = (torch.randn(5, 7, generator=g) for _ in range(3))
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, 0.3, mode)
    expected_loss, expected_clipfrac = ref.value_loss(
        ref.rows(vpreds), ref.rows(returns), ref.rows(values), ref.rows(mask), 0.3, mode
    )
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert clipfrac.item() == pytest.approx(expected_clipfrac, abs=1e-6)
    assert agg_loss(vpreds, mask, mode).item() == pytest.approx(
        ref.agg(ref.rows(vpreds), ref.rows(mask), mode), rel=1e-5, abs=1e-6
    )


def test_aggregation_skips_fully_masked_sequences_and_scales_for_data_parallel():
    loss = torch.tensor([[1.0, 3.0], [5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(4.0)
    # two ranks, 4 tokens in the global batch: this rank's share of the sum times dp_size
    assert agg_loss(loss, mask, "token-mean", dp_size=2, batch_num_tokens=4).item() == pytest.approx(4.0 / 4 * 2)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(loss, mask, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="Unknown loss_agg_mode 'mean'"):
        agg_loss(loss, mask, "mean")


# ------------------------------------------------------------------ entropy
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 64])
def test_entropy_in_chunks_matches_a_plain_loop(chunk_size):
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(1)) * 3
    entropy = entropy_from_logits(logits, chunk_size=chunk_size)
    expected = [[ref.entropy(row) for row in seq] for seq in logits.tolist()]
    assert entropy.shape == (3, 4)
    assert torch.allclose(entropy, torch.tensor(expected), atol=1e-5)


def test_seq_mean_token_sum_norm_is_verl_091s_by_hand():
    """verl 0.9.1: the sum of each sequence's token losses, averaged over the (global) non-empty sequences, divided by
    the response length T (Dr.GRPO's constant). Two sequences, T = 4, one of them empty: (1 + 2 + 3) / 1 / 4."""
    losses = torch.tensor([[1.0, 2.0, 3.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert agg_loss(losses, mask, "seq-mean-token-sum-norm").item() == pytest.approx(6.0 / 1 / 4)
    # two ranks, each holding one of two non-empty sequences: scaled by dp_size, the ranks' mean is the global loss
    assert agg_loss(
        losses[:1], mask[:1], "seq-mean-token-sum-norm", dp_size=2, global_batch_size=2
    ).item() == pytest.approx(6.0 / 2 / 4 * 2)


def test_chunks_recomputed_in_the_backward_pass_give_the_plain_gradient():
    """Under autograd the chunks are checkpointed (their softmax is not kept): the entropy's and the log-probs'
    gradients
    are still those of the plain, unchunked formulas."""
    from rl_core.models.logprob import token_log_probs

    logits = torch.randn(6, 5, 11, generator=torch.Generator().manual_seed(3), requires_grad=True)
    entropy_from_logits(logits, chunk_size=4).sum().backward()
    chunked, logits.grad = logits.grad, None
    probs = torch.softmax(logits, -1)
    (torch.logsumexp(logits, -1) - (probs * logits).sum(-1)).sum().backward()
    assert torch.allclose(chunked, logits.grad, atol=1e-6)
    half = logits.detach().bfloat16().requires_grad_()
    labels = torch.randint(0, 11, (6, 5), generator=torch.Generator().manual_seed(4))
    token_log_probs(half, labels, chunk_size=7).sum().backward()
    chunked = half.grad.float()
    half.grad = None
    torch.log_softmax(half.float(), -1).gather(-1, labels.unsqueeze(-1)).sum().backward()
    assert torch.allclose(chunked, half.grad.float(), atol=1e-2)


def test_entropy_of_uniform_and_one_hot():
    assert entropy_from_logits(torch.zeros(1, 8)).item() == pytest.approx(math.log(8), rel=1e-6)
    assert entropy_from_logits(torch.tensor([[0.0, -1e4, -1e4]])).item() == pytest.approx(0.0, abs=1e-6)


# ------------------------------------------------------------------ masked statistics
@pytest.mark.parametrize("seed,padding", CASES)
def test_masked_statistics_match_numpy_on_the_valid_entries(seed, padding):
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(g, 6, 5, padding)
    mask[0, :2] = 1  # at least two valid entries for the unbiased variance
    values = torch.randn(6, 5, generator=g)
    values[mask == 0] = float("nan")  # masked-out garbage must not leak
    valid = values[mask.bool()].numpy().astype(np.float64)
    assert masked_mean(values, mask).item() == pytest.approx(valid.mean(), rel=1e-5)
    assert masked_var(values, mask).item() == pytest.approx(valid.var(ddof=1), rel=1e-4)
    whitened = masked_whiten(values, mask)[mask.bool()].numpy()
    assert np.allclose(whitened, (valid - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8), atol=1e-4)


def test_masked_var_needs_two_entries():
    with pytest.raises(ValueError, match="one element"):
        masked_var(torch.ones(2, 2), torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
