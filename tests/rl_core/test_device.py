"""Devices and mixed precision: trainer.device resolution, Batch moves at a stage's edges, bf16 compute over fp32
weights (run on the CPU: torch's CPU autocast is the same code path), the static-cache rollout, FLOP counting.
No GPU exists here: the CUDA-only pieces are run by bench/gpu_check.py on a GPU machine."""

import pytest
import torch
from omegaconf import OmegaConf

from rl_core import device
from rl_core.batch import Batch
from rl_core.config_checks import ConfigValueError, check_config
from rl_core.device import (
    DeviceError,
    compute_dtype,
    cuda_device_index,
    on_worker_device,
    resolve_device,
    rollout_dtype,
)
from rl_core.input_checks import device_problems
from rl_core.models.flops import matmul_weights, mfu, peak_flops, training_flops
from rl_core.models.loading import load_policy_model
from rl_core.models.value_head import load_critic_model
from rl_core.rollout import build_rollout_engine
from rl_core.workers import ActorRolloutRefWorker
from tests.rl_core.helpers import addition_dataset


def test_trainer_device_resolves_against_the_clusters_gpus():
    assert resolve_device("auto", 0) == "cpu" and resolve_device("auto", 2) == "cuda"
    assert resolve_device("cpu", 8) == "cpu" and resolve_device("cuda", 1) == "cuda"
    with pytest.raises(DeviceError, match="trainer.device=cuda but the cluster has no GPU.*trainer.device=cpu"):
        resolve_device("cuda", 0)
    with pytest.raises(DeviceError, match="choose one of auto, cpu, cuda"):
        resolve_device("tpu", 0)
    assert compute_dtype("auto", "cuda") == torch.bfloat16 and compute_dtype("auto", "cpu") == torch.float32
    assert compute_dtype("fp16", "cpu") == torch.float16


def test_cuda_on_a_machine_without_a_gpu_is_refused_before_anything_starts(config):
    assert not torch.cuda.is_available()  # this test describes the CPU-only development machines
    config.trainer.device = "cuda"
    (problem,) = device_problems(config)
    assert "trainer.device=cuda but torch sees no GPU" in problem and "trainer.device=cpu" in problem
    config.trainer.ray.address = "10.0.0.1:6379"  # a remote cluster's GPUs are checked once connected
    assert device_problems(config) == []


def test_a_ray_worker_that_sees_one_gpu_uses_device_0_whatever_its_local_rank():
    """Ray gives an actor with num_gpus=1 only its own GPU: local rank 3 of a node is then cuda:0 (asking for cuda:3
    failed every rank >= 1 before). A process that sees all of its node's GPUs (torchrun) uses its local rank."""
    assert cuda_device_index(3, 1) == 0 and cuda_device_index(0, 1) == 0
    assert cuda_device_index(3, 8) == 3
    with pytest.raises(DeviceError, match="local rank 5, but this process sees 2 GPU"):
        cuda_device_index(5, 2)


def test_float16_training_is_refused(config):
    """Without a loss scaler float16 gradients underflow silently: refused, with the way out."""
    for key in ("actor_rollout_ref.actor.fsdp_config.dtype", "critic.fsdp.dtype", "actor_rollout_ref.model.dtype"):
        changed = config.copy()
        OmegaConf.update(changed, key, "fp16")
        with pytest.raises(ConfigValueError, match=rf"{key}=float16.*loss scaling.*bfloat16"):
            check_config(changed)


def test_tensor_parallel_rollout_needs_vllm(config):
    config.trainer.n_gpus_per_node = 4
    config.actor_rollout_ref.rollout.tensor_model_parallel_size = 2
    with pytest.raises(
        ConfigValueError, match="tensor_model_parallel_size=2: tensor parallelism needs rollout.name=vllm"
    ):
        check_config(config)
    config.actor_rollout_ref.rollout.name = "vllm"
    check_config(config)
    config.actor_rollout_ref.rollout.tensor_model_parallel_size = 3
    with pytest.raises(ConfigValueError, match="a divisor of trainer.n_gpus_per_node=4"):
        check_config(config)


