"""The tokenizer against the model's embedding: which token ids a run feeds a model, and whether it has rows for them.

Checkpoints differ in both directions. Qwen2.5 has 151,665 tokens over 151,936 embedding rows: the rows past the
tokenizer are never used, which is fine. A fine-tune that added a special token without resizing the embedding, or a
tokenizer class that adds one at save time (transformers' ``Qwen2Tokenizer`` adds ``<|endoftext|>``), has more tokens
than rows: that is fine too as long as no id the run feeds the model lies past the rows. The ids a run feeds are

* the prompts' ids, chat template included (the datasets tokenize every prompt before the run starts);
* the pad, eos and bos ids (the padded forward and ``generate`` embed the pad id under the attention mask);
* a multi-turn run's template glue around tool answers (the tool role's header, the next assistant header);
* the ids the policy samples, all below its LM head's rows (a critic with another checkpoint must have those rows).

An id past the rows is an ``IndexError: index out of range in self`` deep inside a worker; :func:`ids_past_rows` finds
them first. Reading the sizes (:func:`embedding_rows`, :func:`tokenizer_id_bound`) needs neither torch nor
transformers, so the common case (no more tokens than rows) is settled in milliseconds before anything starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# a conversation whose rendering holds every piece of template glue a multi-turn run appends after a tool call
TOOL_TURN = [
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
    {"role": "tool", "content": "t"},
]


def embedding_rows(folder: str | Path) -> int | None:
    """The rows of a checkpoint's input embedding as its ``config.json`` states them (``vocab_size``, or its
    ``text_config``'s for a vision-language model); None when it states none."""
    config = json.loads((Path(folder) / "config.json").read_text())
    rows = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(rows) if rows else None


def tokenizer_id_bound(folder: str | Path) -> int | None:
    """One more than the largest token id a tokenizer folder's files name (``tokenizer.json``'s vocabulary and added
    tokens, ``tokenizer_config.json``'s ``added_tokens_decoder``, ``vocab.json`` and ``added_tokens.json``); None when
    they name none (a SentencePiece ``tokenizer.model`` alone: only loading it tells)."""
    folder = Path(folder)
    ids: list[int] = []

    def read(name: str) -> Any:
        path = folder / name
        return json.loads(path.read_text()) if path.is_file() else None

    tokenizer = read("tokenizer.json") or {}
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        ids += vocab.values()
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids by position
        ids.append(len(vocab) - 1)
    ids += [token["id"] for token in tokenizer.get("added_tokens") or []]
    ids += [int(key) for key in (read("tokenizer_config.json") or {}).get("added_tokens_decoder") or {}]
    ids += (read("vocab.json") or {}).values()
    ids += (read("added_tokens.json") or {}).values()
    return max(ids) + 1 if ids else None


def fed_ids(tokenizer: Any, prompt_ids: Iterable[list[int]], multi_turn: bool) -> dict[int, str]:
    """The token ids a run feeds the policy besides what it samples, each with where it first comes from: the special
    tokens, the tokenized prompts and, for a multi-turn run, the chat template's glue around a tool answer."""
    fed: dict[int, str] = {}
    for name in ("pad", "eos", "bos"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None:
            fed.setdefault(int(token_id), f"the {name} token")
    for ids in prompt_ids:
        for token_id in ids:
            fed.setdefault(int(token_id), "the prompts")
    if multi_turn and tokenizer.chat_template is not None:
        text = tokenizer.apply_chat_template(TOOL_TURN, add_generation_prompt=True, tokenize=False)
        for token_id in tokenizer(text, add_special_tokens=False)["input_ids"]:
            fed.setdefault(int(token_id), "the chat template's tool turn")
    return fed


def ids_past_rows(fed: dict[int, str], rows: int) -> dict[int, str]:
    """The ids of ``fed`` that a model with ``rows`` embedding rows does not have."""
    return {token_id: origin for token_id, origin in sorted(fed.items()) if token_id >= rows}


def describe_ids(tokenizer: Any, ids: dict[int, str], limit: int = 5) -> str:
    """``257 '<|im_start|>' (the prompts), ...``: the first ``limit`` of ``ids`` with their tokens and origins."""
    listed = [f"{i} {tokenizer.convert_ids_to_tokens(i)!r} ({origin})" for i, origin in list(ids.items())[:limit]]
    more = f" and {len(ids) - limit} more" if len(ids) > limit else ""
    return ", ".join(listed) + more


def model_rows(model: Any) -> tuple[int, int | None]:
    """A loaded model's input-embedding rows and its LM head's (None for a model without one: a critic)."""
    rows = model.get_input_embeddings().num_embeddings
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_rows = getattr(head, "out_features", None) if head is not None else None
    return int(rows), None if head_rows is None else int(head_rows)
