"""When a rollout of its own generates which step's prompts: the window of steps ahead of the trainer (torch-free: the
config check uses it before anything loads).

verl's asynchronous recipes bound how far the rollout runs ahead of the trainer by admitting work, never by throwing
finished samples away. Its weights are synced every ``T = trigger_parameter_sync_step`` steps (at steps 1, 1+T,
1+2T, ...: a *sync point*); from a sync point the rollout may generate the next ``W`` steps' prompts with the weights
it then holds::

    W = (1 + staleness_threshold) * T        (verl: at most that many batches between two syncs)

so step k's generation may start once step ``k - W + 1``'s period has begun, and the samples a step trains on are at
most ``W - 1`` policy versions old. The schedules (``async_training.mode``) are windows:

* ``sync``: ``W = 1, T = 1``: each step generates its own prompts with the latest weights (staleness 0);
* ``one_step_off`` (verl's one_step_off_policy): ``W = 2, T = 1``: step k+1's generation overlaps step k's training;
* ``fully_async`` (verl's fully_async_policy): ``W`` and ``T`` from ``staleness_threshold`` and
  ``trigger_parameter_sync_step``; several generations may be in flight at once, one per rollout worker.

The window counts whole steps (a step's prompts are generated together, GRPO groups whole), so ``(1 + s) * T`` must
be a whole number. verl's ``require_batches`` (mini-batches per trainer fetch) is ``data.train_batch_size /
ppo_mini_batch_size`` here: a step trains on one step's batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEDULES = ("sync", "one_step_off", "fully_async")
AGENT_BATCHING = ("rounds", "continuous")  # how multi-turn trajectories share generation (rl_core/agent/endpoint.py)


def agent_batching(mode: str) -> str:
    """``rollout.agent.batching``'s default for ``async_training.mode``: the deterministic rounds for a synchronous
    run, continuous batching (each trajectory on its own) when the rollout runs ahead of the trainer."""
    return "rounds" if mode == "sync" else "continuous"


@dataclass(frozen=True)
class GenerationWindow:
    """``steps`` (W): the steps a sync point's weights may generate; ``sync_every`` (T): steps between syncs."""

    steps: int = 1
    sync_every: int = 1

    @classmethod
    def from_config(cls, async_training: Any) -> GenerationWindow:
        """The window of ``async_training.mode`` (see the module docstring); the values are checked by
        :func:`check_async_training`."""
        mode = async_training.mode
        if mode == "sync":
            return cls(1, 1)
        if mode == "one_step_off":
            return cls(2, 1)
        sync_every = int(async_training.trigger_parameter_sync_step)
        return cls(round((1 + float(async_training.staleness_threshold)) * sync_every), sync_every)

    @property
    def max_staleness(self) -> int:
        """The most policy versions a trained sample can be behind the actor that trains on it."""
        return self.steps - 1

    def last_launchable(self, step: int) -> int:
        """The last step whose generation may have started by step ``step``: its period's sync point + W - 1."""
        return step - (step - 1) % self.sync_every + self.steps - 1


def rollout_workers(config: Any) -> int:
    """How many rollout workers a rollout of its own has (``rollout.nnodes x rollout.n_gpus_per_node``): each is a
    replica of the policy that generates whole steps (verl: one rollout replica per GPU at tensor parallel size 1)."""
    return int(config.rollout.nnodes) * int(config.rollout.n_gpus_per_node)


