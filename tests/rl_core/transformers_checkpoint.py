"""A checkpoint saved the way a user's is: transformers' own ``Qwen2Tokenizer`` (not the project's tiny builder) over
a byte-level vocabulary, and a Qwen2 model whose embedding has however many rows the test asks for.

``Qwen2Tokenizer`` adds its special tokens after the 256 byte tokens: ``<|im_end|>`` (eos, 256), ``<|endoftext|>``
(pad, 257), then the chat template's ``<|im_start|>`` (258): 259 tokens. ``extra_tokens`` are special tokens
added after them, as a fine-tune that added a token without resizing the embedding has."""

from pathlib import Path

import torch
from tokenizers import pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Tokenizer

from rl_core.models.tiny import CHAT_TEMPLATE, IM_END, IM_START

TOKENS = 259  # the 256 bytes, <|endoftext|>, <|im_start|>, <|im_end|>


def save_user_checkpoint(folder: Path, rows: int, extra_tokens: tuple[str, ...] = ()) -> Path:
    """A random 2-layer Qwen2 with ``rows`` embedding rows and a ``Qwen2Tokenizer`` of ``TOKENS + len(extra_tokens)``
    tokens, both saved with ``save_pretrained``."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Qwen2Tokenizer(vocab={char: i for i, char in enumerate(alphabet)}, merges=[], eos_token=IM_END)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END, *extra_tokens]})
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == TOKENS + len(extra_tokens)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=rows,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id if tokenizer.eos_token_id < rows else None,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id < rows else None,  # else no embedding to build
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
