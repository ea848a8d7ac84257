"""Workers on the tiny model in one process: a PPO step with a critic, a GRPO step, learning on a fixed batch,
LoRA references, checkpoints, the reward model."""

import copy
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rl_core.algos import POLICY_LOSSES, register_policy_loss
from rl_core.algos.aggregate import agg_loss
from rl_core.algos.kl import get_kl_controller
from rl_core.algos.masked import masked_mean
from rl_core.batch import Batch
from rl_core.data.sampler import ResumableSampler
from rl_core.metrics import rollout_probs_diff_metrics
from rl_core.models.loading import load_tokenizer
from rl_core.models.logprob import response_log_probs
from rl_core.ppo_step import StepWorkers, run_ppo_step, run_validation, use_critic, use_reference
from rl_core.reward.manager import RewardManager, build_reward_manager
from rl_core.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker, train_loop
from rl_core.workers.train_loop import NonFiniteError
from tests.rl_core.helpers import addition_dataset, assert_same_adam_step


def build_workers(config, with_critic):
    actor = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor_rollout_ref")
    actor.init_model()
    critic = None
    if with_critic:
        critic = CriticWorker(config.critic)
        critic.init_model()
    return actor, critic


def assert_finished_batch(
    batch, n_samples, response_length, masked_keys=("old_log_probs", "advantages", "returns", "token_level_rewards")
):
    mask = batch.tensors["response_mask"]
    assert mask.shape == (n_samples, response_length)
    for key in ("old_log_probs", "advantages", "returns", "token_level_rewards"):
        assert batch.tensors[key].shape == (n_samples, response_length), key
        assert torch.isfinite(batch.tensors[key]).all(), key
    for key in masked_keys:
        assert torch.all(batch.tensors[key][mask == 0] == 0), f"{key} is non-zero outside the response mask"
    assert (batch.tensors["old_log_probs"][mask.bool()] <= 0).all()


def step_inputs(tmp_path, actor, config, count=8):
    data = addition_dataset(tmp_path, actor.tokenizer, config.data, count=count)
    sampler = ResumableSampler(len(data), config.data.train_batch_size, shuffle=False)
    return data, sampler, build_reward_manager(config, actor.tokenizer), get_kl_controller(config.algorithm.kl_ctrl)


