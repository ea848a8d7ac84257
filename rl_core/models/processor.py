"""A vision-language checkpoint's processor: what turns a prompt's text and images into the model's inputs (the image
placeholders expanded to the image's tokens, the images to ``pixel_values`` and their grids).

A checkpoint is multimodal when its folder has an image processor's config (``preprocessor_config.json``, or
``processor_config.json`` naming one); text-only checkpoints have no processor. The processor is the one transformers'
``AutoProcessor`` builds, with the policy's tokenizer (left padding, the pad token, ``custom_chat_template``).

Where torchvision is not installed (it is not here: the project's torch build has no matching wheel), transformers
cannot build the video half of a processor that has one (Qwen2-VL's, Qwen2.5-VL's), and ``AutoProcessor`` then
silently returns the bare tokenizer. Those processors are built without their video part instead
(:func:`image_only_processor`): images work the same, a video is refused.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from rl_core.models.folder import ModelLoadError

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


@cache
def image_only_processor(class_name: str) -> type:
    """A subclass of transformers' processor ``class_name`` without its video processor (built only with an image
    processor and a tokenizer)."""
    import transformers

    base = getattr(transformers, class_name, None)
    if base is None:
        raise ModelLoadError(f"transformers {transformers.__version__} has no processor class {class_name!r}")

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        kwargs.pop("video_processor", None)
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(class_name, (base,), {"__init__": __init__, "__module__": __name__})


def processor_class_name(folder: Path) -> str | None:
    """The ``processor_class`` a checkpoint folder's processor files name, or None (no processor files: text-only)."""
    found = None
    for name in PROCESSOR_FILES:
        path = folder / name
        if path.is_file():
            found = found or json.loads(path.read_text()).get("processor_class") or "AutoProcessor"
    return found


def load_processor(
    folder: Path, tokenizer: Any, trust_remote_code: bool = False, chat_template: str | None = None
) -> Any | None:
    """The multimodal processor of the checkpoint in ``folder`` with ``tokenizer`` as its tokenizer, or None for a
    text-only checkpoint. ``chat_template`` (``model.custom_chat_template``) replaces the processor's."""
    class_name = processor_class_name(folder)
    if class_name is None:
        return None
    import transformers
    from transformers import AutoProcessor
    from transformers.processing_utils import ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(folder, trust_remote_code=trust_remote_code)
        failure = None if isinstance(processor, ProcessorMixin) else "AutoProcessor gave the bare tokenizer"
    except (OSError, ValueError, TypeError, ImportError) as error:
        failure = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    if failure is not None:  # a video half that needs torchvision, most likely: built without it
        if class_name == "AutoProcessor" or not hasattr(transformers, class_name):
            raise ModelLoadError(
                f"{folder}: transformers {transformers.__version__} cannot build the checkpoint's processor "
                f"({class_name}: {failure}); install torchvision, or a transformers release that has it"
            )
        processor = image_only_processor(class_name).from_pretrained(folder, trust_remote_code=trust_remote_code)
    if getattr(processor, "image_processor", None) is None:
        raise ModelLoadError(f"{folder}: the checkpoint's processor {type(processor).__name__} has no image processor")
    processor.tokenizer = tokenizer
    if chat_template:
        processor.chat_template = chat_template
    elif processor.chat_template is None:
        processor.chat_template = tokenizer.chat_template
    return processor
