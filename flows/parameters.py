"""The training run's form: the main knobs as a typed model that the Prefect UI renders (defaults, descriptions,
choices) and that Prefect validates before a run starts.

A form is only a friendlier way to write Hydra overrides: :meth:`TrainSettings.to_overrides` turns every field
that differs from its default into ``key=value``, and the free list of overrides the user adds goes after it (so it
wins on the same key). The run then composes its config exactly as ``ppoflow train`` would with those overrides. The
defaults shown are read from :func:`rl_core.config.default_config` (their one source); a field the embedded demo's
profile sets (learning rate, batch size, ...) is empty by default: the config's value then applies, verl's for a
model of one's own and the profile's for the embedded model.
"""

from __future__ import annotations

from typing import Any, Literal

from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flows.config import demo_profile
from rl_core.algos import ADVANTAGE_ESTIMATORS
from rl_core.config import default_config

DEFAULTS = default_config()
PROFILE_VALUES = demo_profile()  # the embedded demo's values
Algorithm = Literal[tuple(sorted(ADVANTAGE_ESTIMATORS))]  # type: ignore[valid-type]

# form field -> the config key it sets
FIELD_KEYS = {
    "experiment": "trainer.project_name",
    "run_name": "trainer.experiment_name",
    "model_path": "actor_rollout_ref.model.path",
    "train_files": "data.train_files",
    "val_files": "data.val_files",
    "algorithm": "algorithm.adv_estimator",
    "batch_size": "data.train_batch_size",
    "rollout_n": "actor_rollout_ref.rollout.n",
    "learning_rate": "actor_rollout_ref.actor.optim.lr",
    "total_steps": "trainer.total_training_steps",
    "max_response_length": "data.max_response_length",
    "temperature": "actor_rollout_ref.rollout.temperature",
    "kl_loss_coef": "actor_rollout_ref.actor.kl_loss_coef",
    "lora_rank": "actor_rollout_ref.model.lora_rank",
    "save_freq": "trainer.save_freq",
    "test_freq": "trainer.test_freq",
    "reward_function_path": "custom_reward_function.path",
}


def set_by_demo_profile(field: str) -> bool:
    return OmegaConf.select(PROFILE_VALUES, FIELD_KEYS[field]) is not None


def default(field: str) -> Any:
    """The form's default: the config's, or empty (None) for a field the demo profile sets."""
    return None if set_by_demo_profile(field) else OmegaConf.select(DEFAULTS, FIELD_KEYS[field])


def profile_note(field: str) -> str:
    """'empty = <the config's default> (<the demo profile's> with the embedded model)'."""
    key = FIELD_KEYS[field]
    config_default = OmegaConf.select(DEFAULTS, key)
    shown = "trainer.total_epochs passes" if config_default is None else config_default
    return f"empty = {shown} ({OmegaConf.select(PROFILE_VALUES, key)} with the embedded model)"


def hydra_value(value: Any) -> str:
    """``value`` as Hydra override syntax: strings quoted (a path may hold ``,`` ``=`` or spaces), None as null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return repr(value)


class TrainSettings(BaseModel):
    """The main knobs of a training run; everything else is a Hydra override in the run's ``overrides`` list."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), frozen=True)

    experiment: str = Field(default("experiment"), min_length=1, description="MLflow experiment (trainer.project_name)")
    run_name: str = Field(default("run_name"), min_length=1, description="MLflow run name (trainer.experiment_name)")
    model_path: str | None = Field(
        default("model_path"),
        description="a local Hugging Face model folder; empty = the embedded tiny model (actor_rollout_ref.model.path)",
    )
    train_files: str | None = Field(
        default("train_files"),
        description="training parquet/jsonl file(s) in verl's format; empty = the synthetic addition task "
        "(data.train_files)",
    )
    val_files: str | None = Field(
        default("val_files"), description="validation file(s); empty = the synthetic task's (data.val_files)"
    )
    algorithm: Algorithm | None = Field(
        default("algorithm"),
        description=f"advantage estimator; gae adds a critic; {profile_note('algorithm')} (algorithm.adv_estimator)",
    )
    batch_size: int | None = Field(
        default("batch_size"),
        gt=0,
        description=f"prompts per step; {profile_note('batch_size')} (data.train_batch_size)",
    )
    rollout_n: int | None = Field(
        default("rollout_n"),
        gt=0,
        description=f"responses sampled per prompt; {profile_note('rollout_n')} (actor_rollout_ref.rollout.n)",
    )
    learning_rate: float | None = Field(
        default("learning_rate"),
        gt=0,
        lt=1,
        description=f"actor learning rate; {profile_note('learning_rate')} (actor_rollout_ref.actor.optim.lr)",
    )
    total_steps: int | None = Field(
        default("total_steps"),
        gt=0,
        description=f"training steps; {profile_note('total_steps')} (trainer.total_training_steps)",
    )
    max_response_length: int | None = Field(
        default("max_response_length"),
        gt=0,
        description=f"most tokens of a response; {profile_note('max_response_length')} (data.max_response_length)",
    )
    temperature: float = Field(
        default("temperature"),
        gt=0,
        description="sampling temperature of the training rollouts (actor_rollout_ref.rollout.temperature)",
    )
    kl_loss_coef: float = Field(
        default("kl_loss_coef"),
        ge=0,
        description="weight of the KL-to-reference loss, when actor.use_kl_loss is on (GRPO's way; the embedded demo "
        "turns it on); the in-reward penalty's is algorithm.kl_ctrl.kl_coef, an override "
        "(actor_rollout_ref.actor.kl_loss_coef)",
    )
    lora_rank: int = Field(
        default("lora_rank"), ge=0, description="LoRA rank; 0 = full fine-tuning (actor_rollout_ref.model.lora_rank)"
    )
    save_freq: int = Field(
        default("save_freq"),
        ge=-1,
        description="checkpoint every N steps; the last step's is always written (it holds the final model), so "
        "-1 = that one only (trainer.save_freq)",
    )
    test_freq: int = Field(
        default("test_freq"),
        ge=-1,
        description="validate every N steps (and at the last); -1 = never (trainer.test_freq)",
    )
    reward_function_path: str | None = Field(
        default("reward_function_path"),
        description="a Python file with compute_score(...); empty = the built-in scorers (custom_reward_function.path)",
    )

    @field_validator("model_path", "train_files", "val_files", "reward_function_path", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value

    def to_overrides(self) -> list[str]:
        """``key=value`` for every field that differs from its form default (an empty field leaves the config's
        value)."""
        return [
            f"{FIELD_KEYS[name]}={hydra_value(value)}"
            for name, value in self.model_dump().items()
            if value != default(name)
        ]
