"""A multimodal row's images, verl's format: the prompt's messages carry one ``<image>`` placeholder per image, in
order, and the row's ``data.image_key`` column (``images``) lists the images, each one of

* ``{"bytes": b"...", "path": ...}`` (how parquet stores a ``datasets.Image``; ``bytes`` wins when both are set),
* raw image bytes, a ``PIL.Image``,
* a file path (relative paths are relative to the dataset file's folder) or a ``data:image/...;base64,`` URL.

Every image is decoded once, when the dataset loads, to RGB; one that is missing or cannot be decoded is refused then,
naming the row and the image.
"""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path
from typing import Any

from rl_core.data.rows import DatasetError

IMAGE_PLACEHOLDER = "<image>"


def decode_image(value: Any, where: str, base: Path | None = None):
    """One image of a row (any form of the module doc) as an RGB ``PIL.Image``; a DatasetError naming ``where``
    otherwise."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, str) and value.startswith("data:image/"):
            data = io.BytesIO(base64.b64decode(value.split(",", 1)[1]))
        elif isinstance(value, str):
            path = Path(value).expanduser()
            path = path if path.is_absolute() or base is None else base / path
            if not path.is_file():
                raise DatasetError(f"{where}: no such image file {str(path)!r}")
            data = path
        elif isinstance(value, (bytes, bytearray)):
            data = io.BytesIO(value)
        else:
            raise DatasetError(
                f"{where}: an image must be bytes, a path, a data URL or {{'bytes', 'path'}}, not {value!r:.60}"
            )
        image = Image.open(data)
        image.load()  # decode now: a truncated file fails here, not in the rollout
        return image.convert("RGB")
    except UnidentifiedImageError:
        raise DatasetError(f"{where}: not an image Pillow can read (the bytes are no PNG, JPEG, ...)") from None
    except (OSError, ValueError) as error:
        raise DatasetError(f"{where}: the image cannot be decoded ({type(error).__name__}: {error})") from None


def row_images(row: dict, image_key: str, where: str, base: Path | None = None) -> list:
    """The row's decoded images (empty when it has none)."""
    images = row.get(image_key)
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        images = [images]
    return [decode_image(image, f"{where}, {image_key}[{i}]", base) for i, image in enumerate(images)]


def with_image_parts(messages: list[dict], image_count: int, where: str) -> list[dict]:
    """The messages with each ``<image>`` placeholder made a ``{"type": "image"}`` part of the message's content (the
    text around them ``{"type": "text"}`` parts), as processors' chat templates take them; the placeholders must be as
    many as the images."""
    out, found = [], 0
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            found += sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
            out.append(message)
            continue
        parts = []
        for piece in re.split(f"({re.escape(IMAGE_PLACEHOLDER)})", content):
            if piece == IMAGE_PLACEHOLDER:
                parts.append({"type": "image"})
                found += 1
            elif piece:
                parts.append({"type": "text", "text": piece})
        out.append({**message, "content": parts})
    if found != image_count:
        raise DatasetError(
            f"{where}: the prompt has {found} {IMAGE_PLACEHOLDER} placeholder(s) for {image_count} image(s); put one "
            f"{IMAGE_PLACEHOLDER} in the prompt where each image goes"
        )
    return out


# what a processor returns besides the prompt's tokens: the rest is the model's multimodal input
TEXT_KEYS = ("input_ids", "attention_mask")


def prompt_text(processor: Any, prompt: str | list[dict], image_count: int, where: str, tools: Any = None) -> str:
    """A prompt with images rendered by the processor's chat template (generation prompt appended)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return processor.apply_chat_template(
        with_image_parts(messages, image_count, where), tools=tools, add_generation_prompt=True, tokenize=False
    )


def encode_with_images(processor: Any, text: str, images: list) -> tuple[list[int], dict]:
    """(token ids, multimodal model inputs) of ``text`` with ``images``: the processor's output, each image
    placeholder expanded to the image's tokens; the inputs are its tensors but the tokens (per image, e.g.
    ``pixel_values`` and ``image_grid_thw``; per prompt token as 1-D tensors, e.g. ``mm_token_type_ids``:
    :func:`rl_core.models.multimodal.vision_model_inputs` lays them over a batch)."""
    import torch

    encoded = processor(text=[text], images=images, return_tensors="pt")
    ids = encoded["input_ids"][0]
    inputs = {
        key: value[0] if value.dim() == 2 and value.shape == (1, len(ids)) else value
        for key, value in encoded.items()
        if key not in TEXT_KEYS and isinstance(value, torch.Tensor)
    }
    return ids.tolist(), inputs
