"""Rollout correction in the step: the decoupled mode's weights and rejection reach the advantage and the loss, the
bypass mode trains on the rollout's log-probs without the old-log-prob pass; the tiny model in one process."""

import copy

import numpy as np
import pytest
import torch

from rl_core.algos.kl import get_kl_controller
from rl_core.algos.masked import masked_mean
from rl_core.batch import Batch
from rl_core.ppo_step import StepWorkers, advantage, run_ppo_step
from rl_core.workers import ActorRolloutRefWorker
from tests.rl_core.test_workers import build_workers, fixed_batch, step_inputs


def test_the_decoupled_mode_weighs_and_rejects_before_the_advantage(config):
    """Old log-probs 0.5 above the rollout's on the second response's first token (ratio e^0.5 = 1.65) and 2 above
    on the fourth's (ratio 7.4): token TIS at 2 weighs them 1.65 and 2; a token_k1 filter at [0.2, 5] (-log r within
    [log 0.2, log 5]) rejects the fourth's token, so its GRPO advantage is 0 there and the mask replaces the batch's."""
    config.algorithm.adv_estimator = "grpo"
    config.algorithm.rollout_correction.rollout_is = "token"
    config.algorithm.rollout_correction.rollout_rs = "token_k1"
    config.algorithm.rollout_correction.rollout_rs_threshold = "0.2_5"
    mask = torch.ones(4, 3)
    rollout = torch.full((4, 3), -1.0)
    old = rollout.clone()
    old[1, 0] += 0.5
    old[3, 0] += 2.0
    batch = Batch(
        {"token_level_scores": torch.tensor([[0, 0, 1.0], [0, 0, 0], [0, 0, 1], [0, 0, 0]]), "response_mask": mask}
        | {"rollout_log_probs": rollout},
        {"uid": np.array(["a", "a", "b", "b"], dtype=object)},
    )
    kl = get_kl_controller(config.algorithm.kl_ctrl)
    out, metrics = advantage(config, kl, batch, Batch({"old_log_probs": old}), None, None)
    kept = torch.ones(4, 3)
    kept[3, 0] = 0.0
    assert torch.equal(out.tensors["response_mask"], kept)
    weights = out.tensors["rollout_is_weights"]
    torch.testing.assert_close(weights[1, 0], torch.tensor(np.exp(0.5), dtype=torch.float32))
    assert weights[3, 0] == 2.0  # truncated; the rejected token is out of the loss through the mask
    assert out.tensors["advantages"][3, 0] == 0 and out.tensors["advantages"][3, 1] != 0
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 12)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 12)
    assert batch.tensors["response_mask"] is mask  # the stage does not touch its input


def test_importance_weights_scale_the_policy_loss(tmp_path, config):
    """The same batch from the same weights: with every weight 2 the policy loss is twice the unweighted one."""
    config.actor_rollout_ref.actor.ppo_mini_batch_size = config.data.train_batch_size
    first, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(first, tmp_path, config)
    start = copy.deepcopy(first.module.state_dict())
    plain = first.update_actor(batch)
    second = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
    second.init_model()
    second.module.load_state_dict(start)
    weighted = second.update_actor(Batch({**batch.tensors, "rollout_is_weights": 2 * batch.tensors["response_mask"]}))
    assert plain["actor/pg_loss"] != 0
    assert weighted["actor/pg_loss"] == pytest.approx(2 * plain["actor/pg_loss"], rel=1e-5)


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_the_bypass_mode_trains_on_the_rollouts_log_probs(tmp_path, config, loss_type):
    """No old-log-prob pass; the update's ratio is pi_theta / pi_rollout, ~1 in one process (the same model sampled);
    its rollout_corr/ metrics come from the update's micro-batches; REINFORCE's loss is -mean(A log pi) (token-mean)."""
    config.actor_rollout_ref.rollout.calculate_log_probs = True  # the demo profile's is false
    config.algorithm.rollout_correction.bypass_mode = True
    config.algorithm.rollout_correction.loss_type = loss_type
    config.algorithm.rollout_correction.rollout_is = "token"
    config.actor_rollout_ref.actor.use_kl_loss = False
    config.actor_rollout_ref.actor.ppo_mini_batch_size = config.data.train_batch_size
    actor, _ = build_workers(config, with_critic=False)
    before = copy.deepcopy(actor.module.state_dict())
    batch, metrics = run_ppo_step(config, StepWorkers(actor), *step_inputs(tmp_path, actor, config), step=1)
    assert "timing_s/old_log_prob" not in metrics and "old_log_probs" not in batch
    assert metrics["actor/entropy"] > 0 and abs(metrics["actor/ppo_kl"]) < 1e-4
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
    assert abs(metrics["rollout_corr/kl"]) < 1e-4
    if loss_type == "reinforce":
        check = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
        check.init_model()
        check.module.load_state_dict(before)
        log_probs = check.compute_log_prob(batch).tensors["old_log_probs"]
        mask = batch.tensors["response_mask"]
        expected = -masked_mean(batch.tensors["advantages"] * log_probs, mask).item()
        assert metrics["actor/pg_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
    else:
        assert metrics["actor/pg_clipfrac"] == 0.0
