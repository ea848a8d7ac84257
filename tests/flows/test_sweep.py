"""Sweeps (flows/sweep.py, flows/sweep_space.py) and evaluation (flows/evaluate.py): the search space as Hydra parses
it, and real sweeps of short training runs nested under one MLflow parent run (real Prefect API, Ray head, MLflow on
SQLite)."""

import json
import math
from pathlib import Path

import optuna
import pytest
import ray
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from flows.config import compose_config
from flows.demo import ensure_demo_data
from flows.evaluate import EvaluationSourceError, evaluate
from flows.sweep import ChildResult, ranked, resolve_metric, sweep
from flows.sweep_space import SweepError, check_sweep, grid, parse_search_space, suggest
from flows.workers import WORKERS_NAMESPACE_TAG

METRIC = "actor/entropy"  # differs between the children of these short runs (the validation accuracy often does not)


# ---------------------------------------------------------------------------------------------- the search space
def test_a_grid_is_every_combination_first_key_slowest():
    space = parse_search_space(
        [
            "data.train_batch_size=8",
            "algorithm.adv_estimator=grpo,rloo",
            "actor_rollout_ref.actor.optim.lr=1e-5,3e-5",
            "actor_rollout_ref.rollout.n=range(2,5,2)",
        ],
        "grid",
    )
    assert space.fixed == ["data.train_batch_size=8"]
    assert grid(space) == [
        [f"algorithm.adv_estimator={a}", f"actor_rollout_ref.actor.optim.lr={lr}", f"actor_rollout_ref.rollout.n={n}"]
        for a in ("grpo", "rloo")
        for lr in ("1e-05", "3e-05")
        for n in (2, 4)
    ]


@pytest.mark.parametrize(
    "overrides, search, message",
    [
        (["data.train_batch_size=8"], "grid", "varies nothing"),
        (["trainer.default_local_dir=a,b"], "grid", "trainer.default_local_dir cannot vary"),
        (["trainer.experiment_name=a,b"], "grid", "cannot vary"),
        (["actor_rollout_ref.actor.optim.lr=interval(1e-6,1e-4)"], "grid", "an interval has no grid"),
        (["algorithm.adv_estimator=grpo,rloo", "algorithm.adv_estimator=gae,grpo"], "grid", "swept twice"),
        (["algorithm.adv_estimator=grpo,,"], "grid", "Hydra's syntax"),
        (["algorithm.no_such_key=1,2"], "grid", "unknown config key 'algorithm.no_such_key'"),
        (["algorithm.adv_estimator=grpo,ppo9"], "grid", "child algorithm.adv_estimator=ppo9: algorithm.adv_estimator"),
        (
            ["data.nokey=3", "algorithm.adv_estimator=grpo,rloo"],
            "grid",
            "fixed overrides: unknown config key 'data.nokey'",
        ),
        (["data.train_batch_size=32,many"], "grid", "expected int, got 'many'"),
        (["algorithm.adv_estimator=grpo,rloo"], "bayes", "search is grid, random or tpe"),
    ],
)
def test_bad_sweeps_are_refused_before_anything_runs(overrides, search, message):
    with pytest.raises(SweepError, match=message):
        check_sweep(overrides, search)


def test_a_search_draws_from_the_choices_ranges_and_intervals():
    space = parse_search_space(
        [
            "algorithm.adv_estimator=grpo,rloo",
            "actor_rollout_ref.rollout.n=range(2,9,2)",
            "actor_rollout_ref.actor.optim.lr=tag(log,interval(1e-6,1e-2))",
            "actor_rollout_ref.actor.clip_ratio=interval(0.1,0.3)",
        ],
        "random",
    )
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    drawn = []
    for _ in range(40):
        trial = study.ask()
        drawn.append(dict(o.split("=", 1) for o in suggest(trial, space)))
        study.tell(trial, 0.0)
    assert {d["algorithm.adv_estimator"] for d in drawn} == {"grpo", "rloo"}
    assert {d["actor_rollout_ref.rollout.n"] for d in drawn} <= {"2", "4", "6", "8"}
    lrs = [float(d["actor_rollout_ref.actor.optim.lr"]) for d in drawn]
    # log-uniform: half the draws below 1e-4
    assert all(1e-6 <= lr <= 1e-2 for lr in lrs) and sum(lr < 1e-4 for lr in lrs) > 10
    assert all(0.1 <= float(d["actor_rollout_ref.actor.clip_ratio"]) <= 0.3 for d in drawn)
    assert study.trials[0].distributions["actor_rollout_ref.actor.optim.lr"].log


