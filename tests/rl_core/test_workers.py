"""Workers on the tiny model in one process: a PPO step with a critic, a GRPO step, learning on a fixed batch,
LoRA references, checkpoints, the reward model."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rl_core.algos.kl import get_kl_controller
from rl_core.batch import Batch
from rl_core.ppo_step import run_ppo_step, use_critic, use_reference
from rl_core.reward.manager import build_reward_manager
from rl_core.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker
from rl_core.workers.train_loop import NonFiniteError
from tests.rl_core.helpers import addition_dataset


def build_workers(config, with_critic):
    actor = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor_rollout_ref")
    actor.init_model()
    critic = None
    if with_critic:
        critic = CriticWorker(config.critic)
        critic.init_model()
    return actor, critic


def assert_finished_batch(batch, n_samples, response_length, masked_keys=("old_log_probs", "advantages", "returns", "token_level_rewards")):
    mask = batch.tensors["response_mask"]
    assert mask.shape == (n_samples, response_length)
    for key in ("old_log_probs", "advantages", "returns", "token_level_rewards"):
        assert batch.tensors[key].shape == (n_samples, response_length), key
        assert torch.isfinite(batch.tensors[key]).all(), key
    for key in masked_keys:
        assert torch.all(batch.tensors[key][mask == 0] == 0), f"{key} is non-zero outside the response mask"
    assert (batch.tensors["old_log_probs"][mask.bool()] <= 0).all()


def test_one_ppo_step_with_a_critic(tmp_path, config):
    config.algorithm.adv_estimator = "gae"
    config.actor_rollout_ref.actor.use_kl_loss = False
    config.algorithm.use_kl_in_reward = True
    assert use_critic(config) and use_reference(config)
    actor, critic = build_workers(config, with_critic=True)
    prompts = addition_dataset(tmp_path, actor.tokenizer, config.data, count=8).collate([0, 1, 2, 3], "s1-")
    reward = build_reward_manager(config, actor.tokenizer)
    before = copy.deepcopy(actor.module.state_dict())
    batch, metrics = run_ppo_step(prompts, actor, critic, reward, config, get_kl_controller(config.algorithm.kl_ctrl), global_step=1)
    assert_finished_batch(batch, 16, config.data.max_response_length, masked_keys=("old_log_probs", "token_level_rewards"))  # GAE: see advantage.py
    assert batch.tensors["values"].shape == (16, config.data.max_response_length)
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/entropy", "critic/vf_loss",
                 "critic/vf_clipfrac", "critic/grad_norm", "critic/score/mean", "response_length/mean", "actor/reward_kl_penalty", "timing_s/gen"):
        assert name in metrics, name
    changed = [k for k, v in actor.module.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the actor update changed no weight"


def test_one_grpo_step(tmp_path, config):
    assert not use_critic(config) and use_reference(config)  # the default: grpo with a KL loss
    actor, _ = build_workers(config, with_critic=False)
    prompts = addition_dataset(tmp_path, actor.tokenizer, config.data, count=8).collate([4, 5, 6, 7], "s1-")
    batch, metrics = run_ppo_step(prompts, actor, None, build_reward_manager(config, actor.tokenizer), config,
                                  get_kl_controller(config.algorithm.kl_ctrl), global_step=1)
    assert_finished_batch(batch, 16, config.data.max_response_length)
    assert "values" not in batch and "actor/kl_loss" in metrics and "critic/vf_loss" not in metrics
    # the GRPO advantages of one prompt's group are centred (scores 0/1 within a group)
    for uid in set(batch.non_tensors["uid"]):
        rows = [i for i, u in enumerate(batch.non_tensors["uid"]) if u == uid]
        first_token = batch.tensors["advantages"][rows, 0]
        assert abs(first_token.sum().item()) < 1e-4


def fixed_batch(actor, tmp_path, config):
    prompts = addition_dataset(tmp_path, actor.tokenizer, config.data, count=8).collate(list(range(4)), "fix-")
    prompts.meta_info["global_step"] = 1
    batch = actor.generate_sequences(prompts)
    batch.union(Batch(actor.compute_log_prob(batch).tensors))
    batch.union(Batch(actor.compute_ref_log_prob(batch).tensors))
    generator = torch.Generator().manual_seed(0)
    batch.tensors["advantages"] = torch.randn(len(batch), 1, generator=generator) * batch.tensors["response_mask"]
    return batch


def test_repeated_updates_on_a_fixed_batch_lower_the_loss(tmp_path, config):
    config.actor_rollout_ref.actor.optim.lr = 1e-3
    config.actor_rollout_ref.actor.clip_ratio_high = config.actor_rollout_ref.actor.clip_ratio_low = 10.0  # no clipping plateau
    actor, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(actor, tmp_path, config)
    losses = [actor.update_actor(batch).meta_info["metrics"]["actor/pg_loss"] for _ in range(8)]
    assert losses[-1] < losses[0] - 0.05, losses

    config.algorithm.adv_estimator = "gae"
    critic = CriticWorker(config.critic)
    critic.init_model()
    batch.union(Batch(critic.compute_values(batch).tensors))
    batch.tensors["returns"] = torch.ones_like(batch.tensors["values"]) * batch.tensors["response_mask"]
    config.critic.cliprange_value = 100.0
    vf_losses = [critic.update_critic(batch).meta_info["metrics"]["critic/vf_loss"] for _ in range(8)]
    assert vf_losses[-1] < vf_losses[0] * 0.5, vf_losses


def test_micro_batch_size_does_not_change_the_update(tmp_path, config):
    config.actor_rollout_ref.actor.use_kl_loss = True
    actor, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(actor, tmp_path, config)
    start = copy.deepcopy(actor.module.state_dict())
    results = []
    for micro in (1, 3, 16):
        config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = micro
        fresh = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
        fresh.init_model()
        fresh.module.load_state_dict(start)
        metrics = fresh.update_actor(batch).meta_info["metrics"]
        results.append((metrics["actor/pg_loss"], torch.cat([p.flatten() for p in fresh.module.parameters()])))
    for loss, weights in results[1:]:
        assert loss == pytest.approx(results[0][0], abs=1e-5)
        assert torch.allclose(weights, results[0][1], atol=2e-5)  # only the summation order differs


def test_lora_reference_is_the_base_model(tmp_path, config):
    config.actor_rollout_ref.model.lora_rank = 4
    config.actor_rollout_ref.actor.optim.lr = 1e-2
    actor, _ = build_workers(config, with_critic=False)
    assert actor.ref_module is actor.module  # no second copy of the weights
    batch = fixed_batch(actor, tmp_path, config)
    for _ in range(2):
        actor.update_actor(batch)
    ref = actor.compute_ref_log_prob(batch).tensors["ref_log_prob"]
    base = ActorRolloutRefWorker(copy.deepcopy(config.actor_rollout_ref), role="ref")
    base.model_config.lora_rank = 0
    base.init_model()
    expected = base.compute_ref_log_prob(batch).tensors["ref_log_prob"]
    mask = batch.tensors["response_mask"].bool()
    assert torch.allclose(ref[mask], expected[mask], atol=1e-5)
    current = actor.compute_log_prob(batch).tensors["old_log_probs"]
    assert not torch.allclose(current[mask], expected[mask], atol=1e-4), "the adapter should have moved the policy"


def test_checkpoint_round_trip_and_hf_loadable(tmp_path, config):
    actor, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(actor, tmp_path, config)
    actor.update_actor(batch)
    actor.save_checkpoint(tmp_path / "ckpt" / "actor")
    assert not list((tmp_path / "ckpt").rglob("*.bin")) and not list((tmp_path / "ckpt").rglob("*.pt"))
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "actor")
    for name, tensor in actor.module.state_dict().items():
        assert torch.equal(hf_model.state_dict()[name], tensor), name
    after_one = actor.update_actor(batch).meta_info["metrics"]
    restored = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
    restored.init_model()
    restored.load_checkpoint(tmp_path / "ckpt" / "actor")
    assert restored.steps_trained == 1
    again = restored.update_actor(batch).meta_info["metrics"]
    assert again["actor/pg_loss"] == pytest.approx(after_one["actor/pg_loss"], abs=1e-6)
    assert again["actor/grad_norm"] == pytest.approx(after_one["actor/grad_norm"], rel=1e-5)


def test_nan_loss_stops_the_update_without_touching_the_weights(tmp_path, config):
    actor, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(actor, tmp_path, config)
    batch.tensors["advantages"][0, 0] = float("nan")
    before = copy.deepcopy(actor.module.state_dict())
    with pytest.raises(NonFiniteError, match="actor update: the loss is nan.*optimizer step was not taken"):
        actor.update_actor(batch)
    assert all(torch.equal(v, before[k]) for k, v in actor.module.state_dict().items())


def test_role_checks(config):
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="ref")
    with pytest.raises(RuntimeError, match="update_actor needs the 'actor' role"):
        worker.update_actor(Batch())
    with pytest.raises(ValueError, match="role='critic'"):
        ActorRolloutRefWorker(config.actor_rollout_ref, role="critic")


def test_reward_model_scores_the_last_response_token(tmp_path, config, tiny_model_path):
    rm_path = tmp_path / "rm"
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    model.save_pretrained(rm_path)
    from rl_core.models.loading import load_tokenizer

    load_tokenizer(str(tiny_model_path)).save_pretrained(rm_path)
    actor, _ = build_workers(config, with_critic=False)
    prompts = addition_dataset(tmp_path, actor.tokenizer, config.data, count=4).collate([0, 1], "rm-")
    batch = actor.generate_sequences(prompts)
    config.reward_model.model.path = str(rm_path)
    same_tokenizer = RewardModelWorker(config.reward_model)
    same_tokenizer.init_model()
    scores = same_tokenizer.compute_rm_score(batch).tensors["rm_scores"]
    lengths = batch.tensors["response_mask"].sum(-1)
    nonzero = scores.nonzero()
    assert nonzero[:, 1].tolist() == (lengths - 1).tolist()
    # independent check of one row: the classifier's pooled output on the unpadded sequence
    row = 0
    ids = batch.tensors["input_ids"][row][batch.tensors["attention_mask"][row].bool()].unsqueeze(0)
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits[0, 0]
    assert scores[row, lengths[row] - 1].item() == pytest.approx(expected.item(), abs=1e-4)
    # with a separate input tokenizer the text is re-encoded: same tokenizer here, so the same scores
    config.reward_model.model.input_tokenizer = str(tiny_model_path)
    retokenizing = RewardModelWorker(config.reward_model)
    retokenizing.init_model()
    assert retokenizing.compute_rm_score(batch).tensors["rm_scores"].nonzero().shape[0] == len(batch)


def test_lora_checkpoint_holds_only_the_adapter_and_restores_it(tmp_path, config):
    config.actor_rollout_ref.model.lora_rank = 4
    config.actor_rollout_ref.actor.optim.lr = 1e-2
    actor, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(actor, tmp_path, config)
    actor.update_actor(batch)
    actor.save_checkpoint(tmp_path / "lora")
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists() and not (tmp_path / "lora" / "model.safetensors").exists()
    restored = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
    restored.init_model()
    restored.load_checkpoint(tmp_path / "lora")
    mask = batch.tensors["response_mask"].bool()
    assert torch.allclose(restored.compute_log_prob(batch).tensors["old_log_probs"][mask], actor.compute_log_prob(batch).tensors["old_log_probs"][mask], atol=1e-6)
