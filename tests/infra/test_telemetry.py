"""No usage telemetry leaves a run (infra/telemetry.py): the commands, the stack's servers and the Kubernetes
manifests turn MLflow's, Prefect's and Ray's off, and a value the user set wins."""

import json
import os
import subprocess
import sys

from infra.k8s.render import load_values, render
from infra.stack import service_command
from infra.telemetry import NO_TELEMETRY_ENV
from tests.conftest import ROOT

# what MLflow decides once a command has configured its process (its CI / test-run guess set aside: CI runs this)
MLFLOW_DECIDES = """
import json, os
{configure}
import mlflow.telemetry.utils as telemetry
telemetry._IS_IN_CI_ENV_OR_TESTING = False
print(json.dumps([telemetry.is_telemetry_disabled(), {{key: os.environ.get(key) for key in {keys!r}}}]))
"""


def mlflow_decides(configure: bool, **user_env: str) -> list:
    unset = {*NO_TELEMETRY_ENV, "DO_NOT_TRACK"}  # MLflow honours DO_NOT_TRACK too: a machine's own setting
    env = {key: value for key, value in os.environ.items() if key not in unset} | user_env
    setup = "from flows.prefect_server import configure_prefect\nconfigure_prefect()" if configure else ""
    code = MLFLOW_DECIDES.format(configure=setup, keys=list(NO_TELEMETRY_ENV))
    command = [sys.executable, "-c", code]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_a_command_turns_mlflow_and_prefect_telemetry_off_unless_the_user_set_it():
    assert mlflow_decides(configure=False)[0] is False  # MLflow's default: it would report
    assert mlflow_decides(configure=True) == [True, NO_TELEMETRY_ENV]
    disabled, env = mlflow_decides(configure=True, MLFLOW_DISABLE_TELEMETRY="false")  # the user opts back in
    assert disabled is False and env["MLFLOW_DISABLE_TELEMETRY"] == "false"


def test_ray_started_by_hand_would_report_and_the_setting_turns_it_off(monkeypatch):
    from ray._common.usage import usage_lib

    monkeypatch.setenv("RAY_USAGE_STATS_CONFIG_PATH", "/nonexistent/config.json")  # not this machine's own choice
    monkeypatch.delenv("RAY_USAGE_STATS_ENABLED", raising=False)
    assert usage_lib.usage_stats_enabled()  # `ray start`'s default: its head reports every hour
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", NO_TELEMETRY_ENV["RAY_USAGE_STATS_ENABLED"])
    assert not usage_lib.usage_stats_enabled()


def test_the_stacks_servers_and_the_manifests_turn_telemetry_off(tmp_path, monkeypatch):
    for key in NO_TELEMETRY_ENV:
        monkeypatch.delenv(key, raising=False)
    for name in ("prefect", "mlflow", "ray"):
        _, env, _ = service_command(name, 4200, tmp_path)
        assert NO_TELEMETRY_ENV.items() <= env.items(), name
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")  # the user's own choice wins
    assert service_command("ray", 4200, tmp_path)[1]["RAY_USAGE_STATS_ENABLED"] == "1"
    manifests = [manifest for group in render(load_values()).values() for manifest in group]
    containers = {
        manifest["metadata"]["name"]: manifest["spec"]["template"]["spec"]["containers"][0]
        for manifest in manifests
        if manifest["kind"] == "Deployment"
    }
    (ray_cluster,) = [manifest for manifest in manifests if manifest["kind"] == "RayCluster"]
    groups = [ray_cluster["spec"]["headGroupSpec"], *ray_cluster["spec"]["workerGroupSpecs"]]
    containers |= {f"ray pod {i}": group["template"]["spec"]["containers"][0] for i, group in enumerate(groups)}
    assert len(containers) == 5
    for name, container in containers.items():
        env = {item["name"]: item.get("value") for item in container["env"]}
        assert NO_TELEMETRY_ENV.items() <= env.items(), name