def check_async_training(config: Any, error: type[Exception] = ValueError) -> None:
    """A rollout of its own (``rollout.*``) and its schedule (``async_training.*``): what they need and what is not
    built, as ``error`` naming the key and the fix."""
    pool, settings = config.rollout, config.async_training
    mode = settings.mode
    if pool.n_gpus_per_node < 0 or pool.nnodes < 1:
        raise error(
            f"rollout.nnodes={pool.nnodes}, rollout.n_gpus_per_node={pool.n_gpus_per_node}: nnodes >= 1 and "
            "n_gpus_per_node >= 0 (0: the rollout on the trainer's workers)"
        )
    if mode != "fully_async" and (settings.staleness_threshold != 0 or settings.trigger_parameter_sync_step != 1):
        raise error(
            f"async_training.staleness_threshold={settings.staleness_threshold} / trigger_parameter_sync_step="
            f"{settings.trigger_parameter_sync_step} apply to async_training.mode=fully_async (mode={mode} fixes its "
            "window); set mode=fully_async or leave them at 0 and 1"
        )
    if settings.trigger_parameter_sync_step < 1 or not settings.staleness_threshold >= 0:
        raise error(
            f"async_training.trigger_parameter_sync_step={settings.trigger_parameter_sync_step}, staleness_threshold="
            f"{settings.staleness_threshold}: the first >= 1 (updates between weight syncs), the second >= 0"
        )
    steps = (1 + float(settings.staleness_threshold)) * int(settings.trigger_parameter_sync_step)
    if abs(steps - round(steps)) > 1e-9:
        raise error(
            f"async_training.staleness_threshold={settings.staleness_threshold} with trigger_parameter_sync_step="
            f"{settings.trigger_parameter_sync_step} lets {steps:g} steps' prompts generate between weight syncs: the "
            "rollout generates whole steps, so (1 + staleness_threshold) x trigger_parameter_sync_step must be whole "
            "(e.g. staleness_threshold 0 or 1 for trigger_parameter_sync_step=1, 0 or 0.5 for 2)"
        )
    if settings.partial_rollout:
        check_partial_rollout(config, error)
    if pool.n_gpus_per_node == 0:
        if mode != "sync":
            raise error(
                f"async_training.mode={mode} needs a rollout of its own: set rollout.n_gpus_per_node (e.g. 1), the "
                "rollout's workers beside the trainer's"
            )
        return
    window = GenerationWindow.from_config(settings)
    if rollout_workers(config) > window.steps:
        raise error(
            f"rollout.nnodes x rollout.n_gpus_per_node = {rollout_workers(config)} rollout workers, but "
            f"async_training (mode={mode}) lets at most {window.steps} step(s) generate at once: each worker generates "
            f"whole steps, so the others would wait; use at most {window.steps} or widen the window "
            "(mode=fully_async with a larger staleness_threshold or trigger_parameter_sync_step)"
        )
    if window.steps > 1 and config.algorithm.filter_groups.enable:
        raise error(
            f"async_training.mode={mode} generates steps ahead, with algorithm.filter_groups.enable=true: dynamic "
            "sampling generates until enough groups differ, which cannot be launched ahead; use mode=sync"
        )


def check_partial_rollout(config: Any, error: type[Exception]) -> None:
    """``async_training.partial_rollout=true`` (rl_core/rollout/partial.py) needs a window that lets a generation be
    in flight at a weight sync, a transport that tells the generation newer weights are coming, and the HF engine
    with trajectories the project assembles (single turn, the tool loop, endpoint agents; not loops of one's own)."""
    settings, rollout = config.async_training, config.actor_rollout_ref.rollout
    fix = "or set async_training.partial_rollout=false"
    if settings.mode != "fully_async" or not settings.staleness_threshold > 0:
        raise error(
            f"async_training.partial_rollout=true with mode={settings.mode}, staleness_threshold="
            f"{settings.staleness_threshold}: only a fully_async window with staleness_threshold > 0 has generations "
            f"in flight at a weight sync (verl's rule); set them, {fix}"
        )
    if rollout.checkpoint_engine.backend == "naive":
        raise error(
            "async_training.partial_rollout=true needs weights the generation hears coming: set "
            f"actor_rollout_ref.rollout.checkpoint_engine.backend=gloo (CPUs) or nccl (GPUs), {fix}"
        )
    if rollout.name != "hf" or rollout.agent.agent_loop_config_path:
        raise error(
            "async_training.partial_rollout=true is built for actor_rollout_ref.rollout.name=hf and the trajectories "
            "ppoflow assembles (single turn, the tool loop, endpoint agents), not loops of one's own (this run: "
            f"name={rollout.name}, agent_loop_config_path={rollout.agent.agent_loop_config_path}); {fix}"
        )
