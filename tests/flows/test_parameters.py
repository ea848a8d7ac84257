"""The training form (flows/parameters.py): its fields say what the config says, and a form run composes the same
config as the command line with the same overrides."""

import pytest
from omegaconf import OmegaConf
from pydantic import ValidationError

from flows.config import compose_config
from flows.parameters import FIELD_KEYS, TrainSettings, hydra_value, set_by_demo_profile
from flows.train import training_overrides
from rl_core.algos import ADVANTAGE_ESTIMATORS


def test_the_form_shows_the_configs_defaults_and_choices():
    composed = compose_config(["actor_rollout_ref.model.path=/models/own"])  # a model of one's own: verl's defaults
    form = TrainSettings()
    for field, key in FIELD_KEYS.items():
        if set_by_demo_profile(field):  # empty: the config's value applies (verl's, or the demo profile's)
            value = OmegaConf.select(composed, key)
            shown = "trainer.total_epochs passes" if value is None else str(value)
            assert (
                getattr(form, field) is None and f"empty = {shown} " in TrainSettings.model_fields[field].description
            ), field
        elif field != "model_path":
            assert getattr(form, field) == OmegaConf.select(composed, key), field
    schema = TrainSettings.model_json_schema()
    assert set(schema["properties"]) == set(FIELD_KEYS)
    assert all(FIELD_KEYS[name] in prop["description"] for name, prop in schema["properties"].items())
    choices = [option["enum"] for option in schema["properties"]["algorithm"]["anyOf"] if "enum" in option]
    assert choices and sorted(choices[0]) == sorted(ADVANTAGE_ESTIMATORS)
    assert form.to_overrides() == []  # an untouched form changes nothing


def test_a_form_run_composes_the_config_the_command_line_would(tmp_path):
    reward = tmp_path / "my reward, v2's.py"  # a path Hydra would misread unquoted
    form = TrainSettings(
        algorithm="rloo",
        batch_size=8,
        rollout_n=2,
        learning_rate=3e-5,
        total_steps=7,
        lora_rank=4,
        run_name="form-run",
        model_path="",
        reward_function_path=str(reward),
        test_freq=-1,
    )
    extra = ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=16"]  # the free list wins
    from_form = compose_config(training_overrides(form, extra))
    from_cli = compose_config(
        [
            "algorithm.adv_estimator=rloo",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.optim.lr=3e-5",
            "trainer.total_training_steps=7",
            "actor_rollout_ref.model.lora_rank=4",
            "trainer.experiment_name=form-run",
            f"custom_reward_function.path='{str(reward).replace(chr(39), chr(92) + chr(39))}'",
            "trainer.test_freq=-1",
            *extra,
        ]
    )
    assert OmegaConf.to_container(from_form) == OmegaConf.to_container(from_cli)
    assert from_form.data.train_batch_size == 16 and from_form.custom_reward_function.path == str(reward)
    assert from_form.actor_rollout_ref.model.path is None  # an empty field is the default (the embedded model)


def test_an_empty_form_field_leaves_the_demo_profile_or_verls_value():
    # the demo's
    assert compose_config(training_overrides(TrainSettings(), [])).actor_rollout_ref.actor.optim.lr == 1e-3
    own = TrainSettings(model_path="/models/own")
    assert compose_config(training_overrides(own, [])).actor_rollout_ref.actor.optim.lr == 1e-6  # verl's
    assert (
        compose_config(training_overrides(TrainSettings(learning_rate=1e-6), [])).actor_rollout_ref.actor.optim.lr
        == 1e-6
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("batch_size", 0),
        ("rollout_n", -1),
        ("learning_rate", 0.0),
        ("learning_rate", 5.0),
        ("algorithm", "ppo2"),
        ("total_steps", 0),
        ("lora_rank", -1),
        ("save_freq", -2),
        ("batch_size", "many"),
        ("run_name", ""),
    ],
)
def test_the_form_refuses_bad_values(field, value):
    with pytest.raises(ValidationError, match=field):
        TrainSettings(**{field: value})


def test_the_form_refuses_unknown_fields():
    with pytest.raises(ValidationError, match="lr"):
        TrainSettings(lr=1e-5)


@pytest.mark.parametrize(
    "value, text",
    [(None, "null"), (True, "true"), (3, "3"), (1e-05, "1e-05"), ("a,b=c", "'a,b=c'"), ("it's", "'it\\'s'")],
)
def test_hydra_values(value, text):
    assert hydra_value(value) == text
