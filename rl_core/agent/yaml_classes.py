"""What verl's tool and interaction YAMLs share: a list of entries under one key, each naming a class by its import
path (``class_name``) that must subclass the interface of its kind (the agent-loop YAML's ``_target_`` too)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml


def yaml_entries(path: str | Path, key: str, what: str, item: str, error: type[Exception]) -> list[tuple[str, Any]]:
    """[(where, entry)] of the list under ``key`` in the YAML at ``path``; ``where`` names the file and the entry
    (``<what> <path>, <item> <index>``) for messages. ``error`` when it cannot be read or holds no such list."""
    try:
        document = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as problem:
        raise error(f"{what} {path}: cannot read it ({problem})") from None
    entries = document.get(key) if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise error(f"{what} {path}: expected `{key}:` with a list of {item}s")
    return [(f"{what} {path}, {item} {index}", entry) for index, entry in enumerate(entries)]


def import_class(class_name: str, where: str, base: type, error: type[Exception]) -> type:
    """The class at the import path ``class_name``, checked to subclass ``base``; ``error`` naming ``where``."""
    module_name, _, name = str(class_name).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as problem:
        raise error(f"{where}: cannot import class_name {class_name!r} ({problem})") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise error(f"{where}: {class_name} is not a {base.__name__} ({base.__module__})")
    return cls
