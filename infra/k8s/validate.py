"""Check rendered manifests against the schemas a cluster applies them with, before any cluster sees them.

* Kubernetes' own kinds (Namespace, ConfigMap, StatefulSet, Deployment, Service): the API's OpenAPI schemas for
  ``KUBERNETES_VERSION``, strict (an unknown field is an error, as ``kubectl apply``'s default field validation makes
  it), through the ``kubernetes-validate`` package (the dev extra; it bundles the schemas);
* KubeRay's ``RayCluster``: ``schemas/raycluster-ray.io-v1.json`` (the CRD's fields ppoflow renders, written from
  KubeRay's v1 API), and each of its pod templates as a Kubernetes ``PodTemplateSpec``, strict.

    python -m infra.k8s.validate FOLDER     # the YAML files `ppoflow k8s-render FOLDER` wrote
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

KUBERNETES_VERSION = "1.33"  # the oldest Kubernetes the manifests are meant for
RAYCLUSTER_SCHEMA = Path(__file__).with_name("schemas") / "raycluster-ray.io-v1.json"


def manifest_errors(manifest: dict[str, Any]) -> list[str]:
    """What a cluster would refuse in one manifest, each naming the kind, name and field path; [] when none."""
    import jsonschema
    import kubernetes_validate

    name = f"{manifest.get('kind')} {manifest.get('metadata', {}).get('name')}"

    def core(resource: dict[str, Any], where: str) -> list[str]:
        try:
            kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            return [f"{name}: {where}{path}: {error.message}"]
        except kubernetes_validate.SchemaNotFoundError:
            return [f"{name}: no Kubernetes {KUBERNETES_VERSION} schema for {resource.get('apiVersion')}"]
        return []

    if manifest.get("kind") != "RayCluster":
        return core(manifest, "")
    schema = json.loads(RAYCLUSTER_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = [
        f"{name}: {'.'.join(str(part) for part in error.absolute_path)}: {error.message}"
        for error in validator.iter_errors(manifest)
    ]
    spec = manifest.get("spec", {})
    groups = [("headGroupSpec", spec.get("headGroupSpec", {}))]
    groups += [(f"workerGroupSpecs.{i}", group) for i, group in enumerate(spec.get("workerGroupSpecs", []))]
    for where, group in groups:
        if "template" in group:
            template = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": group["template"],
            }
            errors += core(template, f"spec.{where}.")
    return errors


def folder_errors(folder: Path) -> list[str]:
    """:func:`manifest_errors` of every manifest in the folder's YAML files."""
    return [
        error
        for path in sorted(Path(folder).glob("*.yaml"))
        for manifest in yaml.safe_load_all(path.read_text())
        if manifest
        for error in manifest_errors(manifest)
    ]


if __name__ == "__main__":
    found = folder_errors(Path(sys.argv[1]))
    print("\n".join(found) or f"every manifest passes the Kubernetes {KUBERNETES_VERSION} and KubeRay schemas")
    sys.exit(1 if found else 0)
