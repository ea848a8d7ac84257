"""``CriticWorker``: the value model — ``compute_values`` before the advantage, ``update_critic`` after it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rl_core.algos.config_access import config_get
from rl_core.algos.masked import masked_mean
from rl_core.algos.value import compute_value_loss
from rl_core.batch import Batch
from rl_core.checkpoint import load_trainable, save_trainable
from rl_core.models.logprob import response_values
from rl_core.models.lora import apply_lora
from rl_core.models.optim import build_lr_scheduler, build_optimizer
from rl_core.models.value_head import load_critic_model
from rl_core.workers.dispatch import DP_COMPUTE, ONE_TO_ALL, dispatch
from rl_core.workers.fsdp import optimizer_state_on_device, shard_module
from rl_core.workers.train_loop import local_mini_batch_size, run_updates


class CriticWorker:
    def __init__(self, config: Any):
        self.config = config
        self.model_config = config_get(config, "model")
        self.steps_trained = 0

    @dispatch(ONE_TO_ALL)
    def init_model(self) -> None:
        model, self.tokenizer = load_critic_model(self.model_config)
        self.module = shard_module(apply_lora(model, self.model_config, task_type="TOKEN_CLS"), config_get(self.config, "fsdp"))
        optim_config = config_get(self.config, "optim")
        self.optimizer = build_optimizer(self.module.parameters(), optim_config)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, optim_config)

    def _values(self, micro: Batch) -> torch.Tensor:
        return response_values(self.module, micro.tensors["input_ids"], micro.tensors["attention_mask"], micro.tensors["position_ids"],
                               micro.tensors["responses"].shape[-1], remove_padding=bool(config_get(self.model_config, "use_remove_padding", True)))

    @dispatch(DP_COMPUTE)
    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """V(s_t) for every response position, zero outside the response mask."""
        self.module.eval()
        micro = int(config_get(self.config, "forward_micro_batch_size_per_gpu", 64))
        values = torch.cat([self._values(m) for m in batch.split(micro)]) * batch.tensors["response_mask"]
        return Batch({"values": values.float()})

    @dispatch(DP_COMPUTE)
    def update_critic(self, batch: Batch) -> Batch:
        """Value-loss updates on ``batch`` (needs values, returns, response_mask); one LR-scheduler step."""
        config = self.config
        n = int(config_get(config, "rollout_n", 1))
        loss_agg_mode = config_get(config, "loss_agg_mode", "token-mean")
        cliprange_value = float(config_get(config, "cliprange_value", 0.5))

        def micro_loss(micro: Batch, info: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
            mask = micro.tensors["response_mask"]
            vpreds = self._values(micro)
            vf_loss, vf_clipfrac = compute_value_loss(vpreds, micro.tensors["returns"], micro.tensors["values"], mask, cliprange_value,
                                                      loss_agg_mode, **info)
            return vf_loss, {"critic/vf_loss": vf_loss.item(), "critic/vf_clipfrac": vf_clipfrac.item(),
                             "critic/vpred_mean": masked_mean(vpreds, mask).item()}

        with optimizer_state_on_device(self.optimizer, bool(config_get(config_get(config, "fsdp"), "optimizer_offload", False))):
            metrics = run_updates(
                "critic", self.module, self.optimizer, batch,
                mini_batch_size=local_mini_batch_size(int(config_get(config, "ppo_mini_batch_size", len(batch))) * n, "critic"),
                micro_batch_size=int(config_get(config, "ppo_micro_batch_size_per_gpu", 8)),
                epochs=int(config_get(config, "ppo_epochs", 1)), shuffle=bool(config_get(config, "shuffle", False)),
                seed=self.steps_trained, grad_clip=float(config_get(config, "grad_clip", 1.0)), micro_loss=micro_loss,
            )
        self.lr_scheduler.step()
        self.steps_trained += 1
        return Batch(meta_info={"metrics": metrics})

    @dispatch(ONE_TO_ALL)
    def save_checkpoint(self, folder: str | Path) -> None:
        save_trainable(folder, self.module, self.tokenizer, self.optimizer, self.lr_scheduler, {"steps_trained": self.steps_trained})

    @dispatch(ONE_TO_ALL)
    def load_checkpoint(self, folder: str | Path) -> None:
        self.steps_trained = int(load_trainable(folder, self.module, self.optimizer, self.lr_scheduler)["steps_trained"])
