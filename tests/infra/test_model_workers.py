"""Real tiny-model workers on Ray: 1 rank vs 2 ranks (FSDP2 over gloo) give the same numbers, and actor,
critic and reference policy live fused in one process."""

import copy
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from flows.workers import weights_at
from infra.resource_pool import ResourcePool
from infra.worker_group import WorkerGroup
from rl_core.algos.kl import get_kl_controller
from rl_core.batch import Batch
from rl_core.data.sampler import ResumableSampler
from rl_core.models.loading import load_tokenizer
from rl_core.ppo_step import StepWorkers, generate, run_ppo_step, run_validation
from rl_core.reward.manager import build_reward_manager
from rl_core.workers import ActorRolloutRefWorker, CriticWorker
from rl_core.workers.train_loop import NonFiniteError
from tests.rl_core.helpers import addition_dataset, assert_same_adam_step


@pytest.fixture()
def fixed_batch(tmp_path, config):
    """16 responses with old log-probs, ref log-probs and random advantages, made in this process."""
    config.actor_rollout_ref.actor.use_kl_loss = True
    local = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
    local.init_model()
    prompts = addition_dataset(tmp_path, local.tokenizer, config.data, count=8).collate([0, 1, 2, 3], "fix-")
    prompts.meta_info["global_step"] = 1
    batch = local.generate_sequences(prompts.repeat_interleave(config.actor_rollout_ref.rollout.n))
    batch.union(Batch(local.compute_log_prob(batch).tensors))
    batch.union(Batch(local.compute_ref_log_prob(batch).tensors))
    batch.tensors["advantages"] = (
        torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(0)) * batch.tensors["response_mask"]
    )
    return batch


def actor_group(config, world, prefix, worker_env):
    specs = {"actor_rollout_ref": (ActorRolloutRefWorker, (config.actor_rollout_ref, "actor_rollout_ref"), {})}
    group = WorkerGroup.create(
        ResourcePool(prefix, [world]), specs, prefix=prefix, namespace="ppoflow-tests", env_vars=worker_env
    )
    group.role("actor_rollout_ref").init_model()
    return group


def test_one_and_two_ranks_give_the_same_update(ray_address, worker_env, fixed_batch, config, tmp_path):
    config.actor_rollout_ref.actor.use_kl_loss = True
    # one mini-batch of all 16 responses, two epochs: two optimizer steps. (With several mini-batches each rank
    # cuts its own shard, as in verl, so a global mini-batch holds other rows than on one rank.)
    config.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    config.actor_rollout_ref.actor.ppo_epochs = 2
    results = {}
    for world in (1, 2):
        group = actor_group(config, world, f"equiv{world}", worker_env)
        try:
            actor = group.role("actor_rollout_ref")
            # a batch size that does not divide by the world size: padded for dispatch, unpadded on collect
            odd = fixed_batch[list(range(7))]
            log_probs = actor.compute_log_prob(odd).tensors["old_log_probs"]
            metrics = actor.update_actor(fixed_batch)
            actor.save_checkpoint(str(tmp_path / f"world{world}"))
            results[world] = (log_probs, metrics, load_file(str(tmp_path / f"world{world}" / "model.safetensors")))
        finally:
            group.kill()
    (lp1, m1, w1), (lp2, m2, w2) = results[1], results[2]
    mask = fixed_batch.tensors["response_mask"][:7].bool()
    assert lp1.shape == (7, fixed_batch.tensors["responses"].shape[1])
    assert torch.allclose(lp1[mask], lp2[mask], atol=1e-5)
    assert torch.allclose(lp1[mask], fixed_batch.tensors["old_log_probs"][:7][mask], atol=1e-5)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):  # (ppo_kl is a mean of per-micro-batch means)
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    assert w1.keys() == w2.keys(), sorted(set(w1) ^ set(w2))
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-5), name


def test_two_ranks_compute_in_bf16_and_keep_fp32_master_weights(ray_address, worker_env, fixed_batch, config, tmp_path):
    """FSDP2's mixed-precision policy (parameters gathered in bf16, gradients reduced in float32): the GPU's multi-rank
    path, run here over gloo."""
    config.actor_rollout_ref.actor.fsdp_config.dtype = "bfloat16"
    group = actor_group(config, 2, "bf16x2", worker_env)
    try:
        actor = group.role("actor_rollout_ref")
        log_probs = actor.compute_log_prob(fixed_batch).tensors["old_log_probs"]
        actor.update_actor(fixed_batch)
        actor.save_checkpoint(str(tmp_path / "bf16"))
    finally:
        group.kill()
    mask = fixed_batch.tensors["response_mask"].bool()
    error = (log_probs - fixed_batch.tensors["old_log_probs"])[mask].abs().max()
    assert log_probs.dtype == torch.float32 and 0 < float(error) < 0.2  # bf16 compute, close to the float32 log-probs
    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    start = load_file(f"{config.actor_rollout_ref.model.path}/model.safetensors")
    assert all(t.dtype == torch.float32 for t in saved.values())
    assert any(not torch.equal(saved[k], start[k]) for k in saved)


