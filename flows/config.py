"""Composing the run's config with Hydra, and rejecting wrong keys and types before any worker starts.

``compose_config(["algorithm.adv_estimator=grpo", ...])`` reads ``configs/ppo_trainer.yaml`` and applies the
overrides (Hydra syntax; ``+key=value`` adds a key the tree does not have). Then every value is checked against
the type of its default: ``trainer.total_training_steps=abc`` is an error naming the key, not a crash at step 1.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIG_NAME = "ppo_trainer"


class ConfigError(ValueError):
    """An override names a key the config does not have, or gives a value of the wrong type."""


def _type_name(value: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(type(value), type(value).__name__)


def _check_types(value: Any, default: Any, key: str) -> None:
    if default is None or value is None:  # null defaults take any type; any key may be set to null
        return
    if isinstance(default, DictConfig):
        if not isinstance(value, DictConfig):
            raise ConfigError(f"{key}: expected a mapping (a config group), got {value!r}")
        for sub_key in value:
            if sub_key in default:
                _check_types(value[sub_key], default[sub_key], f"{key}.{sub_key}" if key else str(sub_key))
        return
    if isinstance(default, ListConfig):
        if not isinstance(value, ListConfig):
            raise ConfigError(f"{key}: expected a list, got {value!r} ({_type_name(value)}); write it as {key}=[a,b]")
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ConfigError(f"{key}: expected {_type_name(default)} (default {default!r}), got {value!r} ({_type_name(value)})")


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The root config with ``overrides`` applied and checked; interpolations resolved."""
    overrides = list(overrides or [])
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            config = compose(config_name=CONFIG_NAME, overrides=overrides)
    except OverrideParseException as error:
        raise ConfigError(f"{str(error).splitlines()[0]}: overrides are key=value (Hydra syntax)") from None
    except ConfigCompositionException as error:
        cause = str(error.__cause__ or "")
        if "not in struct" in cause:
            full_key = re.search(r"full_key: (\S+)", cause)
            key = full_key.group(1) if full_key else cause.splitlines()[0]
            raise ConfigError(f"unknown config key {key!r}: check the spelling (see configs/{CONFIG_NAME}.yaml), "
                              f"or write +{key}=... to add a key of your own") from None
        raise ConfigError(f"bad override: {str(error).splitlines()[0]} {cause.splitlines()[0] if cause else ''}".strip()) from None
    defaults = OmegaConf.load(CONFIG_DIR / f"{CONFIG_NAME}.yaml")
    try:
        OmegaConf.resolve(config)
        OmegaConf.resolve(defaults)
    except Exception as error:
        raise ConfigError(f"config interpolation failed: {error}") from None
    _check_types(config, defaults, "")
    return config


def flatten(config: DictConfig, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": value}`` for every leaf (lists as their string form): MLflow params."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, DictConfig):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
    return flat
