"""The typed config: one default per key, every key read somewhere, and wrong keys, types and values refused."""

import inspect
import re
import shutil
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from flows.config import CONFIG_DIR, ConfigError, absolute_paths, compose_config
from rl_core.config import default_config
from rl_core.config_checks import CHOICES, check_config
from rl_core.models.optim import build_optimizer
from rl_core.run_roles import recomputes_old_log_prob
from tests.conftest import ROOT

CODE_FOLDERS = ("rl_core", "flows", "infra")


def leaf_keys(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key in node:
        value = node._get_node(key)
        name = f"{prefix}{key}"
        if isinstance(value, DictConfig) and OmegaConf.get_type(value) is not dict:
            keys += leaf_keys(value, f"{name}.")
        else:
            keys.append(name)
    return keys


def test_every_key_is_read_by_the_code():
    """A key that no code reads is accepted and then ignored: each leaf's name must be read (``.name`` or ``"name"``)
    somewhere outside the dataclasses that declare it (the value checks count: ``strategy`` and ``hybrid_engine``
    exist for verl's override strings and only accept the one mode ppoflow builds)."""
    code = "".join(
        path.read_text()
        for folder in CODE_FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if path != ROOT / "rl_core" / "config.py"
    )
    code += inspect.getsource(check_config) + repr(CHOICES)
    unread = [
        key
        for key in leaf_keys(default_config())
        if not re.search(rf"(\.{key.rsplit('.', 1)[-1]}\b|[\"']{key.rsplit('.', 1)[-1]}[\"'])", code)
    ]
    assert unread == []


def test_the_yaml_adds_no_default_of_its_own():
    composed = compose_config(["actor_rollout_ref.model.path=/models/own"])
    schema = default_config()
    schema.actor_rollout_ref.model.path = "/models/own"
    OmegaConf.resolve(schema)
    absolute_paths(schema)
    assert OmegaConf.to_container(composed) == OmegaConf.to_container(schema)
    assert set(OmegaConf.load(ROOT / "configs" / "ppo_trainer.yaml")) == {"defaults"}


def test_code_takes_its_defaults_from_the_schema():
    """The defaults that once disagreed between the YAML and the code now come from one place."""
    import torch

    config = compose_config(["actor_rollout_ref.model.path=/models/own"])
    optimizer = build_optimizer(torch.nn.Linear(2, 2).parameters(), config.actor_rollout_ref.actor.optim)
    assert optimizer.param_groups[0]["lr"] == config.actor_rollout_ref.actor.optim.lr == 1e-6
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    assert config.data.filter_overlong_prompts is False


def test_rollout_corrections_settings_are_checked_with_what_each_mode_needs():
    key = "algorithm.rollout_correction"
    with pytest.raises(ConfigError, match=re.escape(f"{key}.rollout_is='tokens': choose token, sequence or null")):
        compose_config([f"{key}.rollout_is=tokens"])
    with pytest.raises(ConfigError, match="token_k9 is not a filter"):
        compose_config([f"{key}.rollout_rs=token_k9", f"{key}.rollout_rs_threshold=2"])
    with pytest.raises(ConfigError, match="set actor_rollout_ref.rollout.calculate_log_probs=true"):
        compose_config([f"{key}.bypass_mode=true", "actor_rollout_ref.rollout.calculate_log_probs=false"])
    with pytest.raises(ConfigError, match="recompute_old_log_prob=false computes no pi_old"):
        compose_config(
            [f"{key}.rollout_is=token", "actor_rollout_ref.actor.recompute_old_log_prob=false"]
            + ["actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.actor.ppo_mini_batch_size=32"]
        )
    # Hydra would read 1_5 as 15 (digit grouping): the bounds stay the string the user typed
    logprobs = "actor_rollout_ref.rollout.calculate_log_probs=true"
    config = compose_config([f"{key}.rollout_is=token", f"{key}.rollout_is_threshold=0.2_5", logprobs])
    assert config.algorithm.rollout_correction.rollout_is_threshold == "0.2_5"


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.total_trainin_steps=3", "unknown config key 'trainer.total_trainin_steps'"),
        ("+data.access_key=abc", "unknown config key 'data.access_key'"),
        ("data.train_batch_size=many", "data.train_batch_size: expected int, got 'many'"),
        ("actor_rollout_ref.actor.use_kl_loss=maybe", "actor_rollout_ref.actor.use_kl_loss: expected bool"),
        ("data.train_batch_size=null", "data.train_batch_size"),
        ("trainer.total_training_steps=-5", "trainer.total_training_steps=-5: must be > 0"),
        ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n=0: must be > 0"),
        ("actor_rollout_ref.actor.optim.lr=nan", "actor_rollout_ref.actor.optim.lr=nan: must be a finite number > 0"),
        ("trainer.device=tpu", "trainer.device='tpu': choose one of auto, cpu, cuda"),
        (
            "actor_rollout_ref.actor.strategy=megatron",
            "actor_rollout_ref.actor.strategy='megatron': choose one of fsdp, fsdp2",
        ),
        ("actor_rollout_ref.hybrid_engine=false", "only the hybrid engine"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=64", "cannot be larger than the step's batch"),
        (
            "actor_rollout_ref.actor.clip_ratio_c=1.0",
            "actor_rollout_ref.actor.clip_ratio_c=1.0: the dual-clip bound must be greater than 1",
        ),
        (
            "trainer.experiment_name=run-hf_" + "Q" * 30,
            "trainer.experiment_name holds a token or a password ('run-***')",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_config([override])


def test_a_token_budget_shorter_than_a_sequence_is_refused_where_it_packs_micro_batches():
    short = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16"  # the demo's sequences: 32 + 8 tokens
    compose_config([short])  # the demo's micro-batches go by count
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16 is shorter than the longest sequence "
            "(data.max_prompt_length + data.max_response_length = 40), and "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu packs micro-batches by it"
        ),
    ):
        compose_config([short, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"])
    own = compose_config(["actor_rollout_ref.model.path=/models/m"])  # verl's defaults: null, packed by 16384 tokens
    assert own.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is None


def test_dict_fields_take_keys_of_their_own():
    config = compose_config(
        ["+custom_reward_function.reward_kwargs.bonus=2", "+actor_rollout_ref.model.override_config.rope_theta=5.0"]
    )
    assert config.custom_reward_function.reward_kwargs.bonus == 2
    assert config.actor_rollout_ref.model.override_config.rope_theta == 5.0


def test_total_epochs_and_total_steps_stop_at_whichever_comes_first():
    from rl_core.ppo_step import resolved_total_steps

    config = compose_config(["trainer.total_epochs=2", "trainer.total_training_steps=100"])
    assert resolved_total_steps(config, batches_per_epoch=10) == 20
    config = compose_config(["trainer.total_epochs=2", "trainer.total_training_steps=7"])
    assert resolved_total_steps(config, batches_per_epoch=10) == 7
    config = compose_config(["trainer.total_epochs=3", "trainer.total_training_steps=null"])
    assert resolved_total_steps(config, batches_per_epoch=10) == 30


def test_schema_file_is_where_the_readme_says():
    assert (ROOT / "rl_core" / "config.py").is_file() and Path(compose_config.__code__.co_filename).name == "config.py"


def test_skipping_the_old_log_prob_pass_needs_one_epoch_and_one_mini_batch():
    base = [
        "actor_rollout_ref.actor.recompute_old_log_prob=false",
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    ]
    assert compose_config(base).actor_rollout_ref.actor.recompute_old_log_prob is False
    for extra in (
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "algorithm.use_kl_in_reward=true",
    ):
        with pytest.raises(ConfigError, match="recompute_old_log_prob=false needs ppo_epochs=1"):
            compose_config([*base, extra])


def test_the_old_log_prob_pass_runs_by_default_only_where_the_update_would_not_give_the_same_numbers():
    """null (the default): skipped with one epoch and one mini-batch; run where the update's own pass would come
    after a first optimizer step or the old log-probs are needed before it; an explicit value wins."""
    one_update = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]
    assert compose_config(one_update).actor_rollout_ref.actor.recompute_old_log_prob is None
    assert not recomputes_old_log_prob(compose_config(one_update))
    for extra in (
        ["actor_rollout_ref.actor.ppo_epochs=2"],
        ["actor_rollout_ref.actor.ppo_mini_batch_size=8"],
        ["algorithm.use_kl_in_reward=true"],
        ["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=true"],
        ["trainer.critic_warmup=1"],
        ["actor_rollout_ref.actor.recompute_old_log_prob=true"],
    ):
        assert recomputes_old_log_prob(compose_config([*one_update, *extra])), extra
    bypass = [
        *one_update,
        "algorithm.rollout_correction.bypass_mode=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    ]
    assert not recomputes_old_log_prob(compose_config([*bypass, "actor_rollout_ref.actor.recompute_old_log_prob=true"]))


def test_paths_are_made_absolute_against_the_working_folder(tmp_path, monkeypatch):
    """Workers on a persistent cluster run in the cluster's folder: a relative path there names another file."""
    monkeypatch.chdir(tmp_path)
    config = compose_config(
        [
            "data.train_files=[a.parquet,b.parquet]",
            "actor_rollout_ref.model.path=models/mine",
            "custom_reward_function.path='~/reward.py'",
        ]
    )
    assert list(config.data.train_files) == [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    assert config.actor_rollout_ref.model.path == config.critic.model.path == str(tmp_path / "models" / "mine")
    assert config.custom_reward_function.path == str(Path("~/reward.py").expanduser())
    assert (
        config.trainer.cache_dir == str(tmp_path / ".ppoflow")
        and config.trainer.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    )
    assert config.trainer.default_local_dir == str(tmp_path / "checkpoints" / "ppoflow" / "demo")


def test_the_tool_demo_takes_its_profile_over_the_demos_and_a_users_model_neither(tmp_path, monkeypatch):
    """`ppoflow train data.synthetic.task=calc`: the demo profile, then the tool demo's (multi-turn with the calculator,
    its YAML found wherever the command runs); a user's overrides still win; with a model path, no profile."""
    monkeypatch.chdir(tmp_path)
    calc = compose_config(["data.synthetic.task=calc", "actor_rollout_ref.rollout.n=2"])
    multi_turn = calc.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable and multi_turn.format == "tag"
    assert multi_turn.tool_config_path == str(ROOT / "configs" / "tools" / "calculator.yaml")
    assert calc.trainer.experiment_name == "demo_calc" and calc.data.train_batch_size == 16
    assert calc.actor_rollout_ref.rollout.n == 2
    assert calc.actor_rollout_ref.actor.optim.lr == 3e-4  # its own, below the addition demo's
    assert calc.actor_rollout_ref.actor.clip_ratio_high == compose_config([]).actor_rollout_ref.actor.clip_ratio_high
    own = compose_config(["data.synthetic.task=calc", "actor_rollout_ref.model.path=mine"])
    assert not own.actor_rollout_ref.rollout.multi_turn.enable and own.trainer.experiment_name != "demo_calc"


def test_the_same_composition_again_is_an_independent_copy_of_what_the_request_would_compose(tmp_path, monkeypatch):
    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    monkeypatch.setattr("flows.config.CONFIG_DIR", configs)
    monkeypatch.chdir(tmp_path)
    overrides = ["data.train_files=data/train.jsonl", "trainer.total_training_steps=3"]
    for _ in range(3):
        config = compose_config(overrides)
        assert config.trainer.total_training_steps == 3 and config.trainer.project_name == "ppoflow"
        assert config.data.train_files == str(tmp_path / "data" / "train.jsonl")
        config.trainer.total_training_steps = 99  # a caller changes its copy (load_inputs fills in the demo's paths)
    trainer_yaml = configs / "ppo_trainer.yaml"  # a config file edited: composed again
    trainer_yaml.write_text(trainer_yaml.read_text() + "\ntrainer:\n  project_name: edited\n")
    assert compose_config(overrides).trainer.project_name == "edited"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # relative paths resolve against the new working folder
    assert compose_config(overrides).data.train_files == str(tmp_path / "elsewhere" / "data" / "train.jsonl")
    interpolating = ["trainer.experiment_name=${oc.env:PPOFLOW_TEST_NAME}"]
    for name in ("first-name", "second-name"):  # an interpolation reads the environment each time
        monkeypatch.setenv("PPOFLOW_TEST_NAME", name)
        assert compose_config(interpolating).trainer.experiment_name == name
