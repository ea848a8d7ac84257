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


def save_model_weights(model: torch.nn.Module, tokenizer: Any, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """``save_pretrained`` in safetensors: a loadable HF checkpoint, or the LoRA adapter for a peft model.

    ``state_dict`` gives the full weights when the module is sharded (call on rank 0 only).
    """
    if state_dict is not None and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        # the same layout as an unsharded save: a tied output layer is not stored twice
        state_dict = {k: v for k, v in state_dict.items() if not k.endswith("lm_head.weight")}
    model.save_pretrained(folder, safe_serialization=True, **({"state_dict": state_dict} if state_dict is not None else {}))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def load_model_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Load weights saved by :func:`save_model_weights` into ``model`` in place (full model or LoRA adapter),
    sharded or not."""
    from rl_core.models.value_head import VALUE_HEAD_FILE, ValueHeadModel
    from rl_core.workers.data_parallel import world_size
    from rl_core.workers.fsdp import load_full_model_state_dict

    folder = Path(folder)
    adapter = folder / "adapter_model.safetensors"
    if adapter.exists():
        if world_size() > 1:
            raise NotImplementedError(f"{adapter}: loading a LoRA adapter into a model sharded over {world_size()} ranks is not supported yet; resume on one rank")
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, load_file(str(adapter)))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"{adapter} does not fit this model: unexpected keys {unexpected[:5]}")
        return
    files = sorted(folder.glob("model*.safetensors"))  # model.safetensors or model-0000i-of-0000n.safetensors shards
    if not files:
        raise FileNotFoundError(f"{folder} holds no model*.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    if isinstance(model, ValueHeadModel):
        state = {f"body.{k}": v for k, v in state.items()}
        state.update({f"value_head.{k}": v for k, v in load_file(str(folder / VALUE_HEAD_FILE)).items()})
    missing, unexpected = load_full_model_state_dict(model, state)
    if getattr(model.config, "tie_word_embeddings", False):  # the tied output layer is not saved separately
        missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})")


def save_trainable(folder: str | Path, module: torch.nn.Module, tokenizer: Any, optimizer: torch.optim.Optimizer,
                   lr_scheduler: Any, extra: dict[str, Any]) -> None:
    """A trainable model's checkpoint: weights in ``folder`` + optimizer, LR scheduler and ``extra`` in
    state.safetensors. Every rank must call it (sharded weights are gathered); rank 0 writes."""
    from rl_core.workers.data_parallel import world_size
    from rl_core.workers.fsdp import full_model_state_dict, full_optimizer_state_dict, is_rank_zero

    weights = full_model_state_dict(module) if world_size() > 1 else None
    optimizer_state = full_optimizer_state_dict(module, optimizer)
    if is_rank_zero():
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_model_weights(module, tokenizer, folder, weights)
        save_state({"optimizer": optimizer_state, "lr_scheduler": lr_scheduler.state_dict(), "extra": extra}, folder / "state.safetensors")
    if world_size() > 1:
        torch.distributed.barrier()


def load_trainable(folder: str | Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any) -> dict[str, Any]:
    """Restore what :func:`save_trainable` wrote (in place) and return its ``extra``. Every rank must call it."""
    from rl_core.workers.fsdp import load_full_optimizer_state_dict

    folder = Path(folder)
    load_model_weights(module, folder)
    state = load_state(folder / "state.safetensors")
    load_full_optimizer_state_dict(module, optimizer, state["optimizer"])
    lr_scheduler.load_state_dict(state["lr_scheduler"])
    return state["extra"]
