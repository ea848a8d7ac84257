"""The ppoflow command line: listing, and a bad training config rejected in one line before anything starts."""

import subprocess
import sys

from tests.conftest import ROOT


def ppoflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_algos_lists_the_registries():
    result = ppoflow("algos")
    assert result.returncode == 0 and "grpo" in result.stdout and "cispo" in result.stdout and "k3+" in result.stdout


def test_train_rejects_a_bad_key_and_a_bad_type():
    result = ppoflow("train", "algorithm.adv_estimatr=gae")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "ppoflow train: unknown config key 'algorithm.adv_estimatr': check the spelling (`ppoflow config` prints every "
        "key); your reward function's own settings go in custom_reward_function.reward_kwargs"
    )
    result = ppoflow("train", "trainer.total_training_steps=ten")
    assert result.returncode == 2 and "trainer.total_training_steps: expected int, got 'ten' (str)" in result.stderr
    result = ppoflow("train", "+trainer.wandb_key=abc")  # `+` cannot add a key the schema does not have
    assert result.returncode == 2 and "unknown config key 'trainer.wandb_key'" in result.stderr


def test_config_prints_the_composed_config_with_the_overrides():
    result = ppoflow("config", "data.train_batch_size=64", "actor_rollout_ref.rollout.n=3")
    assert result.returncode == 0
    import yaml

    composed = yaml.safe_load(result.stdout)
    assert composed["data"]["train_batch_size"] == 64
    assert composed["critic"]["rollout_n"] == 3  # interpolations resolved
    assert composed["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1.0e-3  # the one default, from rl_core/config.py


def test_tools_call_runs_one_call_of_a_built_in_or_configured_tool(tmp_path):
    assert ppoflow("tools", "call", "calculator", '{"expression": "37*48"}').stdout == "1776\n"
    assert ppoflow("tools", "call", "python", '{"code": "print(2**10)"}').stdout == "1024\n"
    (tmp_path / "tools.yaml").write_text("tools: []")
    refused = ppoflow("tools", "call", "--config", str(tmp_path / "tools.yaml"), "calculator", "{}")
    assert refused.returncode == 2 and "expected `tools:` with a list" in refused.stderr


def test_a_refusal_imports_neither_torch_nor_ray_nor_prefect(tmp_path):
    """What keeps a refusal in seconds: the checks of bad values and missing files (and of a sweep) import none of the
    heavy packages (bench/refusals.py times them)."""
    heavy = ("torch", "transformers", "ray", "prefect", "mlflow")
    folder = f"trainer.default_local_dir={tmp_path}/checkpoints"
    for command in (
        ["train", "data.train_batch_size=0", folder],
        ["train", f"data.train_files={tmp_path}/missing.parquet", folder],
        ["train", "algorithm.adv_estimator=grop", folder],  # the registries' names are read from their modules' source
        ["sweep", "algorithm.adv_estimator=grpo"],  # a sweep that varies nothing
    ):
        code = (
            "import sys\nfrom flows.cli import main\n"
            f"code = main({command!r})\n"
            f"print(code, [name for name in {heavy!r} if name in sys.modules])"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert result.stdout.splitlines()[-1] == "2 []", result.stdout + result.stderr


def test_the_command_imports_no_model_code():
    """The command's modules (the flow, the step, the input checks, the worker group it creates) import transformers'
    tokenizers and configs, not its modeling code, which only the workers load (~2-4 s of the command's start-up on 2
    cores: bench/README.md); the padding-free passes' context and the decode loop's rotation are the project's own for
    that reason."""
    code = (
        "import sys\nimport flows.train, flows.workers\n"
        "print(sorted(name for name in sys.modules if name in ('transformers.modeling_utils', "
        "'rl_core.models.packed_attention') or name.startswith('transformers.models.') and '.modeling_' in name "
        "and '.models.auto.' not in name))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.stdout.splitlines()[-1] == "[]", result.stdout + result.stderr


def test_the_resume_check_of_a_fresh_run_imports_neither_mlflow_nor_torch(tmp_path):
    """A run with nothing to resume passes its resume check in milliseconds: MLflow's client and the checkpoint code
    are imported only for a run that has a checkpoint (flows/resume.py::check_resume)."""
    code = (
        "import sys\nfrom flows.config import compose_config\nfrom flows.resume import check_resume\n"
        f"result = check_resume(compose_config(['trainer.default_local_dir={tmp_path}/checkpoints']))\n"
        "print(result, [name for name in ('torch', 'mlflow') if name in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.stdout.splitlines()[-1] == "None []", result.stdout + result.stderr


LOST_STOP = """
import os, signal, sys, time, weakref
from flows.cli.flow_commands import _stop_on_signals
received = _stop_on_signals()


def callback(ref):
    os.kill(os.getpid(), signal.SIGTERM)  # handled inside this callback, where Python ignores what is raised
    sum(range(1000))


def run():
    thing = type("Thing", (), {})()
    keep = weakref.ref(thing, callback)
    del thing
    time.sleep(5)
    return "went on"


try:
    if sys.argv[1] == "flow":  # Prefect's SIGTERM handler, as during a flow run
        from prefect.utilities.engine import capture_sigterm

        with capture_sigterm():
            print(run())
    else:
        print(run())
except KeyboardInterrupt as stop:
    print(stop, received)
"""


def test_a_stop_raised_where_python_ignores_it_is_raised_again():
    """A signal's handler may run inside a weakref callback or a finalizer, whose exception Python ignores: the stop
    is then sent again (a killed command's run had waited out its Ray time-out), ours or Prefect's during a flow."""
    runs = [
        subprocess.Popen([sys.executable, "-c", LOST_STOP, where], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for where in ("command", "flow")
    ]
    for run in runs:
        out, _ = run.communicate(timeout=120)
        assert out.strip().splitlines()[-1] == "stopped by SIGTERM [15]", out
