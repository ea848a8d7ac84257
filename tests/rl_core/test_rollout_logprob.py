"""HF rollout engine and response log-probs on the tiny model: masks, sampling settings, padding-free parity."""

import pytest
import torch

from rl_core.config import ModelConfig
from rl_core.models.loading import load_policy_model
from rl_core.models.logprob import response_log_probs, response_values
from rl_core.models.value_head import load_critic_model
from rl_core.rollout import build_rollout_engine
from rl_core.rollout.base import response_mask_until_stop
from tests.rl_core.helpers import addition_dataset


@pytest.fixture()
def policy(config):
    return load_policy_model(config.actor_rollout_ref.model)


@pytest.fixture()
def prompts(tmp_path, policy, config):
    dataset = addition_dataset(tmp_path, policy[1], config.data, count=6)
    return dataset.collate(list(range(6)), uid_prefix="s0-")


def test_response_mask_keeps_the_first_stop_token_and_nothing_after():
    responses = torch.tensor([[5, 6, 2, 7, 2], [2, 5, 5, 5, 5], [5, 5, 5, 5, 5]])
    assert response_mask_until_stop(responses, [2]).tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert response_mask_until_stop(responses, [7, 6]).tolist()[0] == [1, 1, 0, 0, 0]


def test_generate_n_samples_per_prompt_with_verl_layout(policy, prompts, config):
    model, tokenizer = policy
    engine = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout)
    out = engine.generate_sequences(prompts)
    n, R, P = config.actor_rollout_ref.rollout.n, config.data.max_response_length, config.data.max_prompt_length
    assert len(out) == 6 * n
    assert out.tensors["responses"].shape == (6 * n, R) and out.tensors["input_ids"].shape == (6 * n, P + R)
    assert out.non_tensors["uid"].tolist() == [f"s0-{i}" for i in range(6) for _ in range(n)]
    mask = out.tensors["response_mask"]
    responses = out.tensors["responses"]
    # after the first EOS: masked out and padded; the attention mask covers prompt + valid response
    assert torch.all(responses[mask == 0] == tokenizer.pad_token_id)
    for row in range(len(out)):
        eos = (responses[row] == tokenizer.eos_token_id).nonzero()
        if len(eos):
            assert mask[row].sum() == eos[0, 0] + 1
    assert torch.equal(out.tensors["attention_mask"][:, P:], mask)
    # positions continue from the prompt's last position
    positions = out.tensors["position_ids"]
    assert torch.equal(positions[:, P], positions[:, P - 1] + 1)


def test_sampling_is_seeded_by_global_step_and_greedy_validation_is_repeatable(policy, prompts, config):
    model, tokenizer = policy
    engine = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout)
    prompts.meta_info["global_step"] = 3
    first, again = engine.generate_sequences(prompts), engine.generate_sequences(prompts)
    assert torch.equal(first.tensors["responses"], again.tensors["responses"])
    prompts.meta_info["global_step"] = 4
    assert not torch.equal(first.tensors["responses"], engine.generate_sequences(prompts).tensors["responses"])
    prompts.meta_info["validate"] = True
    greedy = engine.generate_sequences(prompts)
    assert len(greedy) == 6  # val_kwargs.n = 1
    config.actor_rollout_ref.rollout.generation_batch_size = 2  # chunked generation gives the same greedy output
    chunked = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout).generate_sequences(prompts)
    assert torch.equal(greedy.tensors["responses"], chunked.tensors["responses"])


def test_rollout_log_probs_match_a_recomputation(policy, prompts, config):
    model, tokenizer = policy
    config.actor_rollout_ref.rollout.calculate_log_probs = True
    config.actor_rollout_ref.rollout.temperature = 0.7
    out = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout).generate_sequences(prompts)
    assert out.meta_info["temperature"] == 0.7
    with torch.no_grad():
        recomputed, _ = response_log_probs(model, out.tensors["input_ids"], out.tensors["attention_mask"], out.tensors["position_ids"],
                                           out.tensors["responses"].shape[1], temperature=0.7)
    mask = out.tensors["response_mask"].bool()
    assert torch.allclose(out.tensors["rollout_log_probs"][mask], recomputed[mask], atol=1e-4)


def test_padding_free_log_probs_entropy_and_values_equal_the_padded_path(policy, prompts, config, tiny_model_path):
    model, tokenizer = policy
    sequences = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout).generate_sequences(prompts)
    args = (sequences.tensors["input_ids"], sequences.tensors["attention_mask"], sequences.tensors["position_ids"], sequences.tensors["responses"].shape[1])
    mask = sequences.tensors["response_mask"].bool()
    with torch.no_grad():
        packed_lp, packed_entropy = response_log_probs(model, *args, temperature=1.3, calculate_entropy=True, remove_padding=True)
        padded_lp, padded_entropy = response_log_probs(model, *args, temperature=1.3, calculate_entropy=True, remove_padding=False)
        # independent check: each sequence alone, with no padding at all
        for row in range(0, len(sequences), 5):
            valid = sequences.tensors["attention_mask"][row].bool()
            ids = sequences.tensors["input_ids"][row][valid].unsqueeze(0)
            logits = model(input_ids=ids).logits[0] / 1.3
            n_resp = int(mask[row].sum())
            expected = torch.log_softmax(logits[-n_resp - 1 : -1], -1).gather(-1, ids[0, -n_resp:].unsqueeze(-1)).squeeze(-1)
            assert torch.allclose(packed_lp[row][mask[row]], expected, atol=1e-5)
        critic, _ = load_critic_model(ModelConfig(path=str(tiny_model_path)))
        packed_v = response_values(critic, *args, remove_padding=True)
        padded_v = response_values(critic, *args, remove_padding=False)
    assert torch.allclose(packed_lp[mask], padded_lp[mask], atol=1e-5)
    assert torch.allclose(packed_entropy[mask], padded_entropy[mask], atol=1e-4)
    assert torch.allclose(packed_v[mask], padded_v[mask], atol=1e-5)
