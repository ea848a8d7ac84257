"""HF rollout engine and response log-probs on the tiny model: masks, sampling settings, padding-free parity."""

import json

import pytest
import torch

from rl_core.config import ModelConfig, RolloutConfig
from rl_core.metrics import rollout_probs_diff_metrics
from rl_core.models.loading import ModelLoadWarning, load_policy_model
from rl_core.models.logprob import response_log_probs, response_values
from rl_core.models.tiny import make_tiny_model
from rl_core.models.value_head import load_critic_model
from rl_core.rollout import build_rollout_engine, hf_engine
from rl_core.rollout.base import TokenSample, cut_at_stop, sampling_seed
from tests.rl_core.helpers import addition_dataset, response_logits


@pytest.fixture()
def policy(config):
    return load_policy_model(config.actor_rollout_ref.model)


@pytest.fixture()
def prompts(tmp_path, policy, config):
    dataset = addition_dataset(tmp_path, policy[1], config.data, count=6)
    return dataset.collate(list(range(6)), uid_prefix="s0-")


def test_a_response_keeps_the_first_stop_token_and_nothing_after():
    rows = [[5, 6, 2, 7, 2], [2, 5, 5, 5, 5], [5, 5, 5, 5, 5]]
    cut = [cut_at_stop(row, [2], budget=5) for row in rows]
    assert [(sample.token_ids, sample.finish_reason) for sample in cut] == [
        ([5, 6, 2], "stop"),
        ([2], "stop"),
        ([5, 5, 5, 5, 5], "length"),
    ]
    assert cut_at_stop(rows[0], [7, 6], budget=5).token_ids == [5, 6]
    assert cut_at_stop(rows[0], [7], budget=2) == TokenSample([5, 6], None, "length")  # the budget comes first


def test_generation_pads_the_prompts_only_to_the_longest(policy, prompts, config):
    """The batch comes left-padded to data.max_prompt_length (verl's layout, and the output keeps it), but generation
    pads to the longest prompt: the KV cache and attention would otherwise cover the padding too."""
    model, tokenizer = policy
    widths = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _, args: widths.append(args[0].shape[1]))
    engine = build_rollout_engine(
        "hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout
    )
    out = engine.generate_sequences(prompts)
    hook.remove()
    longest = int(prompts.tensors["attention_mask"].sum(-1).max())
    assert longest < prompts.tensors["input_ids"].shape[1] == config.data.max_prompt_length
    assert widths[0] == longest and set(widths[1:]) == {1}  # the prefill, then one token per decoding step
    assert out.tensors["input_ids"].shape[1] == config.data.max_prompt_length + config.data.max_response_length


def test_generate_one_response_per_row_with_verl_layout(policy, prompts, config):
    model, tokenizer = policy
    engine = build_rollout_engine(
        "hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout
    )
    n, R, P = 3, config.data.max_response_length, config.data.max_prompt_length
    out = engine.generate_sequences(prompts.repeat_interleave(n))  # the controller repeats each prompt n times
    assert len(out) == 6 * n
    assert out.tensors["responses"].shape == (6 * n, R) and out.tensors["input_ids"].shape == (6 * n, P + R)
    assert out.non_tensors["uid"].tolist() == [f"s0-{i}" for i in range(6) for _ in range(n)]
    assert len({tuple(r) for r in out.tensors["responses"].tolist()}) > 6  # the samples of one prompt differ
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


def test_seeds_differ_across_ranks_chunks_and_steps():
    """Every chunk of every rank draws its own random stream; a step re-run draws the same one."""
    rollout = RolloutConfig()
    seeds = [
        sampling_seed(rollout, {"global_step": step}, rank, chunk)
        for step in (1, 2, 1001)
        for rank in range(4)
        for chunk in range(50)
    ]
    assert len(set(seeds)) == len(seeds) and all(0 <= seed < 2**63 for seed in seeds)
    assert sampling_seed(rollout, {"global_step": 7}, 1, 3) == sampling_seed(rollout, {"global_step": 7}, 1, 3)