def test_one_ppo_step_with_a_critic(tmp_path, config):
    config.algorithm.adv_estimator = "gae"
    config.actor_rollout_ref.actor.use_kl_loss = False
    config.algorithm.use_kl_in_reward = True
    assert use_critic(config) and use_reference(config)
    actor, critic = build_workers(config, with_critic=True)
    data, sampler, reward, kl = step_inputs(tmp_path, actor, config)
    before = copy.deepcopy(actor.module.state_dict())
    batch, metrics = run_ppo_step(config, StepWorkers(actor, critic), data, sampler, reward, kl, step=1)
    # GAE: see advantage.py
    assert_finished_batch(
        batch, 16, config.data.max_response_length, masked_keys=("old_log_probs", "token_level_rewards")
    )
    assert batch.tensors["values"].shape == (16, config.data.max_response_length)
    # the step's metrics are the batch's numbers
    assert metrics["critic/score/mean"] == pytest.approx(batch.tensors["token_level_scores"].sum(-1).mean().item())
    kl_sum = (batch.tensors["token_level_scores"] - batch.tensors["token_level_rewards"]).sum(
        -1
    ) / config.algorithm.kl_ctrl.kl_coef
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(kl_sum.mean().item(), abs=1e-5)
    assert 0 <= metrics["actor/pg_clipfrac"] <= 1 and metrics["actor/grad_norm"] > 0 and metrics["critic/vf_loss"] > 0
    assert {"timing_s/gen", "timing_s/values", "timing_s/update_critic", "timing_s/update_actor"} <= set(metrics)
    changed = [k for k, v in actor.module.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "the actor update changed no weight"


def test_one_grpo_step(tmp_path, config):
    assert not use_critic(config) and use_reference(config)  # the default: grpo with a KL loss
    actor, _ = build_workers(config, with_critic=False)
    batch, metrics = run_ppo_step(config, StepWorkers(actor), *step_inputs(tmp_path, actor, config), step=1)
    assert_finished_batch(batch, 16, config.data.max_response_length)
    assert "values" not in batch and "critic/vf_loss" not in metrics and "timing_s/values" not in metrics
    assert metrics["actor/kl_loss"] >= 0  # low_var_kl is non-negative
    # the GRPO advantages of one prompt's group are centred (scores 0/1 within a group)
    for uid in set(batch.non_tensors["uid"]):
        rows = [i for i, u in enumerate(batch.non_tensors["uid"]) if u == uid]
        first_token = batch.tensors["advantages"][rows, 0]
        assert abs(first_token.sum().item()) < 1e-4


def test_remax_baseline_is_the_greedy_responses_score(tmp_path, config):
    config.algorithm.adv_estimator = "remax"
    actor, _ = build_workers(config, with_critic=False)
    data, sampler, reward, kl = step_inputs(tmp_path, actor, config)
    batch, _ = run_ppo_step(config, StepWorkers(actor), data, sampler, reward, kl, step=1)
    # independently: greedy decoding of the same prompts, scored
    prompts = data.collate(list(range(config.data.train_batch_size)))
    prompts.meta_info.update(global_step=1000, greedy=True)
    greedy = actor.generate_sequences(prompts)
    expected = reward(greedy).token_level_scores.sum(-1).repeat_interleave(config.actor_rollout_ref.rollout.n)
    assert torch.equal(batch.tensors["reward_baselines"], expected)
    scores = batch.tensors["token_level_scores"].sum(-1)
    first = batch.tensors["response_mask"].argmax(-1) * 0  # ReMax: advantage = score - baseline on every valid token
    assert torch.allclose(batch.tensors["advantages"][torch.arange(len(batch)), first], scores - expected)


def test_dynamic_sampling_keeps_groups_with_differing_scores_only(tmp_path, config):
    config.algorithm.filter_groups.enable = True
    config.algorithm.filter_groups.metric = "seq_reward"
    config.algorithm.filter_groups.max_num_gen_batches = 20
    config.data.train_batch_size = 2
    config.actor_rollout_ref.actor.ppo_mini_batch_size = 2
    actor, _ = build_workers(config, with_critic=False)
    data, sampler, _, kl = step_inputs(tmp_path, actor, config, count=16)
    # the untrained tiny model never adds correctly: score the parity of the response's characters instead
    reward = RewardManager(
        actor.tokenizer,
        lambda data_source, solution_str, ground_truth, extra_info: float(sum(map(ord, solution_str)) % 2),
    )
    batch, metrics = run_ppo_step(config, StepWorkers(actor), data, sampler, reward, kl, step=1)
    assert len(batch) == 2 * config.actor_rollout_ref.rollout.n
    scores = batch.tensors["token_level_scores"].sum(-1).tolist()
    for uid in set(batch.non_tensors["uid"]):
        assert len({scores[i] for i, u in enumerate(batch.non_tensors["uid"]) if u == uid}) > 1, uid
    assert metrics["train/num_gen_batches"] == sampler.batch_in_epoch  # one sampler batch per generation batch


def test_validation_scores_with_the_reward_model_when_enabled(tmp_path, config, tiny_model_path):
    rm_path = tiny_reward_model(tmp_path, tiny_model_path)
    config.reward_model.enable = True
    config.reward_model.model.path = str(rm_path)
    actor, _ = build_workers(config, with_critic=False)
    rm = RewardModelWorker(config.reward_model)
    rm.init_model()
    data, _, reward, _ = step_inputs(tmp_path, actor, config, count=4)
    metrics = run_validation(config, StepWorkers(actor, reward_model=rm), data, reward)
    prompts = data.collate(list(range(4)))
    prompts.meta_info.update(validate=True, global_step=0)
    rm_scores = rm.compute_rm_score(actor.generate_sequences(prompts)).tensors["rm_scores"].sum(-1)
    assert metrics["val-core/ppoflow/addition/acc/mean@1"] == pytest.approx(rm_scores.mean().item(), abs=1e-6)
    assert rm_scores.abs().sum() > 0


def fixed_batch(actor, tmp_path, config):
    prompts = addition_dataset(tmp_path, actor.tokenizer, config.data, count=8).collate(list(range(4)), "fix-")
    prompts.meta_info["global_step"] = 1
    batch = actor.generate_sequences(prompts.repeat_interleave(config.actor_rollout_ref.rollout.n))
    batch.union(Batch(actor.compute_log_prob(batch).tensors))
    batch.union(Batch(actor.compute_ref_log_prob(batch).tensors))
    generator = torch.Generator().manual_seed(0)
    batch.tensors["advantages"] = torch.randn(len(batch), 1, generator=generator) * batch.tensors["response_mask"]
    return batch


def test_repeated_updates_on_a_fixed_batch_lower_the_loss(tmp_path, config):
    config.actor_rollout_ref.actor.optim.lr = 1e-3
    # no clipping plateau
    config.actor_rollout_ref.actor.clip_ratio_high = config.actor_rollout_ref.actor.clip_ratio_low = 10.0
    actor, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(actor, tmp_path, config)
    losses = [actor.update_actor(batch)["actor/pg_loss"] for _ in range(8)]
    assert losses[-1] < losses[0] - 0.05, losses

    config.algorithm.adv_estimator = "gae"
    critic = CriticWorker(config.critic)
    critic.init_model()
    batch.union(Batch(critic.compute_values(batch).tensors))
    batch.tensors["returns"] = torch.ones_like(batch.tensors["values"]) * batch.tensors["response_mask"]
    config.critic.cliprange_value = 100.0
    vf_losses = [critic.update_critic(batch)["critic/vf_loss"] for _ in range(8)]
    assert vf_losses[-1] < vf_losses[0] * 0.5, vf_losses


@pytest.mark.parametrize("loss_mode", sorted(POLICY_LOSSES))
def test_micro_batch_size_does_not_change_the_update(tmp_path, config, loss_mode):
    """Every registered policy loss gives the same update (loss and weights) whatever the micro-batch size: the
    micro-batch size is a memory knob. (clip_cov and kl_cov choose their tokens within each micro-batch, as verl does:
    their choice is switched off here, so that what is compared is the losses' scale.)"""
    config.actor_rollout_ref.actor.use_kl_loss = True
    config.actor_rollout_ref.actor.policy_loss.loss_mode = loss_mode
    config.actor_rollout_ref.actor.policy_loss.clip_cov_lb = 1e9  # no token is a clip_cov candidate
    config.actor_rollout_ref.actor.policy_loss.ppo_kl_coef = 0.0  # kl_cov's chosen tokens get no penalty
    actor, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(actor, tmp_path, config)
    start = copy.deepcopy(actor.module.state_dict())
    results = []
    for micro in (1, 3, 16):
        config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = micro
        fresh = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
        fresh.init_model()
        fresh.module.load_state_dict(start)
        metrics = fresh.update_actor(batch)
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
    after_one = actor.update_actor(batch)
    restored = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
    restored.init_model()
    restored.load_checkpoint(tmp_path / "ckpt" / "actor")
    assert restored.steps_trained == 1
    again = restored.update_actor(batch)
    assert again["actor/pg_loss"] == pytest.approx(after_one["actor/pg_loss"], abs=1e-6)
    assert again["actor/grad_norm"] == pytest.approx(after_one["actor/grad_norm"], rel=1e-5)


def test_nan_loss_stops_the_update_without_touching_the_weights(tmp_path, config):
    actor, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(actor, tmp_path, config)
    batch.tensors["advantages"][0, 0] = float("nan")
    before = copy.deepcopy(actor.module.state_dict())
    with pytest.raises(
        NonFiniteError,
        match=r"actor update: the loss is nan .*after 0 optimizer step\(s\).*resuming restarts from the last "
        r"checkpoint",
    ):
        actor.update_actor(batch)
    assert all(torch.equal(v, before[k]) for k, v in actor.module.state_dict().items())


def test_a_non_finite_gradient_norm_skips_that_optimizer_step_as_verl_does(tmp_path, config, monkeypatch):
    actor, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(actor, tmp_path, config)  # 16 rows in 2 mini-batches of 8
    norms = iter([float("inf"), 0.5])
    monkeypatch.setattr(train_loop, "clip_grad_norm", lambda parameters, max_norm: next(norms))
    before = copy.deepcopy(actor.module.state_dict())
    metrics = actor.update_actor(batch)
    assert metrics["actor/skipped_steps"] == 1.0 and metrics["actor/grad_norm"] == 0.5
    assert any(not torch.equal(v, before[k]) for k, v in actor.module.state_dict().items())  # the second step was taken


def test_a_verl_legacy_loss_that_ignores_the_global_batch_info_is_scaled_to_the_mini_batch(tmp_path, config):
    """A loss written for verl's legacy path returns a micro-batch mean; the worker says so at load and weighs it by the
    micro-batch's share, so that the update does not depend on the micro-batch size."""

    @register_policy_loss("legacy_mean_pg")
    def legacy(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        return agg_loss(-advantages * torch.exp(log_prob - old_log_prob), response_mask, "token-mean"), {}

    try:
        config.actor_rollout_ref.actor.policy_loss.loss_mode = "legacy_mean_pg"
        config.actor_rollout_ref.actor.ppo_mini_batch_size = config.data.train_batch_size
        actor, _ = build_workers(config, with_critic=False)
        batch = fixed_batch(actor, tmp_path, config)
        start = copy.deepcopy(actor.module.state_dict())
        updates = []
        for micro in (2, 16):
            config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = micro
            fresh = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
            notes = fresh.init_model()
            fresh.module.load_state_dict(start)
            fresh.update_actor(batch)
            updates.append(torch.cat([p.flatten() for p in fresh.module.parameters()]))
        assert any("'legacy_mean_pg' does not read config.global_batch_info" in note for note in notes)
        assert torch.allclose(updates[0], updates[1], atol=2e-5)
    finally:
        POLICY_LOSSES.pop("legacy_mean_pg")


def test_the_critic_has_no_dropout(config):
    """A token-classification head defaults to dropout 0.1 when the config names no classifier_dropout."""
    critic = CriticWorker(config.critic)
    critic.init_model()
    assert [m.p for m in critic.module.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0] == []


def test_role_checks(config):
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="ref")
    with pytest.raises(RuntimeError, match="update_actor needs the 'actor' role"):
        worker.update_actor(Batch())
    with pytest.raises(ValueError, match="role='critic'"):
        ActorRolloutRefWorker(config.actor_rollout_ref, role="critic")


def tiny_reward_model(tmp_path, tiny_model_path):
    """A sequence-classification head on the tiny model, saved with the policy's tokenizer."""
    rm_path = tmp_path / "rm"
    if not rm_path.exists():
        torch.manual_seed(1)
        AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1).save_pretrained(rm_path)
        load_tokenizer(str(tiny_model_path)).save_pretrained(rm_path)
    return rm_path


