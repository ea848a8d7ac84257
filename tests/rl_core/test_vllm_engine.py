"""The vllm rollout engine without vLLM (it is not installed in the test environment): the weight hand-over (names, LoRA
merge, dtype), the config translation, the output layout from vLLM-shaped results, the order of the engine's calls to
a recording stand-in for vLLM (said so in each test that uses one), and the clear errors where vLLM or a GPU is
missing."""

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rl_core.batch import Batch
from rl_core.config import ModelConfig
from rl_core.input_checks import device_problems
from rl_core.models.loading import load_policy_model
from rl_core.models.lora import apply_lora
from rl_core.rollout import build_rollout_engine
from rl_core.rollout.base import SamplingParams, assemble_samples, prompt_contexts, row_seed
from rl_core.rollout.vllm import engine as vllm_engine_module
from rl_core.rollout.vllm.engine import VLLMNotAvailableError, VLLMRolloutEngine
from rl_core.rollout.vllm.settings import engine_arguments, sampling_arguments, tensor_parallel_slice
from rl_core.rollout.vllm.weights import checkpoint_name, inference_weights
from tests.rl_core.helpers import addition_dataset


def test_lora_actor_weights_arrive_as_a_merged_hf_checkpoint(tiny_model_path):
    """What vLLM's load_weights gets is a plain HF state dict: loaded into a fresh HF model (as vLLM would load it), it
    computes exactly what the LoRA actor computes."""
    config = ModelConfig(path=str(tiny_model_path), lora_rank=4)
    actor = apply_lora(load_policy_model(config)[0], config)
    for name, parameter in actor.named_parameters():
        if "lora_B" in name:  # a fresh adapter's B is zero: give it weight so that the merge matters
            parameter.data.normal_(std=0.5)
    plain, _ = load_policy_model(ModelConfig(path=str(tiny_model_path)))
    weights = dict(inference_weights(actor))
    # a tied lm_head is the embedding (vLLM ties it too)
    assert set(weights) == {name for name, _ in plain.named_parameters()}
    missing, unexpected = plain.load_state_dict(weights, strict=False)
    assert (
        missing == ["lm_head.weight"] and unexpected == [] and plain.lm_head.weight is plain.model.embed_tokens.weight
    )
    ids = torch.tensor([[3, 10, 11, 12, 4]])
    assert torch.allclose(plain(ids).logits, actor(ids).logits, atol=1e-5)
    assert not torch.allclose(
        plain(ids).logits, load_policy_model(ModelConfig(path=str(tiny_model_path)))[0](ids).logits, atol=1e-3
    )
    assert all(t.dtype == torch.bfloat16 for _, t in inference_weights(actor, torch.bfloat16))


def test_checkpoint_names():
    assert (
        checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert checkpoint_name("model.norm.weight") == "model.norm.weight"


def test_engine_arguments_follow_the_config(config):
    rollout, model = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    arguments = engine_arguments(rollout, model, torch.bfloat16)
    assert arguments["dtype"] == "bfloat16" and arguments["load_format"] == "dummy"
    assert arguments["max_model_len"] == config.data.max_prompt_length + config.data.max_response_length
    assert arguments["enable_sleep_mode"] is True and arguments["distributed_executor_backend"] == "uni"
    assert (
        arguments["gpu_memory_utilization"] == rollout.gpu_memory_utilization
        and arguments["trust_remote_code"] is False
    )
    assert "hf_overrides" not in arguments
    rollout.tensor_model_parallel_size, rollout.max_model_len, rollout.free_cache_engine = 2, 99, False
    model.override_config = {"rope_theta": 5000.0}
    arguments = engine_arguments(rollout, model, torch.float16)
    assert (arguments["tensor_parallel_size"], arguments["distributed_executor_backend"]) == (2, "external_launcher")
    assert (
        arguments["max_model_len"] == 99 and arguments["enable_sleep_mode"] is False and arguments["dtype"] == "float16"
    )
    assert arguments["hf_overrides"] == {"rope_theta": 5000.0}


def test_sampling_arguments():
    sample = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, top_k=-1)
    arguments = sampling_arguments(sample, 16, [2, 7], calculate_log_probs=True, seed=5)
    assert (
        arguments["n"] == 1
        and arguments["temperature"] == 0.7
        and arguments["top_k"] == 0
        and arguments["logprobs"] == 0
    )
    assert arguments["max_tokens"] == 16 and arguments["stop_token_ids"] == [2, 7] and arguments["seed"] == 5
    greedy = sampling_arguments(SamplingParams(do_sample=False, temperature=1.0, top_p=1.0, top_k=5), 16, [2], False, 0)
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 0 and greedy["logprobs"] is None


