"""Kubernetes manifests for ppoflow at scale, rendered from one values file (``infra/k8s/values.yaml``).

``render(values)`` returns ``{file name: [manifest, ...]}``; :func:`write` puts them in a folder for ``kubectl apply
-f``:

* ``00-namespace.yaml``   the namespace;
* ``10-postgres.yaml``    PostgreSQL (StatefulSet + Service) holding the ``prefect`` and ``mlflow`` databases;
* ``20-prefect.yaml``     the Prefect server (Deployment + Service) on PostgreSQL;
* ``30-mlflow.yaml``      the MLflow tracking server (Deployment + Service): PostgreSQL backend, artifacts in S3;
* ``40-raycluster.yaml``  a KubeRay ``RayCluster``: a CPU head and a GPU worker group (``nvidia.com/gpu`` per pod);
* ``50-controller.yaml``  the Prefect worker of the ``process`` work pool that runs the flows (the controller), next
  to the Ray head; its start-up registers the ppoflow deployments in that pool (``ppoflow deploy``).

Services are ClusterIP only (reach the UIs with ``kubectl port-forward``); passwords and S3 keys come from the
secret named in the values, never from the manifests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from infra.ray_settings import INLINE_OBJECTS_ENV
from infra.telemetry import NO_TELEMETRY_ENV

VALUES_FILE = Path(__file__).with_name("values.yaml")
RAY_HEAD_SERVICE = "ppoflow-ray-head-svc"  # KubeRay names the head's service <cluster name>-head-svc
REQUIRED = (
    "namespace",
    "image",
    "secret_name",
    "postgres.image",
    "postgres.storage",
    "s3.endpoint_url",
    "s3.bucket",
    "prefect.image",
    "prefect.ui_api_url",
    "mlflow.workers",
    "ray.head.cpu",
    "ray.head.memory",
    "ray.gpu_workers.replicas",
    "ray.gpu_workers.gpus_per_node",
    "ray.gpu_workers.cpu",
    "ray.gpu_workers.memory",
    "controller.work_pool",
)


def load_values(path: str | Path = VALUES_FILE, overrides: list[str] | None = None) -> dict[str, Any]:
    """The values file with ``key.path=value`` overrides applied, checked for what every manifest needs."""
    values = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides or [])))
    missing = [key for key in REQUIRED if OmegaConf.select(values, key) in (None, "")]
    if missing:
        raise ValueError(f"{path}: set {', '.join(missing)}")
    for key in ("ray.gpu_workers.replicas", "ray.gpu_workers.gpus_per_node", "mlflow.workers"):
        if not isinstance(OmegaConf.select(values, key), int) or OmegaConf.select(values, key) < 1:
            raise ValueError(f"{key}={OmegaConf.select(values, key)!r}: must be an integer >= 1")
    return OmegaConf.to_container(values, resolve=True)


def _meta(values: dict, name: str) -> dict:
    return {
        "name": name,
        "namespace": values["namespace"],
        "labels": {"app.kubernetes.io/part-of": "ppoflow", "app.kubernetes.io/name": name},
    }


def _resources(cpu: Any, memory: str, gpus: int = 0) -> dict:
    amounts = {"cpu": str(cpu), "memory": str(memory), **({"nvidia.com/gpu": gpus} if gpus else {})}
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _secret_env(values: dict, name: str, key: str) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": values["secret_name"], "key": key}}}


def _service(values: dict, name: str, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(values, name),
        "spec": {
            "type": "ClusterIP",
            "selector": {"app.kubernetes.io/name": name},
            "ports": [{"name": "http", "port": port, "targetPort": port}],
        },
    }


def _deployment(values: dict, name: str, container: dict) -> dict:
    pod: dict[str, Any] = {"containers": [container]}
    if values.get("image_pull_secret"):
        pod["imagePullSecrets"] = [{"name": values["image_pull_secret"]}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(values, name),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {"metadata": {"labels": {"app.kubernetes.io/name": name}}, "spec": pod},
        },
    }


def _tracking_env(values: dict) -> list[dict]:
    return [
        {"name": "PREFECT_API_URL", "value": "http://prefect:4200/api"},
        {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow:5000"},
        {"name": "MLFLOW_S3_ENDPOINT_URL", "value": values["s3"]["endpoint_url"]},
        _secret_env(values, "AWS_ACCESS_KEY_ID", "s3-access-key-id"),
        _secret_env(values, "AWS_SECRET_ACCESS_KEY", "s3-secret-access-key"),
        *_no_telemetry_env(),
    ]


def _no_telemetry_env() -> list[dict]:
    """No usage telemetry from the servers, the Ray pods and the controller (infra/telemetry.py)."""
    return [{"name": key, "value": value} for key, value in NO_TELEMETRY_ENV.items()]


def postgres(values: dict) -> list[dict]:
    pg = values["postgres"]
    # POSTGRES_DB creates `prefect`
    init = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(values, "postgres-init"),
        "data": {"databases.sql": "CREATE DATABASE mlflow;\n"},
    }
    container = {
        "name": "postgres",
        "image": pg["image"],
        "ports": [{"containerPort": 5432}],
        "env": [
            {"name": "POSTGRES_USER", "value": "ppoflow"},
            {"name": "POSTGRES_DB", "value": "prefect"},
            _secret_env(values, "POSTGRES_PASSWORD", "postgres-password"),
            {"name": "PGDATA", "value": "/var/lib/postgresql/data/pgdata"},
        ],
        "resources": _resources(pg["cpu"], pg["memory"]),
        "volumeMounts": [
            {"name": "data", "mountPath": "/var/lib/postgresql/data"},
            {"name": "init", "mountPath": "/docker-entrypoint-initdb.d"},
        ],
    }
    stateful = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(values, "postgres"),
        "spec": {
            "serviceName": "postgres",
            "replicas": 1,
            "selector": {"matchLabels": {"app.kubernetes.io/name": "postgres"}},
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": "postgres"}},
                "spec": {
                    "containers": [container],
                    "volumes": [{"name": "init", "configMap": {"name": "postgres-init"}}],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": pg["storage"]}}},
                }
            ],
        },
    }
    return [init, stateful, _service(values, "postgres", 5432)]


def prefect_server(values: dict) -> list[dict]:
    pf = values["prefect"]
    container = {
        "name": "prefect",
        "image": pf["image"],
        "command": ["prefect", "server", "start", "--host", "0.0.0.0", "--port", "4200"],
        "ports": [{"containerPort": 4200}],
        "resources": _resources(pf["cpu"], pf["memory"]),
        "env": [
            _secret_env(values, "POSTGRES_PASSWORD", "postgres-password"),
            {
                "name": "PREFECT_API_DATABASE_CONNECTION_URL",
                "value": "postgresql+asyncpg://ppoflow:$(POSTGRES_PASSWORD)@postgres:5432/prefect",
            },
            {"name": "PREFECT_UI_API_URL", "value": pf["ui_api_url"]},
            *_no_telemetry_env(),
        ],
        "readinessProbe": {"httpGet": {"path": "/api/health", "port": 4200}, "periodSeconds": 10},
    }
    return [_deployment(values, "prefect", container), _service(values, "prefect", 4200)]


def mlflow_server(values: dict) -> list[dict]:
    ml, s3 = values["mlflow"], values["s3"]
    command = [
        "mlflow",
        "server",
        "--host",
        "0.0.0.0",
        "--port",
        "5000",
        "--workers",
        str(ml["workers"]),
        "--backend-store-uri",
        "postgresql://ppoflow:$(POSTGRES_PASSWORD)@postgres:5432/mlflow",
        "--artifacts-destination",
        f"s3://{s3['bucket']}/{s3.get('prefix') or ''}".rstrip("/"),
    ]
    container = {
        "name": "mlflow",
        "image": values["image"],
        "command": command,
        "ports": [{"containerPort": 5000}],
        "resources": _resources(ml["cpu"], ml["memory"]),
        "env": [
            _secret_env(values, "POSTGRES_PASSWORD", "postgres-password"),
            {"name": "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "value": "false"},
            *_tracking_env(values)[2:],
        ],
        "readinessProbe": {"httpGet": {"path": "/health", "port": 5000}, "periodSeconds": 10},
    }
    return [_deployment(values, "mlflow", container), _service(values, "mlflow", 5000)]


def ray_cluster(values: dict) -> list[dict]:
    head, gpu = values["ray"]["head"], values["ray"]["gpu_workers"]

    def pod(name: str, resources: dict, extra: dict | None = None) -> dict:
        container = {
            "name": name,
            "image": values["image"],
            "resources": resources,
            "env": [
                _secret_env(values, "RAY_AUTH_TOKEN", "ray-auth-token"),
                {"name": "RAY_AUTH_MODE", "value": "token"},
                *({"name": key, "value": value} for key, value in INLINE_OBJECTS_ENV.items()),
                *_no_telemetry_env(),
            ],
            "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
        }
        spec = {
            "containers": [container],
            "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", **(extra or {}).get("shm", {})}}],
        }
        if (extra or {}).get("node_selector"):
            spec["nodeSelector"] = extra["node_selector"]
        return {"spec": spec}

    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _meta(values, "ppoflow-ray"),
        "spec": {
            "headGroupSpec": {
                "rayStartParams": {"num-gpus": "0", "dashboard-host": "0.0.0.0"},
                "template": pod("ray-head", _resources(head["cpu"], head["memory"])),
            },
            "workerGroupSpecs": [
                {
                    "groupName": "gpu",
                    "replicas": gpu["replicas"],
                    "minReplicas": gpu["replicas"],
                    "maxReplicas": gpu["replicas"],
                    "rayStartParams": {"num-gpus": str(gpu["gpus_per_node"])},
                    "template": pod(
                        "ray-worker",
                        _resources(gpu["cpu"], gpu["memory"], gpu["gpus_per_node"]),
                        {
                            "shm": {"sizeLimit": gpu.get("shared_memory", "64Gi")},
                            "node_selector": gpu.get("node_selector"),
                        },
                    ),
                }
            ],
        },
    }
    return [cluster]


def controller(values: dict) -> list[dict]:
    ctl, gpu = values["controller"], values["ray"]["gpu_workers"]
    # the train deployment's default overrides size the worker group to the GPU worker group
    sizing = f"trainer.nnodes={gpu['replicas']} trainer.n_gpus_per_node={gpu['gpus_per_node']} trainer.device=cuda"
    script = (
        f"ppoflow deploy --work-pool {ctl['work_pool']} --train-overrides {sizing} && prefect worker start --pool "
        f"{ctl['work_pool']} --type process"
    )
    env = [
        *_tracking_env(values),
        {"name": "RAY_ADDRESS", "value": f"{RAY_HEAD_SERVICE}:6379"},
        _secret_env(values, "RAY_AUTH_TOKEN", "ray-auth-token"),
        {"name": "RAY_AUTH_MODE", "value": "token"},
    ]
    container = {
        "name": "controller",
        "image": values["image"],
        "command": ["/bin/sh", "-c", script],
        "env": env,
        "resources": _resources(ctl["cpu"], ctl["memory"]),
    }
    return [_deployment(values, "ppoflow-controller", container)]


def render(values: dict) -> dict[str, list[dict]]:
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": values["namespace"], "labels": {"app.kubernetes.io/part-of": "ppoflow"}},
    }
    return {
        "00-namespace.yaml": [namespace],
        "10-postgres.yaml": postgres(values),
        "20-prefect.yaml": prefect_server(values),
        "30-mlflow.yaml": mlflow_server(values),
        "40-raycluster.yaml": ray_cluster(values),
        "50-controller.yaml": controller(values),
    }


def write(values: dict, out_dir: str | Path) -> list[Path]:
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, manifests in render(values).items():
        path = folder / name
        path.write_text(yaml.safe_dump_all(manifests, sort_keys=False))
        written.append(path)
    return written
