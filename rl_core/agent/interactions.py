"""Interactions, verl's simulated users: after a policy turn that calls no tool, the trajectory's interaction reads
the conversation and answers as a user would (a hint, a correction, "correct!"), scores the turn, and says whether
the dialogue is over. Its answer is appended as the chat template's user message (mask 0) and the policy speaks again.

verl's interface (``verl/interactions/base.py``) and config file (``multi_turn.interaction_config_path``)::

    interaction:
      - name: gsm8k                                   # what a row's extra_info.interaction_kwargs.name picks
        class_name: my_package.GSM8KInteraction       # a BaseInteraction
        config: {}                                    # its own settings

A row that has ``extra_info.interaction_kwargs`` (``{"name": ..., ...}``) gets an instance of that interaction:
``start_interaction(None, **interaction_kwargs)`` on its first reply, ``generate_response(instance, messages,
**interaction_kwargs) -> (should_terminate, text, turn_score, data)`` for every reply,
``finalize_interaction(instance)`` once the rollout ends. The turn scores reach the reward function as
``extra_info["turn_scores"]``.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from rl_core.agent.yaml_classes import import_class, yaml_entries


class BaseInteraction:
    """A simulated user; ``config`` is its entry's ``config`` with its ``name``."""

    def __init__(self, config: dict[str, Any]):
        self.config = dict(config or {})
        self.name: str = self.config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """A new instance (per trajectory); returns its id."""
        return instance_id or uuid.uuid4().hex

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        """(whether the dialogue ends here, the user's reply, this turn's score, extra data)."""
        raise NotImplementedError

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        """Free what the instance holds (always called, once the rollout ends)."""


class InteractionConfigError(ValueError):
    """The interaction YAML cannot be used."""


def load_interactions(path: str | Path) -> dict[str, BaseInteraction]:
    """{name: interaction} of the interaction YAML at ``path``; every problem names the file and the entry."""
    interactions: dict[str, BaseInteraction] = {}
    for where, entry in yaml_entries(path, "interaction", "interaction config", "entry", InteractionConfigError):
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise InteractionConfigError(f"{where}: needs class_name (and optionally name and config)")
        cls = import_class(entry["class_name"], where, BaseInteraction, InteractionConfigError)
        class_name = entry["class_name"].rpartition(".")[2]
        name = str(entry.get("name") or class_name)
        if name in interactions:
            raise InteractionConfigError(f"{where}: a second interaction named {name!r}")
        try:
            interactions[name] = cls({**(entry.get("config") or {}), "name": name})
        except Exception as error:
            raise InteractionConfigError(f"{where} ({name}): {error}") from None
    return interactions


def configured_interactions(multi_turn: Any) -> dict[str, BaseInteraction]:
    """The interactions of a run (``actor_rollout_ref.rollout.multi_turn``): those of its interaction YAML when
    multi-turn rollouts are on, else none."""
    if not multi_turn.enable or not multi_turn.interaction_config_path:
        return {}
    return load_interactions(multi_turn.interaction_config_path)
