"""The algorithm names read without importing torch (rl_core/algo_names.py) are the registries' own."""

import subprocess
import sys
from pathlib import Path

import rl_core.algos as algos
from rl_core.algo_names import REGISTRIES, algorithm_choices, decorated_names

ROOT = Path(__file__).resolve().parents[2]


def test_the_decorators_in_the_source_are_the_registries_contents():
    for registry, (source, decorator) in REGISTRIES.items():
        assert decorated_names(source, decorator) == set(getattr(algos, registry)) != set()


def test_before_the_registries_are_imported_the_choices_come_from_the_source():
    code = (
        "import sys\nfrom rl_core.algo_names import algorithm_choices\n"
        "choices = algorithm_choices()\n"
        "print('torch' in sys.modules, sorted(choices['algorithm.adv_estimator']))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.stdout.strip() == f"False {sorted(algos.ADVANTAGE_ESTIMATORS)}", result.stderr


def test_a_name_registered_at_run_time_is_accepted_once_the_registries_are_imported():
    @algos.register_adv_est("test_only_estimator")
    def estimator(**_):
        raise AssertionError("not called")

    try:
        assert "test_only_estimator" in algorithm_choices()["algorithm.adv_estimator"]
    finally:
        del algos.ADVANTAGE_ESTIMATORS["test_only_estimator"]
