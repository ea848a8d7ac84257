"""Micro-batches packed by tokens (verl's use_dynamic_bsz): the packing against hand values and a brute-force check,
the rows put back in order, and the same log-probs, values and update as micro-batches by count on a batch of very
uneven lengths."""

import copy
import random

import pytest
import torch

from rl_core.batch import Batch
from rl_core.workers import ActorRolloutRefWorker, CriticWorker
from rl_core.workers.micro_batches import (
    in_micro_batches,
    micro_batch_limits,
    micro_batch_rows,
    pack_by_tokens,
    split_into,
    trim_response_padding,
)
from tests.rl_core.test_workers import build_workers, fixed_batch


def test_packing_by_tokens_by_hand():
    # longest first, each into the first group with room: 9 | 7 | 5, then 4 -> 5+4, 3 -> 7+3, 1 -> 9+1
    assert pack_by_tokens([3, 9, 5, 7, 1, 4], max_tokens=10) == [[1, 4], [0, 3], [2, 5]]
    assert pack_by_tokens([10, 10], max_tokens=10) == [[0], [1]]
    with pytest.raises(ValueError, match="does not fit in a micro-batch of at most 8 tokens"):
        pack_by_tokens([3, 9], max_tokens=8)


@pytest.mark.parametrize("seed", range(5))
def test_every_row_once_and_no_group_over_the_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([2, 3, 40, 64]) for _ in range(rng.randint(1, 40))]
    groups = pack_by_tokens(lengths, max_tokens=64)
    assert sorted(row for group in groups for row in group) == list(range(len(lengths)))
    assert all(sum(lengths[row] for row in group) <= 64 for group in groups)
    assert len(groups) <= len(lengths) and len(groups) >= -(-sum(lengths) // 64)  # never fewer than the tokens need
    more = split_into(groups, len(groups) + 3)
    assert sorted(row for group in more for row in group) == list(range(len(lengths)))
    assert len(more) == min(len(groups) + 3, len(lengths))


def test_a_micro_batch_runs_at_the_width_of_its_longest_response():
    lengths = torch.tensor([2, 3])
    response_mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    micro = Batch(
        {
            "prompts": torch.ones(2, 6, dtype=torch.long),  # as wide as the responses: never cut
            "responses": torch.arange(12).view(2, 6),
            "response_mask": response_mask,
            "attention_mask": torch.cat([torch.ones(2, 6, dtype=torch.long), response_mask], dim=1),
            "advantages": torch.ones(2, 1),
        }
    )
    trimmed = trim_response_padding(micro)
    assert trimmed.tensors["responses"].tolist() == [[0, 1, 2], [6, 7, 8]]
    assert trimmed.tensors["attention_mask"].shape == (2, 9) and trimmed.tensors["prompts"].shape == (2, 6)
    assert trimmed.tensors["advantages"].shape == (2, 1)


def test_outputs_come_back_in_the_batch_order():
    lengths = torch.tensor([5, 1, 4, 2, 3, 1])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    batch = Batch({"attention_mask": mask, "responses": mask, "value": torch.arange(6.0)[:, None] * 10})
    groups = micro_batch_rows(batch, micro_batch_size=2, max_tokens=6)
    assert [sum(lengths[r] for r in group) <= 6 for group in groups] == [True] * len(groups) and len(groups) == 3
    (back, none) = in_micro_batches(
        batch, 2, 6, lambda micro: (micro.tensors["responses"] * (micro.tensors["value"] + 1), None)
    )
    assert torch.equal(back, batch.tensors["responses"] * (batch.tensors["value"] + 1)) and none is None
    assert micro_batch_rows(batch, micro_batch_size=4) == [[0, 1, 2, 3], [4, 5]]


def uneven(batch):
    """Every other response cut to its first token: lengths from ~10 to the full width."""
    batch = copy.deepcopy(batch)
    prompt_width = batch.tensors["prompts"].shape[1]
    for row in range(0, len(batch), 2):
        batch.tensors["response_mask"][row, 1:] = 0
        batch.tensors["attention_mask"][row, prompt_width + 1 :] = 0
    return batch


@pytest.mark.parametrize("padding_free", [True, False])
def test_token_budget_gives_the_same_log_probs_values_and_update(tmp_path, config, padding_free):
    """(Padded forward passes run at each micro-batch's own width: trim_response_padding.)"""
    config.actor_rollout_ref.model.use_remove_padding = padding_free
    config.actor_rollout_ref.actor.use_kl_loss = True
    config.algorithm.adv_estimator = "gae"
    actor, critic = build_workers(config, with_critic=True)
    batch = uneven(fixed_batch(actor, tmp_path, config))
    lengths = batch.tensors["attention_mask"].sum(-1)
    budget = int(lengths.max()) * 2
    assert len(micro_batch_rows(batch, 2, budget)) < len(micro_batch_rows(batch, 2))  # fewer, fuller passes
    start, critic_start = copy.deepcopy(actor.module.state_dict()), copy.deepcopy(critic.module.state_dict())
    batch.union(Batch(critic.compute_values(batch).tensors))
    batch.tensors["returns"] = torch.ones_like(batch.tensors["values"]) * batch.tensors["response_mask"]
    results = []
    # by count; by tokens (use_dynamic_bsz); by tokens because no micro-batch size is set (the default)
    for micro, dynamic in ((2, False), (2, True), (None, False)):
        config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = micro
        config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = micro
        config.critic.ppo_micro_batch_size_per_gpu = micro
        config.actor_rollout_ref.actor.use_dynamic_bsz = dynamic  # ref's, rollout's and critic's follow it
        config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = budget
        config.critic.ppo_max_token_len_per_gpu = budget
        fresh = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
        fresh.init_model()
        fresh.module.load_state_dict(start)
        fresh_critic = CriticWorker(config.critic)
        fresh_critic.init_model()
        fresh_critic.module.load_state_dict(critic_start)
        log_probs = fresh.compute_log_prob(batch).tensors
        values = fresh_critic.compute_values(batch).tensors["values"]
        metrics = fresh.update_actor(batch)
        critic_metrics = fresh_critic.update_critic(batch)
        weights = torch.cat([p.flatten() for p in fresh.module.parameters()])
        critic_weights = torch.cat([p.flatten() for p in fresh_critic.module.parameters()])
        results.append((log_probs, values, metrics, critic_metrics, weights, critic_weights))
    mask = batch.tensors["response_mask"]  # (a padded pass's values past a response's end are not used)
    (lp_a, v_a, m_a, c_a, w_a, cw_a) = results[0]
    for lp_b, v_b, m_b, c_b, w_b, cw_b in results[1:]:
        assert torch.allclose(lp_a["old_log_probs"] * mask, lp_b["old_log_probs"] * mask, atol=1e-5)
        assert torch.allclose(lp_a["entropys"] * mask, lp_b["entropys"] * mask, atol=1e-5)
        assert torch.allclose(v_a, v_b, atol=1e-5)
        assert m_a["actor/pg_loss"] == pytest.approx(m_b["actor/pg_loss"], abs=1e-5)
        assert c_a["critic/vf_loss"] == pytest.approx(c_b["critic/vf_loss"], abs=1e-5)
        assert torch.allclose(w_a, w_b, atol=2e-5) and torch.allclose(cw_a, cw_b, atol=2e-5)  # the sums' order differs
    assert micro_batch_limits(None, False, budget) == micro_batch_limits(2, True, budget) == (None, budget)
    assert micro_batch_limits(2, False, budget) == (2, None)