def test_each_chunk_of_each_rank_is_sampled_with_its_own_seed(policy, prompts, config, monkeypatch):
    """The seeds the HF engine samples with, collected over two ranks and one-row chunks, are all different."""
    model, tokenizer = policy
    config.actor_rollout_ref.rollout.generation_batch_size = 1
    engine = build_rollout_engine(
        "hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout
    )
    used, draw = [], engine._draw
    monkeypatch.setattr(engine, "_draw", lambda *args, **kwargs: used.append(args[3]) or draw(*args, **kwargs))
    for rank in (0, 1):
        monkeypatch.setattr(hf_engine, "data_parallel_rank", lambda rank=rank: rank)
        engine.generate_sequences(prompts.repeat_interleave(2))
    assert len(used) == 2 * 12 and len(set(used)) == len(used)


def test_sampling_is_seeded_by_global_step_and_greedy_validation_is_repeatable(policy, prompts, config):
    model, tokenizer = policy
    engine = build_rollout_engine(
        "hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout
    )
    prompts.meta_info["global_step"] = 3
    first, again = engine.generate_sequences(prompts), engine.generate_sequences(prompts)
    assert torch.equal(first.tensors["responses"], again.tensors["responses"])
    prompts.meta_info["global_step"] = 4
    assert not torch.equal(first.tensors["responses"], engine.generate_sequences(prompts).tensors["responses"])
    prompts.meta_info["validate"] = True
    greedy = engine.generate_sequences(prompts)
    assert len(greedy) == 6  # val_kwargs.n = 1
    config.actor_rollout_ref.rollout.generation_batch_size = 2  # chunked generation gives the same greedy output
    chunked = build_rollout_engine(
        "hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout
    ).generate_sequences(prompts)
    assert torch.equal(greedy.tensors["responses"], chunked.tensors["responses"])


def test_sampling_draws_from_the_whole_distribution(policy, prompts, config):
    """With top_k=-1 and top_p=1 nothing truncates the distribution (transformers' generate would apply top_k=50 from
    its
    global defaults if left unset): on the random tiny model (320 tokens, close to uniform) most sampled tokens rank
    beyond the top 50, and each one's rank is spread over the vocabulary."""
    model, tokenizer = policy
    rollout = config.actor_rollout_ref.rollout
    rollout.top_k, rollout.top_p = -1, 1.0
    out = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=rollout).generate_sequences(
        prompts.repeat_interleave(8)
    )
    mask = out.tensors["response_mask"].bool()
    logits = response_logits(model, out)
    sampled = logits.gather(-1, out.tensors["responses"].unsqueeze(-1))
    ranks = (logits > sampled).sum(-1)[mask]
    assert (ranks >= 50).float().mean() > 0.5, ranks.tolist()


