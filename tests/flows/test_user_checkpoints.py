"""`ppoflow train` on checkpoints saved through transformers' own tokenizer class, as a user's are (not the project's
tiny builder): more tokens than embedding rows, and fewer, both train; the pad token past the rows is refused in one
line before Ray, Prefect or MLflow start. A vision-language checkpoint trains on verl's multimodal rows; a bad image is
refused in one line before anything starts. On the session's Ray head and Prefect API (the command would start its
own)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL

from rl_core.data.rows import write_rows
from rl_core.data.synthetic import addition_rows, shapes_rows
from rl_core.models.tiny_vlm import make_tiny_vlm
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


def test_verl_multimodal_rows_train_through_ppoflow_train(tmp_path, demo_cache, ray_address, prefect_api):
    """A vision-language checkpoint on verl-format rows with images (shapes and a geo3k-style row): the images reach
    the workers through Ray, the samples table carries their thumbnails, each validation logs samples with images."""
    model = make_tiny_vlm(tmp_path / "model", family="qwen2_5_vl")
    geo3k = {**shapes_rows(1, 0, "geo")[0], "data_source": "hiyouga/geometry3k", "ability": "math"}
    geo3k["prompt"] = [{"role": "user", "content": "<image>Find x."}]
    rows = shapes_rows(15, 0) + [geo3k]
    train_file, val_file = write_rows(rows, tmp_path / "train.parquet"), write_rows(rows[:4], tmp_path / "val.parquet")
    overrides = small_run_overrides(
        tmp_path,
        demo_cache,
        "+profile=demo",
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={train_file}",
        f"data.val_files={val_file}",
        "data.max_prompt_length=32",
        "data.max_response_length=4",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"trainer.ray.address={ray_address}",
    )
    result = ppoflow_train(*overrides, env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "its batches run padded" in result.stdout + result.stderr  # said once, in the run's log
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    client = MlflowClient(summary["tracking_uri"])
    assert client.get_run(summary["run_id"]).data.metrics["training/rollout_probs_diff_max"] < 1e-4
    folder = tmp_path / "artifacts"
    samples_file = client.download_artifacts(summary["run_id"], "samples/step_000002.json", folder)
    samples = json.loads(Path(samples_file).read_text())
    images = samples["data"][0][samples["columns"].index("images")]
    assert len(images) == 1 and images[0].startswith("data:image/png;base64,")
    validation = [a.path for a in client.list_artifacts(summary["run_id"], "validation")]
    assert validation == ["validation/step_000000.json", "validation/step_000002.json"]
    logged = json.loads(Path(client.download_artifacts(summary["run_id"], validation[-1], folder)).read_text())
    assert logged["columns"][:2] == ["image", "question"] and len(logged["data"]) == 4


NOT_AN_IMAGE = "not an image Pillow can read (the bytes are no PNG, JPEG, ...)"


def test_a_bad_image_is_refused_in_one_line_before_anything_starts(tmp_path):
    model = make_tiny_vlm(tmp_path / "model", family="qwen2_vl")
    rows = shapes_rows(8, 0)
    rows[5]["images"] = [{"bytes": b"GIF89a, then nothing", "path": None}]
    train_file, val_file = write_rows(rows, tmp_path / "train.parquet"), write_rows(rows[:2], tmp_path / "val.parquet")
    result = ppoflow_train(
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={train_file}",
        f"data.val_files={val_file}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "algorithm.adv_estimator=grpo",
        f"trainer.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        f"trainer.default_local_dir={tmp_path}/checkpoints",
        env={"PATH": "/usr/bin:/bin", "PPOFLOW_HOME": str(tmp_path)},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.splitlines()
    assert line == f"ppoflow train: data.train_files: {train_file}: row 5, images[0]: {NOT_AN_IMAGE}"
    assert "Ray" not in result.stdout.replace("Ray at trainer.ray.address", "")  # nothing was started
