"""The model loading pipeline on a real local HF checkpoint, its errors, LoRA, critics, optimizers, schedules."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    CodeGenConfig,
    CodeGenForCausalLM,
    Qwen2ForCausalLM,
    Qwen2ForTokenClassification,
)

from rl_core.config import ModelConfig, OptimConfig
from rl_core.models.checkpointing import (
    activation_bytes,
    apply_gradient_checkpointing,
    free_bytes,
    needs_gradient_checkpointing,
)
from rl_core.models.loading import ModelLoadError, load_hf_config, load_policy_model, resolve_model_class
from rl_core.models.lora import adapter_disabled, apply_lora
from rl_core.models.optim import apply_optim_settings, build_lr_scheduler, build_optimizer, lr_multiplier
from rl_core.models.value_head import ValueHeadModel, load_critic_model
from rl_core.workers import ActorRolloutRefWorker, CriticWorker
from tests.rl_core.helpers import checkpoints_activations


def test_make_tiny_model_cli_writes_a_checkpoint_that_loads_like_qwen25(tmp_path):
    out = tmp_path / "tiny"
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "make-tiny-model", str(out)], capture_output=True, text=True, check=True
    )
    assert str(out) in result.stdout
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    # the same pipeline a user's Qwen2.5 checkpoint takes: tokenizer -> AutoConfig -> class detection -> weights
    model, tokenizer = load_policy_model(
        ModelConfig(
            path=str(out),
            dtype="float32",
            override_config={"attention_dropout": 0.0},
            enable_gradient_checkpointing=False,
        )
    )
    assert isinstance(model, Qwen2ForCausalLM) and tokenizer.padding_side == "left"
    assert model.config.attention_dropout == 0.0 and not checkpoints_activations(model)
    checkpointed, _ = load_policy_model(ModelConfig(path=str(out), enable_gradient_checkpointing=True))
    assert checkpoints_activations(checkpointed)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    reference = AutoModelForCausalLM.from_pretrained(out)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_gradient_checkpointing_by_default_only_where_a_micro_batch_would_not_fit(tiny_model_path):
    """null: on where a micro-batch of the token budget keeps more than half of the memory left after the gradients
    and Adam's moments; an explicit true / false wins; a model that is not trained (no budget) never checkpoints."""
    model, _ = load_policy_model(ModelConfig(path=tiny_model_path, enable_gradient_checkpointing=False))
    text = model.config.get_text_config()
    parameters = sum(p.numel() for p in model.parameters())
    per_token = text.num_hidden_layers * text.hidden_size * 34 * 4 // 2  # float32: twice 16-bit's 34 bytes
    assert activation_bytes(model, 1000, torch.float32) == 1000 * per_token
    assert activation_bytes(model, 1000, torch.bfloat16) == 1000 * per_token // 2
    free = 12 * parameters + 2 * 1000 * per_token  # exactly fits 1000 tokens
    assert not needs_gradient_checkpointing(model, 1000, torch.float32, free)
    assert needs_gradient_checkpointing(model, 1001, torch.float32, free)
    # on this machine: the demo-sized model and verl's 16384-token budget fit; a budget past the memory does not
    assert not apply_gradient_checkpointing(model, None, 16384, "cpu", torch.float32)
    assert not checkpoints_activations(model)
    assert apply_gradient_checkpointing(model, None, free_bytes("cpu") // per_token + 1, "cpu", torch.float32)
    assert checkpoints_activations(model)
    assert not apply_gradient_checkpointing(model, None, None, "cpu", torch.float32)  # not trained
    default, _ = load_policy_model(ModelConfig(path=tiny_model_path), train_tokens=16384)
    assert ModelConfig().enable_gradient_checkpointing is None and not checkpoints_activations(default)
    forced, _ = load_policy_model(ModelConfig(path=tiny_model_path, enable_gradient_checkpointing=True))
    assert checkpoints_activations(forced)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such folder.*local checkpoints only"):
        load_policy_model(ModelConfig(path=str(tmp_path / "nope")))
    with pytest.raises(ModelLoadError, match="is not set"):
        load_policy_model(ModelConfig(path=None))


def test_remote_code_needs_trust_remote_code(tiny_model_path, tmp_path):
    folder = tmp_path / "remote"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="ships its own model code.*trust_remote_code=true"):
        load_policy_model(ModelConfig(path=str(folder)))


def test_unknown_architecture_and_bad_override(tiny_model_path):
    from transformers import ViTConfig

    with pytest.raises(ModelLoadError, match="ViTConfig.*not a causal LM"):
        resolve_model_class(ViTConfig())
    with pytest.raises(ModelLoadError, match="override_config.no_such_field"):
        load_hf_config(str(tiny_model_path), {"no_such_field": 1})
    with pytest.raises(ModelLoadError, match="external_lib='not_a_module_xyz'"):
        load_policy_model(ModelConfig(path=str(tiny_model_path), external_lib="not_a_module_xyz"))


