"""Standby worker groups (infra/standby.py, flows/standby_workers.py, flows/workers.py): a run that ends on the stack
leaves one, the next run of the same shape adopts it, any other group's creation ends it first. The session's Ray head,
real workers and models."""

import copy
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch
from omegaconf import OmegaConf

from flows import standby_workers, workers
from flows.standby_workers import leave_standby, leaves_standby
from flows.workers import (
    PREFIX,
    build_fresh_workers,
    code_fingerprint,
    kill_worker_group,
    load_models,
    reattach_workers,
    start_fresh_workers,
    start_workers,
    worker_shape,
    workers_namespace,
)
from infra import standby
from infra.fused_worker import child_processes, library_folders, modules_from_elsewhere
from infra.worker_group import WorkerDiedError
from rl_core.models.loading import load_tokenizer
from tests.rl_core.helpers import addition_dataset

SECRET = "sk-" + "a1" * 12  # shaped like an OpenAI key (flows/secrets.py)


@pytest.fixture()
def first(config, tmp_path, ray_address, monkeypatch):
    """A run's config (its own checkpoint folder, so its own namespace; the stack's folder in ``tmp_path``); no standby
    group outlives the test."""
    monkeypatch.setenv("PPOFLOW_HOME", str(tmp_path / "home"))
    config.trainer.default_local_dir = str(tmp_path / "first")
    config.trainer.cpus_per_worker = 1
    yield config
    standby.release(PREFIX)


@pytest.fixture()
def by_value():
    """The functions a test sends to a worker travel by value: the worker then imports no test module (to the worker
    that is a user's code, as the test of it shows)."""
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    yield
    ray.cloudpickle.unregister_pickle_by_value(module)


def another_run(config, folder, **trainer):
    other = copy.deepcopy(config)
    other.trainer.default_local_dir = str(folder)
    for key, value in trainer.items():
        other.trainer[key] = value
    return other


