"""The Kubernetes manifests (infra/k8s): rendered from one values file, sized by it, secrets only by reference."""

import copy
import subprocess
import sys

import pytest
import yaml

from infra.k8s.render import VALUES_FILE, load_values, render
from infra.k8s.validate import folder_errors, manifest_errors
from infra.ray_settings import INLINE_OBJECTS_ENV
from tests.conftest import ROOT


def by_kind(manifests: dict) -> dict:
    found = {}
    for documents in manifests.values():
        for manifest in documents:
            found[(manifest["kind"], manifest["metadata"]["name"])] = manifest
    return found


@pytest.mark.parametrize(
    "overrides, nodes, gpus, namespace",
    [
        ([], 2, 8, "ppoflow"),
        (
            [
                "ray.gpu_workers.replicas=1",
                "ray.gpu_workers.gpus_per_node=1",
                "namespace=trial",
                "ray.gpu_workers.memory=96Gi",
            ],
            1,
            1,
            "trial",
        ),
    ],
)
def test_the_manifests_follow_the_values(tmp_path, overrides, nodes, gpus, namespace):
    command = [
        sys.executable,
        "-m",
        "flows.cli",
        "k8s-render",
        str(tmp_path),
        *(["--set", *overrides] if overrides else []),
    ]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=120)
    manifests = {path.name: list(yaml.safe_load_all(path.read_text())) for path in sorted(tmp_path.glob("*.yaml"))}
    assert manifests == render(load_values(VALUES_FILE, overrides))  # the files are what render() makes
    assert folder_errors(tmp_path) == []  # Kubernetes' own schemas and KubeRay's, strict
    kinds = by_kind(manifests)
    assert set(kinds) == {
        ("Namespace", namespace),
        ("ConfigMap", "postgres-init"),
        ("StatefulSet", "postgres"),
        ("Service", "postgres"),
        ("Deployment", "prefect"),
        ("Service", "prefect"),
        ("Deployment", "mlflow"),
        ("Service", "mlflow"),
        ("RayCluster", "ppoflow-ray"),
        ("Deployment", "ppoflow-controller"),
    }
    assert all(m["metadata"].get("namespace", namespace) == namespace for m in kinds.values())
    ray = kinds[("RayCluster", "ppoflow-ray")]
    assert ray["apiVersion"] == "ray.io/v1"
    [group] = ray["spec"]["workerGroupSpecs"]
    worker = group["template"]["spec"]["containers"][0]
    assert group["replicas"] == nodes and group["rayStartParams"]["num-gpus"] == str(gpus)
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == gpus
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    for pod in (head, worker):  # batches travel inside the calls, as on the embedded cluster
        assert {
            "name": "RAY_max_direct_call_object_size",
            "value": INLINE_OBJECTS_ENV["RAY_max_direct_call_object_size"],
        } in pod["env"]
    assert (
        "nvidia.com/gpu" not in head["resources"]["limits"]
        and ray["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    )
    # the controller registers the deployments sized to the GPU group and runs them next to the Ray head
    controller = kinds[("Deployment", "ppoflow-controller")]["spec"]["template"]["spec"]["containers"][0]
    script = controller["command"][-1]
    assert (
        f"trainer.nnodes={nodes} trainer.n_gpus_per_node={gpus}" in script
        and "prefect worker start --pool ppoflow --type process" in script
    )
    env = {e["name"]: e for e in controller["env"]}
    assert (
        env["RAY_ADDRESS"]["value"] == "ppoflow-ray-head-svc:6379"
        and env["PREFECT_API_URL"]["value"] == "http://prefect:4200/api"
    )
    # PostgreSQL behind Prefect and MLflow, artifacts in S3; services cluster-internal
    prefect_env = {
        e["name"]: e for e in kinds[("Deployment", "prefect")]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert prefect_env["PREFECT_API_DATABASE_CONNECTION_URL"]["value"].startswith("postgresql+asyncpg://")
    mlflow = kinds[("Deployment", "mlflow")]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert (
        mlflow[mlflow.index("--backend-store-uri") + 1].startswith("postgresql://")
        and mlflow[mlflow.index("--artifacts-destination") + 1] == "s3://ppoflow/mlflow"
    )
    assert all(kinds[("Service", name)]["spec"]["type"] == "ClusterIP" for name in ("prefect", "mlflow", "postgres"))
    # no secret value in any manifest: every password and key is a secretKeyRef
    text = yaml.safe_dump_all([m for ms in manifests.values() for m in ms])
    assert "password:" not in text.lower() and text.count("secretKeyRef") >= 8


@pytest.mark.parametrize(
    "override, message",
    [("ray.gpu_workers.replicas=0", "ray.gpu_workers.replicas=0: must be an integer >= 1"), ("image=", "set image")],
)
def test_bad_values_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        load_values(VALUES_FILE, [override])


def test_the_schemas_refuse_what_a_cluster_would():
    """A string map holding a number, an unknown field in a pod's container, one in the RayCluster's spec, a count
    that is not a number: each refused, naming the field."""
    manifests = render(load_values(VALUES_FILE, []))
    ray = copy.deepcopy(manifests["40-raycluster.yaml"][0])
    ray["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 8
    ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["gpus"] = 8
    ray["spec"]["headGroupSpec"]["replicas"] = 1
    errors = manifest_errors(ray)
    assert len(errors) == 3 and all(e.startswith("RayCluster ppoflow-ray: spec.") for e in errors)
    assert any("workerGroupSpecs.0.rayStartParams.num-gpus: 8 is not of type 'string'" in e for e in errors)
    assert any("workerGroupSpecs.0.template.spec.containers.0: " in e and "'gpus' was unexpected" in e for e in errors)
    assert any("headGroupSpec: " in e and "'replicas' was unexpected" in e for e in errors)
    prefect = copy.deepcopy(manifests["20-prefect.yaml"][0])
    prefect["spec"]["replicas"] = "two"
    assert manifest_errors(prefect) == ["Deployment prefect: spec.replicas: 'two' is not of type 'integer', 'null'"]
