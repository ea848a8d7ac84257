"""Usage telemetry off by default: a ppoflow run reports nothing about itself to third parties.

MLflow (its client since 3.x, and its server for the UI) sends usage records to its vendor's endpoint unless told not
to; Prefect's server reports usage, which its client SDK follows too; and a Ray cluster started by ``ray start`` (a
KubeRay cluster's head included) reports its usage every hour from its head (``ray.init``'s local clusters do not).
Every process ppoflow configures (the commands, the launcher) and every server it starts (the stack's, the Kubernetes
manifests' Ray pods too) gets these variables; a value the user set wins, so setting one opts back in.
"""

from __future__ import annotations

import os

NO_TELEMETRY_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def telemetry_env() -> dict[str, str]:
    """:data:`NO_TELEMETRY_ENV`, with the values this process's environment already sets."""
    return {key: os.environ.get(key, value) for key, value in NO_TELEMETRY_ENV.items()}
