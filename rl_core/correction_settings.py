"""The settings of verl's ``algorithm.rollout_correction`` (the maths: :mod:`rl_core.algos.rollout_correction`),
parsed and checked without torch: the config checks read them before anything imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_core.config_access import config_get
from rl_core.config_checks import ConfigValueError

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
RS_OPTIONS = tuple(
    f"{level}_{k}" for level in RS_LEVELS for k in ("k1", "k2", "k3") if not (level == "seq_max" and k == "k1")
)
LOSS_TYPES = ("ppo_clip", "reinforce")


class RolloutCorrectionError(ValueError):
    """A rollout-correction setting that cannot be used; the message names the key and the fix."""


@dataclass(frozen=True)
class RolloutCorrection:
    """The parsed ``algorithm.rollout_correction`` (what each does: :mod:`rl_core.algos.rollout_correction`)."""

    rollout_is: str | None = None
    is_upper: float = 2.0
    is_lower: float | None = None  # set: IcePop (zero outside the bounds); None: TIS (truncate at is_upper)
    is_batch_normalize: bool = False
    rejections: tuple[tuple[str, float | None, float], ...] = ()  # (option, lower ratio bound for k1, upper)
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    @property
    def corrects(self) -> bool:
        """Whether anything changes the loss (weights or rejection); otherwise only the metrics are computed."""
        return self.rollout_is is not None or bool(self.rejections)

    @classmethod
    def from_config(cls, section: Any) -> RolloutCorrection:
        """Parse verl's keys (an OmegaConf node, a dataclass or a dict); a bad value raises
        :class:`RolloutCorrectionError` naming it."""
        key = "algorithm.rollout_correction"
        rollout_is = config_get(section, "rollout_is")
        if rollout_is is not None and rollout_is not in IS_LEVELS:
            raise RolloutCorrectionError(f"{key}.rollout_is={rollout_is!r}: choose token, sequence or null")
        upper, lower = parse_is_threshold(config_get(section, "rollout_is_threshold", 2.0))
        rollout_rs = config_get(section, "rollout_rs")
        rejections: tuple = ()
        if rollout_rs is not None:
            options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
            unknown = [o for o in options if o not in RS_OPTIONS]
            if unknown or not options:
                raise RolloutCorrectionError(
                    f"{key}.rollout_rs={rollout_rs!r}: {', '.join(unknown) or 'no option'} is not a filter; "
                    f"comma-separated names from {', '.join(RS_OPTIONS)}"
                )
            thresholds = parse_rs_thresholds(options, config_get(section, "rollout_rs_threshold"))
            rejections = tuple((o, *thresholds[o]) for o in options)
        loss_type = config_get(section, "loss_type", "ppo_clip")
        if loss_type not in LOSS_TYPES:
            raise RolloutCorrectionError(f"{key}.loss_type={loss_type!r}: choose ppo_clip or reinforce")
        return cls(
            rollout_is=rollout_is,
            is_upper=upper,
            is_lower=lower,
            is_batch_normalize=bool(config_get(section, "rollout_is_batch_normalize", False)),
            rejections=rejections,
            bypass_mode=bool(config_get(section, "bypass_mode", False)),
            loss_type=loss_type,
        )


def _bounds(spec: Any, what: str) -> tuple[float | None, float]:
    """``upper`` or ``"lower_upper"`` -> (lower or None, upper), both > 0 and lower <= upper."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise RolloutCorrectionError(f"{what}={spec!r}: a number or a 'lower_upper' string")
    text = str(spec).strip()
    try:
        lower, upper = (float(p) for p in text.split("_", 1)) if "_" in text else (None, float(text))
    except ValueError:
        raise RolloutCorrectionError(f"{what}={spec!r}: a number or a 'lower_upper' string") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise RolloutCorrectionError(f"{what}={spec!r}: bounds must be > 0, the lower one at most the upper one")
    return lower, upper


def parse_is_threshold(spec: Any) -> tuple[float, float | None]:
    """``rollout_is_threshold`` -> (upper, lower or None: TIS)."""
    lower, upper = _bounds(spec, "algorithm.rollout_correction.rollout_is_threshold")
    return upper, lower


def parse_rs_thresholds(options: list[str], spec: Any) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs_threshold`` (one shared or one per option, comma-separated) -> option: (lower, upper); a k1
    option without a lower bound gets 1/upper, the others take an upper bound only."""
    what = "algorithm.rollout_correction.rollout_rs_threshold"
    if spec is None:
        raise RolloutCorrectionError(f"{what}=null: rollout_rs needs a threshold (e.g. 2.0, or '0.5_2.0' for k1)")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()] if isinstance(spec, str) else [spec]
    if len(parts) not in (1, len(options)):
        raise RolloutCorrectionError(f"{what}={spec!r}: one threshold for all filters or one per filter")
    thresholds = {}
    for option, part in zip(options, parts * len(options) if len(parts) == 1 else parts):
        lower, upper = _bounds(part, f"{what} ({option})")
        if option.endswith("k1"):
            thresholds[option] = (1.0 / upper if lower is None else lower, upper)
        elif lower is not None:
            raise RolloutCorrectionError(f"{what}={spec!r}: {option} takes one upper bound, not 'lower_upper'")
        else:
            thresholds[option] = (None, upper)
    return thresholds


def check_rollout_correction(config: Any) -> None:
    """``algorithm.rollout_correction``'s values, and what its modes need: the rollout's log-probs, and in the
    decoupled mode the recomputed old log-probs."""
    key = "algorithm.rollout_correction"
    try:
        settings = RolloutCorrection.from_config(config.algorithm.rollout_correction)
    except RolloutCorrectionError as error:
        raise ConfigValueError(str(error)) from None
    if (settings.corrects or settings.bypass_mode) and not config.actor_rollout_ref.rollout.calculate_log_probs:
        raise ConfigValueError(
            f"{key} needs the rollout's own log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    skips_old_pass = config.actor_rollout_ref.actor.recompute_old_log_prob is False
    if settings.corrects and not settings.bypass_mode and skips_old_pass:
        raise ConfigValueError(
            f"{key} in the decoupled mode weighs the samples by pi_old / pi_rollout, and "
            "actor_rollout_ref.actor.recompute_old_log_prob=false computes no pi_old: set it to true, or "
            f"{key}.bypass_mode=true (the rollout's log-probs as the old ones)"
        )
    if settings.bypass_mode and config.algorithm.use_kl_in_reward:
        raise ConfigValueError(
            f"{key}.bypass_mode=true with algorithm.use_kl_in_reward=true: the KL penalty needs the recomputed old "
            "log-probs that the bypass mode skips; use actor_rollout_ref.actor.use_kl_loss instead"
        )
