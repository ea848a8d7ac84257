"""What a training step shows besides MLflow's metrics: the console line (and the Prefect flow run's Logs tab), and
the rollout samples table the inspector page reads."""

from __future__ import annotations

from typing import Any

from rl_core.batch import Batch, response_ends
from rl_core.batch_fields import (
    ADVANTAGES,
    ATTENTION_MASK,
    MULTI_TURN,
    OLD_LOG_PROBS,
    PROMPTS,
    REF_LOG_PROB,
    RESPONSE_MASK,
    RESPONSES,
    TOKEN_LEVEL_SCORES,
)


def validation_summary(metrics: dict[str, float]) -> str:
    """``<data source> <mean@n>, ...`` of the validation metrics among ``metrics`` ('' when there are none)."""
    return ", ".join(
        f"{k[len('val-core/') : k.rindex('/acc/')]} {v:.3f}"
        for k, v in metrics.items()
        if k.startswith("val-core/") and "/mean@" in k
    )


def console_line(step: int, total: int, metrics: dict[str, float], seconds: float) -> str:
    kl = metrics.get("actor/kl_loss", metrics.get("actor/reward_kl_penalty", 0.0))
    line = (
        f"step {step}/{total} | score {metrics.get('critic/score/mean', 0):.3f} | kl {kl:.4f} | entropy "
        f"{metrics.get('actor/entropy', 0):.3f} | response_len {metrics.get('response_length/mean', 0):.1f} | "
        f"{seconds:.1f}s"
    )
    val = validation_summary(metrics)
    return line + (" | val " + val if val else "")


def samples_table(batch: Batch, tokenizer: Any, count: int) -> dict[str, list]:
    """``count`` rollout samples spread over the batch: prompt, response, score, advantage, and per response token its
    text, advantage and (with a reference policy) KL estimate ``old_log_prob - ref_log_prob`` (the inspector colours
    tokens by them); for multi-turn rollouts also whether each token is the policy's (``token_from_policy``: 0 on tool
    answers) and each sample's ``tool_calls``."""
    rows = list(range(0, len(batch), max(1, len(batch) // count)))[:count]
    tensors = batch.tensors
    lengths = response_ends(tensors[RESPONSE_MASK]).tolist()
    prompt_width = tensors[PROMPTS].shape[1]
    table = {
        "prompt": [
            tokenizer.decode(
                tensors[PROMPTS][r][tensors[ATTENTION_MASK][r, :prompt_width].bool()], skip_special_tokens=False
            )
            for r in rows
        ],
        "response": [tokenizer.decode(tensors[RESPONSES][r, : lengths[r]], skip_special_tokens=False) for r in rows],
        "score": [float(tensors[TOKEN_LEVEL_SCORES][r].sum()) for r in rows],
        "advantage": [float(tensors[ADVANTAGES][r, 0]) for r in rows],
        "response_tokens": [
            [tokenizer.decode([token]) for token in tensors[RESPONSES][r, : lengths[r]].tolist()] for r in rows
        ],
        "token_advantages": [tensors[ADVANTAGES][r, : lengths[r]].tolist() for r in rows],
    }
    if REF_LOG_PROB in tensors and OLD_LOG_PROBS in tensors:
        kl = tensors[OLD_LOG_PROBS] - tensors[REF_LOG_PROB]
        table["token_kl"] = [kl[r, : lengths[r]].tolist() for r in rows]
    if MULTI_TURN in batch.non_tensors:  # tool answers inside the response: the inspector greys them, lists the calls
        table["token_from_policy"] = [tensors[RESPONSE_MASK][r, : lengths[r]].tolist() for r in rows]
        table["tool_calls"] = [
            [
                {key: call[key] for key in ("name", "arguments", "error", "answer", "latency_s")}
                for call in batch.non_tensors[MULTI_TURN][r]["tool_calls"]
            ]
            for r in rows
        ]
    return table
