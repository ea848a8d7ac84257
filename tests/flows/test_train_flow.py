"""The training flow end to end: real Prefect API, real Ray workers, MLflow on SQLite, the tiny demo model."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from flows.config import ConfigError
from flows.prefect_view import one_line
from flows.resume import ResumeRefused
from flows.train import train
from flows.workers import WORKERS_NAMESPACE_TAG
from rl_core.config import ModelConfig
from rl_core.data.rows import write_rows
from rl_core.data.synthetic import calc_rows, calc_transcript
from rl_core.models.folder import ModelLoadError
from rl_core.models.loading import load_policy_model
from rl_core.models.tiny import make_tiny_model
from rl_core.separate_rollout import SeparateRollout
from rl_core.sft import SFTExample, run_sft
from rl_core.step_checkpoint import StepCheckpoints
from tests.conftest import ROOT
from tests.flows.conftest import metric_history

VERL_NAMES = (
    "actor/pg_loss",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/grad_norm",
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "response_length/mean",
    "timing_s/gen",
    "perf/throughput",
    "perf/time_per_step",
)


def flow_run_task_names(flow_run_id: str, wanted: set[str], timeout_s: float = 60) -> set[str]:
    """The names of the flow run's task runs, once all of ``wanted`` are among them or ``timeout_s`` has passed
    (Prefect records them from events, a little after they ran, in no set order)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        names = {run.name for run in runs}
        if wanted <= names or time.monotonic() > deadline:
            return names
        time.sleep(0.5)


def test_grpo_three_steps(run_overrides, tmp_path):
    result = train(overrides=run_overrides("trainer.register_model_name=ppoflow-tiny"))
    assert result["step"] == 3 and Path(result["checkpoint_dir"]).name == "global_step_3"
    json.dumps(result)  # the CLI's last line
    history = metric_history(result["tracking_uri"], result["run_id"])
    for name in VERL_NAMES:
        assert sorted(history[name]) == [1, 2, 3], name
    assert all(len(values) == 1 for steps in history.values() for values in steps.values())  # each step once
    assert "val-core/ppoflow/addition/acc/mean_at_1" in history and sorted(
        history["val-core/ppoflow/addition/acc/mean_at_1"]
    ) == [0, 3]
    assert "critic/vf_loss" not in history  # grpo: no critic
    client = MlflowClient(result["tracking_uri"])
    run = client.get_run(result["run_id"])
    assert run.data.params["algorithm.adv_estimator"] == "grpo" and run.info.status == "FINISHED"
    assert run.data.tags["checkpoint/latest"].endswith("global_step_3")
    # what it was made from (flows.tracking.provenance_tags), in an experiment MLflow's UI opens as model training
    assert "trainer.total_training_steps=3" in run.data.tags["ppoflow.overrides"].splitlines()
    assert "mlflow.source.git.commit" in run.data.tags or not (ROOT / ".git").exists()
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    # the Prefect graph covers the run, its task runs named by step; validation's seconds are verl's timing_s/testing
    assert sorted(history["timing_s/testing"]) == [0, 3]
    assert run.data.tags["ppoflow.prefect_ui_url"].startswith("http://127.0.0.1")  # the harness's server: a live link
    phases = {"load-inputs", "set-up", "step-0/validate", "step-1/generate", "step-3/update_actor", "step-3/validate"}
    assert phases <= flow_run_task_names(run.data.tags["ppoflow.prefect_flow_run_id"], phases)
    artifacts = {a.path for a in client.list_artifacts(result["run_id"])}
    assert {"config", "model", "samples"} <= artifacts
    model_files = {Path(a.path).name for a in client.list_artifacts(result["run_id"], "model")}
    assert {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
    } <= model_files and "state.safetensors" not in model_files  # no optimizer state
    assert client.get_latest_versions("ppoflow-tiny")[0].run_id == result["run_id"]
    # the final checkpoint is a plain HF checkpoint
    model = AutoModelForCausalLM.from_pretrained(Path(result["checkpoint_dir"]) / "actor")
    assert model.config.model_type == "qwen2"
    assert len(list((tmp_path / "checkpoints").glob("global_step_*"))) == 2  # max_ckpt_to_keep


