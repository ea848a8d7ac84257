"""Gradient-norm clipping of FSDP2 shards, CPU-offloaded (``param_offload``), on two gloo ranks: the same norm and the
same clipped gradients as torch's clip_grad_norm_ on the whole model. (On GPUs the norm is reduced on the device: an
nccl collective cannot take the CPU shards' tensors; that path needs a GPU.)"""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.rl_core.helpers import run_on_two_gloo_ranks


def clip_on_two_ranks(rank: int, results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from rl_core.workers.fsdp import clip_grad_norm

    torch.manual_seed(0)
    sharded = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    whole = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    whole.load_state_dict(sharded.state_dict())
    mesh = init_device_mesh("cpu", (2,))
    for layer in [*sharded, sharded]:
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    sharded(x).pow(2).sum().backward()
    norm = clip_grad_norm(list(sharded.parameters()), max_norm=0.5)
    whole(x).pow(2).sum().backward()
    for parameter in whole.parameters():  # FSDP averages the ranks' gradients
        dist.all_reduce(parameter.grad)
        parameter.grad /= 2
    expected = torch.nn.utils.clip_grad_norm_(whole.parameters(), max_norm=0.5)
    clipped = [p.grad.full_tensor() for p in sharded.parameters()]
    if rank == 0:
        results["norm"] = (norm, float(expected))
        results["grads_equal"] = all(torch.allclose(a, b.grad, atol=1e-6) for a, b in zip(clipped, whole.parameters()))


def test_clipping_offloaded_fsdp2_shards_equals_clipping_the_whole_model():
    with mp.Manager() as manager:
        results = manager.dict()
        run_on_two_gloo_ranks(clip_on_two_ranks, results)
        norm, expected = results["norm"]
        # the norm was above the bound: the gradients were clipped
        assert abs(norm - expected) < 1e-5 and expected > 0.5
        assert results["grads_equal"]