def test_lora_trains_only_the_adapter_and_disabling_it_gives_the_base_model(tiny_model_path):
    base, _ = load_policy_model(ModelConfig(path=str(tiny_model_path)))
    model, _ = load_policy_model(ModelConfig(path=str(tiny_model_path)))
    model = apply_lora(model, ModelConfig(lora_rank=4, lora_alpha=8, target_modules="all-linear"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # make the adapter non-trivial
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        with adapter_disabled(model):
            disabled = model(input_ids=ids).logits
        enabled = model(input_ids=ids).logits
        expected = base(input_ids=ids).logits
    assert torch.allclose(disabled, expected, atol=1e-6)
    assert not torch.allclose(enabled, expected, atol=1e-3)


def test_a_model_without_lora_is_returned_as_it_is_without_importing_peft(monkeypatch):
    # peft is ~230 modules on each worker's start (and a standby worker imports what a used one had)
    monkeypatch.setitem(sys.modules, "peft", None)  # an import of peft would now raise ImportError
    model = torch.nn.Linear(2, 2)
    assert apply_lora(model, ModelConfig()) is model
    with pytest.raises(ImportError):
        apply_lora(model, ModelConfig(lora_rank=4, lora_alpha=8, target_modules="all-linear"))


def test_no_layer_is_swapped_for_a_kernel_from_the_hub(tiny_model_path):
    # transformers 5 with the `kernels` package (its dependency) kernelizes a model by default: layers replaced by
    # code downloaded from the Hugging Face Hub, and a re-kernelization at each train()/eval() switch
    assert AutoModelForCausalLM.from_pretrained(tiny_model_path).use_kernels  # what a plain load does here
    policy, _ = load_policy_model(ModelConfig(path=str(tiny_model_path)))
    critic, _ = load_critic_model(ModelConfig(path=str(tiny_model_path)))
    for model in (policy, critic):
        assert not model.use_kernels and model.kernels_mode is None
        model.train()
        assert model.kernels_mode is None


def test_critic_uses_token_classification_when_available(tiny_model_path):
    critic, _ = load_critic_model(ModelConfig(path=str(tiny_model_path)))
    assert isinstance(critic, Qwen2ForTokenClassification)
    values = critic(input_ids=torch.tensor([[1, 2, 3]])).logits[..., 0]
    assert values.shape == (1, 3)


def test_critic_falls_back_to_a_value_head(tiny_model_path, tmp_path):
    # CodeGen has a causal LM but no token-classification class in transformers
    folder = tmp_path / "codegen"
    CodeGenForCausalLM(
        CodeGenConfig(vocab_size=320, n_embd=32, n_layer=1, n_head=4, n_positions=64, rotary_dim=4)
    ).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_path / name, folder / name)
    critic, _ = load_critic_model(ModelConfig(path=str(folder)))
    assert isinstance(critic, ValueHeadModel)
    values = critic(input_ids=torch.tensor([[1, 2, 3]])).logits[..., 0]
    assert values.shape == (1, 3)
    critic.save_pretrained(tmp_path / "saved")
    # as a worker's checkpoint holds them
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        shutil.copy(tiny_model_path / name, tmp_path / "saved" / name)
    reloaded, _ = load_critic_model(ModelConfig(path=str(tmp_path / "saved")))
    assert isinstance(reloaded, ValueHeadModel)
    assert torch.allclose(
        reloaded(input_ids=torch.tensor([[1, 2, 3]])).logits, critic(input_ids=torch.tensor([[1, 2, 3]])).logits
    )


def test_lr_schedules_by_hand():
    # constant with 2 warm-up steps: 0, .5, 1, 1 ; cosine over 10 steps after 2 warm-up, half a cycle, min ratio .1
    assert [lr_multiplier(s, "constant", 2, 10) for s in range(4)] == [0.0, 0.5, 1.0, 1.0]
    assert lr_multiplier(2, "cosine", 2, 10, 0.1) == pytest.approx(1.0)
    assert lr_multiplier(6, "cosine", 2, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(10, "cosine", 2, 10, 0.1) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="lr_scheduler_type='linear'"):
        lr_multiplier(5, "linear", 0, 10)


def test_optimizer_and_scheduler_from_config():
    layer = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(layer.parameters(), OptimConfig(lr=0.1, weight_decay=0.0, betas=[0.9, 0.99]))
    scheduler = build_lr_scheduler(
        optimizer, OptimConfig(lr_scheduler_type="cosine", lr_warmup_steps_ratio=0.5, total_training_steps=4)
    )
    lrs = []
    for _ in range(4):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.0, 0.05, 0.1, 0.1 * 0.5 * (1 + math.cos(math.pi * 0.5))])
    with pytest.raises(ValueError, match="needs optim.total_training_steps"):
        build_lr_scheduler(optimizer, OptimConfig(lr_scheduler_type="cosine"))


