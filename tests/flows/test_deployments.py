"""``ppoflow serve`` against a real Prefect server (the session's test harness, on 127.0.0.1): the deployments and their
forms, flow runs created through the API as the Prefect UI creates them, what those runs show in Prefect and
record in MLflow, and a sweep whose children run as the served train deployment."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
from prefect.settings import PREFECT_API_URL

from tests.conftest import ROOT, small_run_overrides

CRON = "0 2 * * *"


def form_overrides(folder: Path, demo_cache: Path, *extra: str) -> list[str]:
    """The small run's overrides without the keys the tests set through the form."""
    return [
        o
        for o in small_run_overrides(folder, demo_cache, *extra)
        if not o.startswith(("trainer.total_training_steps=", "trainer.test_freq="))
    ]


@pytest.fixture(scope="module")
def served(prefect_api, ray_address, tmp_path_factory):
    """`ppoflow serve` in a subprocess (flow runs go to the session's Ray head), until the module's tests are done."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "RAY_ADDRESS": ray_address}
    command = [
        sys.executable,
        "-m",
        "flows.cli",
        "serve",
        "--sweep-cron",
        CRON,
        "--sweep-overrides",
        "algorithm.adv_estimator=grpo,rloo",
    ]
    with open(log, "w") as output:
        process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    try:
        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    found = {
                        name: client.read_deployment_by_name(f"ppoflow-{name}/{name}")
                        for name in ("train", "evaluate", "sweep")
                    }
                    if all(d.status.value == "READY" for d in found.values()):
                        break
                except Exception:
                    pass
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, "the deployments were not served within 120 s:\n" + log.read_text()
                time.sleep(1)
            yield client, found, log
    finally:
        process.send_signal(signal.SIGINT)  # a user's Ctrl-C: it stops (the suite may run with SIGINT ignored)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise AssertionError("`ppoflow serve` did not stop on SIGINT within 30 s:\n" + log.read_text()) from None


def wait_final(client, flow_run_id, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while True:
        flow_run = client.read_flow_run(flow_run_id)
        if flow_run.state is not None and flow_run.state.is_final():
            return flow_run
        assert time.monotonic() < deadline, f"flow run {flow_run_id} still {flow_run.state} after {timeout_s} s"
        time.sleep(1)


def flow_run_logs(client, flow_run_id, until, timeout_s: float = 60) -> list[str]:
    """The flow run's log messages, once ``until(messages)`` holds (logs reach the API in batches, shortly after the
    run's final state) or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        messages = [
            entry.message
            for entry in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        ]
        if until(messages) or time.monotonic() > deadline:
            return messages
        time.sleep(1)


def test_the_deployments_and_their_forms(served):
    _, found, _ = served
    train = found["train"]
    schema = train.parameter_openapi_schema
    assert list(schema["properties"]) == ["settings", "overrides", "tags"]
    form = schema["definitions"]["TrainSettings"]["properties"]
    batch_size = next(option for option in form["batch_size"]["anyOf"] if option.get("type") == "integer")
    assert batch_size["exclusiveMinimum"] == 0 and "data.train_batch_size" in form["batch_size"]["description"]
    algorithms = next(option["enum"] for option in form["algorithm"]["anyOf"] if "enum" in option)
    # empty: the config's (the demo profile's grpo here)
    assert "grpo" in algorithms and form["algorithm"]["default"] is None
    assert train.concurrency_limit == 1 or train.global_concurrency_limit.limit == 1  # one training run at a time
    sweep = found["sweep"]
    assert [s.schedule.cron for s in sweep.schedules] == [CRON]
    assert sweep.parameters["overrides"] == ["algorithm.adv_estimator=grpo,rloo"]
    assert "source" in found["evaluate"].parameter_openapi_schema["required"]


def test_an_invalid_form_value_is_refused_before_a_run_exists(served):
    client, found, _ = served
    with pytest.raises(Exception, match="batch_size|greater than 0|Validation"):
        client.create_flow_run_from_deployment(found["train"].id, parameters={"settings": {"batch_size": 0}})
    with pytest.raises(Exception, match="algorithm|ppo9|Validation"):
        client.create_flow_run_from_deployment(found["train"].id, parameters={"settings": {"algorithm": "ppo9"}})


