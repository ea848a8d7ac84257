"""``ActorRolloutRefWorker``: the policy's roles fused in one process (the seed's actor / rollout / ref).

``role`` is any combination of ``actor``, ``rollout`` and ``ref`` (``actor_rollout_ref``, ``actor_rollout``,
``ref``, ...). In the hybrid engine the rollout engine samples with the actor's own module, so generation
always uses the live weights (the vllm engine gets them pushed after each update). With LoRA the reference policy
is the same module with the adapter disabled.

Models live on ``device`` (``cpu`` or ``cuda``, chosen by the controller from ``trainer.device``); each stage gets
its Batch moved there and returns its result on the CPU (:func:`rl_core.device.on_worker_device`). Forward passes
run in ``actor.fsdp_config.dtype`` over ``model.dtype`` weights (mixed precision, :func:`rl_core.device.autocast`),
generation in ``rollout.dtype`` (:func:`rl_core.device.rollout_dtype`).

Stage methods take a :class:`rl_core.batch.Batch` and return a Batch, or the update's metrics:
  generate_sequences(prompts)  -> sequences, one per prompt row (see rl_core.rollout.base)
  compute_log_prob(batch)      -> old_log_probs, entropys          (current actor, no grad)
  compute_ref_log_prob(batch)  -> ref_log_prob
  update_actor(batch)          -> {"actor/pg_loss": ..., ...}      (PPO epochs x mini x micro batches)
"""

from __future__ import annotations

import contextlib
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from rl_core.agent.runner import MultiTurnRollout
from rl_core.agent.tools.registry import configured_tools
from rl_core.algos.aggregate import agg_loss
from rl_core.algos.kl import kl_penalty
from rl_core.algos.policy_loss import get_policy_loss_fn
from rl_core.batch import Batch
from rl_core.batch_fields import (
    ATTENTION_MASK,
    ENTROPYS,
    INPUT_IDS,
    MULTI_MODAL_INPUTS,
    OLD_LOG_PROBS,
    POSITION_IDS,
    REF_LOG_PROB,
    RESPONSE_MASK,
    RESPONSES,
    ROLLOUT_CORRECTION,
    TEMPERATURE,
)
from rl_core.checkpoint import rng_state, set_rng_state
from rl_core.device import autocast, compute_dtype, memory_metrics, on_worker_device, rollout_dtype
from rl_core.models.flops import update_mfu
from rl_core.models.loading import (
    ModelLoadWarning,
    load_policy_model,
    load_policy_processor,
    load_warnings,
    padding_free_works,
    seeded_init,
)
from rl_core.models.logprob import response_log_probs
from rl_core.models.lora import adapter_disabled, apply_lora, uses_lora
from rl_core.models.multimodal import freeze_vision_tower, placeholder_token_ids, vision_model_inputs
from rl_core.models.optim import build_lr_scheduler, build_optimizer
from rl_core.rollout import build_rollout_engine
from rl_core.rollout.partial import NewerWeights
from rl_core.weight_sync import (
    InProcessTransport,
    WeightsUpdate,
    WeightTransport,
    load_tensors,
    trained_tensors,
)
from rl_core.workers.data_parallel import world_size
from rl_core.workers.dispatch import DP_COMPUTE, ONE_TO_ALL, dispatch
from rl_core.workers.fsdp import (
    full_model_state_dict,
    full_parameters,
    is_rank_zero,
    optimizer_state_on_device,
    shard_module,
)
from rl_core.workers.micro_batches import in_micro_batches, micro_batch_limits
from rl_core.workers.policy_loss_call import LossConfig, OldPassMetrics, micro_policy_loss, reads_global_batch_info
from rl_core.workers.train_loop import MicroLoss, local_mini_batch_size, run_updates
from rl_core.workers.trainable_state import load_model_weights, load_trainable, save_trainable

ROLES = ("actor", "rollout", "ref")


