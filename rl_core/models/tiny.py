"""Tiny models built in code, with no download: a small causal LM of one of the model families verl's users train
(Qwen2 by default; Llama, Mistral, Qwen3, Gemma 2 and 3, Phi-3, and the mixture-of-experts Qwen3-MoE and Mixtral),
randomly initialised, and a byte-level BPE tokenizer with a chat template.

They are saved with ``save_pretrained``, so they load through exactly the pipeline a user's checkpoint of that family
takes (``ppoflow make-tiny-model OUT [--family llama]`` writes one).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from rl_core.data.synthetic import CALL, END_CALL, calc_rows, calc_transcript, corpus
from rl_core.models.families import FAMILIES

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen's chat format, so that prompts look like a real instruct model's
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ENGLISH = (
    "You are a helpful assistant. The user asks a question and the assistant answers it. What is the answer? Let's "
    "think step by step and output the final answer after ####."
)


def build_tokenizer(
    texts: Iterable[str], vocab_size: int = 320, extra_special_tokens: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``texts`` (digits always split one by one), wrapped for transformers;
    ``extra_special_tokens`` are single tokens that the pre-tokenizer never splits."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END, *extra_special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=IM_END,
        padding_side="left",
        additional_special_tokens=list(extra_special_tokens),
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def task_texts(task: str, max_operand: int) -> tuple[list[str], tuple[str, ...]]:
    """The conversations of synthetic ``task`` (rl_core.data.synthetic) the tiny tokenizer is trained on, and the
    special tokens the task needs."""
    if task == "calc":
        rows = calc_rows(500, seed=0, split="tokenizer")
        conversations = [
            [
                *row["prompt"],
                *calc_transcript(row, use_tool=True),
            ]
            for row in rows
        ]
        template = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
        template.chat_template = CHAT_TEMPLATE
        return [template.apply_chat_template(c, tokenize=False) for c in conversations], (CALL, END_CALL)
    return [
        f"{IM_START}user\n{problem.split('=')[0]}={IM_END}\n{IM_START}assistant\n{problem.split('=')[1]}{IM_END}"
        for problem in corpus(max_operand)
    ], ()


def make_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_operand: int = 20,
    family: str = "qwen2",
    task: str = "addition",
    **shape: int,
) -> Path:
    """Write a randomly initialised causal LM of ``family`` (see FAMILIES) + tokenizer to ``out_dir``; returns the
    folder.
    Tiny by default; ``shape`` overrides other config sizes (``num_attention_heads``, ``intermediate_size``,
    ``vocab_size``: a vocabulary larger than the tokenizer's gives a real model's output-layer cost; ids past the
    tokenizer decode to "")."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: choose one of {', '.join(FAMILIES)}")
    model_type, family_settings = FAMILIES[family]
    out = Path(out_dir)
    texts, specials = task_texts(task, max_operand)
    tokenizer = build_tokenizer(texts + [ENGLISH], extra_special_tokens=specials)
    sizes = {
        "vocab_size": len(tokenizer),
        "intermediate_size": 4 * hidden_size,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        **family_settings,
        **shape,
    }
    sizes.setdefault("head_dim", hidden_size // sizes["num_attention_heads"])
    config = AutoConfig.for_model(
        model_type,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **sizes,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
