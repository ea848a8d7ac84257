"""A fresh run's inputs and workers made before its flow run (flows/prestart.py, what ``ppoflow train`` does while
Prefect's server boots): the session takes the very worker processes when its config is theirs, and refuses them
otherwise, with nothing left behind either way. The command's own path (prestart, then the flow) runs in the stack and
controller-crash tests."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import ray
from mlflow.tracking import MlflowClient

from flows import prestart
from flows.config import compose_config
from flows.demo import apply_embedded_defaults
from flows.train import train
from flows.workers import PREFIX, WORKERS_NAMESPACE_TAG, workers_namespace
from rl_core.step_checkpoint import LOCK_FILE
from tests.conftest import ROOT


def prestarted_rank0(config):
    """The prestarted group's rank 0, once the prestart is done."""
    prestart.wait()
    return ray.get_actor(f"{PREFIX}-rank0", namespace=workers_namespace(config))


def prestarted_pid(config) -> int:
    return ray.get(prestarted_rank0(config).health.remote(), timeout=30)["pid"]


def policy_settings(worker) -> tuple[str, int]:
    """The model path and the LR schedule's length a fused worker's policy role holds."""
    role = worker.roles["actor_rollout_ref"]
    return role.model_config.path, role.actor_config.optim.total_training_steps


def actors_in(namespace: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def trained_run(overrides: list[str]):
    result = train(overrides=overrides)
    return MlflowClient(result["tracking_uri"]).get_run(result["run_id"])


def test_the_session_takes_the_prestarted_workers_of_its_config(run_overrides):
    overrides = run_overrides("trainer.total_training_steps=1", "trainer.val_before_train=false")
    config = compose_config(overrides)
    assert config.actor_rollout_ref.model.path is None  # the demo's, filled in while the workers' processes start
    prestart.prestart(config)
    try:
        pid = prestarted_pid(config)
        # the workers were started before the inputs were loaded, and hold the run's final settings
        held = ray.get(prestarted_rank0(config).__ray_call__.remote(policy_settings), timeout=30)
        run = trained_run(overrides)
    finally:
        prestart.release()
    assert held == (run.data.params["actor_rollout_ref.model.path"], 1)
    assert run.data.tags["ppoflow.worker_pids"] == str(pid)  # the prestarted process trained
    assert run.data.tags[WORKERS_NAMESPACE_TAG] == workers_namespace(config)
    assert not actors_in(workers_namespace(config))  # a finished run ends its workers


def test_workers_prestarted_for_another_config_are_ended_not_used(run_overrides):
    overrides = run_overrides("trainer.total_training_steps=1", "trainer.val_before_train=false")
    other = compose_config([*overrides, "actor_rollout_ref.actor.optim.lr=0.5"])  # another worker setting
    prestart.prestart(other)
    try:
        pid = prestarted_pid(other)
        run = trained_run(overrides)  # the same folder: the prestart's lock is handed over, not fought over
    finally:
        prestart.release()
    assert run.data.tags["ppoflow.worker_pids"] != str(pid) and run.info.status == "FINISHED"
    assert not actors_in(workers_namespace(other))
    assert (Path(compose_config(overrides).trainer.default_local_dir) / LOCK_FILE).read_text() == ""  # let go


def test_loading_the_inputs_imports_none_of_the_flows_modules(demo_cache):
    """The prestart loads the inputs while the command imports the flow: a module both import could be imported by
    two threads at once, which can fail. Each part's new modules after the prestart's imports, in a process of its own
    (a module imports once per process), for a user's own model and data files (the demo's assets are built before
    the command imports the flow)."""
    demo = compose_config([f"trainer.cache_dir={demo_cache}"])
    apply_embedded_defaults(demo, log=lambda line: None)
    own_files = [  # a user's model and data files: nothing for the prestart to build before the flow's import
        f"actor_rollout_ref.model.path={demo.actor_rollout_ref.model.path}",
        f"data.train_files={demo.data.train_files}",
        f"data.val_files={demo.data.val_files}",
    ]
    common = textwrap.dedent(f"""
        import json, sys
        from flows import prestart
        from flows.config import compose_config
        import flows.inputs, flows.workers
        config = compose_config({own_files!r})  # the command's, before its threads start
        prestart.import_data_readers()
        before = set(sys.modules)
    """)
    parts = {
        "flow": "import flows.train",
        "inputs": textwrap.dedent("""
            from flows.inputs import TrainingInputs
            assert len(TrainingInputs.load(config).train_data) > 0
        """),
    }
    processes = {
        name: subprocess.Popen(
            [sys.executable, "-c", common + code + "\nprint(json.dumps(sorted(set(sys.modules) - before)))"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, code in parts.items()
    }
    imported = {}
    for name, process in processes.items():
        out, err = process.communicate(timeout=180)
        assert process.returncode == 0, err[-2000:]
        imported[name] = set(json.loads(out.strip().splitlines()[-1]))
    assert "mlflow" in imported["flow"]  # what the flow imports after the prestart: MLflow, Prefect, ...
    both = imported["inputs"] & imported["flow"]
    assert imported["inputs"] and not both, sorted(both)
