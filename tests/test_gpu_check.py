"""bench/gpu_check.py on the CPU (its GPU run needs a GPU machine): it runs with none of the packages a bare GPU
machine lacks, checks bf16 against float32, and ends with its JSON line."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what a bare GPU machine does not have: each import of these fails in the script's process
ABSENT = ("omegaconf", "hydra", "pyarrow", "ray", "prefect", "mlflow", "vllm", "pandas", "optuna")
RUNNER = (
    f"import runpy, sys; sys.modules.update({{name: None for name in {ABSENT!r}}}); "
    "sys.argv = ['gpu_check.py', '--device', 'cpu', '--out', sys.argv[1]]; "
    "runpy.run_path('bench/gpu_check.py', run_name='__main__')"
)


def test_gpu_check_runs_on_the_cpu_with_only_torch_transformers_peft_safetensors(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["parity/ok"] == 1.0
    assert 0 < result["parity/max_log_prob_error"] < 0.15  # bf16 really ran, and agrees with float32
    assert result["rollout_tokens_per_s"] > 0 and result["train_tokens_per_s"] > 0 and result["mfu"] is None
    assert "step 4:" in done.stdout
    # --out: what it printed and its figures, in the folder named (the GPU machine's $OUT)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == result
    assert "step 4:" in (tmp_path / "gpu_check.log").read_text()
