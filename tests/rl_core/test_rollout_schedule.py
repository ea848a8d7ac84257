"""The asynchronous schedules' windows against verl's rule written out as a loop, and their config refusals."""

import re

import pytest
from omegaconf import OmegaConf

from flows.config import ConfigError, compose_config
from rl_core.rollout_schedule import GenerationWindow


def test_the_modes_windows():
    def window(**settings):
        return GenerationWindow.from_config(OmegaConf.create({"mode": "fully_async", **settings}))

    assert GenerationWindow.from_config(OmegaConf.create({"mode": "sync"})) == GenerationWindow(1, 1)
    assert GenerationWindow.from_config(OmegaConf.create({"mode": "one_step_off"})) == GenerationWindow(2, 1)
    # verl: (1 + staleness_threshold) x trigger_parameter_sync_step batches between two syncs
    assert window(staleness_threshold=0, trigger_parameter_sync_step=1) == GenerationWindow(1, 1)
    assert window(staleness_threshold=1, trigger_parameter_sync_step=1) == GenerationWindow(2, 1)  # one step off
    assert window(staleness_threshold=0.5, trigger_parameter_sync_step=4) == GenerationWindow(6, 4)


@pytest.mark.parametrize("steps,sync_every", [(1, 1), (2, 1), (3, 1), (2, 2), (3, 2), (6, 4), (4, 4)])
def test_each_step_generates_from_the_last_sync_point_whose_batches_reach_it(steps, sync_every):
    """Plain loop: weights synced at steps 1, 1+T, 1+2T, ... (the actor then holds version step-1); from a sync point
    the rollout generates the next W steps not yet generated. A step's samples are then at most W-1 versions old, and
    the window's last_launchable says which steps have started by each step."""
    window = GenerationWindow(steps, sync_every)
    generated_with: dict[int, int] = {}
    for step in range(1, 40):
        if (step - 1) % sync_every == 0:
            for later in range(step, step + steps):
                generated_with.setdefault(later, step - 1)
        assert max(generated_with) == window.last_launchable(step)
        staleness = (step - 1) - generated_with[step]
        assert 0 <= staleness <= window.max_staleness
    steady = [(step - 1) - generated_with[step] for step in range(20, 40)]
    assert max(steady) == window.max_staleness


# a fully asynchronous run whose generations take newer weights between two tokens
PARTIAL = [
    "rollout.n_gpus_per_node=1",
    "async_training.mode=fully_async",
    "async_training.staleness_threshold=1",
    "async_training.partial_rollout=true",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["async_training.mode=one_step_off"], "async_training.mode=one_step_off needs a rollout of its own"),
        (
            ["rollout.n_gpus_per_node=1", "async_training.staleness_threshold=1"],
            "apply to async_training.mode=fully_async",
        ),
        (
            ["rollout.n_gpus_per_node=1", "async_training.mode=fully_async", "async_training.partial_rollout=true"],
            "only a fully_async window with staleness_threshold > 0 has generations in flight at a weight sync",
        ),
        (
            [*PARTIAL, "actor_rollout_ref.rollout.checkpoint_engine.backend=naive"],
            "needs weights the generation hears coming: set actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
        ),
        (
            [*PARTIAL, "actor_rollout_ref.rollout.name=vllm"],
            "is built for actor_rollout_ref.rollout.name=hf and the trajectories ppoflow assembles",
        ),
        (
            ["rollout.n_gpus_per_node=1", "async_training.mode=fully_async", "async_training.staleness_threshold=0.5"],
            "lets 1.5 steps' prompts generate between weight syncs",
        ),
        (
            ["rollout.n_gpus_per_node=1", "async_training.mode=fully_async", "async_training.staleness_threshold=-1"],
            "the second >= 0",
        ),
        (
            ["rollout.n_gpus_per_node=3", "async_training.mode=one_step_off"],
            "use at most 2 or widen the window",
        ),
        (
            ["rollout.n_gpus_per_node=1", "async_training.mode=one_step_off", "algorithm.filter_groups.enable=true"],
            "dynamic sampling generates until enough groups differ",
        ),
        (
            ["actor_rollout_ref.rollout.checkpoint_engine.backend=gloo"],
            "this run's rollout shares the actor's (rollout.n_gpus_per_node=0); set rollout.n_gpus_per_node",
        ),
        (
            [
                "rollout.n_gpus_per_node=1",
                "trainer.device=cpu",
                "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
            ],
            "backend=nccl needs GPUs (trainer.device=cpu): use gloo",
        ),
        (
            ["rollout.n_gpus_per_node=1", "actor_rollout_ref.rollout.checkpoint_engine.backend=mpi"],
            "checkpoint_engine.backend='mpi': choose one of gloo, naive, nccl",
        ),
    ],
)
def test_schedules_that_cannot_run_are_refused_naming_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_config(overrides)


def test_asynchronous_configs_compose():
    compose_config(["rollout.n_gpus_per_node=2", "async_training.mode=one_step_off"])  # two steps, two workers
    compose_config(PARTIAL)
    config = compose_config(
        [
            "rollout.n_gpus_per_node=2",
            "async_training.mode=fully_async",
            "async_training.staleness_threshold=0.5",
            "async_training.trigger_parameter_sync_step=2",
        ]
    )
    assert GenerationWindow.from_config(config.async_training) == GenerationWindow(3, 2)


def test_agents_are_batched_in_rounds_when_synchronous_and_continuously_when_ahead():
    assert compose_config([]).actor_rollout_ref.rollout.agent.batching == "rounds"
    ahead = compose_config(["rollout.n_gpus_per_node=1", "async_training.mode=one_step_off"])
    assert ahead.actor_rollout_ref.rollout.agent.batching == "continuous"
    chosen = compose_config(["actor_rollout_ref.rollout.agent.batching=continuous"])
    assert chosen.actor_rollout_ref.rollout.agent.batching == "continuous"
    with pytest.raises(ConfigError, match="agent.batching=.eager.: choose one of continuous, rounds"):
        compose_config(["actor_rollout_ref.rollout.agent.batching=eager"])