def test_children_are_ranked_best_first_failed_last():
    results = [
        ChildResult(i, [], "FINISHED", f"r{i}", metrics={"m": v}) for i, v in enumerate([0.3, 0.9, float("nan"), 0.5])
    ]
    results.append(ChildResult(4, [], "FAILED", None))
    assert [r.index for r in ranked(results, "m", "max")] == [1, 3, 0, 2, 4]
    assert [r.index for r in ranked(results, "m", "min")] == [0, 3, 1, 2, 4]
    assert (
        resolve_metric("auto", {"critic/score/mean": 1, "val-core/b/acc/mean_at_1": 0, "val-core/a/acc/mean_at_4": 0})
        == "val-core/a/acc/mean_at_4"
    )
    assert resolve_metric("auto", {"critic/score/mean": 1}) == "critic/score/mean"
    assert resolve_metric("val-core/a/acc/mean@4", {}) == "val-core/a/acc/mean_at_4"


# ---------------------------------------------------------------------------------------------- real sweeps
@pytest.fixture(scope="module")
def grid_sweep(tmp_path_factory, demo_cache, ray_address, prefect_api):
    """A grid of two 2-step runs (two learning rates), validated on (part of) the training prompts so that the accuracy
    is not 0. That a grid is every combination of several keys is checked without running it (the first test)."""
    from tests.conftest import small_run_overrides

    folder = tmp_path_factory.mktemp("grid-sweep")
    fixed = small_run_overrides(
        folder, demo_cache, "trainer.total_training_steps=2", "trainer.test_freq=2", "data.val_max_samples=32"
    )
    train_file, _ = ensure_demo_data(compose_config(fixed))
    fixed.append(f"data.val_files={train_file}")
    result = sweep(
        overrides=fixed + ["actor_rollout_ref.actor.optim.lr=1e-4,3e-2"],
        metric=METRIC,
        direction="min",
        name="grid-test",
    )
    return result, fixed


def test_a_grid_sweep_nests_its_children_and_compares_them(grid_sweep):
    result, _ = grid_sweep
    client = MlflowClient(result["tracking_uri"])
    parent = client.get_run(result["parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["ppoflow.kind"] == "sweep"
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert len(children) == 2 and all(c.info.status == "FINISHED" for c in children)
    assert sorted(float(c.data.params["actor_rollout_ref.actor.optim.lr"]) for c in children) == [1e-4, 3e-2]
    # best first (lowest entropy), checked against each child's own MLflow run
    final = {c.info.run_id: c.data.metrics[METRIC] for c in children}
    assert len(set(final.values())) > 1
    order = [child["run_id"] for child in result["children"]]
    assert [final[run] for run in order] == sorted(final.values())
    assert parent.data.tags["ppoflow.best_child_run_id"] == order[0]
    assert math.isclose(parent.data.metrics[f"best/{METRIC}"], min(final.values()))
    # the comparison on the parent run and in Prefect
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"comparison.md", "comparison.json", "curves.png"} <= artifacts
    table = json.loads(Path(client.download_artifacts(parent.info.run_id, "comparison.json")).read_text())
    assert [row["run_id"] for row in table] == order
    assert Path(client.download_artifacts(parent.info.run_id, "curves.png")).read_bytes()[:4] == b"\x89PNG"
    with get_client(sync_client=True) as prefect:
        markdown = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sweep-comparison"]))
        )
    latest = max(markdown, key=lambda a: a.created)
    lines = [line for line in latest.data.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split("|")[-2].strip() for line in lines] == order


def test_the_same_sweep_started_again_continues_it(grid_sweep):
    result, fixed = grid_sweep
    again = sweep(
        overrides=fixed + ["actor_rollout_ref.actor.optim.lr=1e-4,3e-2"],
        metric=METRIC,
        direction="min",
        name="grid-test",
    )
    assert again["parent_run_id"] == result["parent_run_id"]
    assert [c["run_id"] for c in again["children"]] == [c["run_id"] for c in result["children"]]  # nothing ran again