def test_ppo_with_a_critic_three_steps(run_overrides):
    result = train(
        overrides=run_overrides(
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "algorithm.use_kl_in_reward=true",
        )
    )
    history = metric_history(result["tracking_uri"], result["run_id"])
    for name in (
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/values/mean",
        "critic/returns/mean",
        "actor/reward_kl_penalty",
    ):
        assert sorted(history[name]) == [1, 2, 3], name
    assert (Path(result["checkpoint_dir"]) / "critic" / "state.safetensors").exists()


def test_resume_gives_the_same_run_as_training_straight(run_overrides, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    settings = ("trainer.test_freq=2", "trainer.val_before_train=false")
    full = train(overrides=run_overrides("trainer.total_training_steps=4", *settings, folder=straight))
    first = train(overrides=run_overrides("trainer.total_training_steps=2", *settings, folder=split))
    second = train(
        overrides=run_overrides("trainer.total_training_steps=4", "trainer.resume_mode=auto", *settings, folder=split)
    )
    assert second["run_id"] == first["run_id"]  # the same MLflow run continues
    a, b = (
        metric_history(full["tracking_uri"], full["run_id"]),
        metric_history(second["tracking_uri"], second["run_id"]),
    )
    compared = [k for k in a if not k.startswith(("timing_s/", "perf/"))]
    assert "actor/pg_loss" in compared and "val-core/ppoflow/addition/acc/mean_at_1" in compared
    for key in compared:
        assert b[key] == a[key], key  # steps 1-4, once each, identical values
    assert sorted(b["actor/pg_loss"]) == [1, 2, 3, 4]

    # the same command again: the finished run's result, nothing trained, no workers built
    client = MlflowClient(second["tracking_uri"])
    pids = client.get_run(second["run_id"]).data.tags["ppoflow.worker_pids"]
    again = train(overrides=run_overrides("trainer.total_training_steps=4", *settings, folder=split))
    assert again["already_finished"] and (again["run_id"], again["step"]) == (second["run_id"], 4)
    assert (
        again["val_metrics"]["val-core/ppoflow/addition/acc/mean_at_1"]
        == a["val-core/ppoflow/addition/acc/mean_at_1"][4][0]
    )
    assert client.get_run(second["run_id"]).data.tags["ppoflow.worker_pids"] == pids

    # another algorithm: refused before anything changes, naming the key; from the command line in seconds
    checkpoints = sorted(str(p.relative_to(split)) for p in (split / "checkpoints").rglob("*"))
    rloo = run_overrides("trainer.total_training_steps=5", "algorithm.adv_estimator=rloo", *settings, folder=split)
    with pytest.raises(ResumeRefused, match="algorithm.adv_estimator: grpo -> rloo.*resume_allow_config_change"):
        train(overrides=rloo)
    cli = subprocess.run([sys.executable, "-m", "flows.cli", "train", *rloo], capture_output=True, text=True)
    assert cli.returncode == 2 and "algorithm.adv_estimator: grpo -> rloo" in cli.stderr, cli.stderr
    assert "Beginning flow run" not in cli.stdout + cli.stderr  # refused before the flow (and Prefect) started
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "train",
            *run_overrides("trainer.total_training_steps=4", *settings, folder=split),
        ],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 0 and f"run {second['run_id']} already finished at step 4" in cli.stdout, cli.stderr
    assert client.get_run(second["run_id"]).info.status == "FINISHED"
    assert sorted(str(p.relative_to(split)) for p in (split / "checkpoints").rglob("*")) == checkpoints

    # allowed: one more step under half the learning rate, which the restored optimizer uses
    lr = 0.5 * float(client.get_run(second["run_id"]).data.params["actor_rollout_ref.actor.optim.lr"])
    more = train(
        overrides=run_overrides(
            "trainer.total_training_steps=5",
            "trainer.resume_allow_config_change=true",
            f"actor_rollout_ref.actor.optim.lr={lr}",
            *settings,
            folder=split,
        )
    )
    history = metric_history(more["tracking_uri"], more["run_id"])
    assert more["run_id"] == second["run_id"] and history["actor/lr"][5] == [pytest.approx(lr)]
    assert history["actor/lr"][4] == [pytest.approx(2 * lr)]
    run = client.get_run(more["run_id"])
    assert run.data.tags["ppoflow.config_changed_at_4"] == "actor_rollout_ref.actor.optim.lr"
    diff = OmegaConf.load(client.download_artifacts(more["run_id"], "config/resume_4.yaml", str(tmp_path)))
    assert OmegaConf.to_container(diff) == {"actor_rollout_ref.actor.optim.lr": {"from": 2 * lr, "to": lr}}
    now = OmegaConf.load(client.download_artifacts(more["run_id"], "config/ppo_trainer.yaml", str(tmp_path)))
    assert now.actor_rollout_ref.actor.optim.lr == lr