class ActorRolloutRefWorker:
    def __init__(
        self,
        config: Any,
        role: str = "actor_rollout_ref",
        device: str = "cpu",
        weight_transport: WeightTransport | None = None,
        partial_rollout: bool = False,
    ):
        parts = set(role.split("_"))
        if not parts or not parts <= set(ROLES):
            raise ValueError(f"role={role!r}: combine {ROLES} with '_' (e.g. actor_rollout_ref)")
        self.config = config
        self.is_actor, self.is_rollout, self.is_ref = ("actor" in parts), ("rollout" in parts), ("ref" in parts)
        self.model_config = config.model
        self.actor_config = config.actor
        self.rollout_config = config.rollout
        self.device = device
        self.compute_dtype = compute_dtype(config.actor.fsdp_config.dtype, device)
        self.rollout_dtype = torch.float32  # rollout.dtype resolved for the loaded model (init_model)
        self.remove_padding = bool(config.model.use_remove_padding)  # off when the model fails the check at load
        self.module: torch.nn.Module | None = None
        self.ref_module: torch.nn.Module | None = None
        self.steps_trained = 0  # updates done
        self.updates_started = 0  # updates begun: more than steps_trained while (or after a failure in) an update
        self.weight_transport: WeightTransport = weight_transport or InProcessTransport()
        self.loaded_version = 0  # a rollout of its own: the actor's version whose weights it holds
        # a rollout of its own over a rendezvous transport: a generation takes newer weights between two tokens
        # (async_training.partial_rollout; rl_core.rollout.partial)
        self.partial_rollout = partial_rollout

    # ------------------------------------------------------------------ set-up
    @dispatch(ONE_TO_ALL)
    @seeded_init
    def init_model(self) -> list[str]:
        """Load the policy (+LoRA) with its optimizer, the reference policy and the rollout engine, as the role needs;
        returns what loading changed or could not use (:class:`rl_core.models.loading.ModelLoadWarning`), for the log.

        With a world size > 1 the models are sharded with FSDP2 (each rank holds a slice of the weights)."""
        fsdp_config = self.actor_config.fsdp_config
        with load_warnings() as notes:
            if self.is_actor or self.is_rollout:
                train_tokens = int(self.actor_config.ppo_max_token_len_per_gpu) if self.is_actor else None
                model, self.tokenizer = load_policy_model(
                    self.model_config, self.device, self.compute_dtype, train_tokens
                )
                self.remove_padding = self.remove_padding and padding_free_works(
                    model.to(self.device), "actor_rollout_ref.model.use_remove_padding"
                )
                if self.is_actor and self.actor_config.freeze_vision_tower:
                    freeze_vision_tower(model)
                # a vision-language model's processor, saved with its checkpoints (it saves the tokenizer too)
                self.processor = load_policy_processor(self.model_config, self.tokenizer)
                self.module = shard_module(
                    apply_lora(model, self.model_config).to(self.device), fsdp_config, self.compute_dtype
                )
            if self.is_actor:
                optim_config = self.actor_config.optim
                self.optimizer = build_optimizer(self.module.parameters(), optim_config)
                self.lr_scheduler = build_lr_scheduler(self.optimizer, optim_config)
                loss_mode = self.actor_config.policy_loss.loss_mode
                self.loss_is_global = reads_global_batch_info(get_policy_loss_fn(loss_mode), self.actor_config)
                if not self.loss_is_global:
                    warnings.warn(
                        ModelLoadWarning(
                            f"policy loss {loss_mode!r} does not read config.global_batch_info: its value is taken as "
                            "a micro-batch mean and scaled by the micro-batch's share of the mini-batch (verl's legacy "
                            "path); aggregate with agg_loss(..., **config.global_batch_info) for the exact mini-batch "
                            "loss whatever the micro-batch size"
                        ),
                        stacklevel=2,
                    )
            if self.is_ref:
                if self.module is not None and uses_lora(self.model_config):
                    self.ref_module = self.module  # the base weights, with the adapter disabled in compute_ref_log_prob
                else:
                    self.ref_module, self.tokenizer = load_policy_model(
                        self.model_config, self.device, self.compute_dtype
                    )
                    self.ref_module = shard_module(
                        self.ref_module.requires_grad_(False).eval().to(self.device), fsdp_config, self.compute_dtype
                    )
            if self.is_rollout:
                hidden_size = self.module.config.get_text_config().hidden_size
                self.rollout_dtype = rollout_dtype(self.rollout_config.dtype, self.device, hidden_size)
                self.rollout = self._build_rollout()
        return notes

    def _build_rollout(self) -> Any:
        """The rollout engine on the policy's module; with partial rollout it takes newer weights between two tokens;
        wrapped in the multi-turn loop when tools or agents are configured."""
        engine = build_rollout_engine(
            self.rollout_config.name,
            model=self.module,
            tokenizer=self.tokenizer,
            rollout_config=self.rollout_config,
            model_config=self.model_config,
            compute_dtype=self.rollout_dtype,
        )
        if self.partial_rollout:
            engine.newer_weights = NewerWeights(
                held=lambda: self.loaded_version, offered=self.weight_transport.offered, take=self._take_offered_weights
            )
        multi_turn, endpoint = self.rollout_config.multi_turn, self.rollout_config.agent.endpoint
        if multi_turn.enable or endpoint.function is not None or endpoint.command is not None:
            tools = configured_tools(multi_turn) if multi_turn.enable else {}
            return MultiTurnRollout(engine, self.tokenizer, self.rollout_config, tools)
        return engine

    # ------------------------------------------------------------------ stages
    @dispatch(DP_COMPUTE)
    @on_worker_device
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Each rank samples for its shard of prompts with the full (gathered) live weights."""
        self._require(self.is_rollout, "generate_sequences", "rollout")
        with full_parameters(self.module), autocast(self.device, self.rollout_dtype):
            return self.rollout.generate_sequences(prompts)

    @dispatch(DP_COMPUTE)
    @on_worker_device
    @torch.no_grad()
    def compute_log_prob(self, batch: Batch) -> Batch:
        """old_log_probs and entropys of the responses under the current actor."""
        self._require(self.is_actor, "compute_log_prob", "actor")
        rollout = self.rollout_config
        micro, max_tokens = micro_batch_limits(
            rollout.log_prob_micro_batch_size_per_gpu,
            rollout.log_prob_use_dynamic_bsz,
            rollout.log_prob_max_token_len_per_gpu,
        )
        log_probs, entropy = self._log_probs(self.module, batch, micro, max_tokens, calculate_entropy=True)
        return Batch(
            {OLD_LOG_PROBS: log_probs, ENTROPYS: entropy},
            meta_info={TEMPERATURE: batch.meta_info.get(TEMPERATURE, 1.0)},
        )

    @dispatch(DP_COMPUTE)
    @on_worker_device
    @torch.no_grad()
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        self._require(self.is_ref, "compute_ref_log_prob", "ref")
        ref = self.config.ref
        micro, max_tokens = micro_batch_limits(
            ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu
        )
        with adapter_disabled(self.ref_module) if self.ref_module is self.module else contextlib.nullcontext():
            log_probs, _ = self._log_probs(self.ref_module, batch, micro, max_tokens, calculate_entropy=False)
        return Batch({REF_LOG_PROB: log_probs})

    @dispatch(DP_COMPUTE)
    @on_worker_device
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """One PPO update on ``batch`` (needs responses, response_mask, old_log_probs, advantages; ref_log_prob
        with ``use_kl_loss``); then one LR-scheduler step. Without ``recompute_old_log_prob`` the old log-probs are
        this update's own log-probs, detached (one epoch, one mini-batch: the same numbers), and the entropy metric
        that ``compute_log_prob`` reports comes from here. On a GPU it also reports ``perf/mfu/actor`` (the update's
        model FLOPs over its time and the GPU's peak) and the step's peak CUDA memory."""
        self._require(self.is_actor, "update_actor", "actor")
        self.updates_started += 1
        actor = self.actor_config
        own_pass = OldPassMetrics() if OLD_LOG_PROBS not in batch.tensors else None  # the step skipped that pass
        started = time.perf_counter()
        with optimizer_state_on_device(self.optimizer, bool(actor.fsdp_config.optimizer_offload)):
            metrics = run_updates(
                "actor",
                self.module,
                self.optimizer,
                batch,
                mini_batch_size=local_mini_batch_size(int(actor.ppo_mini_batch_size) * int(self.rollout_config.n)),
                micro_batch_limits=micro_batch_limits(
                    actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu
                ),
                epochs=int(actor.ppo_epochs),
                shuffle=bool(actor.shuffle),
                seed=self.steps_trained,
                grad_clip=float(actor.grad_clip),
                micro_loss=self._policy_micro_loss(batch, own_pass),
            )
        if actor.use_kl_loss:
            metrics["actor/kl_coef"] = float(actor.kl_loss_coef)
        if own_pass is not None:
            metrics.update(own_pass.metrics())
        metrics.update(
            update_mfu(
                "actor",
                self.module,
                batch.tensors[ATTENTION_MASK],
                int(actor.ppo_epochs),
                started,
                self.device,
                self.compute_dtype,
            )
        )
        metrics.update(memory_metrics(self.device))
        self.lr_scheduler.step()
        self.steps_trained += 1
        return metrics

    def _policy_micro_loss(self, batch: Batch, own_pass: OldPassMetrics | None) -> MicroLoss:
        """The update's loss on one micro-batch of ``batch``: the policy loss (``actor.policy_loss.loss_mode``), minus
        ``entropy_coeff`` x the entropy, plus ``kl_loss_coef`` x the KL to the reference with ``use_kl_loss``, each
        aggregated by ``loss_agg_mode``; ``own_pass`` collects this forward pass's log-probs as the old ones."""
        actor = self.actor_config
        loss_fn = get_policy_loss_fn(actor.policy_loss.loss_mode)
        loss_agg_mode = actor.loss_agg_mode
        entropy_coeff = float(actor.entropy_coeff)
        use_kl_loss = bool(actor.use_kl_loss)
        bypass = batch.meta_info.get(ROLLOUT_CORRECTION)  # the rollout's log-probs are the old ones
        temperature = batch.meta_info.get(TEMPERATURE, 1.0)

        def micro_loss(micro: Batch, info: dict[str, float], share: float) -> tuple[torch.Tensor, dict[str, float]]:
            mask = micro.tensors[RESPONSE_MASK]
            log_prob, entropy = self._micro_log_probs(
                self.module, micro, temperature, calculate_entropy=entropy_coeff != 0 or own_pass is not None
            )
            if own_pass is not None:
                own_pass.add(micro, log_prob, entropy, bypass)
            pg_loss, metrics = micro_policy_loss(
                micro, log_prob, loss_fn, LossConfig(actor, info), loss_agg_mode, bypass
            )
            if not self.loss_is_global:  # a micro-batch mean: weigh it by the micro-batch's share of the mini-batch
                pg_loss = pg_loss * share
            metrics = {**metrics, "actor/pg_loss": pg_loss.item()}
            loss = pg_loss
            if entropy_coeff != 0:
                entropy_loss = agg_loss(entropy, mask, loss_agg_mode, **info)
                loss = loss - entropy_coeff * entropy_loss
                metrics["actor/entropy_loss"] = entropy_loss.item()
            if use_kl_loss:
                kld = kl_penalty(log_prob, micro.tensors[REF_LOG_PROB], actor.kl_loss_type)
                kl_loss = agg_loss(kld, mask, loss_agg_mode, **info)
                loss = loss + float(actor.kl_loss_coef) * kl_loss
                metrics["actor/kl_loss"] = kl_loss.item()
            return loss, metrics

        return micro_loss

    # ------------------------------------------------------------------ weights for a rollout of its own
    @dispatch(ONE_TO_ALL)
    def weights_version(self) -> int:
        """The actor's updates done; a rollout-only worker: the actor's version whose weights it holds."""
        return self.steps_trained if self.is_actor else self.loaded_version

    @dispatch(ONE_TO_ALL)
    def open_weight_channel(self, replica: int) -> Any:
        """A rendezvous transport's channel to rollout worker ``replica``, opened by rank 0: its address, for both
        sides' :meth:`connect_weight_channel` (``infra.weight_transport.CollectiveTransport``)."""
        self._require(self.is_actor, "open_weight_channel", "actor")
        return self.weight_transport.open(replica) if is_rank_zero() else None

    @dispatch(ONE_TO_ALL)
    def connect_weight_channel(self, address: Any, replica: int | None = None) -> None:
        """Join the channel at ``address``: the actor's rank 0 its side for rollout worker ``replica``, a rollout
        worker its own (``replica`` left out); waits until the other side joins too."""
        if self.is_actor and is_rank_zero():
            self.weight_transport.connect(address, replica)
        elif not self.is_actor:
            self.weight_transport.connect(address)

    @dispatch(ONE_TO_ALL)
    def export_weights(self, to: int | None = None) -> WeightsUpdate | None:
        """The trained tensors through the weight transport (to rollout worker ``to`` when it addresses one), with the
        version (every rank gathers a sharded model, rank 0 sends: :mod:`rl_core.weight_sync`)."""
        self._require(self.is_actor, "export_weights", "actor")
        names = [name for name, _ in trained_tensors(self.module)]
        if world_size() > 1:
            state = full_model_state_dict(self.module)
            tensors = ((name, state[name]) for name in names)
        else:
            tensors = trained_tensors(self.module)
        if not is_rank_zero():
            return None
        return WeightsUpdate(self.steps_trained, self.weight_transport.send(tensors, to, self.steps_trained))

    @dispatch(ONE_TO_ALL)
    def receive_weights(self, update: WeightsUpdate) -> int:
        """A rollout-only worker takes the actor's exported weights and version; returns how many tensors moved (none
        when it holds them already: a generation took them between two tokens, partial rollout)."""
        self._require(self.is_rollout and not self.is_actor, "receive_weights", "rollout (without the actor)")
        if update.version <= self.loaded_version:
            return 0
        count = load_tensors(self.module, self.weight_transport.receive(update.handle))
        self.loaded_version = update.version
        return count

    def _take_offered_weights(self) -> int:
        """Partial rollout, between two tokens of a generation: the weights the actor sends now; their version."""
        load_tensors(self.module, self.weight_transport.receive(None))
        self.loaded_version = self.weight_transport.received_version
        return self.loaded_version

    # ------------------------------------------------------------------ checkpoints
    @dispatch(ONE_TO_ALL)
    def save_checkpoint(self, folder: str | Path) -> None:
        """Weights (HF safetensors layout, or the LoRA adapter) in ``folder``; optimizer, scheduler, RNG in
        state.safetensors."""
        self._require(self.is_actor, "save_checkpoint", "actor")
        save_trainable(
            folder,
            self.module,
            self.processor or self.tokenizer,
            self.optimizer,
            self.lr_scheduler,
            {"rng": rng_state(), "steps_trained": self.steps_trained},
        )

    @dispatch(ONE_TO_ALL)
    def load_weights(self, folder: str | Path) -> None:
        """The policy's weights only (a full model or a LoRA adapter, e.g. a registered model without training
        state)."""
        self._require(self.is_actor or self.is_rollout, "load_weights", "actor or rollout")
        load_model_weights(self.module, folder)

    @dispatch(ONE_TO_ALL)
    def load_checkpoint(self, folder: str | Path) -> None:
        self._require(self.is_actor, "load_checkpoint", "actor")
        extra = load_trainable(folder, self.module, self.optimizer, self.lr_scheduler, self.actor_config.optim)
        set_rng_state(extra["rng"])
        self.steps_trained = self.updates_started = int(extra["steps_trained"])

    # ------------------------------------------------------------------ helpers
    def _micro_log_probs(self, module: torch.nn.Module, micro: Batch, temperature: float, calculate_entropy: bool):
        vision = vision_model_inputs(
            micro.non_tensors.get(MULTI_MODAL_INPUTS), micro.tensors[INPUT_IDS], micro.tensors[ATTENTION_MASK]
        )
        with autocast(self.device, self.compute_dtype):
            return response_log_probs(
                module,
                micro.tensors[INPUT_IDS],
                micro.tensors[ATTENTION_MASK],
                micro.tensors[POSITION_IDS],
                micro.tensors[RESPONSES].shape[-1],
                temperature=temperature,
                calculate_entropy=calculate_entropy,
                remove_padding=self.remove_padding,
                entropy_chunk_size=int(self.actor_config.entropy_from_logits_chunk_size),
                vision=vision,
                placeholders=placeholder_token_ids(module),
            )

    def _log_probs(
        self,
        module: torch.nn.Module,
        batch: Batch,
        micro_batch_size: int | None,
        max_tokens: int | None,
        calculate_entropy: bool,
    ):
        module.eval()
        temperature = batch.meta_info.get(TEMPERATURE, 1.0)
        return in_micro_batches(
            batch,
            micro_batch_size,
            max_tokens,
            lambda micro: self._micro_log_probs(module, micro, temperature, calculate_entropy),
        )

    def _require(self, present: bool, method: str, role: str) -> None:
        if not present:
            raise RuntimeError(f"{method} needs the {role!r} role; this worker was built without it")
