"""The names the algorithm settings accept, known without importing torch, so that a misspelt one is refused before
anything imports the maths (a second, not the seconds torch takes).

The fixed choices (loss aggregation modes, KL estimators) are defined here and imported by the modules that implement
them (:mod:`rl_core.algos.aggregate`, :mod:`rl_core.algos.kl`). The registries' names (advantage estimators, policy
losses) are those of the ``@register_adv_est("name")`` / ``@register_policy_loss("name")`` decorators in their modules'
source (:func:`decorated_names`): what fills the registries when the modules are imported. Once they are imported, the
registries themselves answer (:func:`algorithm_choices`), with whatever a plugin registered besides.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTIES = KL_ESTIMATORS + tuple(f"{name}+" for name in KL_ESTIMATORS)

ALGOS = Path(__file__).resolve().parent / "algos"
REGISTRIES = {  # registry: (its module's file, the decorator that fills it)
    "ADVANTAGE_ESTIMATORS": (ALGOS / "advantage.py", "register_adv_est"),
    "POLICY_LOSSES": (ALGOS / "policy_loss.py", "register_policy_loss"),
}


def decorated_names(source: Path, decorator: str) -> set[str]:
    """The string arguments of ``@decorator("name")`` on the functions in the Python file ``source``, read without
    importing it."""
    return {
        call.args[0].value
        for node in ast.walk(ast.parse(source.read_text(), str(source)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for call in node.decorator_list
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == decorator
        and call.args
        and isinstance(call.args[0], ast.Constant)
    }


def registered_names(registry: str) -> set[str]:
    """The names in one of :data:`REGISTRIES`: the live registry once :mod:`rl_core.algos` is imported, else its
    module's decorators."""
    if "rl_core.algos" in sys.modules:
        return set(getattr(sys.modules["rl_core.algos"], registry))
    return decorated_names(*REGISTRIES[registry])


def algorithm_choices() -> dict[str, set[str]]:
    """The config keys that name an algorithm, each with the names it accepts."""
    return {
        "algorithm.adv_estimator": registered_names("ADVANTAGE_ESTIMATORS"),
        "actor_rollout_ref.actor.policy_loss.loss_mode": registered_names("POLICY_LOSSES"),
        "actor_rollout_ref.actor.loss_agg_mode": set(LOSS_AGG_MODES),
        "critic.loss_agg_mode": set(LOSS_AGG_MODES),
        "actor_rollout_ref.actor.kl_loss_type": set(KL_PENALTIES),
        "algorithm.kl_penalty": set(KL_PENALTIES),
    }