def test_reward_model_scores_the_last_response_token(tmp_path, config, tiny_model_path):
    rm_path = tiny_reward_model(tmp_path, tiny_model_path)
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
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
    # independent check of every row: the classifier's output on the unpadded sequence
    for row in range(len(batch)):
        ids = batch.tensors["input_ids"][row][batch.tensors["attention_mask"][row].bool()].unsqueeze(0)
        with torch.no_grad():
            expected = model(input_ids=ids).logits[0, 0]
        assert scores[row, lengths[row] - 1].item() == pytest.approx(expected.item(), abs=1e-4)
    # with a separate input tokenizer, prompt + response are decoded and re-encoded with the RM's chat template
    config.reward_model.model.input_tokenizer = str(tiny_model_path)
    retokenizing = RewardModelWorker(config.reward_model)
    retokenizing.init_model()
    rescored = retokenizing.compute_rm_score(batch).tensors["rm_scores"]
    tokenizer = retokenizing.tokenizer
    for row in range(len(batch)):
        response = tokenizer.decode(batch.tensors["responses"][row, : lengths[row]], skip_special_tokens=True)
        messages = list(batch.non_tensors["raw_prompt"][row]) + [{"role": "assistant", "content": response}]
        ids = tokenizer(
            tokenizer.apply_chat_template(messages, tokenize=False), return_tensors="pt", add_special_tokens=False
        )["input_ids"]
        with torch.no_grad():
            expected = model(input_ids=ids).logits[0, 0]
        assert rescored[row, lengths[row] - 1].item() == pytest.approx(expected.item(), abs=1e-4)


