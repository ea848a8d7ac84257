"""The evaluate flow: a trained policy on a validation set, greedy and sampled, in an MLflow run of its own.

The policy is a step checkpoint (``.../global_step_N`` or its ``actor`` folder, a local one or at a URL, ``s3://...``)
or a registered MLflow model version (``models:/<name>/<version>``). Its training run (recorded in the checkpoint, or
the version's run) gives the config the evaluation starts from — model, data, prompt and reward settings — and
``overrides`` change it (another ``data.val_files``, ``custom_reward_function.path``, ...). Two validation passes with
the training run's own code (:func:`rl_core.ppo_step.run_validation`):

* greedy (one response per prompt): ``val-core/<data_source>/acc/mean@1``, the metric training logs, so a
  checkpoint's evaluation reproduces its run's validation at that step;
* sampled (``samples`` responses per prompt at ``temperature``): ``sampled/val-core/<ds>/acc/mean@n`` and pass@k.

The MLflow run is tagged with its source (``ppoflow.source_run_id``, ``ppoflow.source``), in the source run's
experiment unless ``trainer.project_name`` is overridden.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from mlflow.artifacts import download_artifacts
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from prefect import flow
from prefect.states import Failed

from flows.config import compose_config
from flows.demo import apply_embedded_defaults
from flows.prefect_view import PrefectRunView, mlflow_run_url, one_line
from flows.secrets import REDACTED, redacted_keys
from flows.tracking import CONFIG_ARTIFACT, RunTracker, open_store, provenance_tags, tracking_uri
from flows.workers import build_workers, step_workers
from infra.cluster import connect
from rl_core.agent.tools.registry import tool_schemas
from rl_core.data.dataset import RLDataset
from rl_core.models.loading import load_policy_processor, load_policy_tokenizer
from rl_core.ppo_step import StepWorkers, run_validation
from rl_core.remote_folder import RemoteFolder, RemoteStorageError, is_remote
from rl_core.reward.custom import load_custom_reward_function
from rl_core.reward.manager import RewardManager, build_reward_manager
from rl_core.step_checkpoint import STATE_FILE, damage


class EvaluationSourceError(ValueError):
    """The policy to evaluate cannot be found, or its training run cannot."""


def resolve_source(source: str, client: MlflowClient, download_to: Path) -> tuple[Path, str, int]:
    """(actor folder, training run id, global step) of a step checkpoint folder, its ``actor`` folder, or
    ``models:/<name>/<version>`` (downloaded to ``download_to``)."""
    if source.startswith("models:/"):
        name, _, version = source.removeprefix("models:/").partition("/")
        if not version.isdigit():
            raise EvaluationSourceError(
                f"{source!r}: name a registered version, models:/<name>/<version> (e.g. models:/ppoflow-policy/1)"
            )
        try:
            model_version = client.get_model_version(name, version)
        except Exception as error:
            raise EvaluationSourceError(
                f"{source!r}: no such model version in {client.tracking_uri} ({one_line(error)})"
            ) from None
        folder = Path(
            download_artifacts(
                artifact_uri=model_version.source, dst_path=str(download_to), tracking_uri=client.tracking_uri
            )
        )
        step = max((m.step for m in client.get_metric_history(model_version.run_id, "training/global_step")), default=0)
        return folder, model_version.run_id, step
    if is_remote(source):  # a step checkpoint at a URL: read back into download_to, checked against its manifest
        parent, _, name = source.rstrip("/").removesuffix("/actor").rpartition("/")
        try:
            RemoteFolder(parent).download(name, download_to / name)
        except RemoteStorageError as error:
            raise EvaluationSourceError(str(error)) from None
        problem = damage(download_to / name)
        if problem:
            raise EvaluationSourceError(f"{source!r}: {problem}; evaluate another global_step_N")
        source = str(download_to / name)
    folder = Path(source).expanduser().resolve()
    checkpoint = folder if (folder / STATE_FILE).is_file() else folder.parent
    if not (checkpoint / STATE_FILE).is_file() or not (checkpoint / "actor").is_dir():
        raise EvaluationSourceError(
            f"{source!r} is not a step checkpoint: give a global_step_N folder (holding {STATE_FILE} and actor/) or "
            "its actor folder, or a registered model as models:/<name>/<version>"
        )
    state = json.loads((checkpoint / STATE_FILE).read_text())
    return checkpoint / "actor", state["mlflow_run_id"], int(state["global_step"])


def source_config_yaml(client: MlflowClient, run_id: str) -> str:
    try:
        return Path(
            client.download_artifacts(run_id, CONFIG_ARTIFACT, tempfile.mkdtemp(prefix="ppoflow-eval-"))
        ).read_text()
    except Exception as error:
        raise EvaluationSourceError(
            f"the training run {run_id} is not in the MLflow store {client.tracking_uri} or has no {CONFIG_ARTIFACT} "
            f"({one_line(error)}); point MLFLOW_TRACKING_URI or trainer.tracking_uri at its store"
        ) from None


def check_no_redacted_values(config: DictConfig) -> None:
    """The training run's stored config has its secrets replaced by ``***``: an evaluation needs them given again."""
    hidden = redacted_keys(config)
    if hidden:
        raise EvaluationSourceError(
            f"the training run's stored config hides secret values ({', '.join(hidden)} = {REDACTED!r}): pass them "
            f"again as overrides, e.g. {hidden[0]}='${{oc.env:MY_SECRET}}' (the secret read from the environment)"
        )