def test_actor_critic_and_ref_fused_in_one_process(ray_address, worker_env, fixed_batch, config):
    config.algorithm.adv_estimator = "gae"
    specs = {
        "actor_rollout_ref": (ActorRolloutRefWorker, (config.actor_rollout_ref, "actor_rollout_ref"), {}),
        "critic": (CriticWorker, (config.critic,), {}),
    }
    group = WorkerGroup.create(
        ResourcePool("fused", [1]), specs, prefix="fused", namespace="ppoflow-tests", env_vars=worker_env
    )
    try:
        actor, critic = group.role("actor_rollout_ref"), group.role("critic")
        actor.init_model()
        critic.init_model()
        (report,) = group.health()
        assert set(report["steps_trained"]) == {"actor_rollout_ref", "critic"}  # both roles in the same pid
        batch = copy.deepcopy(fixed_batch)
        batch.union(Batch(critic.compute_values(batch).tensors))
        batch.tensors["returns"] = batch.tensors["response_mask"].float()
        ref = actor.compute_ref_log_prob(batch).tensors["ref_log_prob"]
        mask = batch.tensors["response_mask"].bool()
        assert torch.allclose(ref[mask], batch.tensors["ref_log_prob"][mask], atol=1e-5)
        at_start = {"worker_steps": {"actor_rollout_ref": 0, "critic": 0}}
        assert weights_at(group, at_start, timeout=30)  # a checkpoint taken now would need no reload
        assert "critic/vf_loss" in critic.update_critic(batch)
        assert not weights_at(group, at_start, timeout=30)  # the critic moved past it
        assert "actor/pg_loss" in actor.update_actor(batch)
        report = group.health()[0]
        assert report["steps_trained"] == report["updates_started"] == {"actor_rollout_ref": 1, "critic": 1}
        assert weights_at(group, {"worker_steps": {"actor_rollout_ref": 1, "critic": 1}}, timeout=30)
        assert not weights_at(group, {"global_step": 1}, timeout=30)  # a checkpoint from before this was recorded
    finally:
        group.kill()


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_a_batch_that_does_not_divide_over_the_ranks_gives_the_one_rank_update(
    ray_address, worker_env, fixed_batch, config, tmp_path, loss_agg_mode
):
    """15 responses over 2 ranks: the dispatcher pads one row, which must weigh nothing (loss, token counts,
    metrics)."""
    config.actor_rollout_ref.actor.ppo_mini_batch_size = 4  # x n=4: one mini-batch of all (16 >= 15) responses
    config.actor_rollout_ref.actor.loss_agg_mode = loss_agg_mode
    odd = fixed_batch[list(range(15))]
    results = {}
    for world in (1, 2):
        group = actor_group(config, world, f"uneven{world}", worker_env)
        try:
            actor = group.role("actor_rollout_ref")
            metrics = actor.update_actor(odd)
            actor.save_checkpoint(str(tmp_path / f"world{world}"))
            results[world] = (metrics, load_file(str(tmp_path / f"world{world}" / "model.safetensors")))
            if world == 2:  # a NaN loss on rank 1 only: both ranks stop at once, none waits in a collective
                poisoned = copy.deepcopy(odd)
                poisoned.tensors["advantages"][12] = float("nan")  # row 12 lands on rank 1 (rows 8-15)
                with pytest.raises(NonFiniteError, match="non-finite on at least one rank"):
                    actor.update_actor(poisoned, timeout_s=60)
        finally:
            group.kill()
    (m1, w1), (m2, w2) = results[1], results[2]
    # a padded row with weight would move these by ~1/15
    for key in (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
    ):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    assert_same_adam_step(w1, w2, config.actor_rollout_ref.actor.optim.lr)  # 2 ranks sum in another order than 1


def test_a_batch_of_prompts_that_does_not_divide_over_two_ranks_keeps_n_samples_per_prompt(
    ray_address, worker_env, config, tmp_path
):
    """3 prompts on 2 ranks with n=4: exactly 12 responses, 4 per prompt; GRPO and ReMax (its greedy baseline is one
    row per prompt) train on such a batch, and validation with 4 samples per prompt scores 4 per prompt."""
    config.data.train_batch_size = 3
    config.actor_rollout_ref.actor.ppo_mini_batch_size = 3
    config.actor_rollout_ref.actor.optim.total_training_steps = 2
    group = actor_group(config, 2, "uneven-prompts", worker_env)
    try:
        workers = StepWorkers(actor=group.role("actor_rollout_ref"), world_size=2)
        data = addition_dataset(tmp_path, load_tokenizer(config.actor_rollout_ref.model.path), config.data, count=6)
        sequences = generate(workers, data.collate([0, 1, 2], "p-"), 4)
        assert len(sequences) == 12 and Counter(sequences.non_tensors["uid"]) == {"p-0": 4, "p-1": 4, "p-2": 4}
        sampler = ResumableSampler(len(data), 3, shuffle=False)
        reward, kl = (
            build_reward_manager(config, load_tokenizer(config.actor_rollout_ref.model.path)),
            get_kl_controller(config.algorithm.kl_ctrl),
        )
        for step, estimator in enumerate(("grpo", "remax"), start=1):
            config.algorithm.adv_estimator = estimator
            batch, metrics = run_ppo_step(config, workers, data, sampler, reward, kl, step)
            assert len(batch) == 12 and set(Counter(batch.non_tensors["uid"]).values()) == {4}, estimator
            assert "actor/pg_loss" in metrics
        assert batch.tensors["reward_baselines"].shape == (12,)
        odd = addition_dataset(
            tmp_path, load_tokenizer(config.actor_rollout_ref.model.path), config.data, count=5, split="val"
        )
        # 5 rows on 2 ranks: one padding row, removed
        assert len(generate(workers, odd.collate(list(range(5)), "v-"), 1)) == 5
        val_kwargs = {**config.actor_rollout_ref.rollout.val_kwargs, "n": 4, "do_sample": True, "temperature": 1.0}
        metrics = run_validation(config, workers, odd, reward, val_kwargs=val_kwargs)  # 20 rows: 4 per prompt
        assert "val-core/ppoflow/addition/acc/pass@4" in metrics
    finally:
        group.kill()