def standby_namespaces() -> set[str]:
    return {
        actor["namespace"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if standby.NAMESPACE_MARK in actor["namespace"]
    }


def sampled(group, prompts):
    """What the group's policy samples for ``prompts`` (seeded by the step) and its log-probs of it."""
    actor = group.role("actor_rollout_ref")
    batch = actor.generate_sequences(prompts)
    return batch.tensors["responses"], actor.compute_log_prob(batch).tensors["old_log_probs"]


def shifted(role):
    """The role's policy changed, as an update would."""
    with torch.no_grad():
        for parameter in role.module.parameters():
            parameter.add_(0.5)


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_next_run_of_the_same_shape_adopts_the_standby_group_and_finds_it_under_its_folder(
    first, tmp_path, ranks, by_value
):
    first.trainer.n_gpus_per_node = ranks  # two: the adopter joins them in a process group of their own
    first.custom_reward_function.reward_kwargs = {"api_key": SECRET}
    tokenizer = load_tokenizer(first.actor_rollout_ref.model.path)
    prompts = addition_dataset(tmp_path, tokenizer, first.data, count=4).collate([0, 1, 2, 3], "p-")
    prompts.meta_info["global_step"] = 1
    used = build_fresh_workers(first)
    used_pid = used.health()[0]["pid"]
    fresh_responses, fresh_log_probs = sampled(used, prompts)
    left = leave_standby(used, first)
    assert left.startswith(f"left {ranks} standby worker(s) in ") and standby.has_any(), left
    assert len(standby_namespaces()) == 1
    # what it was made from, for the stack's launcher to offer again at the stack's next start: the owner's only, no
    # secret, and a config whose workers have the same shape
    recipe = tmp_path / "home" / "standby.json"
    assert recipe.stat().st_mode & 0o777 == 0o600 and SECRET not in recipe.read_text()
    record = json.loads(recipe.read_text())
    assert "transformers.models.qwen2.modeling_qwen2" in record["imports"]
    assert worker_shape(OmegaConf.create(record["config"])) == worker_shape(first)

    second = another_run(first, tmp_path / "second")
    assert worker_shape(second) == worker_shape(first)  # other paths and folders, the same workers
    group = start_fresh_workers(second)
    namespace = workers_namespace(second)
    assert group.namespace in standby_namespaces() and not standby.has_any()  # taken: no other run gets it
    assert group.health()[0]["pid"] != used_pid  # a process of its own, not the used one's
    # it imported the model's code before any run asked (what the used worker had imported)
    imported = ray.get(group.actors[0].imported_modules.remote(["transformers"]))
    assert "transformers.models.qwen2.modeling_qwen2" in imported
    load_models(group, second)
    assert group.health()[0]["steps_trained"] == {"actor_rollout_ref": 0}
    responses, log_probs = sampled(group, prompts)  # as a fresh group's, to the bit
    assert torch.equal(responses, fresh_responses) and torch.equal(log_probs, fresh_log_probs)

    # a later controller of the second run finds the workers under its folder's namespace, as any run's
    assert standby.live_namespace(namespace) == group.namespace
    again = reattach_workers(second, namespace)
    assert again is not None and again.health()[0]["pid"] == group.health()[0]["pid"]

    # the second run ends: its own workers, adopted, are the next standby group, with their models dropped (changed
    # here as training would: a model kept would sample otherwise)
    ray.get(
        [actor.__ray_call__.remote(lambda worker: shifted(worker.roles["actor_rollout_ref"])) for actor in group.actors]
    )
    pids = [report["pid"] for report in group.health()]
    left = leave_standby(group, second)
    assert left.startswith(f"left {ranks} standby worker(s) in ") and "the run's own" in left, left
    assert standby.live_namespace(namespace) == namespace  # the second run's folder has no workers any more
    assert [report["labels"] for report in group.health()] == [{"mlflow_run_id": "standby"}] * ranks
    assert reattach_workers(second, namespace) is None
    third = another_run(first, tmp_path / "third")
    reused = start_fresh_workers(third)
    assert [report["pid"] for report in reused.health()] == pids and not standby.has_any()
    assert [report["served"] for report in reused.health()] == [1] * ranks
    # the second run's model was dropped: nothing loaded until the third run loads its own
    assert (
        ray.get(
            [
                actor.__ray_call__.remote(lambda worker: worker.roles["actor_rollout_ref"].module is None)
                for actor in reused.actors
            ]
        )
        == [True] * ranks
    )
    load_models(reused, third)
    responses, log_probs = sampled(reused, prompts)  # as a fresh group's, to the bit
    assert torch.equal(responses, fresh_responses) and torch.equal(log_probs, fresh_log_probs)
    # ending the run's workers by its namespace ends them where they live
    assert kill_worker_group(workers_namespace(third)) == ranks
    assert standby.live_namespace(workers_namespace(third)) == workers_namespace(third) and not standby_namespaces()


def test_a_standby_group_of_another_shape_or_whose_record_was_lost_ends_when_a_group_starts(first, tmp_path):
    leave_standby(build_fresh_workers(first), first)
    (live,) = standby_namespaces()
    other = another_run(first, tmp_path / "other", cpus_per_worker=2)
    assert worker_shape(other) != worker_shape(first)
    assert start_fresh_workers(other).namespace == workers_namespace(other)  # not adopted: built, the standby ended
    assert not standby_namespaces() and not standby.has_any()
    kill_worker_group(workers_namespace(other))

    # a command stopped between starting a standby group and recording it: the group is found by its namespace
    leave_standby(build_fresh_workers(first), first)
    standby.claim(worker_shape(first))  # the record gone
    assert standby_namespaces() and not standby.has_any()
    group = start_workers(other, workers_namespace(other))
    assert not standby_namespaces()

    # no room for a standby group: the run's own group ends all the same, and nothing fails
    no_room = another_run(first, tmp_path / "other", cpus_per_worker=1000)
    left = leave_standby(group, no_room)
    assert left.startswith("no standby workers left (InsufficientResourcesError: resource pool"), left
    assert not standby_namespaces() and not standby.has_any()
    with pytest.raises(WorkerDiedError):
        group.health()


def imported_here(path):
    """Import the file ``path`` as a module of its own, as a custom reward's file is."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    sys.modules[path.stem] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[path.stem])


def test_on_the_stack_a_run_s_new_workers_start_as_a_standby_group_recorded_as_the_run_s(first, tmp_path, monkeypatch):
    # the session's Ray head stands in for the stack's here (tests/infra/test_stack.py runs the stack's end to end)
    monkeypatch.setattr(standby_workers, "leaves_standby", lambda: True)
    namespace = workers_namespace(first)
    group = start_fresh_workers(first)
    assert group.namespace in standby_namespaces() and not group.adopted and not standby.has_any()
    assert standby.live_namespace(namespace) == group.namespace  # the run's, as an adopted group
    assert reattach_workers(first, namespace).health()[0]["pid"] == group.health()[0]["pid"]
    pid = group.health()[0]["pid"]
    left = leave_standby(group, first)
    assert "the run's own, their imports done" in left and standby.live_namespace(namespace) == namespace, left
    adopted = start_fresh_workers(another_run(first, tmp_path / "second"))
    assert adopted.adopted and adopted.namespace == group.namespace and adopted.health()[0]["pid"] == pid
    kill_worker_group(workers_namespace(another_run(first, tmp_path / "second")))


def test_workers_that_ran_a_user_s_code_or_left_a_thread_serve_no_other_run(first, tmp_path, by_value):
    leave_standby(start_fresh_workers(first), first)  # started in the run's own namespace: new workers in its place
    user_module = tmp_path / "my_scores.py"
    user_module.write_text("SCORE = 1.0\n")
    group = start_fresh_workers(another_run(first, tmp_path / "second"))
    used_pid = group.health()[0]["pid"]
    ray.get(group.actors[0].__ray_call__.remote(lambda worker: imported_here(user_module)))
    left = leave_standby(group, another_run(first, tmp_path / "second"))
    why = "not the run's own: it imported 1 module(s) from outside the installed libraries: ['my_scores']"
    assert f"({why})" in left, left
    with pytest.raises(WorkerDiedError):
        group.health()

    third = another_run(first, tmp_path / "third")
    group = start_fresh_workers(third)
    assert group.health()[0]["pid"] != used_pid and group.health()[0]["served"] == 0
    started = "threading.Thread(target=time.sleep, args=(60,), name='ppoflow-scores', daemon=True).start()"
    ray.get(group.actors[0].__ray_call__.remote(lambda worker: exec(started, {"threading": threading, "time": time})))
    left = leave_standby(group, third)
    assert "(not the run's own: a thread of the ended run is still alive: ['ppoflow-scores'])" in left, left


def test_modules_from_outside_the_libraries_are_a_user_s(tmp_path):
    folders = library_folders()
    before = modules_from_elsewhere(folders)  # this process's: the tests' modules and the controller's (flows)
    assert "tests" in before and "flows" in before
    assert not {"torch", "torch.ops", "transformers", "rl_core", "infra.fused_worker", "json"} & set(before)
    (tmp_path / "scores_of_mine.py").write_text("SCORE = 1.0\n")
    imported_here(tmp_path / "scores_of_mine.py")
    try:
        assert modules_from_elsewhere(folders) == [*before, "scores_of_mine"]
    finally:
        del sys.modules["scores_of_mine"]


def test_a_process_s_children_are_found_while_they_live():
    sleeping = subprocess.Popen(["sleep", "30"])
    try:
        assert sleeping.pid in child_processes()
    finally:
        sleeping.kill()
        sleeping.wait()
    assert sleeping.pid not in child_processes()


def test_one_claim_per_offer_and_only_for_its_shape(ray_address):
    standby.register("ppoflow-run-standby-a", "shape1")
    standby.register("ppoflow-run-standby-b", "shape2")
    assert standby.claim("shape3") is None
    assert standby.claim("shape1") == "ppoflow-run-standby-a"
    assert standby.claim("shape1") is None  # taken
    assert standby.has_any()  # shape2's is still offered
    assert standby.release(PREFIX) == 0 and not standby.has_any()  # records without workers: nothing to kill


def test_the_workers_code_on_disk_is_part_of_the_shape(tmp_path, monkeypatch):
    source = tmp_path / "rl_core" / "algos" / "loss.py"
    source.parent.mkdir(parents=True)
    source.write_text("a = 1\n")
    monkeypatch.setattr(workers, "PROJECT_ROOT", str(tmp_path))
    before = code_fingerprint()
    (tmp_path / "rl_core" / "notes.txt").write_text("not code")
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "cli.py").write_text("the controller's code: not the workers'")
    assert code_fingerprint() == before
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 1))
    assert code_fingerprint() != before
    source.write_text("a = 22\n")
    assert code_fingerprint() != before


def test_only_a_command_on_the_stack_leaves_a_standby_group(ray_address, monkeypatch):
    assert not leaves_standby()  # the session's head is no `ppoflow up` stack's
    monkeypatch.setenv("PPOFLOW_HOME", "/nonexistent")
    assert not leaves_standby()