def test_tensor_parallel_slice_returns_each_ranks_own_rows():
    assert [tensor_parallel_slice([3, 2, 4], r) for r in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 9)]


def test_outputs_become_token_samples_in_verls_layout():
    """vLLM's RequestOutput objects are stood in for by namespaces with the same fields (vLLM is not installed)."""
    engine = object.__new__(VLLMRolloutEngine)
    engine.response_length, engine.pad_token_id, engine.stop_token_ids = 4, 0, [9]
    engine.config = OmegaConf.create({"calculate_log_probs": True})
    engine.vllm = SimpleNamespace(SamplingParams=dict)
    prompts = Batch(
        {
            "input_ids": torch.tensor([[0, 5, 6], [7, 8, 6]]),
            "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
            "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]]),
        },
        {"uid": ["a", "b"]},
    )

    def completion(tokens):
        return SimpleNamespace(token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=-0.1 * t)} for t in tokens])

    requests = []
    outputs = [SimpleNamespace(outputs=[completion([2, 3, 4, 5])]), SimpleNamespace(outputs=[completion([4, 9, 3])])]
    engine.llm = SimpleNamespace(generate=lambda reqs, params, use_tqdm: requests.extend(zip(reqs, params)) or outputs)
    samples = engine.generate_tokens(prompt_contexts(prompts), [4, 4], SamplingParams(True, 0.7, 1.0, -1), seed=5)
    assert [request["prompt_token_ids"] for request, _ in requests] == [[5, 6], [7, 8, 6]]  # no left padding
    assert [params["seed"] for _, params in requests] == [row_seed(5, 0), row_seed(5, 1)]
    assert [(s.token_ids, s.finish_reason) for s in samples] == [([2, 3, 4, 5], "length"), ([4, 9], "stop")]
    out = assemble_samples(prompts, samples, engine.response_length, engine.pad_token_id)
    assert out.non_tensors["uid"].tolist() == ["a", "b"]
    assert out.tensors["responses"].tolist() == [[2, 3, 4, 5], [4, 9, 0, 0]]
    assert out.tensors["response_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert torch.allclose(out.tensors["rollout_log_probs"][0], torch.tensor([-0.2, -0.3, -0.4, -0.5]))
    assert out.tensors["rollout_log_probs"][1].tolist()[2:] == [0.0, 0.0]  # nothing after the stop token
    assert out.tensors["position_ids"][0].tolist() == [0, 0, 1, 2, 3, 4, 5]


class RecordingLLM:
    """A stand-in for ``vllm.LLM`` (vLLM is not installed here) that records the engine's calls in order and answers
    ``generate`` with one completion per request: [the seed's last digit + 3, the stop token]."""

    calls: list = []

    def __init__(self, **arguments):
        RecordingLLM.calls = [("LLM", arguments["generation_config"], arguments["load_format"])]

    def collective_rpc(self, method, args=()):
        RecordingLLM.calls.append((method, len(list(args[0]))))

    def sleep(self, level):
        RecordingLLM.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        RecordingLLM.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        RecordingLLM.calls.append(("reset_prefix_cache",))

    def generate(self, requests, params, use_tqdm=False):
        RecordingLLM.calls.append(
            ("generate", len(requests), tuple(p.n for p in params), tuple(p.seed for p in params))
        )
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=[p.seed % 10 + 3, 2], logprobs=None)]) for p in params
        ]


@pytest.fixture()
def recording_vllm(monkeypatch):
    platforms = SimpleNamespace(current_platform=SimpleNamespace(is_cpu=lambda: False))  # vLLM's GPU build
    stand_in = SimpleNamespace(LLM=RecordingLLM, SamplingParams=SimpleNamespace, platforms=platforms)
    monkeypatch.setitem(sys.modules, "vllm", stand_in)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    return RecordingLLM


