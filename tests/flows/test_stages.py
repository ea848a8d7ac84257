"""The stage runner: stages called in the flow's thread and reported to Prefect as task runs, read back from a real
Prefect API: one per call, named by step, real durations, the data dependencies, a failure as Failed with its error,
retries (only where a re-run gives the same result) as retries."""

import time
from pathlib import Path

import pytest
import torch
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.sorting import TaskRunSort

from flows import stages
from flows.stages import StageRunner, flush_reported_runs, produced, retryable, run_phase
from infra.worker_group import WorkerDiedError, WorkerTimeoutError
from rl_core.batch import Batch

EXPECTED_RUNS = 6


def generate(workers, prompts):
    time.sleep(0.05)
    return Batch({"responses": torch.zeros(2, 3)}, {"uid": ["a", "b"]}), {"gen": 1.0}


def old_log_prob(workers, batch):
    return [len(batch)]


def advantage(config, batch, old):
    return {"adv": old}


def make_flaky(failures: int):
    calls = {"n": 0}

    def values(workers, batch):
        calls["n"] += 1
        if calls["n"] <= failures:
            raise ConnectionError(f"transient {calls['n']}")
        return "values"

    return values


def update_actor(workers, batch, adv):
    raise ValueError("the loss is NaN at step 3")


@flow(name="stage-runner-probe")
def probe() -> str:
    from prefect import runtime

    run_stage = StageRunner(retries=2, retry_safe=("generate", "values"))
    run_phase("set-up", time.sleep, 0.4)  # longer than HOLD_RUNNING_S (0.2 in the test): Running sent while it runs
    run_stage.step = 3
    batch, metrics = run_stage("generate", generate, "workers", "prompts")
    old = run_stage("old_log_prob", old_log_prob, "workers", batch)
    run_stage("advantage", advantage, "config", batch, old)
    assert run_stage("values", make_flaky(1), "workers", batch) == "values"
    with pytest.raises(ValueError, match="NaN"):
        run_stage("update_actor", update_actor, "workers", batch, old)
    assert flush_reported_runs()
    return str(runtime.flow_run.id)


def graph_parents(flow_run_id: str) -> dict[str, set[str]]:
    """Each task run's upstream task runs, by name, as the Prefect UI's run graph draws them."""
    with get_client(sync_client=True) as client:
        nodes = client._client.get(f"/flow_runs/{flow_run_id}/graph-v2").json()["nodes"]
    names = {node_id: node["label"] for node_id, node in nodes}
    return {names[i]: {names[p["id"]] for p in node["parents"]} for i, node in nodes}


def read_task_runs(flow_run_id: str, count: int, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                sort=TaskRunSort.EXPECTED_START_TIME_ASC,
            )
            final = [run for run in runs if run.state is not None and run.state.is_final()]
            if len(final) >= count or time.monotonic() > deadline:
                return {run.name: (run, client.read_task_run_states(run.id)) for run in runs}
            time.sleep(0.25)


def test_stages_read_back_from_prefect_as_task_runs(prefect_api, monkeypatch):
    monkeypatch.setattr(stages, "HOLD_RUNNING_S", 0.2)
    flow_run_id = probe()
    runs = read_task_runs(flow_run_id, EXPECTED_RUNS)
    assert set(runs) == {
        "set-up",
        "step-3/generate",
        "step-3/old_log_prob",
        "step-3/advantage",
        "step-3/values",
        "step-3/update_actor",
    }
    setup_run, setup_states = runs["set-up"]
    assert [s.name for s in setup_states] == ["Running", "Completed"]
    # a stage that ends within HOLD_RUNNING_S is sent once, when it ends, with its start time and duration
    generate_run, generate_states = runs["step-3/generate"]
    assert [s.name for s in generate_states] == ["Completed"] and generate_run.run_count == 1
    # the task run's page says what the stage produced (its Completed state's message)
    assert generate_states[-1].message == "a batch of 2 rows: responses, uid; gen=1"
    assert generate_run.total_run_time.total_seconds() >= 0.05 and generate_run.end_time > generate_run.start_time
    assert generate_run.task_inputs == {}
    # a stage's arguments that are earlier stages' outputs (an item of a tuple output too) are its upstream task runs
    ids = {name: run.id for name, (run, _) in runs.items()}
    inputs = {name: {k: [i.id for i in v] for k, v in run.task_inputs.items()} for name, (run, _) in runs.items()}
    assert inputs["step-3/old_log_prob"] == {"batch": [ids["step-3/generate"]]}
    assert inputs["step-3/advantage"] == {"batch": [ids["step-3/generate"]], "old": [ids["step-3/old_log_prob"]]}
    parents = graph_parents(flow_run_id)
    assert parents["step-3/advantage"] == {"step-3/generate", "step-3/old_log_prob"} and not parents["set-up"]
    # a transient error of an idempotent stage: retried, and shown as a retry
    values_run, values_states = runs["step-3/values"]
    assert [s.name for s in values_states] == ["Running", "AwaitingRetry", "Retrying", "Completed"]
    assert values_run.run_count == 2 and "Retry 1/2" in values_states[1].message
    # an update is never retried; its failure is Failed with the error
    actor_run, actor_states = runs["step-3/update_actor"]
    assert [s.name for s in actor_states] == ["Running", "Failed"]
    assert actor_run.state.message == "Task run encountered an exception ValueError: the loss is NaN at step 3"
    assert actor_run.start_time >= generate_run.end_time  # stages run one after the other


def test_outside_a_flow_run_the_runner_calls_the_function_it_is_given():
    """A patched or custom stage function is what runs (not the module's function of that name); nothing reported."""
    run_stage = StageRunner(retries=0)
    assert run_stage("advantage", lambda x: ("custom", x), 3) == ("custom", 3)
    run_stage.step = 12
    assert run_stage("advantage", lambda x: ("custom", x), 4) == ("custom", 4)
    flaky = make_flaky(2)
    with pytest.raises(ConnectionError):
        StageRunner(retries=1, retry_safe=("values",))("values", flaky, None, None)  # 1 retry of 2 failures
    assert StageRunner(retries=1, retry_safe=())("values", make_flaky(0), None, None) == "values"


def test_a_dead_or_timed_out_worker_is_not_retried_in_place():
    assert retryable(ConnectionError("transient"))
    assert not retryable(WorkerDiedError("worker rank0 died", "rank0"))
    assert not retryable(WorkerTimeoutError("stage 'generate': workers ['rank0'] did not answer"))
    assert not retryable(KeyboardInterrupt())


def test_what_a_stage_produced_in_one_line():
    batch = Batch({"old_log_probs": torch.zeros(4, 2)})
    assert (
        produced((batch, {"actor/entropy": 1.23456, "n": 3}))
        == "a batch of 4 rows: old_log_probs; actor/entropy=1.235, n=3"
    )
    assert produced(None) is None and produced([1, 2]) == "list" and produced({"a": "x"}) == "1 entries"
    assert produced(Path("/ckpt/global_step_3")) == "/ckpt/global_step_3"
    assert produced({f"m{i}": float(i) for i in range(200)}, limit=20) == "m0=0, m1=1, m2=2, m3..."