def test_a_stage_sees_its_batch_on_the_worker_device_and_returns_it_on_the_cpu():
    seen = {}

    class Worker:
        device = "meta"  # a device torch has everywhere, standing in for cuda

        @on_worker_device
        def stage(self, batch: Batch, extra: int) -> Batch:
            seen["device"], seen["extra"] = batch.tensors["x"].device.type, extra
            return Batch({"y": torch.ones(2)}, meta_info={"m": 1})

    batch = Batch({"x": torch.arange(2.0)}, {"s": ["a", "b"]}, {"step": 3})
    out = Worker().stage(batch, 7)
    assert seen == {"device": "meta", "extra": 7}
    assert batch.tensors["x"].device.type == "cpu"  # the caller's batch is not moved
    assert out.tensors["y"].device.type == "cpu" and out.meta_info == {"m": 1}


def test_bf16_compute_keeps_fp32_weights_and_matches_fp32_log_probs(tmp_path, config):
    """Mixed precision: weights, gradients and Adam state stay float32; log-probs agree with float32 compute to bf16
    precision; an update changes the weights."""
    dataset = addition_dataset(tmp_path, load_policy_model(config.actor_rollout_ref.model)[1], config.data, count=4)
    prompts = dataset.collate(list(range(4)), uid_prefix="s0-")
    workers = {}
    for dtype in ("float32", "bfloat16"):
        node = OmegaConf.create(OmegaConf.to_container(config.actor_rollout_ref, resolve=True))
        node.actor.fsdp_config.dtype, node.actor.use_kl_loss = dtype, False
        workers[dtype] = ActorRolloutRefWorker(node, "actor_rollout")
        workers[dtype].init_model()
    sequences = workers["float32"].generate_sequences(prompts)
    fp32 = workers["float32"].compute_log_prob(sequences).tensors["old_log_probs"]
    bf16 = workers["bfloat16"].compute_log_prob(sequences).tensors["old_log_probs"]
    mask = sequences.tensors["response_mask"].bool()
    assert bf16.dtype == torch.float32
    assert 0 < float((bf16 - fp32)[mask].abs().max()) < 0.1  # bf16 really ran (not bit-identical), to its precision

    worker = workers["bfloat16"]
    before = {k: v.clone() for k, v in worker.module.state_dict().items()}
    batch = sequences.union(Batch({"old_log_probs": bf16, "advantages": torch.randn(mask.shape) * mask}))
    metrics = worker.update_actor(batch)
    assert all(p.dtype == torch.float32 for p in worker.module.parameters())
    assert all(v.dtype == torch.float32 for s in worker.optimizer.state.values() for k, v in s.items() if k != "step")
    assert any(not torch.equal(before[k], v) for k, v in worker.module.state_dict().items())
    # GPU-only metrics
    assert "perf/mfu/actor" not in metrics and not any(k.startswith("perf/max_memory") for k in metrics)


def test_the_rollout_dtype_auto_is_bf16_where_it_is_the_faster(monkeypatch):
    """verl samples in bf16; on a CPU without bf16 instructions torch emulates it (slower), and for a narrow model
    autocast's per-op cost outweighs the smaller matmuls: auto keeps float32 there. The probe of this CPU is replaced
    to see both kinds of CPU."""
    assert rollout_dtype("auto", "cuda", 64) == torch.bfloat16 and rollout_dtype("float32", "cuda", 64) == torch.float32
    for has_bf16, wide in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(device, "cpu_computes_bf16", lambda has_bf16=has_bf16: has_bf16)
        assert rollout_dtype("auto", "cpu", 896) == wide and rollout_dtype("auto", "cpu", 64) == torch.float32
        assert rollout_dtype("bf16", "cpu", 64) == torch.bfloat16
    with pytest.raises(DeviceError, match="rollout.dtype='half': choose one of auto, float32"):
        rollout_dtype("half", "cpu", 896)


