"""``ppoflow up --backend postgres``: the team stack on real servers, on loopback: Debian's PostgreSQL (Prefect's and
MLflow's databases) and moto's S3 server (MLflow's artifacts and the run's checkpoints), started and stopped by the
test. The demo trains on it with its checkpoints at ``s3://``; ``ppoflow evaluate`` reads the last one back from there;
``ppoflow down`` leaves nothing running."""

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import boto3
import psycopg
import pytest

from infra.stack import port_open
from tests.conftest import ROOT, free_port
from tests.infra.conftest import SMALL_DEMO, ppoflow, process_group_alive


@pytest.fixture()
def team_env(tmp_path, stack_env):
    """The stack's environment, and a data folder that PostgreSQL's own user can enter (it refuses to run as root,
    and pytest's temporary folders are closed to other users)."""
    installed = subprocess.run([str(ROOT / "tests" / "infra" / "install_postgres.sh")], capture_output=True, text=True)
    assert installed.returncode == 0, f"installing Debian's postgresql failed: {installed.stderr[-2000:]}"
    data = Path(tempfile.mkdtemp(prefix="ppoflow-team-"))
    data.chmod(0o755)
    yield stack_env, data
    ppoflow(stack_env, "down", timeout=120)  # before the folder goes (stack_env's own down then finds nothing)
    shutil.rmtree(data, ignore_errors=True)


def test_the_demo_on_postgresql_and_s3_written_read_back_and_stopped(team_env, tmp_path, demo_cache):
    env, data = team_env
    ports = {name: free_port() for name in ("postgres", "s3", "prefect", "mlflow", "ray")}
    options = [item for name, port in ports.items() for item in (f"--{name}-port", str(port))]
    started = ppoflow(env, "up", "--backend", "postgres", "--data-dir", str(data / "stack"), *options)
    assert started.returncode == 0, started.stdout + started.stderr
    services = json.loads((tmp_path / "home" / "stack.json").read_text())["services"]
    assert list(services) == ["postgres", "s3", "prefect", "mlflow", "ray", "launcher"]  # the stores first
    exports = dict(
        line.removeprefix("export ").split("=", 1) for line in started.stdout.splitlines() if "export" in line
    )
    assert exports["AWS_ENDPOINT_URL_S3"] == f"http://127.0.0.1:{ports['s3']}"
    credentials = json.loads((data / "stack" / "credentials.json").read_text())
    assert (data / "stack" / "credentials.json").stat().st_mode & 0o077 == 0
    assert all(credentials["postgres_password"] not in " ".join(map(str, s.values())) for s in services.values())

    # the demo, its checkpoints in the S3 store (the last one kept), in a folder of its own
    work = tmp_path / "work"
    work.mkdir()
    (work / ".ppoflow").symlink_to(demo_cache)
    folder = "s3://ppoflow/checkpoints/team-demo"
    overrides = [
        *SMALL_DEMO,
        "trainer.total_training_steps=2",
        "trainer.save_freq=1",
        "trainer.max_ckpt_to_keep=1",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={folder}",
        f"trainer.checkpoint_cache_dir={tmp_path / 'checkpoint-copies'}",
    ]
    trained = ppoflow(env, "train", *overrides, timeout=600, cwd=work)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    result = json.loads(trained.stdout.strip().splitlines()[-1])
    assert result["checkpoint_dir"] == f"{folder}/global_step_2"

    # the metrics in PostgreSQL's mlflow database, the flow run in its prefect database
    def database(name: str) -> psycopg.Connection:
        password = credentials["postgres_password"]
        return psycopg.connect(host="127.0.0.1", port=ports["postgres"], user="ppoflow", password=password, dbname=name)

    with database("mlflow") as connection:
        steps = connection.execute(
            "SELECT step FROM metrics WHERE run_uuid = %s AND key = 'critic/score/mean' ORDER BY step",
            (result["run_id"],),
        ).fetchall()
        assert [row[0] for row in steps] == [1, 2]
        tags = dict(connection.execute("SELECT key, value FROM tags WHERE run_uuid = %s", (result["run_id"],)))
        assert tags["checkpoint/latest"] == f"{folder}/global_step_2"
    with database("prefect") as connection:
        states = connection.execute("SELECT state_type FROM flow_run").fetchall()
        assert [str(row[0]) for row in states] == ["COMPLETED"]

    # the checkpoints and MLflow's artifacts in the bucket: step 1 pruned there too, the pointer last
    s3 = boto3.client(
        "s3",
        endpoint_url=exports["AWS_ENDPOINT_URL_S3"],
        aws_access_key_id=exports["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    keys = [item["Key"] for item in s3.list_objects_v2(Bucket="ppoflow")["Contents"]]
    checkpoint_keys = [key for key in keys if key.startswith("checkpoints/team-demo/")]
    assert "checkpoints/team-demo/global_step_2/actor/model.safetensors" in checkpoint_keys
    assert not any("global_step_1/" in key for key in checkpoint_keys)
    pointer = s3.get_object(Bucket="ppoflow", Key="checkpoints/team-demo/latest_checkpointed_iteration.txt")
    assert pointer["Body"].read() == b"2"
    artifacts = [key for key in keys if key.startswith("mlartifacts/") and f"/{result['run_id']}/artifacts/" in key]
    assert any(key.endswith("config/ppo_trainer.yaml") for key in artifacts), artifacts
    assert any("/artifacts/model/" in key and key.endswith("model.safetensors") for key in artifacts), artifacts

    # a checkpoint at a URL, read back by the evaluation (into a temporary folder, checked against its manifest)
    evaluated = ppoflow(env, "evaluate", f"{folder}/global_step_2", "--samples", "2", timeout=600, cwd=work)
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    evaluation = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert evaluation["source_run_id"] == result["run_id"]
    assert any(key.startswith("val-core/") for key in evaluation["metrics"])

    stopped = ppoflow(env, "down", timeout=120)
    assert stopped.returncode == 0 and "stopped postgres, s3, prefect, mlflow, ray, launcher" in stopped.stdout
    assert not any(process_group_alive(service["pid"]) for service in services.values())
    assert not any(port_open(port) for port in ports.values())
