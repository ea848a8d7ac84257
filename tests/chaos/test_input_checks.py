"""Bad data, model and reward inputs are refused before anything starts: one line each, naming the key and the fix,
all of them at once, in well under 2 s, and `ppoflow train` exits 2 before Prefect, Ray or MLflow start."""

import shutil
import subprocess
import sys
import time

import pytest

from rl_core.data.rows import write_rows
from rl_core.data.synthetic import addition_rows
from rl_core.input_checks import InputError, check_run_inputs
from tests.conftest import ROOT


@pytest.fixture()
def data_files(tmp_path):
    rows = addition_rows(12, seed=0, max_operand=9, split="train")
    return write_rows(rows, tmp_path / "train.parquet"), write_rows(rows[:4], tmp_path / "val.jsonl")


@pytest.fixture()
def checked(config, data_files):
    config.data.train_files, config.data.val_files = str(data_files[0]), str(data_files[1])
    return config


def problems(config) -> list[str]:
    try:
        check_run_inputs(config)
    except InputError as error:
        return str(error).splitlines()
    return []


def test_usable_inputs_pass_in_well_under_two_seconds(checked, tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n    return scale\n"
    )
    checked.custom_reward_function.path = str(reward)
    checked.custom_reward_function.reward_kwargs = {"scale": 2.0}
    started = time.perf_counter()
    assert problems(checked) == []
    assert time.perf_counter() - started < 2.0


def test_data_problems(checked, data_files, tmp_path):
    checked.data.train_files = [str(data_files[0]), str(tmp_path / "missing.parquet")]
    assert problems(checked) == [f"data.train_files: {tmp_path / 'missing.parquet'}: no such dataset file"]
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    checked.data.train_files = str(tmp_path / "bad.parquet")
    assert problems(checked)[0].startswith(f"data.train_files: {tmp_path / 'bad.parquet'}: not a readable parquet file")
    write_rows(
        [
            {"data_source": "x", "prompt": "2+2=", "reward_model": {"ground_truth": "4"}},
            {"data_source": "x", "question": "no prompt column"},
        ],
        tmp_path / "rows.jsonl",
    )
    checked.data.train_files = str(data_files[0])
    checked.data.val_files = str(tmp_path / "rows.jsonl")
    assert problems(checked) == [
        f"data.val_files: {tmp_path / 'rows.jsonl'}: row 1: column 'prompt' must be a list of {{'role', 'content'}} "
        "messages or a string, got None"
    ]
    agent_rows = [
        dict(row, agent_name=name) for row, name in zip(addition_rows(2, seed=0), ("tool_agent", "endpoint_agent"))
    ]
    checked.data.val_files = str(write_rows(agent_rows, tmp_path / "agents.jsonl"))
    assert problems(checked) == [
        f"data.val_files: {tmp_path / 'agents.jsonl'}: row 0 has agent_name tool_agent: tool_agent needs "
        "actor_rollout_ref.rollout.multi_turn.enable=true (and its tool_config_path or interaction_config_path)"
    ]
    checked.data.val_files = str(write_rows(agent_rows[1:], tmp_path / "agents.jsonl"))
    assert problems(checked) == [
        f"data.val_files: {tmp_path / 'agents.jsonl'}: row 0 has agent_name endpoint_agent: endpoint_agent needs an "
        "agent: set actor_rollout_ref.rollout.agent.endpoint.function (module:callable) or .command"
    ]
    checked.data.val_files = str(data_files[1])
    checked.data.train_batch_size = 13
    assert problems(checked) == [
        "data.train_batch_size=13 is larger than the 12 rows of data.train_files: lower it or give more data"
    ]
    checked.data.train_max_samples = 3
    checked.data.train_batch_size = 4
    assert problems(checked) == [
        "data.train_batch_size=4 is larger than the 3 rows of data.train_files: lower it or give more data"
    ]


def test_model_problems(checked, tiny_model_path, tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_path, broken)
    (broken / "model.safetensors").unlink()
    checked.actor_rollout_ref.model.path = str(broken)
    assert problems(checked) == [
        f"actor_rollout_ref.model.path={str(broken)!r} has no weights (model.safetensors or pytorch_model.bin); the "
        "download or save did not finish"
    ]
    checked.actor_rollout_ref.model.path = str(tmp_path / "nowhere")
    assert problems(checked)[0].startswith(
        f"actor_rollout_ref.model.path={str(tmp_path / 'nowhere')!r}: no such folder"
    )
    checked.actor_rollout_ref.model.path = str(tiny_model_path)
    checked.critic.model.path = str(tmp_path / "nowhere")
    assert problems(checked) == []  # GRPO: no critic
    checked.algorithm.adv_estimator = "gae"  # the critic's model is needed now
    assert problems(checked)[0].startswith(f"critic.model.path={str(tmp_path / 'nowhere')!r}: no such folder")


@pytest.mark.parametrize(
    "source, manager, expected",
    [
        (None, "naive", "custom_reward_function.path='{path}': no such file"),
        (
            "import not_a_module_anywhere\n",
            "naive",
            "custom_reward_function.path='{path}' failed to import: ModuleNotFoundError",
        ),
        (
            "def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 0\n",
            "naive",
            "custom_reward_function.name='compute_score' is not a function in {path} (it has: ['other'])",
        ),
        (
            "def compute_score(solution, truth):\n    return 0\n",
            "naive",
            "custom_reward_function.name='compute_score' in {path} cannot be called as compute_score(data_source, "
            "solution_str, ground_truth, extra_info)",
        ),
        (
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0\n",
            "batch",
            "custom_reward_function.name='compute_score' in {path} cannot be called as compute_score(data_sources, "
            "solution_strs, ground_truths, extra_infos)",
        ),
    ],
)
def test_reward_function_problems(checked, tmp_path, source, manager, expected):
    path = tmp_path / "reward.py"
    if source is not None:
        path.write_text(source)
    checked.custom_reward_function.path = str(path)
    checked.reward.reward_manager = manager
    [problem] = problems(checked)
    assert problem.startswith(expected.format(path=path)), problem


def test_every_problem_is_reported_at_once(checked, tmp_path):
    checked.data.train_files = str(tmp_path / "missing.parquet")
    checked.actor_rollout_ref.model.path = str(tmp_path / "nowhere")
    checked.custom_reward_function.path = str(tmp_path / "reward.py")
    assert [line.split(":")[0].split("=")[0] for line in problems(checked)] == [
        "data.train_files",
        "actor_rollout_ref.model.path",
        "custom_reward_function.path",
    ]


def test_ppoflow_train_refuses_them_before_starting_anything(tmp_path, data_files):
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "train",
            f"trainer.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
            f"trainer.default_local_dir={tmp_path}/checkpoints",
            f"data.train_files={data_files[0]}",
            f"data.val_files={tmp_path}/missing.jsonl",
            f"actor_rollout_ref.model.path={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PPOFLOW_HOME": str(tmp_path)},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "ppoflow train: data.train_batch_size=1024 is larger than the 12 rows of data.train_files: lower it or give "
        "more data",
        f"ppoflow train: data.val_files: {tmp_path}/missing.jsonl: no such dataset file",
        f"ppoflow train: actor_rollout_ref.model.path={str(tmp_path)!r} has no config.json; it is not a Hugging Face "
        "checkpoint folder",
    ]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "checkpoints").exists()
    print(f"refused in {time.monotonic() - started:.1f} s, interpreter start and imports included")
