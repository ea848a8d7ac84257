"""The vllm rollout engine without vLLM (it cannot be installed here: no GPU, and its wheel pins another torch):
the weight hand-over (names, LoRA merge, dtype), the config translation, the output layout from vLLM-shaped
results, and the clear errors where vLLM or a GPU is missing. vLLM itself is stood in for only in the layout test."""

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
from rl_core.rollout.vllm.engine import VLLMNotAvailableError, VLLMRolloutEngine
from rl_core.rollout.vllm.settings import engine_arguments, sampling_arguments, tensor_parallel_slice
from rl_core.rollout.vllm.weights import checkpoint_name, inference_weights


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
    assert set(weights) == set(plain.state_dict())
    plain.load_state_dict(weights)
    ids = torch.tensor([[3, 10, 11, 12, 4]])
    assert torch.allclose(plain(ids).logits, actor(ids).logits, atol=1e-5)
    assert not torch.allclose(plain(ids).logits, load_policy_model(ModelConfig(path=str(tiny_model_path)))[0](ids).logits, atol=1e-3)
    assert all(t.dtype == torch.bfloat16 for _, t in inference_weights(actor, torch.bfloat16))


def test_checkpoint_names():
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert checkpoint_name("model.norm.weight") == "model.norm.weight"


def test_engine_arguments_follow_the_config(config):
    rollout, model = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    arguments = engine_arguments(rollout, model, torch.bfloat16)
    assert arguments["dtype"] == "bfloat16" and arguments["load_format"] == "dummy"
    assert arguments["max_model_len"] == config.data.max_prompt_length + config.data.max_response_length
    assert arguments["enable_sleep_mode"] is True and arguments["distributed_executor_backend"] == "uni"
    assert arguments["gpu_memory_utilization"] == rollout.gpu_memory_utilization and arguments["trust_remote_code"] is False
    assert "hf_overrides" not in arguments
    rollout.tensor_model_parallel_size, rollout.max_model_len, rollout.free_cache_engine = 2, 99, False
    model.override_config = {"rope_theta": 5000.0}
    arguments = engine_arguments(rollout, model, torch.float16)
    assert (arguments["tensor_parallel_size"], arguments["distributed_executor_backend"]) == (2, "external_launcher")
    assert arguments["max_model_len"] == 99 and arguments["enable_sleep_mode"] is False and arguments["dtype"] == "float16"
    assert arguments["hf_overrides"] == {"rope_theta": 5000.0}


def test_sampling_arguments():
    sample = {"n": 4, "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": -1}
    arguments = sampling_arguments(sample, 16, [2, 7], calculate_log_probs=True, seed=5)
    assert arguments["n"] == 4 and arguments["temperature"] == 0.7 and arguments["top_k"] == 0 and arguments["logprobs"] == 0
    assert arguments["max_tokens"] == 16 and arguments["stop_token_ids"] == [2, 7] and arguments["seed"] == 5
    greedy = sampling_arguments({**sample, "n": 1, "do_sample": False, "top_k": 5}, 16, [2], False, 0)
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 0 and greedy["logprobs"] is None


def test_tensor_parallel_slice_returns_each_ranks_own_rows():
    assert [tensor_parallel_slice([3, 2, 4], r) for r in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 9)]


def test_outputs_take_verls_layout():
    """vLLM's RequestOutput objects are stood in for by namespaces with the same fields (vLLM is not installed)."""
    engine = object.__new__(VLLMRolloutEngine)
    engine.response_length, engine.pad_token_id, engine.stop_token_ids = 4, 0, [9]
    engine.config = OmegaConf.create({"calculate_log_probs": True})
    prompts = Batch({"input_ids": torch.tensor([[0, 5, 6], [7, 8, 6]]), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
                     "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]])}, {"uid": ["a", "b"]})

    def completion(tokens):
        return SimpleNamespace(token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=-0.1 * t)} for t in tokens])

    outputs = [SimpleNamespace(outputs=[completion([1, 9]), completion([2, 3, 4, 5])]),
               SimpleNamespace(outputs=[completion([9]), completion([4, 9, 3])])]
    out = engine._to_batch(prompts, outputs, n=2, temperature=0.7)
    assert out.non_tensors["uid"].tolist() == ["a", "a", "b", "b"]
    assert out.tensors["responses"].tolist() == [[1, 9, 0, 0], [2, 3, 4, 5], [9, 0, 0, 0], [4, 9, 0, 0]]
    assert out.tensors["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert torch.allclose(out.tensors["rollout_log_probs"][1], torch.tensor([-0.2, -0.3, -0.4, -0.5]))
    assert out.tensors["rollout_log_probs"][3].tolist()[2:] == [0.0, 0.0]  # nothing after the stop token
    assert out.tensors["position_ids"][0].tolist() == [0, 0, 1, 2, 3, 4, 5] and out.meta_info["temperature"] == 0.7


def test_vllm_without_a_gpu_or_vllm_is_a_clear_error(config):
    model, tokenizer = load_policy_model(config.actor_rollout_ref.model)
    with pytest.raises(VLLMNotAvailableError, match="runs on CUDA GPUs only.*rollout.name=hf"):
        build_rollout_engine("vllm", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout,
                             model_config=config.actor_rollout_ref.model, compute_dtype=torch.bfloat16)
    config.actor_rollout_ref.rollout.name = "vllm"
    (problem,) = device_problems(config)
    assert "rollout.name=vllm" in problem and ("not installed" in problem or "CUDA GPUs only" in problem)