def test_a_worker_killed_during_step_two_is_replaced(run_overrides, tmp_path):
    overrides = run_overrides("trainer.total_training_steps=4", "trainer.val_before_train=false")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    killed = []

    def kill_after_step_one():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            for experiment in client.search_experiments():
                for run in client.search_runs([experiment.experiment_id]):
                    if run.data.metrics.get("training/global_step", 0) >= 1:
                        ray.kill(
                            ray.get_actor("workers-rank0", namespace=run.data.tags[WORKERS_NAMESPACE_TAG]),
                            no_restart=True,
                        )
                        killed.append(run.info.run_id)
                        return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_after_step_one, daemon=True)
    killer.start()
    result = train(overrides=overrides)
    killer.join(timeout=5)
    assert killed, "the worker was never killed"
    history = metric_history(result["tracking_uri"], result["run_id"])
    assert {step: len(values) for step, values in history["actor/pg_loss"].items()} == {1: 1, 2: 1, 3: 1, 4: 1}
    assert MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.tags["ppoflow.worker_restarts"] == "1"


def test_a_crash_while_writing_a_checkpoint_keeps_the_previous_one(run_overrides, tmp_path, monkeypatch):
    real_commit = StepCheckpoints.commit

    def crash_at_step_two(self, step, trainer_state):
        if step == 2:
            raise OSError("disk full (simulated)")
        return real_commit(self, step, trainer_state)

    monkeypatch.setattr(StepCheckpoints, "commit", crash_at_step_two)
    with pytest.raises(OSError, match="disk full"):
        train(overrides=run_overrides("trainer.val_before_train=false"))
    checkpoints = StepCheckpoints(tmp_path / "checkpoints")
    assert checkpoints.latest_step() == 1
    weights = load_file(str(checkpoints.step_dir(1) / "actor" / "model.safetensors"))
    assert weights and checkpoints.trainer_state(checkpoints.step_dir(1))["global_step"] == 1
    monkeypatch.setattr(StepCheckpoints, "commit", real_commit)
    result = train(overrides=run_overrides("trainer.val_before_train=false"))  # resume_mode=auto picks up step 1
    history = metric_history(result["tracking_uri"], result["run_id"])
    assert {step: len(v) for step, v in history["actor/pg_loss"].items()} == {1: 1, 2: 1, 3: 1}


def test_a_dangling_pointer_is_an_error_not_a_fresh_start(run_overrides, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("7")
    with pytest.raises(Exception, match="global_step_7 does not exist"):
        train(overrides=run_overrides())


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.total_trainin_steps=3", "unknown config key 'trainer.total_trainin_steps'"),
        ("data.train_batch_size=many", "data.train_batch_size: expected int"),
    ],
)
def test_bad_config_fails_before_any_worker_starts(run_overrides, override, message):
    before = {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
    with pytest.raises(ConfigError, match=message):
        train(overrides=run_overrides(override))
    assert {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)} == before