def vllm_engine(config, free_cache_engine):
    model, tokenizer = load_policy_model(config.actor_rollout_ref.model)
    config.actor_rollout_ref.rollout.free_cache_engine = free_cache_engine
    engine = VLLMRolloutEngine(
        model, tokenizer, config.actor_rollout_ref.rollout, config.actor_rollout_ref.model, torch.float32
    )
    return engine, tokenizer


def test_a_sleeping_engine_wakes_loads_the_weights_and_sleeps_again_around_each_rollout(
    config, recording_vllm, tmp_path
):
    engine, tokenizer = vllm_engine(config, free_cache_engine=True)
    assert recording_vllm.calls[0] == ("LLM", "vllm", "dummy")  # vLLM's own sampling defaults, never the checkpoint's
    assert [c[0] for c in recording_vllm.calls[1:]] == ["load_actor_weights", "sleep"]
    prompts = addition_dataset(tmp_path, tokenizer, config.data, count=3).collate([0, 1, 2]).repeat_interleave(2)
    prompts.meta_info["global_step"] = 1
    del recording_vllm.calls[:]
    engine.generate_sequences(prompts)
    assert [c[:2] for c in recording_vllm.calls] == [
        ("wake_up", ("weights",)),
        ("load_actor_weights", len(list(engine.model.parameters()))),
        ("wake_up", ("kv_cache",)),
        ("generate", 6),
        ("sleep", 2),
    ]


def test_an_awake_engine_reloads_changed_weights_and_drops_its_prefix_cache_before_generating(
    config, recording_vllm, tmp_path
):
    """With free_cache_engine=false the engine keeps its KV cache between rollouts: after new weights, the cached prefix
    blocks were computed with the old ones and must go (prompts shared across steps and GRPO groups hit them)."""
    engine, tokenizer = vllm_engine(config, free_cache_engine=False)
    prompts = addition_dataset(tmp_path, tokenizer, config.data, count=3).collate([0, 1, 2]).repeat_interleave(2)
    for step in (1, 1, 2):
        prompts.meta_info["global_step"] = step
        engine.generate_sequences(prompts)
    names = [c[0] for c in recording_vllm.calls[1:]]
    assert names == [
        "load_actor_weights",
        "load_actor_weights",
        "reset_prefix_cache",
        "generate",
        "generate",
        "load_actor_weights",
        "reset_prefix_cache",
        "generate",
    ]


def test_each_row_is_one_request_with_a_seed_of_its_own(config, recording_vllm, tmp_path, monkeypatch):
    """Prompts come repeated n times: each row is a request for one sample; seeds differ across rows, ranks and steps
    (vLLM gives the j-th of n samples of a request seed + j, so seeds one apart used to collide)."""
    engine, tokenizer = vllm_engine(config, free_cache_engine=True)
    prompts = addition_dataset(tmp_path, tokenizer, config.data, count=4).collate([0, 1, 2, 3]).repeat_interleave(4)
    seeds = []
    for rank in (0, 1):
        monkeypatch.setattr(vllm_engine_module, "data_parallel_rank", lambda rank=rank: rank)
        for step in (1, 2):
            prompts.meta_info["global_step"] = step
            out = engine.generate_sequences(prompts)
            ((_, count, ns, step_seeds),) = [c for c in recording_vllm.calls if c[0] == "generate"][-1:]
            assert count == len(out) == 16 and set(ns) == {1}
            seeds += step_seeds
    assert len(set(seeds)) == len(seeds) == 64


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_without_a_gpu_or_vllm_is_a_clear_error(config):
    model, tokenizer = load_policy_model(config.actor_rollout_ref.model)
    with pytest.raises(VLLMNotAvailableError, match="needs vLLM in the workers' environment.*rollout.name=hf"):
        build_rollout_engine(
            "vllm",
            model=model,
            tokenizer=tokenizer,
            rollout_config=config.actor_rollout_ref.rollout,
            model_config=config.actor_rollout_ref.model,
            compute_dtype=torch.bfloat16,
        )
    config.actor_rollout_ref.rollout.name = "vllm"
    (problem,) = device_problems(config)
    assert "rollout.name=vllm but vLLM is not installed" in problem
