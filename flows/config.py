"""Composing the run's config with Hydra, and refusing wrong keys, types and values before anything starts.

``compose_config(["algorithm.adv_estimator=grpo", ...])`` composes ``configs/ppo_trainer.yaml``, whose schema is
:class:`rl_core.config.PPOTrainerConfig` (every key, its type and its default: verl's), with the overrides (Hydra
syntax). When the overrides leave ``actor_rollout_ref.model.path`` null (the embedded demo), the demo profile
``configs/profile/demo.yaml`` comes between the defaults and the overrides. OmegaConf refuses unknown keys and
values of the wrong type; :func:`rl_core.config.check_config` refuses values no run can use. Each is a
:class:`ConfigError` naming the key.
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flows.secrets import redact_text
from rl_core.config import RESOLVERS, PPOTrainerConfig
from rl_core.config_checks import ConfigValueError, check_config
from rl_core.remote_folder import is_remote

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIG_NAME = "ppo_trainer"
DEMO_PROFILE = CONFIG_DIR / "profile" / "demo.yaml"
# over the demo profile, for data.synthetic.task=calc / shapes
TASK_PROFILES = {
    "calc": CONFIG_DIR / "profile" / "demo_calc.yaml",
    "shapes": CONFIG_DIR / "profile" / "demo_shapes.yaml",
}
# `${configs_dir:}` in a config: this folder (the tool demo's profile names its tool YAML with it)
OmegaConf.register_new_resolver("configs_dir", lambda: str(CONFIG_DIR), replace=True)
for _name, _resolver in RESOLVERS.items():  # e.g. `${agent_batching:${async_training.mode}}`
    OmegaConf.register_new_resolver(_name, _resolver, replace=True)
ConfigStore.instance().store(name="ppoflow_schema", node=PPOTrainerConfig)


class ConfigError(ValueError):
    """An override names a key the config does not have, or gives a value of the wrong type or an unusable one."""


def _explain(error: BaseException) -> str:
    """One line naming the key and the fix, from an OmegaConf/Hydra error."""
    text = str(error)
    full_key = re.search(r"full_key: (\S+)", text)
    key = full_key.group(1) if full_key else ""
    first = text.splitlines()[0] if text else type(error).__name__
    if (
        "not in" in first
        or "Could not append" in first
        or "Could not override" in first
        or "Key '" in first
        and "not" in first
    ):
        name = key or (re.search(r"'([^']+)'", first).group(1) if re.search(r"'([^']+)'", first) else first)
        return (
            f"unknown config key {name!r}: check the spelling (`ppoflow config` prints every key); your reward "
            "function's own settings go in custom_reward_function.reward_kwargs"
        )
    conversion = re.match(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", first)
    if conversion:
        expected = {"Integer": "int", "Float": "float", "Boolean": "bool", "String": "str"}.get(
            conversion.group(3), conversion.group(3)
        )
        return f"{key}: expected {expected}, got {conversion.group(1)!r} ({conversion.group(2)})"
    not_bool = re.match(r"Value '(.*)' is not a valid bool \(type (\w+)\)", first)
    if not_bool:
        return f"{key}: expected bool (true/false), got {not_bool.group(1)!r} ({not_bool.group(2)})"
    if "Non optional field cannot be assigned None" in first or "field cannot be assigned None" in first:
        return f"{key}: cannot be null"
    return f"{key + ': ' if key else ''}{first}"


# rollout correction's "lower_upper" bounds: Hydra reads an unquoted 1_5 as the number 15 (digit grouping)
BOUND_KEYS = ("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_correction.rollout_rs_threshold")


def bounds_as_strings(overrides: list[str]) -> list[str]:
    """The overrides with an unquoted ``lower_upper`` value of a :data:`BOUND_KEYS` key quoted, as the user meant."""
    quoted = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+~") in BOUND_KEYS and "_" in value and value[:1] not in "'\"":
            override = f"{key}='{value}'"
        quoted.append(override)
    return quoted


# this process's last composition, {"request": (overrides, base, working folder, config files), "config": ...}:
# `ppoflow train` composes the run's config to check it, then the flow composes it from its parameters (~0.25 s of Hydra
# on the path to the first step)
_LAST_COMPOSED: dict[str, Any] = {}


def compose_config(overrides: list[str] | None = None, base: str | None = None) -> DictConfig:
    """The root config with ``overrides`` applied, interpolations resolved and every value checked. ``base`` (the YAML
    of an earlier run's composed config) replaces the defaults: an evaluation starts from its training run's config.

    Composing is a function of the overrides, the base, the working folder (relative paths become absolute) and the
    config files, but for an interpolation in an override (``${oc.env:...}`` reads the environment): the same request
    as the last one (the files unchanged) gets a copy of the last config, unless an override interpolates."""
    files = tuple((str(path), (found := path.stat()).st_mtime_ns, found.st_size) for path in CONFIG_DIR.rglob("*.yaml"))
    request = (tuple(overrides or []), base, os.getcwd(), files)
    if _LAST_COMPOSED.get("request") == request:
        return copy.deepcopy(_LAST_COMPOSED["config"])
    _LAST_COMPOSED.clear()
    config = _compose_checked(list(request[0]), base)
    if not any("${" in override for override in request[0]):
        _LAST_COMPOSED.update(request=request, config=copy.deepcopy(config))
    return config


def _compose_checked(overrides: list[str], base: str | None) -> DictConfig:
    overrides = bounds_as_strings(overrides)
    try:
        config = _compose(overrides, base)
        # `+profile=demo`: a model of one's own, the demo's values
        chosen = any(o.lstrip("+").startswith("profile=") for o in overrides)
        # the embedded demo: its profile under the overrides
        if base is None and config.actor_rollout_ref.model.path is None and not chosen:
            task_profile = TASK_PROFILES.get(config.data.synthetic.task)
            profiles = [DEMO_PROFILE.stem] + ([task_profile.stem] if task_profile else [])
            config = _compose([f"+profile=[{','.join(profiles)}]", *overrides], base)
        # `+key=value` slips past the schema: refuse it here
        OmegaConf.merge(PPOTrainerConfig, OmegaConf.to_container(config))
        OmegaConf.resolve(config)
    except OverrideParseException as error:
        raise ConfigError(f"{str(error).splitlines()[0]}: overrides are key=value (Hydra syntax)") from None
    except ConfigCompositionException as error:
        raise ConfigError(_explain(error.__cause__ or error)) from None
    except OmegaConfBaseException as error:
        raise ConfigError(_explain(error)) from None
    try:
        check_config(config)
    except ConfigValueError as error:
        raise ConfigError(str(error)) from None
    check_names(config)
    absolute_paths(config)
    return config


def check_names(config: DictConfig) -> None:
    """The run's names are stored as they are (the MLflow experiment and run name, the checkpoint folder, Prefect's
    flow run): a secret in one of them is refused, not redacted."""
    for key in ("trainer.project_name", "trainer.experiment_name"):
        value = str(OmegaConf.select(config, key))
        if redact_text(value) != value:
            raise ConfigError(
                f"{key} holds a token or a password ({redact_text(value)!r}): a run's names are stored as they are "
                "(MLflow, the checkpoint folder, Prefect); choose another name"
            )


# every config key that names a file or folder (a list of them for the data files)
PATH_KEYS = (
    "data.train_files",
    "data.val_files",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "actor_rollout_ref.model.lora_adapter_path",
    "critic.model.path",
    "critic.model.tokenizer_path",
    "critic.model.lora_adapter_path",
    "reward_model.model.path",
    "reward_model.model.input_tokenizer",
    "custom_reward_function.path",
    "trainer.cache_dir",
    "trainer.default_local_dir",
    "trainer.checkpoint_cache_dir",
    "trainer.resume_from_path",
    "trainer.artifact_location",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
)
SQLITE = "sqlite:///"


def absolute_paths(config: DictConfig) -> None:
    """Make every path of ``config`` absolute against this process's working folder (in place; ``~`` expanded), and a
    relative SQLite tracking URI too: the workers run elsewhere (on a persistent cluster, in the cluster's folder)."""

    def absolute(path: str) -> str:
        return path if is_remote(path) else str(Path(path).expanduser().absolute())

    for key in PATH_KEYS:
        value = OmegaConf.select(config, key)
        if isinstance(value, str):
            OmegaConf.update(config, key, absolute(value))
        elif isinstance(value, ListConfig):
            OmegaConf.update(config, key, [absolute(str(item)) for item in value])
    uri = config.trainer.tracking_uri
    if uri.startswith(SQLITE) and not uri.startswith(SQLITE + "/"):
        config.trainer.tracking_uri = SQLITE + absolute(uri.removeprefix(SQLITE))


def _compose(overrides: list[str], base: str | None) -> DictConfig:
    with tempfile.TemporaryDirectory(prefix="ppoflow-config-") as folder:
        config_dir, name = CONFIG_DIR, CONFIG_NAME
        if base is not None:
            config_dir, name = Path(folder), "base"
            (config_dir / "base.yaml").write_text("defaults:\n  - ppoflow_schema\n  - _self_\n\n" + base)
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            return compose(config_name=name, overrides=overrides)


def demo_profile() -> DictConfig:
    """The demo profile's values (what ``compose_config`` applies when no model path is given)."""
    return OmegaConf.load(DEMO_PROFILE)


def flatten(config: DictConfig, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.c": value}`` for every leaf (lists and dicts as their plain form): MLflow params."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, DictConfig) and len(value) and OmegaConf.get_type(value) is not dict:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = OmegaConf.to_container(value) if isinstance(value, (ListConfig, DictConfig)) else value
    return flat
