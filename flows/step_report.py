"""What a training step shows besides MLflow's metrics: the console line (and the Prefect flow run's Logs tab), the
rollout samples table the inspector page reads, and a vision-language run's validation samples with their images."""

from __future__ import annotations

import base64
import io
from typing import Any

from rl_core.batch import Batch, response_ends
from rl_core.batch_fields import (
    ADVANTAGES,
    ATTENTION_MASK,
    MULTI_MODAL_DATA,
    MULTI_TURN,
    OLD_LOG_PROBS,
    PROMPTS,
    RAW_PROMPT,
    REF_LOG_PROB,
    RESPONSE_MASK,
    RESPONSES,
    REWARD_MODEL,
    TOKEN_LEVEL_SCORES,
    UID,
)

THUMBNAIL_PIXELS = 96  # the longer side of an image in the samples table


def thumbnail_urls(data: dict | None) -> list[str]:
    """A row's images (its ``multi_modal_data``) as PNG data URLs at most THUMBNAIL_PIXELS on a side."""
    urls = []
    for image in (data or {}).get("image", []):
        small = image.copy()
        small.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
        out = io.BytesIO()
        small.save(out, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(out.getvalue()).decode())
    return urls


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
    if "training/staleness_max" in metrics:  # a rollout of its own: how many versions behind the samples were
        line += f" | staleness {metrics['training/staleness_max']:.0f}"
    val = validation_summary(metrics)
    return line + (" | val " + val if val else "")


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """The text of each token, such that their concatenation is the decoded sequence: a byte-level token that holds
    part of a multi-byte character decodes alone to U+FFFD, so the tokens of one character are decoded together and
    their text goes to the last of them (the earlier ones get ``""``)."""
    texts: list[str] = []
    pending: list[int] = []
    for token in ids:
        pending.append(token)
        text = tokenizer.decode(pending)
        if text.endswith("\ufffd") and len(pending) < 4:  # a UTF-8 character is at most 4 bytes
            continue
        texts += [""] * (len(pending) - 1) + [text]
        pending = []
    if pending:  # the sequence ends inside a character: what it has is shown as is
        texts += [""] * (len(pending) - 1) + [tokenizer.decode(pending)]
    return texts


def sample_rows(batch: Batch, count: int) -> list[int]:
    """About ``count`` rows spread over the batch, whole prompt groups (the responses of one prompt, GRPO's groups)
    kept together: the first ``count // n`` of evenly spaced groups' rows, in batch order."""
    groups: dict[Any, list[int]] = {}
    for row, uid in enumerate(batch.non_tensors[UID] if UID in batch.non_tensors else range(len(batch))):
        groups.setdefault(uid, []).append(row)
    members = list(groups.values())
    size = max(len(rows) for rows in members)
    wanted = max(1, count // size)
    chosen = members[:: max(1, len(members) // wanted)][:wanted]
    return [row for rows in chosen for row in rows][:count]


def question_text(raw_prompt: Any) -> str:
    """The prompt without its chat template: the last user message of a chat prompt, or the prompt text."""
    if isinstance(raw_prompt, str):
        return raw_prompt
    users = [m.get("content", "") for m in raw_prompt if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else ""


def samples_table(batch: Batch, tokenizer: Any, count: int) -> dict[str, list]:
    """About ``count`` rollout samples, whole prompt groups (:func:`sample_rows`): the prompt and response as the model
    saw them, the question and the response without the chat template (``question``, ``response_text``), the group
    (``uid``), ``ground_truth``, ``response_length``, score, advantage, and per response token its text
    (:func:`token_texts`), advantage and (with a reference policy) KL estimate ``old_log_prob - ref_log_prob`` (the
    inspector colours tokens by them); for multi-turn rollouts also whether each token is the policy's
    (``token_from_policy``: 0 on tool answers) and each sample's ``tool_calls``; with images, each sample's
    thumbnails (``images``: :func:`thumbnail_urls`)."""
    rows = sample_rows(batch, count)
    tensors, objects = batch.tensors, batch.non_tensors
    lengths = response_ends(tensors[RESPONSE_MASK]).tolist()
    prompt_width = tensors[PROMPTS].shape[1]
    prompts = [tensors[PROMPTS][r][tensors[ATTENTION_MASK][r, :prompt_width].bool()] for r in rows]
    responses = [tensors[RESPONSES][r, : lengths[r]] for r in rows]
    truths = [rm.get("ground_truth") if isinstance(rm, dict) else None for rm in objects.get(REWARD_MODEL, [])]
    table = {
        "uid": [str(objects[UID][r]) if UID in objects else str(r) for r in rows],
        "prompt": [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts],
        "question": [
            question_text(objects[RAW_PROMPT][r]) if RAW_PROMPT in objects else tokenizer.decode(ids, True)
            for r, ids in zip(rows, prompts)
        ],
        "ground_truth": [None if not truths or truths[r] is None else str(truths[r]) for r in rows],
        "response": [tokenizer.decode(ids, skip_special_tokens=False) for ids in responses],
        "response_text": [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses],
        "response_length": [int(tensors[RESPONSE_MASK][r].sum()) for r in rows],
        "score": [float(tensors[TOKEN_LEVEL_SCORES][r].sum()) for r in rows],
        "advantage": [float(tensors[ADVANTAGES][r, 0]) for r in rows],
        "response_tokens": [token_texts(tokenizer, ids.tolist()) for ids in responses],
        "token_advantages": [tensors[ADVANTAGES][r, : lengths[r]].tolist() for r in rows],
    }
    if REF_LOG_PROB in tensors and OLD_LOG_PROBS in tensors:
        kl = tensors[OLD_LOG_PROBS] - tensors[REF_LOG_PROB]
        table["token_kl"] = [kl[r, : lengths[r]].tolist() for r in rows]
    if MULTI_TURN in objects:  # tool answers inside the response: the inspector greys them, lists the calls
        table["token_from_policy"] = [tensors[RESPONSE_MASK][r, : lengths[r]].tolist() for r in rows]
        table["tool_calls"] = [
            [
                {key: call[key] for key in ("name", "arguments", "error", "answer", "latency_s")}
                for call in objects[MULTI_TURN][r]["tool_calls"]
            ]
            for r in rows
        ]
    if MULTI_MODAL_DATA in objects:
        table["images"] = [thumbnail_urls(objects[MULTI_MODAL_DATA][r]) for r in rows]
    return table


def validation_images(batch: Batch, tokenizer: Any, count: int) -> dict[str, list] | None:
    """The first ``count`` validation samples that have images, as a table MLflow shows with its image column: the
    first image, the question, the response, the ground truth and the score; None without images."""
    data = batch.non_tensors.get(MULTI_MODAL_DATA)
    rows = [r for r, row in enumerate(data) if row and row.get("image")][:count] if data is not None else []
    if not rows:
        return None
    lengths = response_ends(batch.tensors[RESPONSE_MASK]).tolist()
    truths = batch.non_tensors[REWARD_MODEL]
    return {
        "image": [data[r]["image"][0] for r in rows],
        "question": [question_text(batch.non_tensors[RAW_PROMPT][r]) for r in rows],
        "response": [tokenizer.decode(batch.tensors[RESPONSES][r, : lengths[r]], True) for r in rows],
        "ground_truth": [str(truths[r].get("ground_truth")) for r in rows],
        "score": [float(batch.tensors[TOKEN_LEVEL_SCORES][r].sum()) for r in rows],
    }
