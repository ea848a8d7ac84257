"""Loading a user's scoring function from ``custom_reward_function.path`` / ``.name``."""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_custom_reward_function(
    path: str | None, name: str = "compute_score", reward_kwargs: dict[str, Any] | None = None
) -> Callable | None:
    """The function ``name`` of the Python file ``path`` with ``reward_kwargs`` bound (None when no path is set)."""
    if not path:
        return None
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"custom_reward_function.path={path!r}: no such file")
    module_name = f"ppoflow_custom_reward_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so that pickling (Ray) can find the function again
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise RuntimeError(
            f"custom_reward_function.path={path!r} failed to import: {type(error).__name__}: {error}"
        ) from error
    function = getattr(module, name, None)
    if not callable(function):
        available = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"custom_reward_function.name={name!r} is not a function in {path} (it has: {available})")
    return functools.wraps(function)(functools.partial(function, **reward_kwargs)) if reward_kwargs else function