def test_the_optimizer_on_the_cpu_is_fused_and_takes_adamws_steps():
    """Three steps on random gradients equal AdamW written out as a plain loop over the elements (decoupled weight
    decay, bias-corrected moments), with the fused kernel chosen for CPU parameters."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 4))
    config = OptimConfig(lr=0.05, weight_decay=0.1, betas=[0.8, 0.95])
    optimizer = build_optimizer([weight], config)
    assert optimizer.defaults["fused"] is True
    expected = weight.detach().clone().flatten().tolist()
    m, v = [0.0] * len(expected), [0.0] * len(expected)
    (b1, b2), lr, eps = config.betas, config.lr, 1e-8
    for t in range(1, 4):
        grad = torch.randn(3, 4)
        weight.grad = grad.clone()
        optimizer.step()
        for i, g in enumerate(grad.flatten().tolist()):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            expected[i] *= 1 - lr * config.weight_decay
            expected[i] -= lr * (m[i] / (1 - b1**t)) / (math.sqrt(v[i] / (1 - b2**t)) + eps)
    assert weight.detach().flatten().tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_restore_takes_the_configs_optimizer_settings_and_keeps_the_moments():
    """Resume under a new learning rate (the advice of a NaN loss): the restored optimizer and schedule use it."""

    def trained(config: OptimConfig, steps: int):
        layer = torch.nn.Linear(3, 1)
        optimizer = build_optimizer(layer.parameters(), config)
        scheduler = build_lr_scheduler(optimizer, config)
        for _ in range(steps):
            layer(torch.randn(4, 3)).pow(2).sum().backward()
            optimizer.step()
            scheduler.step()
        return optimizer, scheduler

    old = OptimConfig(lr=0.1, betas=[0.9, 0.99], lr_scheduler_type="cosine", lr_warmup_steps=1, total_training_steps=10)
    saved_optimizer, saved_scheduler = trained(old, 3)
    for new, expected_lr in (
        (old, saved_optimizer.param_groups[0]["lr"]),
        (
            OptimConfig(
                lr=0.02,
                betas=[0.5, 0.9],
                weight_decay=0.3,
                lr_scheduler_type="cosine",
                lr_warmup_steps=1,
                total_training_steps=20,
            ),
            0.02 * lr_multiplier(3, "cosine", 1, 20),
        ),
    ):
        optimizer, scheduler = trained(new, 0)
        optimizer.load_state_dict(saved_optimizer.state_dict())
        scheduler.load_state_dict(saved_scheduler.state_dict())
        apply_optim_settings(optimizer, scheduler, new)
        group = optimizer.param_groups[0]
        assert group["lr"] == pytest.approx(expected_lr) and list(group["betas"]) == list(new.betas)
        assert group["weight_decay"] == new.weight_decay and scheduler.last_epoch == 3
        moments = [state["exp_avg"] for state in optimizer.state.values()]
        assert all(torch.equal(a, b["exp_avg"]) for a, b in zip(moments, saved_optimizer.state.values()))
        scheduler.step()  # the schedule goes on from the new base learning rate
        assert group["lr"] == pytest.approx(float(new.lr) * lr_multiplier(4, "cosine", 1, new.total_training_steps))


def test_what_a_load_makes_anew_is_the_same_in_every_process_and_leaves_torch_s_generator_alone(config):
    """A critic's new value head and LoRA's adapters: torch seeds a new process's generator at random, which the
    generator's state drawn on between two loads stands in for here."""
    config.actor_rollout_ref.model.lora_rank = 4
    made = []
    for _ in range(2):
        torch.rand(100)  # another process's generator
        before = torch.random.get_rng_state()
        critic, actor = CriticWorker(config.critic), ActorRolloutRefWorker(config.actor_rollout_ref, "actor")
        critic.init_model()
        actor.init_model()
        assert torch.equal(torch.random.get_rng_state(), before)  # a run's later draws are its own
        new = {f"critic.{k}": v for k, v in critic.module.state_dict().items() if "score" in k}
        new |= {f"actor.{k}": v for k, v in actor.module.state_dict().items() if "lora_A" in k}
        made.append(new)
    assert any(k.startswith("critic.") for k in made[0]) and any(k.startswith("actor.") for k in made[0])
    assert made[0].keys() == made[1].keys() and all(torch.equal(made[0][k], made[1][k]) for k in made[0])
