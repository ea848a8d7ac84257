"""`ppoflow train` on checkpoints saved through transformers' own tokenizer class, as a user's are (not the project's
tiny builder): more tokens than embedding rows, and fewer, both train; the pad token past the rows is refused in one
line before Ray, Prefect or MLflow start. On the session's Ray head and Prefect API (the command would start its
own)."""

import json
import os
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL

from rl_core.data.rows import write_rows
from rl_core.data.synthetic import addition_rows
from tests.conftest import ROOT, small_run_overrides
from tests.rl_core.transformers_checkpoint import TOKENS, save_user_checkpoint


def ppoflow_train(*overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", *overrides],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=env or os.environ,
    )


@pytest.mark.parametrize(("rows", "extra"), [(TOKENS, ("<|extra_0|>",)), (320, ())], ids=["more-tokens", "fewer"])
def test_a_users_checkpoint_trains_through_ppoflow_train(rows, extra, tmp_path, demo_cache, ray_address, prefect_api):
    model = save_user_checkpoint(tmp_path / "model", rows=rows, extra_tokens=extra)
    overrides = small_run_overrides(
        tmp_path,
        demo_cache,
        "+profile=demo",
        f"actor_rollout_ref.model.path={model}",
        "data.max_prompt_length=64",  # byte-level tokens: the prompts are longer than the tiny tokenizer's
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.ray.address={ray_address}",
    )
    result = ppoflow_train(*overrides, env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["step"] == 1
    metrics = MlflowClient(summary["tracking_uri"]).get_run(summary["run_id"]).data.metrics
    assert metrics["actor/pg_loss"] == metrics["actor/pg_loss"]  # finite: a real update
    said = f"the tokenizer has {TOKENS + 1} tokens and the model's embedding {TOKENS} rows"
    assert (said in result.stdout + result.stderr) == bool(extra)  # one line naming both sizes, only when more


def test_a_pad_token_past_the_rows_is_refused_before_anything_starts(tmp_path):
    model = save_user_checkpoint(tmp_path / "model", rows=256)  # transformers' added tokens have no row
    rows = addition_rows(64, seed=0, max_operand=9, split="train")
    train_file, val_file = write_rows(rows, tmp_path / "train.parquet"), write_rows(rows[:8], tmp_path / "val.parquet")
    started = time.monotonic()
    result = ppoflow_train(
        "+profile=demo",
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={train_file}",
        f"data.val_files={val_file}",
        "data.max_prompt_length=64",
        f"trainer.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        f"trainer.default_local_dir={tmp_path}/checkpoints",
        f"trainer.cache_dir={tmp_path}/cache",
        env={"PATH": "/usr/bin:/bin", "PPOFLOW_HOME": str(tmp_path)},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        "ppoflow train: actor_rollout_ref.model.path: token ids the run feeds the model lie past its embedding: 256 "
        "'<|im_end|>' (the eos token), 257 '<|endoftext|>' (the pad token), 258 '<|im_start|>' (the prompts); the "
        f"tokenizer has {TOKENS} tokens, the model's embedding 256 rows; resize the embedding"
    )
    assert "Ray" not in result.stdout.replace("Ray at trainer.ray.address", "")  # nothing was started
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "checkpoints").exists()
    print(f"refused in {time.monotonic() - started:.1f} s")
