"""Tiny vision-language models built in code, with no download: Qwen2-VL, Qwen2.5-VL or LLaVA (a CLIP vision tower and
a Llama), randomly initialised, with the byte-level BPE tokenizer of :mod:`rl_core.models.tiny`, the family's image
processor (its PIL backend: no torchvision needed) and a chat template that renders ``{"type": "image"}`` parts as the
family's image placeholder.

Saved with ``save_pretrained`` (model, tokenizer, processor), so they load through exactly the pipeline a user's
checkpoint of that family takes (``ppoflow make-tiny-model OUT --family qwen2_5_vl`` writes one). Images are resized to
at most 64 x 64 pixels and cut into 8-pixel patches: a 48 x 48 image is 9 image tokens for the Qwen families (2 x 2
patches merged into one), 36 for LLaVA.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from rl_core.data.synthetic import COLOURS, SHAPES_QUESTION
from rl_core.models.families import VISION_FAMILIES
from rl_core.models.tiny import ENGLISH, IM_END, IM_START, build_tokenizer

PATCH, MERGE = 8, 2  # pixels per patch side; patches merged per side into one image token (Qwen)
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
LLAVA_IMAGE_TOKEN = "<image>"


def vision_chat_template(image_placeholder: str) -> str:
    """Qwen's chat format whose messages' content is a string or a list of ``{"type": "text", "text"}`` and
    ``{"type": "image"}`` parts (the processor expands each image placeholder to the image's tokens)."""
    return (
        "{% for message in messages %}{{ '" + IM_START + "' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '" + image_placeholder + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{{ '" + IM_END + "\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '" + IM_START + "assistant\n' }}{% endif %}"
    )


def _text_sizes(tokenizer, hidden_size: int, num_layers: int) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
    }


def _qwen_parts(family: str, tokenizer, hidden_size: int, num_layers: int):
    """(config, processor) of a tiny Qwen2-VL / Qwen2.5-VL."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from rl_core.models.processor import image_only_processor

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_VISION_TOKENS}
    half_head = hidden_size // 4 // 2  # the text attention's rotary half-dimension, split over (t, h, w)
    text = {
        **_text_sizes(tokenizer, hidden_size, num_layers),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [half_head - 2 * (half_head // 3), half_head // 3, half_head // 3],
        },
    }
    vision = {"depth": 2, "num_heads": 4, "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": 2}
    if family == "qwen2_vl":
        vision.update(embed_dim=hidden_size, hidden_size=hidden_size)
        processor_name = "Qwen2VLProcessor"
    else:  # Qwen2.5-VL: windowed attention in the vision tower except the full-attention blocks
        vision.update(
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            out_hidden_size=hidden_size,
            window_size=PATCH * MERGE * 2,
            fullatt_block_indexes=[1],
        )
        processor_name = "Qwen2_5_VLProcessor"
    config = AutoConfig.for_model(
        family,
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    images = Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=64 * 64
    )
    template = vision_chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    return config, image_only_processor(processor_name)(images, tokenizer, chat_template=template)


def _llava_parts(tokenizer, hidden_size: int, num_layers: int):
    """(config, processor) of a tiny LLaVA: a CLIP vision tower, a projector, a Llama."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    side = 48
    config = AutoConfig.for_model(
        "llava",
        text_config={"model_type": "llama", **_text_sizes(tokenizer, hidden_size, num_layers)},
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "image_size": side,
            "patch_size": PATCH,
            "projection_dim": hidden_size,
        },
        image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    processor = LlavaProcessor(
        images,
        tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        chat_template=vision_chat_template(LLAVA_IMAGE_TOKEN),
        image_token=LLAVA_IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    return config, processor


def make_tiny_vlm(
    out_dir: str | Path, family: str = "qwen2_5_vl", seed: int = 0, hidden_size: int = 64, num_layers: int = 2
) -> Path:
    """Write a randomly initialised vision-language model of ``family`` (one of VISION_FAMILIES) with its tokenizer
    and processor to ``out_dir``; returns the folder. The tokenizer is trained on the shapes task's questions and
    answers (:func:`rl_core.data.synthetic.shapes_rows`) and English."""
    if family not in VISION_FAMILIES:
        raise ValueError(f"family={family!r}: choose one of {', '.join(VISION_FAMILIES)}")
    specials = (LLAVA_IMAGE_TOKEN,) if family == "llava" else QWEN_VISION_TOKENS
    texts = [f"{IM_START}user\n{SHAPES_QUESTION}{IM_END}\n{IM_START}assistant\n{c}{IM_END}" for c in COLOURS]
    tokenizer = build_tokenizer(texts * 20 + [ENGLISH], extra_special_tokens=specials)
    if family == "llava":
        config, processor = _llava_parts(tokenizer, hidden_size, num_layers)
    else:
        config, processor = _qwen_parts(family, tokenizer, hidden_size, num_layers)
    tokenizer.chat_template = processor.chat_template
    for sub in [config, config.get_text_config()]:
        sub.eos_token_id, sub.pad_token_id, sub.bos_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id, None
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
