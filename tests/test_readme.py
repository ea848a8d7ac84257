"""The README's promises: two set-up commands first, and CI runs exactly the README's test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands():
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_opens_with_setup_and_test_commands():
    setup, tests = readme_commands()[:2]
    assert "pip install -e" in setup and "ppoflow" in setup
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1].strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines
