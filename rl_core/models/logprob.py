"""Log-probabilities (and entropy) of the response tokens under a model, with or without padding.

The batch layout is verl's: ``input_ids`` = [left-padded prompt | right-padded response], the last
``response_length`` columns being the response. Token t's log-prob comes from the logits at t - 1, divided by
the sampling temperature (verl's convention: log-probs of the distribution that was sampled).

Padding-free path (``remove_padding``): the valid tokens of all rows are packed into one sequence whose
position ids restart at 0 for each row, with no attention mask; transformers then attends within each row only
(packed-sequence masking), so no compute is spent on padding. Both paths give the same numbers where the model
builds its mask with transformers' packed-sequence detection (or runs flash-attention's varlen kernels); remote code
or a custom attention that ignores it would let each row attend to the rows before it.
:func:`padding_free_mismatch` checks a model on a dummy batch: the workers run it at load and fall back to padded
batches when the two paths disagree. A vision-language model's batch with images always runs padded, its image inputs
given to the forward and its positions computed by the model itself (its image placeholders have probability 0).
"""

from __future__ import annotations

import inspect

import torch
import torch.utils.checkpoint

from rl_core.algos.entropy import entropy_from_logits
from rl_core.models.multimodal import without_placeholders
from rl_core.models.packed_context import packed_forward


def _chunk_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """log softmax(logits)[label] for each position, computed in chunks of rows (no full log-softmax tensor). When a
    gradient will flow, each chunk is recomputed in the backward pass: its float32 copy of half-precision logits is
    not kept for it."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    recompute = flat_logits.requires_grad and torch.is_grad_enabled() and flat_logits.dtype != torch.float32
    pieces = [
        torch.utils.checkpoint.checkpoint(_chunk_log_probs, chunk, chunk_labels, use_reentrant=False)
        if recompute
        else _chunk_log_probs(chunk, chunk_labels)
        for chunk, chunk_labels in zip(flat_logits.split(chunk_size), flat_labels.split(chunk_size))
    ]
    return torch.cat(pieces).reshape(labels.shape) if pieces else flat_logits.new_zeros(labels.shape)


def _accepts(model: torch.nn.Module, argument: str) -> bool:
    try:
        return argument in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    remove_padding: bool = True,
    entropy_chunk_size: int | None = 2048,
    vision: dict[str, torch.Tensor] | None = None,
    placeholders: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log_probs, entropy or None), each (batch, response_length), for the response part of ``input_ids``.
    ``vision``: a vision-language model's image inputs (:func:`rl_core.models.multimodal.vision_model_inputs`); with
    them the forward is padded and the model computes its own positions. ``placeholders``: its image placeholder ids,
    which the rollout never samples (probability 0 here too)."""
    temperature = temperature if temperature and temperature > 0 else 1.0
    if vision:
        remove_padding, position_ids = False, None
    if remove_padding:
        valid = attention_mask.bool()
        packed_ids = input_ids[valid].unsqueeze(0)
        packed_positions = position_ids[valid].unsqueeze(0)
        with packed_forward(packed_positions):
            logits = model(
                input_ids=packed_ids, position_ids=packed_positions, attention_mask=None, use_cache=False
            ).logits[0]
        logits = without_placeholders(logits / temperature, placeholders or [])
        # the logits at packed position i predict the token at i + 1; roll so each token gets its own log-prob
        next_token_log_probs = token_log_probs(logits, torch.roll(packed_ids[0], shifts=-1))
        log_probs = torch.zeros(input_ids.shape, dtype=next_token_log_probs.dtype, device=input_ids.device)
        log_probs[valid] = torch.roll(next_token_log_probs, shifts=1)
        entropy = None
        if calculate_entropy:
            packed_entropy = entropy_from_logits(logits, entropy_chunk_size)
            entropy = torch.zeros(input_ids.shape, dtype=packed_entropy.dtype, device=input_ids.device)
            entropy[valid] = torch.roll(packed_entropy, shifts=1)
            entropy = entropy[:, -response_length:]
        return log_probs[:, -response_length:], entropy

    extra = {"logits_to_keep": response_length + 1} if _accepts(model, "logits_to_keep") else {}
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **extra,
        **(vision or {}),
    ).logits
    logits = without_placeholders(logits[:, -response_length - 1 : -1] / temperature, placeholders or [])
    log_probs = token_log_probs(logits, input_ids[:, -response_length:])
    entropy = entropy_from_logits(logits, entropy_chunk_size) if calculate_entropy else None
    return log_probs, entropy


def response_values(
    critic: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    remove_padding: bool = True,
) -> torch.Tensor:
    """The critic's value for each response position, (batch, response_length).

    As in verl, the value of response token t is read at the position *before* it (the state in which t is
    chosen), i.e. columns [-R-1, -1) of the per-token values.
    """
    if remove_padding:
        valid = attention_mask.bool()
        packed_positions = position_ids[valid].unsqueeze(0)
        with packed_forward(packed_positions):
            packed = critic(
                input_ids=input_ids[valid].unsqueeze(0),
                position_ids=packed_positions,
                attention_mask=None,
                use_cache=False,
            ).logits[0, :, 0]
        values = torch.zeros(input_ids.shape, dtype=packed.dtype, device=input_ids.device)
        values[valid] = packed
    else:
        values = critic(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits[..., 0]
    return values[:, -response_length - 1 : -1]


def padding_free_mismatch(model: torch.nn.Module) -> float:
    """The largest difference between the padding-free and the padded forward of ``model`` (a causal LM: log-probs; a
    critic: values) at the valid tokens of a dummy batch of two rows with different padding, their ids drawn from the
    rows the model's embedding has: ~1e-6 in float32 where packed rows are kept apart, ~0.1 or more where they are
    not. Runs in the weights' own dtype, without autocast."""
    device = next(model.parameters()).device
    rows = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, rows, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :4], attention_mask[1, -2:] = 0, 0  # row 1: left-padded prompt, right-padded response
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    valid = attention_mask.bool()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = (
                model(
                    input_ids=ids[valid].unsqueeze(0),
                    position_ids=position_ids[valid].unsqueeze(0),
                    attention_mask=None,
                    use_cache=False,
                )
                .logits[0]
                .float()
            )
            padded = (
                model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
                .logits[valid]
                .float()
            )
    finally:
        model.train(was_training)
    if packed.shape[-1] > 1:  # a vocabulary: compare log-probs
        packed, padded = torch.log_softmax(packed, dim=-1), torch.log_softmax(padded, dim=-1)
    return float((packed - padded).abs().max())