def test_dynamic_sampling_runs_in_the_flow(run_overrides):
    """The filtering itself is checked on the finished batch in tests/rl_core/test_workers.py; here: the flow path
    runs it and reports the generation batches it needed."""
    result = train(
        overrides=run_overrides(
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.max_num_gen_batches=8",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
        )
    )
    history = metric_history(result["tracking_uri"], result["run_id"])
    assert sorted(history["train/num_gen_batches"]) == [1, 2]
    # every generation batch draws train_batch_size prompts: the sampler position saved at step 2 says how many were
    # drawn
    state = StepCheckpoints(Path(result["checkpoint_dir"]).parent).trainer_state(Path(result["checkpoint_dir"]))
    drawn = state["sampler"]["epoch"] * 16 + state["sampler"]["batch_in_epoch"]  # 64 rows / 4 = 16 batches per epoch
    assert drawn == sum(values[0] for values in history["train/num_gen_batches"].values())


def test_reward_model_lora_critic_warmup_and_resume_from_a_path(run_overrides, tmp_path, tiny_model_path):
    rm_path = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1).save_pretrained(rm_path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(rm_path)
    settings = (
        "+profile=demo",
        f"actor_rollout_ref.model.path={tiny_model_path}",
        "reward_model.enable=true",
        f"reward_model.model.path={rm_path}",
        "actor_rollout_ref.model.lora_rank=4",
        "algorithm.adv_estimator=gae",
        "trainer.critic_warmup=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=2",
    )
    first = train(overrides=run_overrides("trainer.total_training_steps=2", *settings))
    history = metric_history(first["tracking_uri"], first["run_id"])
    # step 1: critic only
    assert sorted(history["critic/vf_loss"]) == [1, 2] and sorted(history["actor/pg_loss"]) == [2]
    assert sorted(history["val-core/ppoflow/addition/acc/mean_at_1"]) == [2]
    # the scores are the reward model's (not the 0/1 rule scores of the addition task)
    assert any(v[0] not in (0.0, 1.0) for v in history["critic/score/mean"].values())
    assert (Path(first["checkpoint_dir"]) / "actor" / "adapter_model.safetensors").exists()
    step_one = Path(first["checkpoint_dir"]).parent / "global_step_1"
    second = train(
        overrides=run_overrides(
            "trainer.total_training_steps=3",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={step_one}",
            *settings,
        )
    )
    assert second["run_id"] == first["run_id"] and second["step"] == 3
    history = metric_history(second["tracking_uri"], second["run_id"])
    assert sorted(history["actor/pg_loss"]) == [2, 3] and all(len(v) == 1 for v in history["actor/pg_loss"].values())


def test_a_failure_while_setting_up_marks_the_run_failed_and_frees_the_workers(run_overrides, tmp_path):
    """The workers start, then loading the model fails on them: nothing of this run may stay RUNNING or alive. The error
    is the worker's own (its type and message, the stage and the worker noted), not Ray's wrapper."""
    with pytest.raises(ModelLoadError, match="lora_adapter_path='/no-such-adapter'") as raised:
        train(overrides=run_overrides("actor_rollout_ref.model.lora_adapter_path=/no-such-adapter"))
    assert type(raised.value) is ModelLoadError
    assert one_line(raised.value).startswith(
        "ModelLoadError: model.lora_adapter_path='/no-such-adapter': no adapter_config.json"
    )
    assert one_line(raised.value).endswith("(raised in stage 'init actor_rollout_ref' by worker workers-rank0)")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("ppoflow").experiment_id])
    assert run.info.status == "FAILED" and "no-such-adapter" in run.data.tags["ppoflow.error"]
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("workers-")]
    live_groups = [
        g
        for g in ray.util.placement_group_table().values()
        if g["name"].startswith("workers-") and g["state"] != "REMOVED"
    ]
    assert live_groups == []


