"""A local Hugging Face checkpoint folder, checked without loading anything (no torch, no transformers): what a run
needs to find there before it starts any process."""

from __future__ import annotations

import json
from pathlib import Path

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ModelLoadError(ValueError):
    """A model or tokenizer could not be loaded; the message names the setting and the fix."""


def local_model_path(path: str | None, setting: str = "actor_rollout_ref.model.path") -> Path:
    """The checkpoint folder, expanded; a clear error when it is missing (nothing is downloaded)."""
    if not path:
        raise ModelLoadError(f"{setting} is not set; point it at a local Hugging Face checkpoint folder")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(
            f"{setting}={path!r}: no such folder. ppoflow loads local checkpoints only; download the model first (e.g. "
            f"`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir {path}`) or fix the path"
        )
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{setting}={path!r} has no config.json; it is not a Hugging Face checkpoint folder")
    return folder


def check_model_folder(path: str | None, setting: str, weights: bool = True, tokenizer: bool = False) -> None:
    """``path`` is a checkpoint folder whose config.json parses and names a ``model_type``, with weight files
    (``weights``) and tokenizer files (``tokenizer``): a ModelLoadError naming ``setting`` otherwise."""
    folder = local_model_path(path, setting)
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{setting}={path!r}: config.json is not valid JSON ({error})") from None
    if not model_type:
        raise ModelLoadError(f"{setting}={path!r}: config.json has no model_type; it is not a transformers checkpoint")
    if weights and not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ModelLoadError(
            f"{setting}={path!r} has no weights ({' or '.join(WEIGHT_FILES[::2])}); the download or save did not finish"
        )
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{setting}={path!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy the tokenizer there or "
            "set actor_rollout_ref.model.tokenizer_path"
        )
