"""Probes of a hostile user and a crashing machine (the session's Ray head, a real Prefect API, MLflow on SQLite):
secrets are stored nowhere, one run at a time uses a folder, a damaged checkpoint is skipped, the Ray token is
private."""

import json
import os
import stat
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from flows.secrets import SECRET_OVERRIDES_ENV, hide_secret_overrides
from flows.train import train
from rl_core.input_checks import InputError
from rl_core.step_checkpoint import CheckpointError, StepCheckpoints
from tests.conftest import small_run_overrides
from tests.flows.conftest import metric_history

SECRET, TOKEN = "s3cr3t-value-42", "hf_" + "Q" * 30


def test_secrets_reach_neither_mlflow_nor_prefect(tmp_path, demo_cache, ray_address, prefect_api, monkeypatch):
    reward = tmp_path / "reward_with_keys.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, api_key=None, endpoint=None, "
        f"hf_token=None):\n    assert api_key == {SECRET!r} and {SECRET!r} in endpoint and hf_token == {TOKEN!r}\n    "
        "return float(solution_str.strip() == ground_truth)\n"
    )
    monkeypatch.setenv("PPOFLOW_TEST_HF_TOKEN", TOKEN)
    monkeypatch.setenv(SECRET_OVERRIDES_ENV, "[]")  # restored after the test
    overrides = small_run_overrides(
        tmp_path,
        demo_cache,
        "trainer.total_training_steps=1",
        "trainer.test_freq=-1",
        f"custom_reward_function.path={reward}",
        f"+custom_reward_function.reward_kwargs.api_key={SECRET}",
        f"+custom_reward_function.reward_kwargs.endpoint='https://user:{SECRET}@host/v1'",
        "+custom_reward_function.reward_kwargs.hf_token='${oc.env:PPOFLOW_TEST_HF_TOKEN}'",
    )
    public = hide_secret_overrides(overrides)  # what `ppoflow train` does with the command line
    assert not any(SECRET in o for o in public)
    result = train(overrides=public)  # the reward function got every secret (it asserts them)
    client = MlflowClient(result["tracking_uri"])
    run = client.get_run(result["run_id"])
    stored = json.dumps(run.data.params) + json.dumps(run.data.tags)
    stored += Path(client.download_artifacts(run.info.run_id, "config/ppo_trainer.yaml", str(tmp_path))).read_text()
    assert run.data.params["custom_reward_function.reward_kwargs"].count("***") == 3
    with get_client(sync_client=True) as prefect:
        flow_run_id = run.data.tags["ppoflow.prefect_flow_run_id"]
        stored += json.dumps(prefect.read_flow_run(flow_run_id).parameters)
        stored += " ".join(
            log.message
            for log in prefect.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        )
    assert SECRET not in stored and TOKEN not in stored


def test_a_second_run_in_a_folder_in_use_is_refused_at_once(tmp_path, demo_cache, ray_address, prefect_api):
    overrides = small_run_overrides(tmp_path, demo_cache)
    holder = StepCheckpoints(tmp_path / "checkpoints").lock({"run": "the-first-run"})
    try:
        started = time.monotonic()
        with pytest.raises(
            InputError,
            match=r"trainer.default_local_dir: folder .*checkpoints is in use by run the-first-run \(pid "
            rf"{os.getpid()}, started",
        ):
            train(overrides=overrides)
        assert time.monotonic() - started < 10
        assert not (tmp_path / "mlflow.db").exists()  # refused before any MLflow run exists
    finally:
        holder.release()


def test_a_damaged_latest_checkpoint_is_skipped_for_the_previous_one(tmp_path, demo_cache, ray_address, prefect_api):
    settings = ("trainer.test_freq=-1", "trainer.val_before_train=false")
    first = train(overrides=small_run_overrides(tmp_path, demo_cache, *settings))
    checkpoints = StepCheckpoints(tmp_path / "checkpoints")
    (checkpoints.step_dir(3) / "actor" / "model.safetensors").unlink()
    client = MlflowClient(first["tracking_uri"])
    # naming the damaged one: refused with the fix, and the finished run is left as it was
    with pytest.raises(
        InputError,
        match=r"trainer.resume_from_path: checkpoint .*global_step_3 is damaged: actor/model.safetensors is missing; "
        r".*global_step_2 is intact",
    ):
        train(
            overrides=small_run_overrides(
                tmp_path,
                demo_cache,
                *settings,
                "trainer.resume_mode=resume_path",
                f"trainer.resume_from_path={checkpoints.step_dir(3)}",
            )
        )
    assert client.get_run(first["run_id"]).info.status == "FINISHED"
    # resume_mode=auto: skips it, continues from step 2 in the same run, every step logged once
    resumed = train(overrides=small_run_overrides(tmp_path, demo_cache, *settings, "trainer.total_training_steps=4"))
    assert resumed["run_id"] == first["run_id"] and resumed["step"] == 4
    history = metric_history(resumed["tracking_uri"], resumed["run_id"])
    assert {step: len(values) for step, values in history["actor/pg_loss"].items()} == {1: 1, 2: 1, 3: 1, 4: 1}
    assert checkpoints.latest_intact() == (4, [])
    # resuming with fewer steps than the checkpoint has: refused, nothing touched
    with pytest.raises(CheckpointError, match=r"global_step_4 is at step 4, past this run's 2 steps"):
        train(overrides=small_run_overrides(tmp_path, demo_cache, *settings, "trainer.total_training_steps=2"))
    assert client.get_run(first["run_id"]).info.status == "FINISHED" and checkpoints.latest_intact() == (4, [])


def test_the_ray_token_is_the_owners_only(ray_address):
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token")).expanduser()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
