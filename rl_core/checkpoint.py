"""Checkpoint files: model weights in Hugging Face's safetensors layout, and any nested state (optimizer, LR
scheduler, RNG, counters) as one safetensors file whose non-tensor parts are JSON in the file's metadata.

Nothing here unpickles: a checkpoint from an untrusted source cannot run code when it is loaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

TREE_KEY = "ppoflow_tree"
# a worker's optimizer, LR scheduler, counters: a resume needs it, a model does not
TRAINING_STATE_FILE = "state.safetensors"


def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON-able description of ``value``; tensors are moved into ``tensors`` and referenced by name."""
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().cpu().contiguous()
        return {"__tensor__": name}
    if isinstance(value, dict):
        return {"__dict__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint state file")


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__dict__" in value:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__dict__"]}
        if "__tuple__" in value:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        if "__ndarray__" in value:
            return np.array(value["__ndarray__"], dtype=value["dtype"])
    return value


def save_state(state: Any, path: str | Path) -> None:
    """Write nested dicts/lists/tuples of tensors, numbers and strings to one safetensors file."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors)
    save_file(tensors, str(path), metadata={TREE_KEY: json.dumps(tree)})


def load_state(path: str | Path) -> Any:
    """Read what :func:`save_state` wrote."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if TREE_KEY not in metadata:
        raise ValueError(f"{path} is not a ppoflow state file (no {TREE_KEY!r} metadata)")
    return _decode(json.loads(metadata[TREE_KEY]), load_file(str(path)))


def rng_state() -> dict[str, Any]:
    """The Python, numpy and torch RNG states (CUDA too when present)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_model_weights(
    model: torch.nn.Module, tokenizer: Any, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """``save_pretrained`` in safetensors: a loadable HF checkpoint, or the LoRA adapter for a peft model, with
    ``tokenizer`` (or a vision-language model's processor, which saves its tokenizer too).

    ``state_dict`` gives the full weights when the module is sharded (call on rank 0 only).
    """
    if state_dict is not None and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        # the same layout as an unsharded save: a tied output layer is not stored twice
        state_dict = {k: v for k, v in state_dict.items() if not k.endswith("lm_head.weight")}
    model.save_pretrained(
        folder, safe_serialization=True, **({"state_dict": state_dict} if state_dict is not None else {})
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
