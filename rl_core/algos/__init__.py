"""The RL algorithm maths of ppoflow: registries of pure functions with verl 0.9's names and signatures.

Where to look: advantage estimators in :mod:`.advantage`, policy losses in :mod:`.policy_loss`, KL penalties and
controllers in :mod:`.kl`, the value loss in :mod:`.value`, loss aggregation in :mod:`.aggregate`, entropy in
:mod:`.entropy`, masked statistics in :mod:`.masked`, rollout correction (importance weights and rejection for samples
from another policy) in :mod:`.rollout_correction`.
"""

from rl_core.algos.advantage import (
    ADVANTAGE_ESTIMATORS,
    call_adv_estimator,
    get_adv_estimator_fn,
    register_adv_est,
)
from rl_core.algos.aggregate import LOSS_AGG_MODES, agg_loss
from rl_core.algos.entropy import compute_entropy_loss, entropy_from_logits
from rl_core.algos.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from rl_core.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rl_core.algos.policy_loss import POLICY_LOSSES, get_policy_loss_fn, register_policy_loss
from rl_core.algos.value import compute_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "call_adv_estimator",
    "compute_entropy_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "register_adv_est",
    "register_policy_loss",
]