def test_lora_checkpoint_holds_only_the_adapter_and_restores_it(tmp_path, config):
    config.actor_rollout_ref.model.lora_rank = 4
    config.actor_rollout_ref.actor.optim.lr = 1e-2
    actor, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(actor, tmp_path, config)
    actor.update_actor(batch)
    actor.save_checkpoint(tmp_path / "lora")
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists() and not (
        tmp_path / "lora" / "model.safetensors"
    ).exists()
    restored = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
    restored.init_model()
    restored.load_checkpoint(tmp_path / "lora")
    mask = batch.tensors["response_mask"].bool()
    assert torch.allclose(
        restored.compute_log_prob(batch).tensors["old_log_probs"][mask],
        actor.compute_log_prob(batch).tensors["old_log_probs"][mask],
        atol=1e-6,
    )


def test_reusing_the_updates_log_probs_as_old_gives_the_same_update(tmp_path, config):
    """One epoch, one mini-batch: old log-probs from a separate pass or from the update's own forward, detached, are
    the same numbers, so the update is the same (one forward pass less), and so are the pass's metrics (the entropy,
    the sampler's probabilities against the policy's)."""
    config.actor_rollout_ref.actor.ppo_mini_batch_size = config.data.train_batch_size
    # clipping would show a difference
    config.actor_rollout_ref.actor.clip_ratio_low = config.actor_rollout_ref.actor.clip_ratio_high = 1e-3
    reference, _ = build_workers(config, with_critic=False)
    batch = fixed_batch(reference, tmp_path, config)
    mask = batch.tensors["response_mask"]
    noise = 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    batch.tensors["rollout_log_probs"] = (batch.tensors["old_log_probs"] + noise).clamp(max=0.0) * mask  # a sampler's
    probs_diff = rollout_probs_diff_metrics(batch.tensors["rollout_log_probs"], batch.tensors["old_log_probs"], mask)
    start = copy.deepcopy(reference.module.state_dict())
    entropy = float(masked_mean(reference.compute_log_prob(batch).tensors["entropys"], batch.tensors["response_mask"]))
    recomputed = reference.update_actor(batch)
    config.actor_rollout_ref.actor.recompute_old_log_prob = False
    reusing = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
    reusing.init_model()
    reusing.module.load_state_dict(start)
    reused = reusing.update_actor(Batch({k: v for k, v in batch.tensors.items() if k != "old_log_probs"}))
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/grad_norm"):
        assert reused[key] == pytest.approx(recomputed[key], abs=1e-6), key
    assert reused["actor/entropy"] == pytest.approx(entropy, rel=1e-5)
    # the old-log-prob stage's check of the sampler, from the update's own pass
    assert probs_diff["training/rollout_probs_diff_mean"] > 1e-4
    for key, value in probs_diff.items():
        assert reused[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert_same_adam_step(
        reusing.module.state_dict(), reference.module.state_dict(), config.actor_rollout_ref.actor.optim.lr
    )


def test_a_step_without_the_old_log_prob_pass(tmp_path, config):
    config.actor_rollout_ref.actor.ppo_mini_batch_size = config.data.train_batch_size
    config.actor_rollout_ref.actor.recompute_old_log_prob = False
    actor, _ = build_workers(config, with_critic=False)
    batch, metrics = run_ppo_step(config, StepWorkers(actor), *step_inputs(tmp_path, actor, config), step=1)
    assert "timing_s/old_log_prob" not in metrics and "old_log_probs" not in batch
    assert metrics["actor/entropy"] > 0 and metrics["actor/pg_clipfrac"] == 0.0  # on-policy: the ratio is exactly 1


def test_a_checkpoints_dropout_is_off_so_the_first_ratio_is_exactly_one(tmp_path, config, tiny_model_path):
    """A checkpoint whose config sets attention dropout 0.5: loaded with dropout off (and said so), the update's own
    forward pass gives the old log-probs exactly: no clipping, no KL on the first mini-batch."""
    folder = tmp_path / "dropout"
    shutil.copytree(tiny_model_path, folder)
    hf_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf_config, "attention_dropout": 0.5}))
    config.actor_rollout_ref.model.path = str(folder)
    # one mini-batch: one step from the old policy
    config.actor_rollout_ref.actor.ppo_mini_batch_size = config.data.train_batch_size
    actor = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
    notes = actor.init_model()
    assert any("dropout turned off for RL (attention_dropout=0.5 -> 0)" in note for note in notes)
    metrics = actor.update_actor(fixed_batch(actor, tmp_path, config))
    # with dropout 0.5: ~0.1 and more
    assert abs(metrics["actor/ppo_kl"]) < 1e-6 and metrics["actor/pg_clipfrac"] == 0.0
    config.actor_rollout_ref.model.override_config = {"attention_dropout": 0.5}  # asked for: kept
    kept = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
    kept.init_model()
    assert kept.module.config.attention_dropout == 0.5


