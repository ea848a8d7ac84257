"""Packed-sequence attention as padded batches of rows (rl_core/models/packed_attention.py) against attention written
as a plain loop, and the model-level result against transformers' own SDPA over the block-diagonal mask."""

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rl_core.models import packed_attention
from rl_core.models.packed_attention import PACKED_SDPA, packed_row_bounds, packed_sdpa_attention, packed_sdpa_mask
from rl_core.models.packed_context import packed_forward


def loop_attention(query, key, value, lengths):
    """Causal softmax attention of each packed row over itself, one position at a time: (1, N, H, D)."""
    out = torch.zeros(query.shape[2], query.shape[1], query.shape[3], dtype=torch.float64)
    start = 0
    for length in lengths:
        for i in range(start, start + length):
            for h in range(query.shape[1]):
                scores = [float(query[0, h, i] @ key[0, h, j]) / math.sqrt(query.shape[3]) for j in range(start, i + 1)]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                for w, j in zip(weights, range(start, i + 1)):
                    out[i, h] += w / sum(weights) * value[0, h, j].double()
        start += length
    return out.unsqueeze(0)


def test_row_bounds_are_where_positions_restart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    assert packed_row_bounds(positions) == [0, 3, 5, 6, 10]
    assert packed_row_bounds(torch.tensor([[5, 6, 7]])) == [0, 3]  # one row, whatever its first position


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_packed_row_attends_to_itself_only(seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (4,), generator=generator).tolist()
    total, heads, dim = sum(lengths), 2, 8
    query, key, value = (torch.randn(1, heads, total, dim, generator=generator) for _ in range(3))
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    module = torch.nn.Module()
    module.is_causal = True
    output, _ = packed_sdpa_attention(module, query, key, value, None, position_ids=position_ids)
    assert torch.allclose(output.double(), loop_attention(query, key, value, lengths), atol=1e-5)


def tiny_qwen2(**overrides):
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, **overrides,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def packed_inputs(lengths, generator=None):
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=generator)
    return ids, torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def test_a_model_gives_sdpa_numbers_with_a_call_per_length_bucket(monkeypatch):
    torch.manual_seed(0)
    model = tiny_qwen2().eval()
    lengths = [5, 7, 3, 6]  # 5, 7, 6 share the bucket (4, 8]; 3 is alone in (2, 4]
    ids, position_ids = packed_inputs(lengths)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        whole = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        model.set_attn_implementation(PACKED_SDPA)
        calls = []
        original = packed_attention.sdpa_attention_forward
        monkeypatch.setattr(
            packed_attention,
            "sdpa_attention_forward",
            lambda *a, **k: calls.append(tuple(a[1].shape[::2])) or original(*a, **k),
        )
        packed = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        alone = model(input_ids=ids[:, :5], use_cache=False).logits  # a single row goes to SDPA whole
    assert calls == [(3, 7), (1, 3)] * model.config.num_hidden_layers + [(1, 5)] * model.config.num_hidden_layers
    assert torch.allclose(packed, whole, atol=1e-5) and torch.allclose(alone, whole[:, :5], atol=1e-5)


IMPLEMENTATIONS = ("sdpa", PACKED_SDPA)  # transformers' SDPA over the whole block-diagonal mask, then the packed one


def logits_and_gradients(model, implementation, ids, position_ids):
    """The logits of a packed forward in ``packed_forward`` (as the padding-free passes run it) with ``implementation``,
    and the parameters' gradients of their mean square, taken after it (as a training step's backward pass is)."""
    model.zero_grad()
    model.set_attn_implementation(implementation)
    with packed_forward(position_ids):
        logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    logits.square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def same_logits_and_gradients(first, second) -> bool:
    return torch.allclose(first[0], second[0], atol=1e-5) and all(
        torch.allclose(a, b, atol=1e-6) for a, b in zip(first[1], second[1])
    )


def spy_on_masks(monkeypatch) -> list[tuple[int, int]]:
    """The (q, kv) lengths of every mask SDPA's mask function builds for the packed implementation."""
    built, original = [], packed_attention.sdpa_mask
    monkeypatch.setattr(packed_attention, "sdpa_mask", lambda *a, **k: built.append(a[1:3]) or original(*a, **k))
    return built


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_causal_models_packed_forward_builds_no_mask_and_gives_sdpa_numbers(checkpointed, monkeypatch):
    """Inside packed_forward (the padding-free log-prob and value passes) a model whose layers all attend causally
    gets no (N, N) mask: each row's causal block is applied per bucket, with the numbers and gradients of transformers'
    SDPA over its block-diagonal mask, also when gradient checkpointing recomputes the layers in the backward pass
    (outside packed_forward). Outside it the mask is built as before."""
    generator = torch.Generator().manual_seed(int(checkpointed))
    torch.manual_seed(int(checkpointed))
    model = tiny_qwen2()
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    ids, position_ids = packed_inputs(torch.randint(1, 20, (6,), generator=generator).tolist(), generator)
    built = spy_on_masks(monkeypatch)
    whole, packed = (
        logits_and_gradients(model, implementation, ids, position_ids) for implementation in IMPLEMENTATIONS
    )
    assert built == []
    assert same_logits_and_gradients(packed, whole)
    with torch.no_grad():
        outside = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    assert torch.allclose(outside, whole[0], atol=1e-5)
    assert built == [(ids.shape[1], ids.shape[1])]  # one mask for the model's layers, outside packed_forward


def test_the_mask_is_skipped_only_for_a_causal_models_causal_mask_of_the_packed_sequence():
    position_ids = torch.tensor([[0, 1, 2, 0, 1]])
    causal, sliding = Qwen2Config(), Qwen2Config(use_sliding_window=True, sliding_window=2)
    mask = {"allow_is_causal_skip": False}  # as transformers asks for a packed sequence's
    with packed_forward(position_ids):
        assert packed_sdpa_mask(1, 5, 5, config=causal, **mask) is None
        assert packed_sdpa_mask(1, 5, 5, config=sliding, **mask) is not None
        assert packed_sdpa_mask(1, 5, 5, config=causal, local_size=2, **mask) is not None  # a window's or chunks' mask
        assert packed_sdpa_mask(1, 5, 5, config=causal, allow_is_bidirectional_skip=False, **mask) is not None
        assert packed_sdpa_mask(1, 5, 5, config=causal, use_vmap=True, **mask) is not None  # a custom mask function
        assert (
            packed_sdpa_mask(1, 5, 5, attention_mask=torch.ones(1, 5, dtype=torch.bool), config=causal, **mask)
            is not None
        )
        assert packed_sdpa_mask(1, 4, 4, config=causal, **mask) is not None  # another sequence than the packed one
    assert packed_sdpa_mask(1, 5, 5, config=causal, **mask) is not None


@pytest.mark.parametrize("seed", [0, 1])
def test_sliding_window_masks_and_gradients_match_sdpa_over_the_whole(seed, monkeypatch):
    """transformers' own mask blocks (here a sliding window of 4 on every layer) reach each row, also inside
    packed_forward (such a mask is more than causal: it is built), and the gradients through the gathered batch are
    those of the block-diagonal whole."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = tiny_qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    lengths = torch.randint(1, 20, (6,), generator=generator).tolist()
    ids, position_ids = packed_inputs(lengths, generator)
    built = spy_on_masks(monkeypatch)
    whole, packed = (
        logits_and_gradients(model, implementation, ids, position_ids) for implementation in IMPLEMENTATIONS
    )
    assert built  # the packed implementation built the window's mask
    assert same_logits_and_gradients(packed, whole)
