"""Every model family ppoflow is tested on (rl_core.models.families): a tiny random checkpoint of each, built in code,
loads through the user's pipeline, keeps packed rows apart in the padding-free forward, and trains two GRPO steps
with verl's defaults (at small sizes); LoRA and a critic on two of them; every advantage estimator with a policy loss,
each on one of the families. (The flow's own runs, tests/flows/test_train_flow.py, are estimator-agnostic: GRPO and GAE
with a critic run there.)"""

import copy
import itertools
import math

import pytest
import torch
import transformers

from flows.config import compose_config
from rl_core.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from rl_core.algos.kl import get_kl_controller
from rl_core.data.sampler import ResumableSampler
from rl_core.models.families import FAMILIES
from rl_core.models.loading import has_attention, load_policy_model
from rl_core.models.logprob import response_log_probs
from rl_core.models.packed_attention import PACKED_SDPA
from rl_core.models.tiny import make_tiny_model
from rl_core.ppo_step import StepWorkers, run_ppo_step
from rl_core.reward.manager import RewardManager
from rl_core.rollout import build_rollout_engine
from rl_core.workers import ActorRolloutRefWorker, CriticWorker
from tests.rl_core.helpers import addition_dataset, checkpoints_activations

CLASSES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    """A reward a random model's samples differ in (the task's own is 0 for all of them)."""
    return sum(c.isdigit() for c in solution_str) / (len(solution_str) + 1)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("families")
    return {family: make_tiny_model(folder / family, seed=0, family=family) for family in FAMILIES}


def step_inputs(config, tokenizer, folder):
    """What run_ppo_step takes besides the workers: 8 addition problems in order, the digit-share reward, the KL
    controller."""
    data = addition_dataset(folder, tokenizer, config.data, count=8)
    sampler = ResumableSampler(len(data), config.data.train_batch_size, shuffle=False)
    reward = RewardManager(tokenizer, digit_share, config.reward, config.data)
    return data, sampler, reward, get_kl_controller(config.algorithm.kl_ctrl)


def verl_config(model_path, *extra):
    """verl's defaults (no demo profile: a model path is given) at sizes a test can afford; gradient checkpointing on,
    verl's default (ppoflow's null would leave it off for models this small): each family's checkpointed update runs."""
    return compose_config(
        [
            f"actor_rollout_ref.model.path={model_path}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "critic.model.enable_gradient_checkpointing=true",
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=4",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "data.max_prompt_length=32",
            "data.max_response_length=8",
            "trainer.total_training_steps=2",
            *extra,
        ]
    )