def run_evaluation(
    source: str, overrides: list[str] | None = None, samples: int = 8, temperature: float = 1.0
) -> dict[str, Any]:
    """Everything the evaluate flow does (see the module doc); returns the run id, source and metrics."""
    if samples < 1 or not temperature > 0:
        raise ValueError(f"samples={samples}, temperature={temperature}: need samples >= 1 and temperature > 0")
    client = open_store(tracking_uri(compose_config(overrides)))
    with tempfile.TemporaryDirectory(prefix="ppoflow-eval-") as downloads:
        actor_folder, source_run_id, step = resolve_source(source, client, Path(downloads))
        config = compose_config(overrides, base=source_config_yaml(client, source_run_id))
        check_no_redacted_values(config)
        apply_embedded_defaults(config)
        tokenizer = load_policy_tokenizer(config.actor_rollout_ref.model)
        processor = load_policy_processor(config.actor_rollout_ref.model, tokenizer)
        tools = tool_schemas(config.actor_rollout_ref.rollout.multi_turn)
        val_data = RLDataset(
            config.data.val_files, tokenizer, config.data, config.data.val_max_samples, tools, processor
        )
        reward_manager = build_reward_manager(
            config, tokenizer, load_custom_reward_function(**config.custom_reward_function)
        )
        tags = {"ppoflow.kind": "evaluate", "ppoflow.source_run_id": source_run_id, "ppoflow.source": source}
        tracker = RunTracker(
            config,
            tags={**provenance_tags(list(overrides or [])), **tags, "ppoflow.source_step": str(step)},
            run_name=f"{client.get_run(source_run_id).info.run_name}-eval",
        )
        view = PrefectRunView()
        view.link_run(
            mlflow_run_url(tracker.uri, tracker.experiment_id, tracker.run_id),
            tracker.uri,
            tracker.run_id,
            actor_folder,
        )
        workers = None
        try:
            connect(config.trainer.ray.address, num_cpus=config.trainer.ray.num_cpus)
            workers = build_workers(config, f"ppoflow-eval-{tracker.run_id}", evaluation=True, log=view.log)
            timeout = config.trainer.worker_timeout_s
            workers.role("actor_rollout_ref").load_weights(str(actor_folder), timeout_s=timeout, stage="load_weights")
            stage_workers = step_workers(workers, timeout, config.reward.timeout_s)
            metrics = greedy_and_sampled(config, stage_workers, val_data, reward_manager, samples, temperature)
            tracker.log_step(step, metrics)
            summary = ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
            view.log(f"evaluated {source} (run {source_run_id}, step {step}): {summary}")
            tracker.finish()
        except BaseException as error:
            tracker.fail(error)
            raise
        finally:
            if workers is not None:
                workers.kill()
    return {
        "tracking_uri": tracker.uri,
        "run_id": tracker.run_id,
        "source_run_id": source_run_id,
        "step": step,
        "metrics": metrics,
    }


def greedy_and_sampled(
    config: DictConfig,
    workers: StepWorkers,
    val_data: RLDataset,
    reward_manager: RewardManager,
    samples: int,
    temperature: float,
) -> dict[str, float]:
    """The validation metrics of one greedy response per prompt, and (prefixed ``sampled/``) of ``samples`` sampled
    responses per prompt at ``temperature``."""
    val_kwargs = dict(config.actor_rollout_ref.rollout.val_kwargs)
    greedy = {**val_kwargs, "n": 1, "do_sample": False}
    sampled = {**val_kwargs, "n": samples, "do_sample": True, "temperature": temperature}
    metrics = run_validation(config, workers, val_data, reward_manager, val_kwargs=greedy)
    for key, value in run_validation(config, workers, val_data, reward_manager, val_kwargs=sampled).items():
        metrics[f"sampled/{key}"] = value
    return metrics


@flow(name="ppoflow-evaluate")
def evaluate(source: str, overrides: list[str] | None = None, samples: int = 8, temperature: float = 1.0) -> Any:
    """Evaluate ``source`` (a global_step_N checkpoint folder or ``models:/<name>/<version>``) greedily and with
    ``samples`` sampled responses per prompt at ``temperature``; ``overrides`` change the training run's config
    (e.g. ``data.val_files=...``). Returns the MLflow run id and the metrics."""
    try:
        return run_evaluation(source, overrides, samples, temperature)
    except Exception as error:
        return Failed(message=one_line(error), data=error)
