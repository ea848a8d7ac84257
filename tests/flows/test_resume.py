"""Which checkpoint a run resumes from and whether its config still matches (flows/resume.py), without Ray or
Prefect: the end-to-end refusal, the finished run and the changed learning rate are in test_train_flow.py."""

import pytest

from flows.config import compose_config
from flows.resume import (
    ResumeRefused,
    already_finished,
    config_changes,
    config_fingerprint,
    config_record,
    find_resume_point,
)
from rl_core.step_checkpoint import StepCheckpoints


def record(*overrides: str) -> dict:
    return config_record(compose_config(list(overrides)))


def test_only_what_changes_the_training_is_a_change():
    base = record()
    operations = record(
        "trainer.total_training_steps=500",
        "trainer.save_freq=5",
        "trainer.test_freq=-1",
        "trainer.worker_timeout_s=30",
        "trainer.ray.address=127.0.0.1:6379",
        "trainer.resume_allow_config_change=true",
        "reward.timeout_s=5",
    )
    assert config_changes(base, operations) == [] and config_fingerprint(base) == config_fingerprint(operations)
    changed = record("algorithm.adv_estimator=rloo", "actor_rollout_ref.actor.optim.lr=5e-4", "trainer.save_freq=5")
    assert config_changes(base, changed) == [
        ("actor_rollout_ref.actor.optim.lr", 0.001, 0.0005),
        ("algorithm.adv_estimator", "grpo", "rloo"),
    ]
    assert config_fingerprint(base) != config_fingerprint(changed)
    assert config_changes({"a.b": 1}, {"a.c": 2}) == [("a.b", 1, "<unset>"), ("a.c", "<unset>", 2)]


def test_a_secret_is_recorded_redacted():
    secret = record("+custom_reward_function.reward_kwargs.api_key=sk-abcdefghijklmnopqrstuvwx")
    assert secret["custom_reward_function.reward_kwargs"] == {"api_key": "***"}


def checkpoint(tmp_path, step: int, state: dict) -> StepCheckpoints:
    checkpoints = StepCheckpoints(tmp_path / "checkpoints")
    checkpoints.staging_dir(step)
    checkpoints.commit(step, {"mlflow_run_id": "r1", **state})
    return checkpoints


def test_a_changed_config_is_refused_unless_allowed(tmp_path):
    checkpoints = checkpoint(tmp_path, 4, {"config": record(), "total_steps": 4})
    rloo = compose_config(["algorithm.adv_estimator=rloo"])
    with pytest.raises(
        ResumeRefused,
        match=r"step 4\) was trained under another config: algorithm.adv_estimator: grpo "
        r"-> rloo\. Start a new run .*trainer.resume_allow_config_change=true",
    ):
        find_resume_point(rloo, checkpoints)
    allowed = compose_config(["algorithm.adv_estimator=rloo", "trainer.resume_allow_config_change=true"])
    point = find_resume_point(allowed, checkpoints)
    assert (point.step, point.run_id, point.changes) == (4, "r1", [("algorithm.adv_estimator", "grpo", "rloo")])
    assert find_resume_point(compose_config(["trainer.resume_mode=disable"]), checkpoints) is None


def test_a_checkpoint_without_a_recorded_config_resumes_unchecked(tmp_path):
    lines = []
    point = find_resume_point(
        compose_config(["algorithm.adv_estimator=rloo"]), checkpoint(tmp_path, 2, {}), lines.append
    )
    assert point.step == 2 and point.changes == [] and "records no config" in lines[0]


def test_a_run_is_finished_when_it_ended_at_the_step_asked_for(tmp_path):
    point = find_resume_point(compose_config([]), checkpoint(tmp_path, 4, {"config": record(), "total_steps": 4}))
    same = compose_config([])
    assert already_finished(point, same, "FINISHED")  # the step count asked the same way: the recorded total
    assert not already_finished(point, same, "FAILED")  # a crash after the last checkpoint: finish it
    assert not already_finished(point, compose_config(["trainer.total_training_steps=8"]), "FINISHED")
    assert not already_finished(point, same, "FINISHED", total_steps=6) and already_finished(point, same, "FINISHED", 4)
