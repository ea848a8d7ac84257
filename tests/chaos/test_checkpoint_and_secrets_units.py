"""The pieces behind the probes, checked directly: checkpoint manifests, the folder lock, secret detection."""

import json
import os

import pytest
from omegaconf import OmegaConf

from flows.secrets import is_secret_key, redacted, split_secret_overrides
from rl_core.step_checkpoint import CheckpointError, StepCheckpoints, damage


def make_checkpoint(checkpoints: StepCheckpoints, step: int, run: str = "r") -> None:
    staging = checkpoints.staging_dir(step)
    (staging / "actor").mkdir()
    (staging / "actor" / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    checkpoints.commit(step, {"mlflow_run_id": run})


@pytest.mark.parametrize(
    "harm, found",
    [
        (lambda f: (f / "actor" / "model.safetensors").unlink(), "actor/model.safetensors is missing"),
        (
            lambda f: (f / "actor" / "model.safetensors").write_bytes(b"short"),
            "actor/model.safetensors has 5 bytes, not 1024",
        ),
        (
            lambda f: (f / "actor" / "model.safetensors").write_bytes(bytes(1024)),
            "actor/model.safetensors does not match its checksum",
        ),
        (lambda f: (f / "trainer_state.json").unlink(), "no trainer_state.json"),
    ],
)
def test_damage_is_found_and_the_previous_checkpoint_used(tmp_path, harm, found):
    checkpoints = StepCheckpoints(tmp_path, max_to_keep=3)
    for step in (1, 2, 3):
        make_checkpoint(checkpoints, step)
    assert (
        json.loads((checkpoints.step_dir(3) / "manifest.json").read_text())["actor/model.safetensors"]["size"] == 1024
    )
    assert checkpoints.latest_intact() == (3, [])
    harm(checkpoints.step_dir(3))
    assert damage(checkpoints.step_dir(3)) == found
    assert checkpoints.latest_intact() == (2, [(3, found)])
    harm(checkpoints.step_dir(2))
    harm(checkpoints.step_dir(1))
    with pytest.raises(CheckpointError, match="every checkpoint in .* is damaged"):
        checkpoints.latest_intact()


def test_a_crash_while_a_step_is_written_again_keeps_its_previous_folder(tmp_path, monkeypatch):
    """Writing step 2 again: the old global_step_2 is set aside, not deleted, until the new one is in place; a crash in
    between (simulated: the rename into place fails) leaves it to be put back, so the pointer never dangles."""
    checkpoints = StepCheckpoints(tmp_path)
    make_checkpoint(checkpoints, 1)
    make_checkpoint(checkpoints, 2)
    real_replace = os.replace

    def crash_on_the_rename_into_place(source, target):
        if str(source).endswith(".tmp_global_step_2"):
            raise OSError("killed (simulated)")
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", crash_on_the_rename_into_place)
    with pytest.raises(OSError, match="killed"):
        make_checkpoint(checkpoints, 2)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not checkpoints.step_dir(2).exists()  # the crash left the old folder aside ...
    assert StepCheckpoints(tmp_path).latest_intact() == (2, [])  # ... and the next run puts it back
    assert not list(tmp_path.glob(".replaced_*"))


def test_a_run_prunes_only_its_own_checkpoints(tmp_path):
    """A second run in the same folder (resume_mode=disable) keeps the first run's checkpoints it does not overwrite."""
    first = StepCheckpoints(tmp_path, max_to_keep=2)
    for step in (1, 2, 3, 4):
        make_checkpoint(first, step, run="first")
    second = StepCheckpoints(tmp_path, max_to_keep=1)
    for step in (1, 2):
        make_checkpoint(second, step, run="second")
    assert {step: second.run_of(step) for step in second.steps()} == {2: "second", 3: "first", 4: "first"}


def test_one_holder_of_a_folder_at_a_time(tmp_path):
    checkpoints = StepCheckpoints(tmp_path / "run")
    with checkpoints.locked({"run": "first"}), pytest.raises(CheckpointError, match="in use by run first"):
        checkpoints.lock({"run": "second"})
    checkpoints.lock({"run": "second"}).release()  # free again once the first let go


@pytest.mark.parametrize(
    "key, secret",
    [
        ("hf_token", True),
        ("custom_reward_function.reward_kwargs.api_key", True),
        ("x.apikey", True),
        ("db.password", True),
        ("s3.secret_access_key", True),
        ("auth", True),
        ("actor_rollout_ref.model.tokenizer_path", False),
        ("rollout.stop_token_ids", False),
        ("data.max_response_length", False),
        ("reward_model.input_tokenizer", False),
    ],
)
def test_secret_keys(key, secret):
    assert is_secret_key(key) is secret


def test_redaction_by_key_and_by_value():
    config = OmegaConf.create(
        {
            "a": {"api_key": "abcd-1234", "url": "https://u:abcd-1234@h", "note": "hf_" + "x" * 24, "n": 3},
            "tokenizer_path": "/models/tok",
        }
    )
    safe = redacted(config)
    assert OmegaConf.to_container(safe) == {
        "a": {"api_key": "***", "url": "https://u:***@h", "note": "***", "n": 3},
        "tokenizer_path": "/models/tok",
    }
    assert config.a.api_key == "abcd-1234"  # the run's own config keeps the value
    assert split_secret_overrides(["+a.b.hf_token=x", "lr=1", "c=sk-" + "A" * 24]) == (
        ["lr=1"],
        ["+a.b.hf_token=x", "c=sk-" + "A" * 24],
    )
    # the key's value inside another override
    assert split_secret_overrides(["+k.api_key='abcd-1234'", "+k.url=https://u:abcd-1234@h", "+k.n=abcd"]) == (
        ["+k.n=abcd"],
        ["+k.api_key='abcd-1234'", "+k.url=https://u:abcd-1234@h"],
    )


WRITER = """
import os, sys
from rl_core.step_checkpoint import StepCheckpoints
checkpoints = StepCheckpoints(sys.argv[1], max_to_keep=2)
step = int(sys.argv[2])
while True:
    staging = checkpoints.staging_dir(step)
    (staging / "actor").mkdir()
    (staging / "actor" / "model.safetensors").write_bytes(os.urandom(4 << 20))
    checkpoints.commit(step, {"mlflow_run_id": "r"})
    print(step, flush=True)
    step += 1
"""


def test_sigkill_during_checkpoint_writes_always_leaves_one_to_resume_from(tmp_path):
    """Eight times: a process writing 4 MB checkpoints back to back is killed at a random moment; an intact checkpoint
    is always there, and the next writer continues after it."""
    import random
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    checkpoints, rng, resumed_from = StepCheckpoints(tmp_path, max_to_keep=2), random.Random(0), 1
    for _ in range(8):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), str(resumed_from)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        writer.stdout.readline()  # one checkpoint done: kill it somewhere in the following ones
        time.sleep(rng.uniform(0.0, 0.3))
        writer.kill()
        writer.wait()
        step, damaged = checkpoints.latest_intact()
        assert step is not None and step >= resumed_from and damaged == []
        assert checkpoints.trainer_state(checkpoints.step_dir(step))["global_step"] == step
        resumed_from = step + 1
    assert resumed_from > 8


def test_an_evaluation_needs_the_secrets_its_training_runs_config_hides():
    """The stored config has ***: evaluating with it would send *** to the reward function (scoring 0 with
    on_error=zero)."""
    from flows.evaluate import EvaluationSourceError, check_no_redacted_values

    stored = redacted(
        OmegaConf.create({"custom_reward_function": {"reward_kwargs": {"api_key": "sk-abcdefghijklmnopqrstuv"}}})
    )
    with pytest.raises(
        EvaluationSourceError, match=r"custom_reward_function.reward_kwargs.api_key = '\*\*\*'.*pass them again"
    ):
        check_no_redacted_values(stored)
    check_no_redacted_values(
        OmegaConf.create({"custom_reward_function": {"reward_kwargs": {"api_key": "given-again"}}})
    )


def test_a_password_in_a_url_is_redacted():
    config = OmegaConf.create(
        {"trainer": {"tracking_uri": "postgresql://mlflow:hunter2@db:5432/mlflow", "note": "http://127.0.0.1:5000"}}
    )
    safe = redacted(config)
    assert (
        safe.trainer.tracking_uri == "postgresql://mlflow:***@db:5432/mlflow"
        and safe.trainer.note == "http://127.0.0.1:5000"
    )