def test_a_model_whose_packed_rows_attend_to_each_other_falls_back_to_padded_batches(tmp_path, config, monkeypatch):
    """Attention that ignores transformers' packed-sequence detection (remote code, a custom kernel; here transformers'
    own SDPA, not ppoflow's packed one, with the detection turned off): the check at load finds it, says so, and the
    worker uses padded batches, whose log-probs are right."""
    import transformers.masking_utils

    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda *args, **kwargs: None)
    config.actor_rollout_ref.model.override_config = {"attn_implementation": "sdpa"}
    actor = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
    notes = actor.init_model()
    assert not actor.remove_padding and any(
        "padding-free forward of Qwen2ForCausalLM disagrees" in note for note in notes
    )
    batch = fixed_batch(actor, tmp_path, config)
    with torch.no_grad():
        padded, _ = response_log_probs(
            actor.module,
            *[batch.tensors[k] for k in ("input_ids", "attention_mask", "position_ids")],
            batch.tensors["responses"].shape[1],
            remove_padding=False,
        )
    mask = batch.tensors["response_mask"].bool()
    assert torch.allclose(batch.tensors["old_log_probs"][mask], padded[mask], atol=1e-6)


def test_row_by_row_attention_keeps_packed_rows_apart_without_transformers_detection(config, monkeypatch):
    """ppoflow's packed attention (the default where SDPA would be) cuts rows by their position ids itself: with
    transformers' packed-sequence detection off, the check at load still finds the padding-free forward right."""
    import transformers.masking_utils

    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda *args, **kwargs: None)
    actor = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout_ref")
    actor.init_model()
    assert actor.remove_padding
