"""A sweep's search space, written as Hydra overrides and parsed by Hydra's own override parser (a plain ``key=value``
holds for every child, a sweep value varies): the grid's children, an Optuna trial's, and the checks that refuse a
sweep before any child runs. No Prefect, no MLflow: ``ppoflow sweep`` refuses a bad sweep without importing them
(:mod:`flows.sweep` runs it)."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override
from hydra.errors import HydraException
from omegaconf import DictConfig

from flows.config import ConfigError, compose_config

# keys the sweep sets for each child (its run name, checkpoint folder, store): a sweep cannot vary them
SET_BY_SWEEP = (
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.default_local_dir",
    "trainer.tracking_uri",
    "trainer.artifact_location",
    "trainer.resume_mode",
    "trainer.resume_from_path",
)


class SweepError(ValueError):
    """The sweep's overrides, search or metric cannot make a sweep."""


@dataclass
class SearchSpace:
    fixed: list[str]  # overrides every child gets
    swept: list[Override]  # the keys that vary, as Hydra parsed them

    def keys(self) -> list[str]:
        return [override.key_or_group for override in self.swept]


def parse_search_space(overrides: list[str], search: str) -> SearchSpace:
    """Split ``overrides`` into fixed ones and swept keys; refuses what cannot make this kind of sweep."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as error:
        raise SweepError(
            f"{str(error).splitlines()[0]}: write key=a,b (or range(...), interval(...)) in Hydra's syntax"
        ) from None
    fixed, swept = [], []
    for override in parsed:
        key = override.key_or_group
        if override.is_sweep_override():
            if key in SET_BY_SWEEP:
                raise SweepError(
                    f"{key} cannot vary in a sweep: the sweep sets it for each child (run name, checkpoint folder, "
                    "store)"
                )
            if key in [other.key_or_group for other in swept]:
                raise SweepError(f"{key} is swept twice; give its values in one override ({key}=a,b,c)")
            if search == "grid" and isinstance(override.value(), IntervalSweep):
                raise SweepError(
                    f"{override.input_line}: an interval has no grid; list values ({key}=a,b) or use search=random or "
                    "tpe"
                )
            swept.append(override)
        else:
            fixed.append(override.input_line)
    if not swept:
        raise SweepError(
            "the sweep varies nothing: give at least one key several values (e.g. algorithm.adv_estimator=grpo,rloo)"
        )
    return SearchSpace(fixed, swept)


def grid(space: SearchSpace) -> list[list[str]]:
    """Every combination of the swept values, as each child's overrides (first key slowest)."""
    values = [
        [f"{override.key_or_group}={value}" for value in override.sweep_string_iterator()] for override in space.swept
    ]
    return [list(combination) for combination in itertools.product(*values)]


def suggest(trial: Any, space: SearchSpace) -> list[str]:
    """A child's overrides drawn by the Optuna ``trial``: categorical for choices and ranges, float for intervals."""
    chosen = []
    for override in space.swept:
        key, value = override.key_or_group, override.value()
        if isinstance(value, IntervalSweep):
            number = trial.suggest_float(key, float(value.start), float(value.end), log="log" in value.tags)
            chosen.append(f"{key}={number!r}")
        else:
            chosen.append(f"{key}={trial.suggest_categorical(key, list(override.sweep_string_iterator()))}")
    return chosen


def sweep_name(overrides: list[str], search: str) -> str:
    """A default name that is the same for the same sweep (started again, it continues)."""
    return f"sweep-{search}-" + hashlib.sha1(json.dumps([search, *overrides]).encode()).hexdigest()[:8]


def check_sweep(
    overrides: list[str], search: str = "grid", trials: int = 8, direction: str = "max"
) -> tuple[SearchSpace, DictConfig, list[list[str]] | None]:
    """(search space, the fixed overrides' config, the grid's children or None for a search), every child's config
    checked before any child runs; a :class:`SweepError` naming the override otherwise."""
    if search not in ("grid", "random", "tpe") or direction not in ("max", "min"):
        raise SweepError(
            f"search={search!r}, direction={direction!r}: search is grid, random or tpe; direction is max or min"
        )
    if search != "grid" and trials < 1:
        raise SweepError(f"trials={trials}: a {search} search needs at least one trial")
    space = parse_search_space(overrides, search)
    try:
        base = compose_config(space.fixed)
    except ConfigError as error:
        raise SweepError(f"the sweep's fixed overrides: {error}") from None
    candidates = grid(space) if search == "grid" else None
    for child in candidates or [
        [
            f"{o.key_or_group}={next(iter(o.sweep_string_iterator()))}"
            for o in space.swept
            if not isinstance(o.value(), IntervalSweep)
        ]
    ]:
        try:
            compose_config(space.fixed + child)
        except ConfigError as error:
            raise SweepError(f"child {' '.join(child)}: {error}") from None
    return space, base, candidates
