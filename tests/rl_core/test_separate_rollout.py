"""A rollout of its own, in one process: weights synced from the actor only when behind, the sync schedule, and
one-step-off (each step's samples one version behind, every prompt trained once, in order)."""

import pytest
import torch

from rl_core.ppo_step import StepWorkers, generation_on, run_ppo_step
from rl_core.separate_rollout import SeparateRollout
from rl_core.weight_sync import sync_rollout_weights
from rl_core.workers import ActorRolloutRefWorker
from tests.rl_core.test_workers import build_workers, fixed_batch, step_inputs


def rollout_worker(config):
    rollout = ActorRolloutRefWorker(config.actor_rollout_ref, role="rollout_ref")
    rollout.init_model()
    return rollout


def test_weights_move_to_the_rollout_only_when_it_is_behind(tmp_path, config):
    actor, _ = build_workers(config, with_critic=False)
    rollout = rollout_worker(config)
    assert not sync_rollout_weights(actor, rollout)  # both at version 0: the same checkpoint
    actor.update_actor(fixed_batch(actor, tmp_path, config))
    assert (actor.weights_version(), rollout.weights_version()) == (1, 0)
    assert sync_rollout_weights(actor, rollout) and rollout.weights_version() == 1
    trained = dict(actor.module.named_parameters())
    for name, parameter in rollout.module.named_parameters():
        assert torch.equal(parameter, trained[name]), name
    assert not sync_rollout_weights(actor, rollout)
    with pytest.raises(RuntimeError, match="receive_weights needs the 'rollout \\(without the actor\\)' role"):
        actor.receive_weights(actor.export_weights())


@pytest.mark.parametrize("schedule,staleness", [("sync", [0, 0, 0]), ("one_step_off", [0, 1, 1])])
def test_a_separate_rollout_trains_every_prompt_once_in_order(tmp_path, config, schedule, staleness):
    config.trainer.total_training_steps = 3
    actor, _ = build_workers(config, with_critic=False)
    data, sampler, reward, kl = step_inputs(tmp_path, actor, config, count=12)
    separate = SeparateRollout(actor, rollout_worker(config), schedule, generation_on(config, reward))
    workers = StepWorkers(actor, separate_rollout=separate)
    expected_order = [sampler.next_batch() for _ in range(3)]
    sampler.load_state_dict(type(sampler)(len(data), config.data.train_batch_size, shuffle=False).state_dict())
    try:
        for step in (1, 2, 3):
            batch, metrics = run_ppo_step(config, workers, data, sampler, reward, kl, step)
            uids = sorted(set(batch.non_tensors["uid"]))
            assert uids == sorted(f"{step}-0-{i}" for i in expected_order[step - 1])
            assert metrics["training/staleness_max"] == staleness[step - 1]
            # a generation launched ahead reports how long the rollout worked on it
            assert ("timing_s/generate_ahead" in metrics) == (staleness[step - 1] > 0)
            assert (batch.tensors["rollout_version"] == step - 1 - staleness[step - 1]).all()
            assert actor.weights_version() == step
    finally:
        separate.close()
    assert separate.pending is None  # the last step launched nothing


def test_a_resume_in_the_middle_of_one_step_off_trains_every_prompt_once(tmp_path, config):
    """A checkpoint after step 2 holds the sampler as of step 2 although step 3's prompts were already generating;
    a new controller (a new rollout, the sampler restored) draws them again: steps 1-4 train the sampler's first four
    batches, once each."""
    config.trainer.total_training_steps = 4
    actor, _ = build_workers(config, with_critic=False)
    data, sampler, reward, kl = step_inputs(tmp_path, actor, config, count=16)
    fresh_state = sampler.state_dict()
    expected = [sorted(f"{step}-0-{i}" for i in sampler.next_batch()) for step in (1, 2, 3, 4)]
    sampler.load_state_dict(fresh_state)
    trained = []

    def steps(numbers, separate):
        try:
            for step in numbers:
                batch, _ = run_ppo_step(
                    config, StepWorkers(actor, separate_rollout=separate), data, sampler, reward, kl, step
                )
                trained.append(sorted(set(batch.non_tensors["uid"])))
        finally:
            separate.close()

    steps((1, 2), SeparateRollout(actor, rollout_worker(config), "one_step_off", generation_on(config, reward)))
    checkpoint = sampler.state_dict()  # what the step-2 checkpoint holds; step 3's generation was in flight
    sampler.load_state_dict(checkpoint)
    steps((3, 4), SeparateRollout(actor, rollout_worker(config), "one_step_off", generation_on(config, reward)))
    assert trained == expected


def test_the_sync_schedule_on_a_rollout_of_its_own_is_the_colocated_run(tmp_path, config):
    """Staleness 0: the same samples, losses and metrics as generating on the trainer's own worker."""
    config.trainer.total_training_steps = 2
    runs = []
    for separate in (False, True):
        torch.manual_seed(0)
        actor, _ = build_workers(config, with_critic=False)
        data, sampler, reward, kl = step_inputs(tmp_path, actor, config)
        rollout = (
            SeparateRollout(actor, rollout_worker(config), "sync", generation_on(config, reward)) if separate else None
        )
        results = [
            run_ppo_step(config, StepWorkers(actor, separate_rollout=rollout), data, sampler, reward, kl, s)
            for s in (1, 2)
        ]
        if rollout is not None:
            rollout.close()
        runs.append(
            [
                {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/", "training/staleness"))}
                | {"responses": batch.tensors["responses"].tolist()}
                for batch, m in results
            ]
        )
    colocated, separate = runs
    assert colocated[1]["actor/entropy"] > 0 and colocated[1]["response_length/mean"] > 0
    assert separate == colocated
