"""``CriticWorker``: the value model — ``compute_values`` before the advantage, ``update_critic`` after it.

On ``device`` with ``critic.fsdp.dtype`` compute, like the actor (see :mod:`rl_core.workers.actor_rollout_ref`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from rl_core.algos.masked import masked_mean
from rl_core.algos.value import compute_value_loss
from rl_core.batch import Batch
from rl_core.batch_fields import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, RESPONSE_MASK, RESPONSES, RETURNS, VALUES
from rl_core.device import autocast, compute_dtype, on_worker_device
from rl_core.models.flops import update_mfu
from rl_core.models.loading import load_warnings, padding_free_works, seeded_init
from rl_core.models.logprob import response_values
from rl_core.models.lora import apply_lora
from rl_core.models.optim import build_lr_scheduler, build_optimizer
from rl_core.models.value_head import load_critic_model
from rl_core.workers.dispatch import DP_COMPUTE, ONE_TO_ALL, dispatch
from rl_core.workers.fsdp import optimizer_state_on_device, shard_module
from rl_core.workers.micro_batches import in_micro_batches, micro_batch_limits
from rl_core.workers.train_loop import local_mini_batch_size, run_updates
from rl_core.workers.trainable_state import load_trainable, save_trainable


class CriticWorker:
    def __init__(self, config: Any, device: str = "cpu"):
        self.config = config
        self.device = device
        self.compute_dtype = compute_dtype(config.fsdp.dtype, device)
        self.model_config = config.model
        self.steps_trained = 0  # updates done
        self.updates_started = 0  # updates begun (see ActorRolloutRefWorker)

    @dispatch(ONE_TO_ALL)
    @seeded_init
    def init_model(self) -> list[str]:
        """Load the critic (+LoRA) and its optimizer; returns what loading changed or could not use, for the log."""
        with load_warnings() as notes:
            model, self.tokenizer = load_critic_model(
                self.model_config, self.device, self.compute_dtype, int(self.config.ppo_max_token_len_per_gpu)
            )
            self.remove_padding = bool(self.model_config.use_remove_padding) and padding_free_works(
                model.to(self.device), "critic.model.use_remove_padding"
            )
        self.module = shard_module(
            apply_lora(model, self.model_config, task_type="TOKEN_CLS").to(self.device),
            self.config.fsdp,
            self.compute_dtype,
        )
        optim_config = self.config.optim
        self.optimizer = build_optimizer(self.module.parameters(), optim_config)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, optim_config)
        return notes

    def _values(self, micro: Batch) -> torch.Tensor:
        with autocast(self.device, self.compute_dtype):
            values = response_values(
                self.module,
                micro.tensors[INPUT_IDS],
                micro.tensors[ATTENTION_MASK],
                micro.tensors[POSITION_IDS],
                micro.tensors[RESPONSES].shape[-1],
                remove_padding=self.remove_padding,
            )
        return values.float()

    @dispatch(DP_COMPUTE)
    @on_worker_device
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """V(s_t) for every response position, zero outside the response mask."""
        self.module.eval()
        config = self.config
        micro, max_tokens = micro_batch_limits(
            config.forward_micro_batch_size_per_gpu, config.use_dynamic_bsz, config.forward_max_token_len_per_gpu
        )
        (values,) = in_micro_batches(batch, micro, max_tokens, lambda m: (self._values(m),))
        values = values * batch.tensors[RESPONSE_MASK]
        return Batch({VALUES: values})

    @dispatch(DP_COMPUTE)
    @on_worker_device
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Value-loss updates on ``batch`` (needs values, returns, response_mask); one LR-scheduler step. On a GPU it
        also
        reports ``perf/mfu/critic``."""
        self.updates_started += 1
        config = self.config
        n = int(config.rollout_n)
        loss_agg_mode = config.loss_agg_mode
        cliprange_value = float(config.cliprange_value)
        started = time.perf_counter()

        def micro_loss(micro: Batch, info: dict[str, float], _share: float) -> tuple[torch.Tensor, dict[str, float]]:
            mask = micro.tensors[RESPONSE_MASK]
            vpreds = self._values(micro)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds, micro.tensors[RETURNS], micro.tensors[VALUES], mask, cliprange_value, loss_agg_mode, **info
            )
            return vf_loss, {
                "critic/vf_loss": vf_loss.item(),
                "critic/vf_clipfrac": vf_clipfrac.item(),
                "critic/vpred_mean": masked_mean(vpreds, mask).item(),
            }

        with optimizer_state_on_device(self.optimizer, bool(config.fsdp.optimizer_offload)):
            metrics = run_updates(
                "critic",
                self.module,
                self.optimizer,
                batch,
                mini_batch_size=local_mini_batch_size(int(config.ppo_mini_batch_size) * n),
                micro_batch_limits=micro_batch_limits(
                    config.ppo_micro_batch_size_per_gpu, config.use_dynamic_bsz, config.ppo_max_token_len_per_gpu
                ),
                epochs=int(config.ppo_epochs),
                shuffle=bool(config.shuffle),
                seed=self.steps_trained,
                grad_clip=float(config.grad_clip),
                micro_loss=micro_loss,
            )
        metrics.update(
            update_mfu(
                "critic",
                self.module,
                batch.tensors[ATTENTION_MASK],
                int(config.ppo_epochs),
                started,
                self.device,
                self.compute_dtype,
            )
        )
        self.lr_scheduler.step()
        self.steps_trained += 1
        return metrics

    @dispatch(ONE_TO_ALL)
    def save_checkpoint(self, folder: str | Path) -> None:
        save_trainable(
            folder,
            self.module,
            self.tokenizer,
            self.optimizer,
            self.lr_scheduler,
            {"steps_trained": self.steps_trained},
        )

    @dispatch(ONE_TO_ALL)
    def load_checkpoint(self, folder: str | Path) -> None:
        self.steps_trained = self.updates_started = int(
            load_trainable(folder, self.module, self.optimizer, self.lr_scheduler, self.config.optim)["steps_trained"]
        )