def test_evaluate_reproduces_the_runs_last_validation(grid_sweep):
    result, fixed = grid_sweep
    client = MlflowClient(result["tracking_uri"])
    name = "val-core/ppoflow/addition/acc/mean_at_1"
    best = max(
        (client.get_run(child["run_id"]) for child in result["children"]), key=lambda run: run.data.metrics[name]
    )
    checkpoint = Path(best.data.tags["checkpoint/latest"])
    trained = max(client.get_metric_history(best.info.run_id, name), key=lambda m: m.step)
    assert trained.step == 2 and trained.value > 0
    evaluation = evaluate(
        source=str(checkpoint), overrides=[f"trainer.tracking_uri={result['tracking_uri']}"], samples=4
    )
    assert evaluation["metrics"]["val-core/ppoflow/addition/acc/mean@1"] == trained.value
    assert evaluation["source_run_id"] == best.info.run_id and evaluation["step"] == 2
    sampled = evaluation["metrics"]
    assert (
        sampled["sampled/val-core/ppoflow/addition/acc/pass@4"]
        >= sampled["sampled/val-core/ppoflow/addition/acc/mean@4"]
    )
    run = client.get_run(evaluation["run_id"])
    assert run.data.tags["ppoflow.source_run_id"] == best.info.run_id and run.info.status == "FINISHED"
    assert (
        run.data.metrics[name] == trained.value
        and "sampled/val-core/ppoflow/addition/acc/pass_at_4" in run.data.metrics
    )
    # the same policy as a registered model version (the run's final `model` artifact)
    client.create_registered_model("sweep-best")
    client.create_model_version("sweep-best", source=f"{best.info.artifact_uri}/model", run_id=best.info.run_id)
    registered = evaluate(
        source="models:/sweep-best/1", overrides=[f"trainer.tracking_uri={result['tracking_uri']}"], samples=1
    )
    assert (
        registered["metrics"]["val-core/ppoflow/addition/acc/mean@1"] == trained.value
        and registered["source_run_id"] == best.info.run_id
    )
    with pytest.raises(EvaluationSourceError, match="not a step checkpoint"):
        evaluate(source=str(checkpoint.parent), overrides=[f"trainer.tracking_uri={result['tracking_uri']}"])
    with pytest.raises(EvaluationSourceError, match="no such model version"):
        evaluate(source="models:/sweep-best/7", overrides=[f"trainer.tracking_uri={result['tracking_uri']}"])


def test_a_failing_child_is_marked_and_the_sweep_goes_on(tmp_path, demo_cache, ray_address, prefect_api):
    from tests.conftest import small_run_overrides

    raising = tmp_path / "raising_reward.py"
    raising.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    raise RuntimeError('scorer "
        "bug')\n"
    )
    fixed = small_run_overrides(tmp_path, demo_cache, "trainer.total_training_steps=1", "trainer.test_freq=-1")
    result = sweep(
        overrides=fixed + [f"custom_reward_function.path=null,'{raising}'"], metric="critic/score/mean", name="failing"
    )
    status = {child["index"]: child for child in result["children"]}
    assert status[0]["status"] == "FINISHED" and status[1]["status"] == "FAILED" and "scorer bug" in status[1]["error"]
    assert [c["index"] for c in result["children"]] == [0, 1]  # the failed child last
    client = MlflowClient(result["tracking_uri"])
    failed = client.get_run(status[1]["run_id"])
    assert failed.info.status == "FAILED" and "scorer bug" in failed.data.tags["ppoflow.error"]
    assert failed.data.tags["mlflow.parentRunId"] == result["parent_run_id"]
    assert not [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == failed.data.tags[WORKERS_NAMESPACE_TAG]
    ]
    assert client.get_run(result["parent_run_id"]).info.status == "FINISHED"


def test_a_random_search_continues_its_optuna_study(tmp_path, demo_cache, ray_address, prefect_api):
    from tests.conftest import small_run_overrides

    fixed = small_run_overrides(
        tmp_path, demo_cache, "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1"
    )
    space = ["actor_rollout_ref.actor.optim.lr=tag(log,interval(1e-5,1e-2))"]
    first = sweep(overrides=fixed + space, search="random", trials=1, metric=METRIC, name="search")
    second = sweep(overrides=fixed + space, search="random", trials=2, metric=METRIC, name="search")
    assert second["parent_run_id"] == first["parent_run_id"] and len(second["children"]) == 2
    assert first["children"][0]["run_id"] in {c["run_id"] for c in second["children"]}
    study = optuna.load_study(study_name="search", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    values = {round(t.value, 6) for t in study.trials}
    assert values == {round(c["metrics"][METRIC], 6) for c in second["children"]}
    with pytest.raises(SweepError, match="needs at least one trial"):
        sweep(overrides=fixed + space, search="tpe", trials=0)