def test_every_family_of_the_table_is_tested():
    assert set(CLASSES) == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_loads_and_its_padding_free_forward_equals_the_padded_one(family, family_models, tmp_path):
    config = verl_config(family_models[family])
    model, tokenizer = load_policy_model(config.actor_rollout_ref.model)
    assert type(model).__name__ == CLASSES[family] and checkpoints_activations(model)  # verl's default, set
    # SDPA (packed rows as padded batches) where the architecture has it (transformers 5.24 has none for Gemma 2)
    assert model.config._attn_implementation == (PACKED_SDPA if has_attention(type(model), "sdpa") else "eager")
    assert family != "gemma2" or transformers.__version__ < "5" or model.config._attn_implementation == "eager"
    prompts = addition_dataset(tmp_path, tokenizer, config.data, count=4).collate([0, 1, 2, 3]).repeat_interleave(2)
    engine_config = config.actor_rollout_ref.rollout
    sequences = build_rollout_engine(
        "hf", model=model, tokenizer=tokenizer, rollout_config=engine_config
    ).generate_sequences(prompts)
    args = [sequences.tensors[k] for k in ("input_ids", "attention_mask", "position_ids")] + [
        sequences.tensors["responses"].shape[1]
    ]
    mask = sequences.tensors["response_mask"].bool()
    with torch.no_grad():
        packed, _ = response_log_probs(model.eval(), *args, remove_padding=True)
        padded, _ = response_log_probs(model, *args, remove_padding=False)
    assert torch.allclose(packed[mask], padded[mask], atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_trains_two_grpo_steps_with_verls_defaults(family, family_models, tmp_path):
    config = verl_config(family_models[family])
    config.actor_rollout_ref.actor.optim.total_training_steps = 2
    actor = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout")
    notes = actor.init_model()
    assert all("padding-free" not in note for note in notes)
    data, sampler, reward, kl = step_inputs(config, actor.tokenizer, tmp_path)
    before = copy.deepcopy(actor.module.state_dict())
    for step in (1, 2):
        batch, metrics = run_ppo_step(config, StepWorkers(actor), data, sampler, reward, kl, step)
        assert len(batch) == 16 and torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
        # verl's default calculate_log_probs: the samples are on-policy
        assert metrics["training/rollout_probs_diff_max"] < 1e-3
    assert any(not torch.equal(v, before[k]) for k, v in actor.module.state_dict().items())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_lora_and_a_critic_train_on_a_family(family, family_models, tmp_path):
    """Llama's critic is LlamaForTokenClassification; Gemma 3 has no such class here, so its critic is the body with a
    value head, which trains whole under LoRA."""
    config = verl_config(
        family_models[family],
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.model.lora_rank=4",
        "critic.model.lora_rank=4",
    )
    for node in (config.actor_rollout_ref.actor.optim, config.critic.optim):
        node.total_training_steps = 1
    actor = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout")
    critic = CriticWorker(config.critic)
    actor.init_model(), critic.init_model()
    head = "value_head" if family == "gemma3" else "score"
    trainable_heads = [name for name, p in critic.module.named_parameters() if head in name and p.requires_grad]
    assert trainable_heads, f"the critic's {head} does not train"
    heads_before = {name: p.detach().clone() for name, p in critic.module.named_parameters() if name in trainable_heads}
    data, sampler, reward, kl = step_inputs(config, actor.tokenizer, tmp_path)
    _, metrics = run_ppo_step(config, StepWorkers(actor, critic), data, sampler, reward, kl, 1)
    assert metrics["critic/vf_loss"] > 0 and "actor/pg_loss" in metrics
    assert any(
        not torch.equal(p, heads_before[name]) for name, p in critic.module.named_parameters() if name in heads_before
    )
    # only the adapter trains
    assert not [n for n, p in actor.module.named_parameters() if p.requires_grad and "lora_" not in n]


POLICY_LOSS_FOR = dict(itertools.zip_longest(sorted(ADVANTAGE_ESTIMATORS), sorted(POLICY_LOSSES), fillvalue="vanilla"))
FAMILY_FOR = dict(zip(sorted(ADVANTAGE_ESTIMATORS), itertools.cycle(sorted(FAMILIES))))


def test_every_policy_loss_is_paired_with_an_estimator():
    assert set(POLICY_LOSS_FOR.values()) == set(POLICY_LOSSES)


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_every_estimator_and_policy_loss_trains_two_steps(estimator, family_models, tmp_path):
    """Each estimator with a policy loss, on a tiny random model of one of the families (verl's defaults), scored by
    the share of digits in a response (a random model's samples differ in it): finite losses, advantages that are
    not all zero, the critic trained with GAE only, the policy's weights changed."""
    config = verl_config(
        family_models[FAMILY_FOR[estimator]],
        f"algorithm.adv_estimator={estimator}",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={POLICY_LOSS_FOR[estimator]}",
    )
    actor = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout")
    critic = CriticWorker(config.critic) if estimator == "gae" else None
    for worker in (actor, critic):
        if worker is not None:
            worker.init_model()
    data, sampler, reward, kl = step_inputs(config, actor.tokenizer, tmp_path)
    before = copy.deepcopy(actor.module.state_dict())
    advantages = []
    for step in (1, 2):
        _, metrics = run_ppo_step(config, StepWorkers(actor, critic), data, sampler, reward, kl, step)
        assert math.isfinite(metrics["actor/pg_loss"])
        assert ("critic/vf_loss" in metrics) == (estimator == "gae")
        advantages.append(metrics["critic/advantages/max"] - metrics["critic/advantages/min"])
    assert any(spread != 0 for spread in advantages)  # the scores differ: something to learn from
    assert any(not torch.equal(v, before[k]) for k, v in actor.module.state_dict().items())
