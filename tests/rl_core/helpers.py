"""Small builders shared by the rl_core tests."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl_core.data.dataset import RLDataset
from rl_core.data.rows import write_rows
from rl_core.data.synthetic import addition_rows
from tests.conftest import free_port


def addition_dataset(tmp_path, tokenizer, data_config, count=16, split="train"):
    path = write_rows(addition_rows(count, seed=0, split=split), tmp_path / f"{split}.parquet")
    return RLDataset(str(path), tokenizer, data_config)


def response_logits(model, batch):
    """The plain forward pass's logits that predict each response token of a sequence batch (B, R, V)."""
    with torch.no_grad():
        logits = model(
            input_ids=batch.tensors["input_ids"],
            attention_mask=batch.tensors["attention_mask"],
            position_ids=batch.tensors["position_ids"],
        ).logits
    return logits[:, -batch.tensors["responses"].shape[1] - 1 : -1]


def assert_same_adam_step(weights_a, weights_b, lr, atol=1e-5):
    """Two state dicts after the same Adam step computed along different float paths. Adam's first step is about
    lr * g / (|g| + eps): where a gradient nearly cancels, summation-order noise can flip single elements by up to
    2 lr, so all but a handful of elements must agree to ``atol`` and none may differ by more than 2.5 lr."""
    differing = sum(int((weights_a[name] - weights_b[name]).abs().gt(atol).sum()) for name in weights_a)
    assert differing <= 1e-4 * sum(w.numel() for w in weights_a.values()), differing
    assert all(float((weights_a[name] - weights_b[name]).abs().max()) <= 2.5 * lr for name in weights_a)


def checkpoints_activations(model) -> bool:
    """Whether gradient (activation) checkpointing is on, under the name this transformers release gives it."""
    flag = getattr(type(model), "is_activation_checkpointing", None)
    return bool(model.is_activation_checkpointing if flag is not None else model.is_gradient_checkpointing)


def run_on_two_gloo_ranks(function, *args) -> None:
    """Run ``function(rank, *args)`` on two spawned processes joined in a gloo process group on 127.0.0.1.

    ``function`` must be importable (spawn pickles it by name); results travel back through a ``Manager`` dict passed in
    ``args``. Each rank waits for the other at a barrier and then leaves with ``os._exit(0)``: tearing gloo down
    (``destroy_process_group`` or the interpreter's own finalization) aborted a rank now and then on 2 busy cores
    ("terminate called without an active exception": a gloo thread still joinable, or holding tensors, as C++ objects
    are destroyed), about 1 run in 4 without the barrier and once in CI with it."""
    mp.spawn(_gloo_rank, args=(free_port(), function, args), nprocs=2)


def _gloo_rank(rank: int, port: int, function, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    function(rank, *args)
    dist.barrier()
    os._exit(0)  # after the barrier both ranks have their results written: skip gloo's teardown (see above)
