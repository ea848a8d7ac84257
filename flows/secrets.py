"""Secrets never stored: what looks like one is redacted from MLflow params and the config artifact, and kept out of
Prefect's flow-run parameters.

A secret is the value of a key whose last part names one (``hf_token``, ``api_key``, ``password``, ...), a string
shaped like a well-known token (Hugging Face ``hf_...``, OpenAI ``sk-...``, GitHub ``ghp_...``, AWS ``AKIA...``), or the
password of a URL (``postgresql://user:password@host/db``). Pass secrets through the environment —
``custom_reward_function.reward_kwargs.api_key='${oc.env:MY_API_KEY}'``
— so that only the interpolation is ever written down; a secret given as a command-line override anyway reaches
the run through the environment of the process, not as a Prefect parameter.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

SECRET_KEY = re.compile(
    r"(^|[._])(\w*_)?(token|secret|password|passwd|api_?key|access_?key|secret_?key|private_?key|credentials?|auth)$",
    re.IGNORECASE,
)
SECRET_VALUE = re.compile(
    r"\b(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_\-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16})\b"
)
URL_PASSWORD = re.compile(r"(://[^/:@\s]+:)[^/@\s]+(@)")  # the password of scheme://user:password@host
REDACTED = "***"
SECRET_OVERRIDES_ENV = "PPOFLOW_SECRET_OVERRIDES"


def is_secret_key(key: str) -> bool:
    return bool(SECRET_KEY.search(key))


def redacted(config: DictConfig) -> DictConfig:
    """A copy of ``config`` with the values of secret keys, and every occurrence of them or of a token-shaped string
    in other values, replaced by ``***``."""
    plain = OmegaConf.to_container(config, resolve=True)
    secrets = {
        str(value) for key, value in _leaves(plain) if value is not None and is_secret_key(key) and len(str(value)) >= 4
    }

    def scrub(node: Any, key: str) -> Any:
        if isinstance(node, dict):
            return {name: scrub(value, f"{key}.{name}" if key else str(name)) for name, value in node.items()}
        if isinstance(node, list):
            return [scrub(value, key) for value in node]
        if node is not None and is_secret_key(key):
            return REDACTED
        if isinstance(node, str):
            return redact_text(node, secrets)
        return node

    safe = copy.deepcopy(config)  # keeps the structured config's types (flatten() relies on them)
    _assign(safe, plain, scrub(plain, ""))
    return safe


def redacted_keys(config: DictConfig) -> list[str]:
    """The keys of ``config`` whose value was (or holds something) redacted: ``***``."""
    plain = OmegaConf.to_container(config, resolve=True)
    return list(dict.fromkeys(key for key, value in _leaves(plain) if isinstance(value, str) and REDACTED in value))


def _leaves(node: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a plain nested dict/list (a list's items under the list's key)."""
    if isinstance(node, dict):
        for name, value in node.items():
            yield from _leaves(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list):
        for value in node:
            yield from _leaves(value, key)
    else:
        yield key, node


def _assign(node: Any, before: Any, after: Any) -> None:
    """Write into ``node`` (a DictConfig/ListConfig) the leaves where ``after`` differs from ``before``."""
    items = before.items() if isinstance(before, dict) else enumerate(before)
    for key, old in items:
        new = after[key]
        if isinstance(old, (dict, list)):
            _assign(node[key], old, new)
        elif new != old:
            node[key] = new


def redact_text(text: str, secrets: set[str] = frozenset()) -> str:
    """``text`` with the given secrets, token-shaped strings and the passwords of URLs (``scheme://user:password@host``)
    replaced by ``***``."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return URL_PASSWORD.sub(rf"\1{REDACTED}\2", SECRET_VALUE.sub(REDACTED, text))


def split_secret_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides that may be stored, the ones that set a secret key, hold a token-shaped value, or contain the
    value of a secret key given in another override)."""
    parts = [(override, *override.partition("=")[::2]) for override in overrides]
    values = {
        value.strip("'\"")
        for _, key, value in parts
        if is_secret_key(key.lstrip("+~")) and len(value.strip("'\"")) >= 4
    }
    public, secret = [], []
    for override, key, value in parts:
        hides = is_secret_key(key.lstrip("+~")) or SECRET_VALUE.search(value) or any(v in value for v in values)
        (secret if hides else public).append(override)
    return public, secret


def hide_secret_overrides(overrides: list[str]) -> list[str]:
    """The overrides to pass as a flow run's parameters; the secret ones go to this process's environment, where
    :func:`secret_overrides` gives them back to the flow (which runs in this process)."""
    public, secret = split_secret_overrides(overrides)
    if secret:
        os.environ[SECRET_OVERRIDES_ENV] = json.dumps(secret)
    return public


def secret_overrides() -> list[str]:
    return json.loads(os.environ.get(SECRET_OVERRIDES_ENV, "[]"))