def test_a_run_from_the_form_trains_and_shows_its_progress_in_prefect(served, tmp_path, demo_cache):
    client, found, log = served
    settings = {
        "algorithm": "rloo",
        "run_name": "from-the-form",
        "learning_rate": 2e-5,
        "total_steps": 2,
        "test_freq": 2,
    }
    flow_run = client.create_flow_run_from_deployment(
        found["train"].id, parameters={"settings": settings, "overrides": form_overrides(tmp_path, demo_cache)}
    )
    flow_run = wait_final(client, flow_run.id)
    assert flow_run.state.is_completed(), f"{flow_run.state.message}\n{log.read_text()[-3000:]}"
    mlflow = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = mlflow.search_runs(
        mlflow.get_experiment_by_name("ppoflow").experiment_id, f"tags.`ppoflow.prefect_flow_run_id` = '{flow_run.id}'"
    )
    params = run.data.params
    assert (
        params["algorithm.adv_estimator"],
        float(params["actor_rollout_ref.actor.optim.lr"]),
        params["trainer.experiment_name"],
    ) == ("rloo", 2e-5, "from-the-form")
    assert run.info.status == "FINISHED" and run.data.metrics["training/global_step"] == 2
    # the Prefect UI's view: per-step lines in the Logs tab, the MLflow link, the checkpoints, the progress
    logs = flow_run_logs(client, flow_run.id, until=lambda lines: any(m.startswith("step 2/2 | score") for m in lines))
    assert any(m.startswith("step 1/2 | score") for m in logs) and any(
        m.startswith("step 2/2 | score") and "| val " in m for m in logs
    )
    artifacts = {
        a.key: a
        for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
        )
    }
    # a link renders as markdown
    assert run.info.run_id in artifacts["mlflow-run"].data and artifacts["mlflow-run"].type == "markdown"
    assert str(tmp_path / "checkpoints") in artifacts["checkpoints"].data
    assert artifacts["training-progress"].type == "progress" and float(artifacts["training-progress"].data) == 100.0
    assert artifacts["training-progress"].description.startswith("step 2/2 | score")


def test_a_failed_run_says_why_in_one_line(served, tmp_path, demo_cache):
    client, found, _ = served
    settings = {"reward_function_path": str(tmp_path / "no_such_reward.py"), "total_steps": 1}
    flow_run = client.create_flow_run_from_deployment(
        found["train"].id, parameters={"settings": settings, "overrides": form_overrides(tmp_path, demo_cache)}
    )
    flow_run = wait_final(client, flow_run.id)
    assert flow_run.state.is_failed()
    assert "no_such_reward.py" in flow_run.state.message and "\n" not in flow_run.state.message


def test_a_served_sweep_runs_its_children_as_the_train_deployment(served, tmp_path, demo_cache):
    client, found, log = served
    overrides = small_run_overrides(tmp_path, demo_cache, "trainer.total_training_steps=1", "trainer.test_freq=-1") + [
        "algorithm.adv_estimator=grpo,rloo"
    ]
    flow_run = client.create_flow_run_from_deployment(
        found["sweep"].id, parameters={"overrides": overrides, "name": "served-sweep", "search": "random", "trials": 1}
    )  # one child: what is checked is how a served sweep's children run (the grid itself: tests/flows/test_sweep.py)
    flow_run = wait_final(client, flow_run.id, timeout_s=400)
    assert flow_run.state.is_completed(), f"{flow_run.state.message}\n{log.read_text()[-3000:]}"
    mlflow = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = mlflow.get_experiment_by_name("ppoflow").experiment_id
    [parent] = mlflow.search_runs(experiment, "tags.`ppoflow.sweep` = 'served-sweep' and tags.`ppoflow.kind` = 'sweep'")
    children = mlflow.search_runs(experiment, f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert [c.data.params["algorithm.adv_estimator"] in ("grpo", "rloo") for c in children] == [True]
    child_flow_runs = [client.read_flow_run(c.data.tags["ppoflow.prefect_flow_run_id"]) for c in children]
    assert all(r.deployment_id == found["train"].id and r.parent_task_run_id is not None for r in child_flow_runs)
