"""Decoding for Llama-family models (Llama, Mistral, Qwen2, Qwen3; Mixtral and Qwen3-MoE, whose MLP is a mixture of
experts) over a pre-allocated KV cache: what transformers' ``generate`` computes, in 52-60 % of its time on small
models (the demo's, 64 rows x 16 sampled tokens: 12.7-16.5 vs 24.3-28.1 ms, ``bench/decode.py``).

At the sizes the CPU runs, a decoding step is per-call overhead, not arithmetic: around a forward of a few hundred
microseconds ``generate`` prepares the inputs, builds a 4-D mask and grows a ``DynamicCache`` by concatenation, each
step (the demo's model, 64 rows, prefill + 16 greedy steps: 20.4 ms by a loop over the model's own forward and
cache, 11.6 ms here). This loop calls each layer's own modules (norms, projections, MLP or experts, the model's
rotary embedding: a LoRA adapter, autocast and any rope scaling work unchanged) and writes only the attention: keys
and values go into one tensor per layer sized for the prompt and the budget, and SDPA reads the filled part with a
boolean mask of the valid keys (causal in the prefill; a padding query attends to itself, so that no NaN reaches the
cache), scaled as the module scales.

It samples as ``generate`` does (transformers 5's ``_sample``) but for the draw itself: the last position's float32
logits go through the given logits processors, a finished row gets the pad token, a row finishes at a stop token, at
the budget or when a stopping criterion says so, and the loop ends when every row has; without sampling the token is
the ``argmax``, the tokens ``generate`` gives (a test compares the two on each family). A sampled token is drawn by
:func:`draw_categorical` (inverse transform) where ``generate`` calls ``torch.multinomial``, which draws one
exponential per vocabulary entry: 0.33 vs 0.04 ms a step for 64 rows of the demo's 320 tokens, 174 vs 28 ms for
64 rows of Qwen2.5's 151,936 on this machine. The same distribution, other draws.

:func:`kv_decodable` says which models it runs: those families with full attention over the whole sequence (no
sliding window it would reach); ``generate`` runs the rest, and every vision-language model.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

KV_DECODE_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe"})


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a LoRA (peft) wrapper, or the model itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def kv_decodable(model: torch.nn.Module, length: int) -> bool:
    """Whether :func:`kv_generate` runs ``model`` for sequences of up to ``length`` tokens: a causal LM of the
    families above whose every layer attends to the whole sequence."""
    config = getattr(_causal_lm(model), "config", None)
    if config is None or getattr(config, "model_type", None) not in KV_DECODE_MODEL_TYPES:
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or not getattr(config, "use_sliding_window", True) or length <= window


def draw_categorical(scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row drawn from ``softmax(scores)`` (rows, vocabulary) by inverse transform: ``u`` uniform in
    [0, total) against the cumulative probabilities, the first index whose cumulative sum exceeds ``u``. A token of
    probability 0 (a score of -inf) is never drawn: its cumulative sum is its predecessor's, and ``u`` stays below the
    total."""
    cumulative = scores.softmax(-1).cumsum(-1)
    total = cumulative[:, -1:]
    uniform = torch.rand(total.shape, generator=generator, device=scores.device, dtype=total.dtype)
    below_total = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, below_total, right=True).squeeze(1)


class _LayerCache:
    """One layer's keys and values, (rows, kv heads, capacity, head dim) each, made at the first write in the dtype
    the projections give (autocast's)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def write(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores ``keys`` and ``values`` (rows, kv heads, new positions, head dim) from position ``start``; returns
        the filled part of each."""
        if self.keys is None or self.values is None:
            self.keys = keys.new_zeros(*keys.shape[:2], self.capacity, keys.shape[-1])
            self.values = values.new_zeros(*values.shape[:2], self.capacity, values.shape[-1])
        end = start + keys.shape[2]
        self.keys[:, :, start:end], self.values[:, :, start:end] = keys, values
        return self.keys[:, :, :end], self.values[:, :, :end]


def _attend(
    layer: torch.nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: _LayerCache,
    start: int,
    mask: torch.Tensor,
) -> torch.Tensor:
    """One decoder layer on ``x`` (rows, new positions, hidden) at positions ``start`` on, attending to the cache's
    keys where ``mask`` (rows, 1, new positions, at least start + new) is true."""
    attention = layer.self_attn
    rows, new = x.shape[:2]
    h = layer.input_layernorm(x)
    q = attention.q_proj(h).view(rows, new, -1, attention.head_dim)
    k = attention.k_proj(h).view(rows, new, -1, attention.head_dim)
    if hasattr(attention, "q_norm"):  # Qwen3 normalises each head's queries and keys
        q, k = attention.q_norm(q), attention.k_norm(k)
    v = attention.v_proj(h).view(rows, new, -1, attention.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    keys, values = cache.write(k, v, start)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask[..., : keys.shape[2]], scale=attention.scaling, enable_gqa=True
    )
    x = x + attention.o_proj(out.transpose(1, 2).reshape(rows, new, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


@torch.no_grad()
def kv_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    do_sample: bool,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    stop_token_ids: list[int],
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Like ``generate``'s output for the same arguments (the left-padded ``input_ids`` followed by the drawn
    tokens, one column per step run), sampled tokens drawn from ``generator``: see the module doc. The processors
    are called one by one (``LogitsProcessorList`` inspects each one's signature at every step)."""
    lm = _causal_lm(model)
    decoder = lm.model
    rows, width = input_ids.shape
    valid = torch.zeros(rows, width + max_new_tokens, dtype=torch.bool, device=input_ids.device)
    valid[:, :width] = attention_mask.bool()
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    causal = torch.ones(width, width, dtype=torch.bool, device=input_ids.device).tril()
    mask = (causal & valid[:, None, :width] | torch.eye(width, dtype=torch.bool, device=input_ids.device))[:, None]
    caches = [_LayerCache(width + max_new_tokens) for _ in decoder.layers]
    stops = torch.tensor(stop_token_ids, dtype=torch.long, device=input_ids.device)
    unfinished = torch.ones(rows, dtype=torch.long, device=input_ids.device)
    x, start = decoder.embed_tokens(input_ids), 0
    for step in range(max_new_tokens):
        # ---- forward the new positions through the layers, the cache filled from `start`
        cos, sin = decoder.rotary_emb(x, positions)
        for layer, cache in zip(decoder.layers, caches):
            x = _attend(layer, x, cos, sin, cache, start, mask)
        logits = lm.lm_head(decoder.norm(x[:, -1:]))[:, -1].to(dtype=torch.float32, copy=True)
        # ---- draw: processors, then draw_categorical (argmax without sampling); finished rows get the pad
        scores = logits
        for processor in logits_processor:
            scores = processor(input_ids, scores)
        token = draw_categorical(scores, generator) if do_sample else scores.argmax(-1)
        token = token * unfinished + pad_token_id * (1 - unfinished)
        input_ids = torch.cat([input_ids, token[:, None]], dim=-1)
        finished = torch.isin(token, stops)
        if stopping_criteria:
            finished |= stopping_criteria(input_ids, scores)
        unfinished = unfinished & ~finished
        if step + 1 == max_new_tokens or unfinished.max() == 0:
            break
        # ---- the drawn token is the next position, a valid key from now on
        start += x.shape[1]
        valid[:, start] = True
        mask = valid[:, None, None, :]
        positions = positions[:, -1:] + 1
        x = decoder.embed_tokens(token[:, None])
    return input_ids
