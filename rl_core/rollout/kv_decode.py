"""Decoding for the decoder-only families of :data:`KV_DECODE_MODEL_TYPES` (Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 1-3; Mixtral and Qwen3-MoE, whose MLP is a mixture of experts) over a pre-allocated KV cache: what transformers'
``generate`` computes, in 52-60 % of its time on small models (the demo's, 64 rows x 16 sampled tokens: 12.7-16.5 vs
24.3-28.1 ms, ``bench/decode.py``).

At the sizes the CPU runs, a decoding step is per-call overhead, not arithmetic: around a forward of a few hundred
microseconds ``generate`` prepares the inputs, builds a 4-D mask and grows a ``DynamicCache`` by concatenation, each
step (the demo's model, 64 rows, prefill + 16 greedy steps: 20.4 ms by a loop over the model's own forward and
cache, 11.6 ms here). This loop calls each layer's own modules (norms, projections, MLP or experts, the model's
rotary embedding: a LoRA adapter, autocast and any rope scaling work unchanged) and writes only the attention: keys
and values go into one tensor per layer sized for the prompt and the budget, and SDPA reads the filled part with a
boolean mask of the valid keys (causal in the prefill; a padding query attends to itself, so that no NaN reaches the
cache), scaled as the module scales. What differs between the families is read off the modules
(:func:`_attend`): Phi-3's fused ``qkv_proj`` and partial rotary dimensions, Qwen3's and Gemma 3's per-head query and
key norms, Gemma's norms around the attention and the MLP outputs (its embedding scales itself), Gemma 2's
soft-capped attention scores (computed as its eager attention computes them: SDPA cannot cap) and Gemma's soft-capped
logits, Gemma 3's rotary embedding per layer type.

It samples as ``generate`` does (transformers 5's ``_sample``) but for the draw itself: the last position's float32
logits go through the given logits processors, a finished row gets the pad token, a row finishes at a stop token, at
the budget or when a stopping criterion says so, and the loop ends when every row has; without sampling the token is
the ``argmax``, the tokens ``generate`` gives (a test compares the two on each family). Unlike ``generate``, the layers
stop running finished rows: once an eighth of the rows they run have finished, those leave the batch and their cached
keys and values are dropped (one copy of the others' filled cache, paid back within a few steps); from then on such a
row's scores are 0 for the processors, and its token is the pad as before. A sampled token is drawn by
:func:`draw_categorical` (inverse transform) where ``generate`` calls ``torch.multinomial``, which draws one
exponential per vocabulary entry: 0.33 vs 0.04 ms a step for 64 rows of the demo's 320 tokens, 174 vs 28 ms for
64 rows of Qwen2.5's 151,936 on this machine. The same distribution, other draws.

:func:`kv_decodable` says which models it runs: those families where every layer attends to the whole sequence (full
attention, or a sliding window the sequence does not reach); ``generate`` runs the rest, and every vision-language
model.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

KV_DECODE_MODEL_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma", "gemma2", "gemma3_text"}
)


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a LoRA (peft) wrapper, or the model itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def kv_decodable(model: torch.nn.Module, length: int) -> bool:
    """Whether :func:`kv_generate` runs ``model`` for sequences of up to ``length`` tokens: a causal LM of the
    families above whose every layer attends to the whole sequence (full attention, or a sliding window of at least
    ``length`` tokens)."""
    config = getattr(_causal_lm(model), "config", None)
    if config is None or getattr(config, "model_type", None) not in KV_DECODE_MODEL_TYPES:
        return False
    layer_types = set(getattr(config, "layer_types", None) or ())
    if not layer_types <= {"full_attention", "sliding_attention"}:
        return False
    window = getattr(config, "sliding_window", None)
    if window is None or length <= window:
        return True
    if layer_types:  # the window would be reached: only where no layer slides
        return "sliding_attention" not in layer_types
    return not getattr(config, "use_sliding_window", True)


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

    def keep(self, rows: torch.Tensor, end: int) -> None:
        """Keeps only ``rows`` (indices into the cached rows), their first ``end`` positions copied (after a write)."""
        for tensor in (self.keys, self.values):
            tensor[: len(rows), :, :end] = tensor[:, :, :end].index_select(0, rows)
        self.keys, self.values = self.keys[: len(rows)], self.values[: len(rows)]


def _projections(attention: torch.nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Queries, keys and values (rows, new positions, heads, head dim): three projections, or Phi-3's fused one."""
    shape = (*h.shape[:2], -1, attention.head_dim)
    if not hasattr(attention, "qkv_proj"):
        return tuple(proj(h).view(shape) for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
    kv_width = attention.num_key_value_heads * attention.head_dim
    q, k, v = attention.qkv_proj(h).split([attention.o_proj.in_features, kv_width, kv_width], dim=-1)
    return q.view(shape), k.view(shape), v.view(shape)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the halves of the last dimension: the rotation by 90 degrees of each pair (i, i + d/2)
    that rotary embeddings combine with ``cos`` and ``sin`` (Llama's layout; a local copy keeps transformers' modeling
    code out of the controller, which imports this module through the rollout's registry)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (rows, heads, positions, head dim) over the first ``cos.shape[-1]``
    dimensions (all of them but for Phi-3's partial rotary factor), as transformers applies it."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, passed = x[..., :rotary], x[..., rotary:]
    return torch.cat([rotated * cos + _rotate_half(rotated) * sin, passed], dim=-1)


def _capped_attention(attention, q, keys, values, mask) -> torch.Tensor:
    """Gemma 2's attention with soft-capped scores, as its eager attention computes it: ``cap * tanh(q k^T * scaling /
    cap)``, masked, a float32 softmax, times the values (kv heads repeated for the query heads)."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    cap = attention.attn_logit_softcapping
    scores = torch.tanh(torch.matmul(q, keys.transpose(2, 3)) * attention.scaling / cap) * cap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), values)


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
    q, k, v = _projections(attention, layer.input_layernorm(x))
    if hasattr(attention, "q_norm"):  # Qwen3 and Gemma 3 normalise each head's queries and keys
        q, k = attention.q_norm(q), attention.k_norm(k)
    q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
    keys, values = cache.write(k, v.transpose(1, 2), start)
    mask = mask[..., : keys.shape[2]]
    if getattr(attention, "attn_logit_softcapping", None) is not None:
        out = _capped_attention(attention, q, keys, values, mask)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=attention.scaling, enable_gqa=True
        )
    out = attention.o_proj(out.transpose(1, 2).reshape(rows, new, -1))
    if not hasattr(layer, "pre_feedforward_layernorm"):  # Llama's order: norm, sublayer, residual
        x = x + out
        return x + layer.mlp(layer.post_attention_layernorm(x))
    x = x + layer.post_attention_layernorm(out)  # Gemma 2 and 3 normalise each sublayer's output too
    return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))


def _rotary_per_layer(decoder: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
    """Each layer's (cos, sin) at ``positions``: one rotary embedding, or Gemma 3's one per layer type."""
    rotary, layers = decoder.rotary_emb, decoder.layers
    if not hasattr(rotary, "layer_types"):
        return [rotary(x, positions)] * len(layers)
    layer_types = decoder.config.layer_types
    by_type = {kind: rotary(x, positions, kind) for kind in set(layer_types)}
    return [by_type[layer_types[i]] for i in range(len(layers))]


def _last_logits(lm: torch.nn.Module, x: torch.Tensor, computed: torch.Tensor, rows: int) -> torch.Tensor:
    """The float32 logits (rows, vocabulary) at the last position of ``x``, the hidden states of the rows ``computed``
    (Gemma's capped: cap * tanh(logits / cap)); 0 for a row no longer run (it gets the pad)."""
    logits = lm.lm_head(lm.model.norm(x[:, -1:]))[:, -1]
    softcap = getattr(lm.config, "final_logit_softcapping", None)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.to(dtype=torch.float32, copy=True)
    if len(computed) < rows:
        logits = logits.new_zeros(rows, logits.shape[-1]).index_copy_(0, computed, logits)
    return logits


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
    computed = torch.arange(rows, device=input_ids.device)  # the rows the layers run: the unfinished ones, roughly
    x, start = decoder.embed_tokens(input_ids), 0
    for step in range(max_new_tokens):
        # ---- forward the new positions through the layers, the cache filled from `start`
        for layer, cache, (cos, sin) in zip(decoder.layers, caches, _rotary_per_layer(decoder, x, positions)):
            x = _attend(layer, x, cos, sin, cache, start, mask)
        logits = _last_logits(lm, x, computed, rows)
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
        left = int(unfinished.sum())
        if step + 1 == max_new_tokens or left == 0:
            break
        # ---- the drawn token is the next position, a valid key from now on; finished rows leave the batch
        start += x.shape[1]
        valid[:, start] = True
        positions = positions[:, -1:] + 1
        if len(computed) - left >= max(1, len(computed) // 8):  # an eighth done: copying the cache pays
            still = unfinished[computed].nonzero().squeeze(1)  # indices into the rows run
            for cache in caches:
                cache.keep(still, start)
            computed, valid, positions = computed[still], valid[still], positions[still]
        mask = valid[:, None, None, :]
        x = decoder.embed_tokens(token[computed, None])
    return input_ids