@pytest.fixture(scope="module")
def calc_caller(tmp_path_factory):
    """The calc task's tiny model after 150 SFT steps (~3 s) on calculator transcripts: nearly all its samples call
    the calculator (not always with the right operands), so the flow's rollouts hold tool answers."""
    folder = make_tiny_model(tmp_path_factory.mktemp("calc") / "caller", task="calc")
    model, tokenizer = load_policy_model(ModelConfig(path=str(folder)))
    rows = calc_rows(64, seed=0, split="sft")
    examples = [SFTExample(row["prompt"], calc_transcript(row, use_tool=True)) for row in rows]
    run_sft(model, tokenizer, examples, steps=150, batch_size=16, lr=3e-3, seed=0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def test_multi_turn_rollouts_with_a_tool_train_and_resume_in_the_flow(run_overrides, tmp_path, calc_caller):
    """The calc task with multi-turn rollouts (format tag, the calculator's YAML) on a model that calls the tool: the
    flow trains and validates, logs verl's num_turns and the tool metrics, the samples table marks the tool's answers
    as not the policy's, and a run resumed after step 1 is the run trained straight (the same trajectories, tool
    answers included). The same run with the demo's calc agent talking to the OpenAI-compatible endpoint instead of
    the built-in loop trains alike: the same metrics. A learning run: bench/calc_demo.py."""
    train_file = write_rows(calc_rows(32, seed=0), tmp_path / "train.parquet")
    val_file = write_rows(calc_rows(8, seed=0, split="val"), tmp_path / "val.parquet")

    def overrides(steps: int, folder: Path) -> list[str]:
        return run_overrides(
            "+profile=demo",
            f"actor_rollout_ref.model.path={calc_caller}",
            f"data.train_files={train_file}",
            f"data.val_files={val_file}",
            "data.max_prompt_length=16",
            "data.max_response_length=24",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.format=tag",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={ROOT / 'configs' / 'tools' / 'calculator.yaml'}",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",  # as the calc agent does
            "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=4",
            f"trainer.total_training_steps={steps}",
            "trainer.test_freq=2",
            folder=folder,
        )

    straight = train(overrides=overrides(2, tmp_path / "straight"))
    history = metric_history(straight["tracking_uri"], straight["run_id"])
    timed = ("timing_s/", "perf/", "tool/latency_s/")
    for name in ("num_turns/mean", "tool/call_rate", "multi_turn/finish/stop", "response_length/model_tokens/mean"):
        assert sorted(history[name]) == [1, 2], name
    assert history["tool/call_rate"][1][0] > 0.5 and history["tool/success_rate"][1][0] > 0.5
    assert sorted(history["val-aux/num_turns/mean"]) == [0, 2] and "timing_s/tools" in history
    assert all(values[0] >= 2 for values in history["num_turns/min"].values())
    client = MlflowClient(straight["tracking_uri"])
    path = client.download_artifacts(straight["run_id"], "samples/step_000002.json", str(tmp_path))
    table = json.loads(Path(path).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    answered = [row for row in rows if row["tool_calls"] and all(c["error"] is None for c in row["tool_calls"])]
    # the calculator's answers are inside the response, not the policy's (the table runs to the last policy token)
    assert answered and all(0 in row["token_from_policy"] for row in answered)

    endpoint = [
        "actor_rollout_ref.rollout.agent.default_agent_loop=endpoint_agent",
        "actor_rollout_ref.rollout.agent.endpoint.function=rl_core.agent.demo_agents:calc_agent",
    ]
    through_endpoint = train(overrides=[*overrides(2, tmp_path / "endpoint"), *endpoint])
    served = metric_history(through_endpoint["tracking_uri"], through_endpoint["run_id"])
    assert served["endpoint/calls_per_sample"][2][0] >= 1 and served["endpoint/untrained_calls_per_sample"][2][0] == 0
    # what the loop and the agent record differently: timings, the finish of a trajectory that hits max turns (the
    # agent just stops), the success of calls (the agent's tool messages are all "calls")
    recorded_alike = [key for key in history if not key.startswith((*timed, "multi_turn/finish", "tool/"))]
    assert "actor/pg_loss" in recorded_alike and any(key.startswith("val-core/") for key in recorded_alike)
    for key in [*recorded_alike, "tool/call_rate", "tool/calls_per_sample"]:
        assert served[key] == history[key], key

    split = tmp_path / "split"
    first = train(overrides=overrides(1, split))
    second = train(overrides=[*overrides(2, split), "trainer.resume_mode=auto"])
    assert second["run_id"] == first["run_id"]
    resumed = metric_history(second["tracking_uri"], second["run_id"])
    compared = [key for key in history if not key.startswith(timed)]
    assert "tool/calls_per_sample" in compared and "actor/pg_loss" in compared
    for key in compared:  # the first part's last step also validated (step 1): that is not in the straight run
        assert {step: resumed[key].get(step) for step in history[key]} == history[key], key


def test_one_step_off_on_two_rollout_workers_survives_the_death_of_one(run_overrides, monkeypatch):
    """The rollout on two workers of its own, fully asynchronous with staleness_threshold=1 (the one-step-off window),
    partial rollout on, the weights broadcast over gloo channels (checkpoint_engine.backend=gloo; Ray's object store is
    the multi-node tests'): each step after the first trains on samples one version old (training/staleness_max: the
    worker synced is the idle one, so nothing is interrupted, fully_async/partial_ratio 0); the worker that step 3's
    generation is launched on is
    killed as it is, and the rollout's workers are rebuilt alone (the trainer's workers go on: the same processes)
    and step 3 runs again, its samples generated then (staleness 0); the run finishes with every step once; no worker
    of either group is left."""
    overrides = run_overrides(
        "trainer.total_training_steps=4",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "rollout.n_gpus_per_node=2",
        "async_training.mode=fully_async",
        "async_training.staleness_threshold=1",
        "async_training.partial_rollout=true",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.rollout_correction.rollout_is=token",
    )
    killed: list[str] = []
    trainer_pids: list[str] = []
    launch = SeparateRollout.launch

    def launch_on_a_killed_rollout(self, prompts, step):  # the flow runs in this process: a known moment
        launch(self, prompts, step)
        if step == 3 and not killed:
            group = self.pending[tuple(prompts.non_tensors["uid"])].worker.role._group
            trainer_pids.append(",".join(str(r["pid"]) for r in self.actor._group.health()))
            ray.kill(group.actors[0], no_restart=True)
            killed.append(group.namespace)

    monkeypatch.setattr(SeparateRollout, "launch", launch_on_a_killed_rollout)
    result = train(overrides=overrides)
    assert killed, "the rollout's worker was never killed"
    history = metric_history(result["tracking_uri"], result["run_id"])
    assert {step: len(values) for step, values in history["actor/pg_loss"].items()} == {1: 1, 2: 1, 3: 1, 4: 1}
    assert {step: values for step, values in history["training/staleness_max"].items()} == {
        1: [0.0],
        2: [1.0],
        3: [0.0],
        4: [1.0],
    }
    assert "rollout_corr/rollout_is_mean" in history
    assert history["fully_async/partial_ratio"] == {1: [0.0], 2: [0.0], 3: [0.0], 4: [0.0]}
    assert all(0 <= v[0] <= 1 for v in history["perf/trainer_idle_fraction"].values())
    assert sorted(history["perf/rollout_idle_fraction"]) == [1, 2, 3, 4]
    assert sorted(history["fully_async/in_flight"]) == [1, 2, 3, 4]
    tags = MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.tags
    assert tags["ppoflow.worker_restarts"] == "1" and tags["ppoflow.worker_pids"] == trainer_pids[0]
    left = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == killed[0]]
    assert left == []
    # both streams in the Prefect flow run: the steps' stages and the rollout's generations ahead, with their version
    run = MlflowClient(result["tracking_uri"]).get_run(result["run_id"])
    streams = {"step-4/generate", "step-4/update_actor", "rollout-4/generate (policy v2)"}
    assert streams <= flow_run_task_names(run.data.tags["ppoflow.prefect_flow_run_id"], streams)
