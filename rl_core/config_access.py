"""Reading algorithm settings from any config object: an OmegaConf node, a dataclass, a dict, or None."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def config_get(config: Any, name: str, default: Any = None) -> Any:
    """``config.name`` if the config has that field and it is not None, else ``default``.

    verl passes OmegaConf nodes and dataclasses interchangeably; a user may pass a plain dict. A field set
    to None means "not set" (verl's ``clip_ratio_low: null`` falls back to ``clip_ratio``).
    """
    if config is None:
        return default
    if isinstance(config, Mapping):
        value = config.get(name, None)
    else:
        try:
            value = getattr(config, name)
        except (AttributeError, KeyError):  # OmegaConf struct nodes raise a subclass of AttributeError
            value = None
    return default if value is None else value