def test_generation_computes_in_the_rollout_dtype_and_the_passes_in_their_own(tmp_path, config):
    """rollout.dtype=bfloat16 over float32 training: the sampler's log-probs differ from the recomputed float32 ones
    by bf16's precision (they are equal to float32's precision when both compute in float32)."""
    dataset = addition_dataset(tmp_path, load_policy_model(config.actor_rollout_ref.model)[1], config.data, count=4)
    prompts = dataset.collate(list(range(4)), uid_prefix="s0-").repeat_interleave(4)
    differences = {}
    for dtype in ("float32", "bfloat16"):
        node = OmegaConf.create(OmegaConf.to_container(config.actor_rollout_ref, resolve=True))
        node.rollout.dtype, node.rollout.calculate_log_probs, node.actor.fsdp_config.dtype = dtype, True, "float32"
        worker = ActorRolloutRefWorker(node, "actor_rollout")
        worker.init_model()
        sequences = worker.generate_sequences(prompts)
        recomputed = worker.compute_log_prob(sequences).tensors["old_log_probs"]
        mask = sequences.tensors["response_mask"].bool()
        differences[dtype] = float((sequences.tensors["rollout_log_probs"] - recomputed)[mask].abs().max())
    assert differences["float32"] < 1e-4
    assert 1e-3 < differences["bfloat16"] < 0.5, differences


def test_static_kv_cache_rollout_gives_the_eager_tokens(tmp_path, config):
    model, tokenizer = load_policy_model(config.actor_rollout_ref.model)
    prompts = addition_dataset(tmp_path, tokenizer, config.data, count=4).collate(list(range(4)), uid_prefix="s0-")
    outputs = []
    for enforce_eager in (True, False):
        config.actor_rollout_ref.rollout.enforce_eager = enforce_eager
        engine = build_rollout_engine(
            "hf", model=model, tokenizer=tokenizer, rollout_config=config.actor_rollout_ref.rollout
        )
        outputs.append(engine.generate_sequences(prompts))
    assert torch.equal(outputs[0].tensors["responses"], outputs[1].tensors["responses"])


def test_training_flops_match_a_hand_count(config):
    """Qwen2 tiny: every projection and the (tied) output layer, counted from the config by hand."""
    model, _ = load_policy_model(config.actor_rollout_ref.model)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    q, kv, o = (
        c.hidden_size * c.num_attention_heads * head_dim,
        2 * c.hidden_size * c.num_key_value_heads * head_dim,
        c.hidden_size**2,
    )
    mlp = 3 * c.hidden_size * c.intermediate_size
    n = c.num_hidden_layers * (q + kv + o + mlp) + c.vocab_size * c.hidden_size
    assert matmul_weights(model) == n
    lengths = torch.tensor([3, 5])
    width = c.num_attention_heads * head_dim
    assert training_flops(model, lengths) == 6 * n * 8 + 12 * c.num_hidden_layers * width * (9 + 25)
    critic, _ = load_critic_model(config.critic.model)  # no output layer; a value head of hidden_size weights instead
    assert (
        training_flops(critic, lengths)
        == 6 * (n - c.vocab_size * c.hidden_size + c.hidden_size) * 8 + 12 * c.num_hidden_layers * width * 34
    )


def test_mfu_only_where_a_peak_is_known(monkeypatch):
    assert peak_flops("cpu", torch.bfloat16) is None and mfu("actor", 1e12, 1.0, "cpu", torch.bfloat16) == {}
    # the GPU's name is what a CUDA machine would report (no GPU here)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40S")
    assert peak_flops("cuda", torch.bfloat16) == 362e12 and peak_flops("cuda", torch.float32) is None
    assert mfu("actor", 181e12, 2.0, "cuda", torch.bfloat16) == {"perf/mfu/actor": 0.25}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some Future GPU")
    assert mfu("actor", 1e12, 1.0, "cuda", torch.bfloat16) == {}
