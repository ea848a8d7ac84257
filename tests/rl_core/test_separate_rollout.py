"""A rollout of its own, in one process: weights synced from the actor only when behind, and the schedules' windows
(sync, one step off, fully asynchronous with one or two rollout workers): each step's samples as many versions
behind as the window says, every prompt trained once, in order, across a resume too."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from infra.weight_transport import CollectiveTransport
from rl_core.ppo_step import StepWorkers, generation_on, run_ppo_step
from rl_core.rollout_schedule import GenerationWindow
from rl_core.separate_rollout import SeparateRollout
from rl_core.weight_sync import WeightsUpdate, sync_rollout_weights, trained_tensors
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


SYNC, ONE_STEP_OFF = GenerationWindow(1, 1), GenerationWindow(2, 1)
SCHEDULE_METRICS = ("timing_s/", "perf/", "training/staleness", "fully_async/")  # times and the rollout's queue


@pytest.mark.parametrize(
    "window,rollouts,staleness,transport",
    [
        (SYNC, 1, [0, 0, 0, 0], "in-process"),
        (ONE_STEP_OFF, 1, [0, 1, 1, 1], "in-process"),
        (ONE_STEP_OFF, 1, [0, 1, 1, 1], "gloo"),  # the weights broadcast over a channel while the worker receives
        # fully_async, staleness_threshold=2: steps 1-3 generate from v0, then each step launches the one 2 ahead
        (GenerationWindow(3, 1), 2, [0, 1, 2, 2], "in-process"),
        (GenerationWindow(3, 1), 2, [0, 1, 2, 2], "gloo"),
        # fully_async, trigger_parameter_sync_step=2, staleness_threshold=0: weights synced at steps 1 and 3 only
        (GenerationWindow(2, 2), 2, [0, 1, 0, 1], "in-process"),
    ],
)
def test_a_separate_rollout_trains_every_prompt_once_in_order(tmp_path, config, window, rollouts, staleness, transport):
    config.trainer.total_training_steps = 4
    actor, _ = build_workers(config, with_critic=False)
    data, sampler, reward, kl = step_inputs(tmp_path, actor, config, count=16)
    roles = [rollout_worker(config) for _ in range(rollouts)]
    if transport == "gloo":
        for role in (actor, *roles):
            role.weight_transport = CollectiveTransport("gloo", 2**20, 60)
    generate, generated_on, held = generation_on(config, reward), [], []

    def generate_and_record(role, prompts):
        generated_on.append(roles.index(role))
        held.append(role.weights_version())  # the version whose weights the worker has as it generates
        return generate(role, prompts)

    separate = SeparateRollout(actor, roles, window, generate_and_record, rendezvous=transport == "gloo")
    workers = StepWorkers(actor, separate_rollout=separate)
    expected_order = [sampler.next_batch() for _ in range(4)]
    sampler.load_state_dict(type(sampler)(len(data), config.data.train_batch_size, shuffle=False).state_dict())
    try:
        for step in (1, 2, 3, 4):
            batch, metrics = run_ppo_step(config, workers, data, sampler, reward, kl, step)
            uids = sorted(set(batch.non_tensors["uid"]))
            assert uids == sorted(f"{step}-0-{i}" for i in expected_order[step - 1])
            assert metrics["training/staleness_max"] == staleness[step - 1] <= window.max_staleness
            assert (batch.tensors["rollout_version"] == step - 1 - staleness[step - 1]).all()
            assert actor.weights_version() == step
            # the generations launched and not taken: the window's steps after this one
            waiting = metrics["fully_async/queue_depth"] + metrics["fully_async/in_flight"]
            assert waiting == min(window.last_launchable(step), 4) - step
            assert metrics["timing_s/generate_ahead"] > 0
    finally:
        separate.close()
    assert separate.pending == {}  # the last step launched nothing
    assert sorted(generated_on) == sorted(i % rollouts for i in range(4))  # the workers took turns
    assert sorted(held) == sorted(step - 1 - behind for step, behind in zip((1, 2, 3, 4), staleness))
    if transport == "gloo":  # each channel still moves the actor's exact weights
        for index, role in enumerate(roles):
            with ThreadPoolExecutor(1) as other:
                received = other.submit(role.receive_weights, WeightsUpdate(actor.weights_version(), None))
                actor.export_weights(to=index)
                assert received.result(timeout=60) == len(list(trained_tensors(actor.module)))
            trained = dict(actor.module.named_parameters())
            for name, parameter in role.module.named_parameters():
                assert torch.equal(parameter, trained[name]), name


@pytest.mark.parametrize("window,rollouts", [(ONE_STEP_OFF, 1), (GenerationWindow(3, 1), 2)])
def test_a_resume_in_the_middle_of_an_asynchronous_run_trains_every_prompt_once(tmp_path, config, window, rollouts):
    """A checkpoint after step 2 holds the sampler as of step 2 although later steps' prompts were already
    generating; a new controller (a new rollout, the sampler restored) draws them again: steps 1-5 train the sampler's
    first five batches, once each."""
    config.trainer.total_training_steps = 5
    actor, _ = build_workers(config, with_critic=False)
    data, sampler, reward, kl = step_inputs(tmp_path, actor, config, count=20)
    fresh_state = sampler.state_dict()
    expected = [sorted(f"{step}-0-{i}" for i in sampler.next_batch()) for step in (1, 2, 3, 4, 5)]
    sampler.load_state_dict(fresh_state)
    trained = []

    def steps(numbers):
        roles = [rollout_worker(config) for _ in range(rollouts)]
        separate = SeparateRollout(actor, roles, window, generation_on(config, reward))
        try:
            for step in numbers:
                batch, _ = run_ppo_step(
                    config, StepWorkers(actor, separate_rollout=separate), data, sampler, reward, kl, step
                )
                trained.append(sorted(set(batch.non_tensors["uid"])))
        finally:
            separate.close()

    steps((1, 2))
    checkpoint = sampler.state_dict()  # what the step-2 checkpoint holds; later steps' generations were in flight
    sampler.load_state_dict(checkpoint)
    steps((3, 4, 5))
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
            SeparateRollout(actor, [rollout_worker(config)], SYNC, generation_on(config, reward)) if separate else None
        )
        results = [
            run_ppo_step(config, StepWorkers(actor, separate_rollout=rollout), data, sampler, reward, kl, s)
            for s in (1, 2)
        ]
        if rollout is not None:
            rollout.close()
        runs.append(
            [
                {k: v for k, v in m.items() if not k.startswith(SCHEDULE_METRICS)}
                | {"responses": batch.tensors["responses"].tolist()}
                for batch, m in results
            ]
        )
    colocated, separate = runs
    assert colocated[1]["actor/entropy"] > 0 and colocated[1]["response_length/mean"] > 0
    assert separate == colocated