@pytest.mark.parametrize("top_k, top_p", [(-1, 1.0), (5, 1.0), (-1, 0.9)])
def test_rollout_log_probs_are_the_sampled_distributions(policy, prompts, config, top_k, top_p):
    """Without truncation they equal ppoflow's recomputed old log-probs at the temperature; with top-k / top-p they
    are the renormalised distribution the sampler drew from."""
    model, tokenizer = policy
    rollout = config.actor_rollout_ref.rollout
    rollout.calculate_log_probs, rollout.temperature, rollout.top_k, rollout.top_p = True, 0.7, top_k, top_p
    out = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=rollout).generate_sequences(
        prompts.repeat_interleave(2)
    )
    assert out.meta_info["temperature"] == 0.7
    mask = out.tensors["response_mask"].bool()
    with torch.no_grad():
        logits = (
            model(
                input_ids=out.tensors["input_ids"],
                attention_mask=out.tensors["attention_mask"],
                position_ids=out.tensors["position_ids"],
            )
            .logits[:, -mask.shape[1] - 1 : -1]
            .float()
            / 0.7
        )
        if top_k > 0:
            logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[..., -1:], -float("inf"))
        if top_p < 1:
            probs = torch.softmax(logits, -1)
            sorted_probs, order = probs.sort(dim=-1)
            drop_sorted = sorted_probs.cumsum(-1) <= 1 - top_p
            logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -float("inf"))
        expected = torch.log_softmax(logits, -1).gather(-1, out.tensors["responses"].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(out.tensors["rollout_log_probs"][mask], expected[mask], atol=1e-4)
    assert torch.all(out.tensors["rollout_log_probs"][~mask] == 0)


def test_a_checkpoints_generation_config_does_not_change_how_the_rollout_samples(tmp_path, config):
    """A checkpoint whose generation_config.json carries a repetition penalty and a no-repeat rule (Qwen2.5-Instruct
    ships a penalty): the samples still come from the policy whose log-probs are trained, and greedy is plain argmax."""
    folder = make_tiny_model(tmp_path / "penalised", seed=0)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(
        json.dumps({**generation, "repetition_penalty": 5.0, "no_repeat_ngram_size": 1, "temperature": 0.3, "top_k": 3})
    )
    config.actor_rollout_ref.model.path = str(folder)
    with pytest.warns(ModelLoadWarning, match="repetition_penalty=5.0.*not used"):
        model, tokenizer = load_policy_model(config.actor_rollout_ref.model)
    rollout = config.actor_rollout_ref.rollout
    rollout.calculate_log_probs = True
    prompts = addition_dataset(tmp_path, tokenizer, config.data, count=6).collate(list(range(6)))
    out = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=rollout).generate_sequences(
        prompts.repeat_interleave(4)
    )
    mask = out.tensors["response_mask"].bool()
    with torch.no_grad():
        recomputed, _ = response_log_probs(
            model,
            out.tensors["input_ids"],
            out.tensors["attention_mask"],
            out.tensors["position_ids"],
            mask.shape[1],
            temperature=1.0,
        )
    assert torch.allclose(out.tensors["rollout_log_probs"][mask], recomputed[mask], atol=1e-4)
    assert (
        rollout_probs_diff_metrics(out.tensors["rollout_log_probs"], recomputed, mask)[
            "training/rollout_probs_diff_max"
        ]
        < 1e-3
    )
    # greedy: each token is the argmax of the model's own logits (a penalty would have forbidden repeats)
    prompts.meta_info["greedy"] = True
    greedy = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=rollout).generate_sequences(
        prompts
    )
    with torch.no_grad():
        logits = model(
            input_ids=greedy.tensors["input_ids"],
            attention_mask=greedy.tensors["attention_mask"],
            position_ids=greedy.tensors["position_ids"],
        ).logits[:, -mask.shape[1] - 1 : -1]
    greedy_mask = greedy.tensors["response_mask"].bool()
    assert torch.equal(logits.argmax(-1)[greedy_mask], greedy.tensors["responses"][greedy_mask])


def test_padding_free_log_probs_entropy_and_values_equal_the_padded_path(policy, prompts, config, tiny_model_path):
    model, tokenizer = policy
    sequences = build_rollout_engine(
        "hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout
    ).generate_sequences(prompts)
    args = (
        sequences.tensors["input_ids"],
        sequences.tensors["attention_mask"],
        sequences.tensors["position_ids"],
        sequences.tensors["responses"].shape[1],
    )
    mask = sequences.tensors["response_mask"].bool()
    with torch.no_grad():
        packed_lp, packed_entropy = response_log_probs(
            model, *args, temperature=1.3, calculate_entropy=True, remove_padding=True
        )
        padded_lp, padded_entropy = response_log_probs(
            model, *args, temperature=1.3, calculate_entropy=True, remove_padding=False
        )
        # independent check: each sequence alone, with no padding at all
        for row in range(0, len(sequences), 5):
            valid = sequences.tensors["attention_mask"][row].bool()
            ids = sequences.tensors["input_ids"][row][valid].unsqueeze(0)
            logits = model(input_ids=ids).logits[0] / 1.3
            n_resp = int(mask[row].sum())
            expected = (
                torch.log_softmax(logits[-n_resp - 1 : -1], -1).gather(-1, ids[0, -n_resp:].unsqueeze(-1)).squeeze(-1)
            )
            assert torch.allclose(packed_lp[row][mask[row]], expected, atol=1e-5)
        critic, _ = load_critic_model(ModelConfig(path=str(tiny_model_path)))
        packed_v = response_values(critic, *args, remove_padding=True)
        padded_v = response_values(critic, *args, remove_padding=False)
    assert torch.allclose(packed_lp[mask], padded_lp[mask], atol=1e-5)
    assert torch.allclose(packed_entropy[mask], padded_entropy[mask], atol=1e-4)
    assert torch.allclose(packed_v[mask], padded_v[mask], atol=1e-5)
