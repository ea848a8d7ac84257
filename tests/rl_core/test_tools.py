"""The tools a policy can call (rl_core/agent/tools): the calculator by hand-computed values and refusals, the tool
YAML's errors, one call's error handling, and the Python sandbox's isolation and limits, measured on the real thing."""

import os
import time
from pathlib import Path

import pytest

from rl_core.agent.tools import python_sandbox
from rl_core.agent.tools.base import BaseTool, call_tool
from rl_core.agent.tools.calculator import evaluate
from rl_core.agent.tools.registry import ToolConfigError, builtin_tool, load_tools

# the sandbox's user in this pytest process, its own: the suite's other process runs sandboxes too, and the checks below
# (no process of the user left; the process limit, which counts per user) must not see them
SANDBOX_UID = 60000 + os.getpid() % 5000

CALCULATOR_YAML = """
tools:
  - class_name: rl_core.agent.tools.calculator.CalculatorTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
"""


@pytest.mark.parametrize(
    "expression, value",
    [("37*48", 1776), ("(2+3)*4", 20), ("7/2", 3.5), ("2**10", 1024), ("-3**2", -9), ("10//3", 3), ("10%3", 1)],
)
def test_the_calculator_computes(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"expression": "__import__('os').getcwd()"}, "only numbers and"),
        ({"expression": "(1).real"}, "only numbers and"),
        ({"expression": "9**99"}, "exponent 99 is larger than 64"),
        ({"expression": "10.0**30*1e10"}, "out of range"),
        ({"expression": "1" * 65}, "at most 64"),
        ({"expression": "1/0"}, "division by zero"),
        ({"expression": "2 +"}, "cannot parse"),
        ({"expr": "1"}, "calculator takes"),
        (["1+1"], "takes a JSON object of arguments, not list"),
    ],
)
def test_the_calculator_answers_a_bad_call_with_an_error_message(arguments, message):
    text = call_tool(builtin_tool("calculator"), arguments).text
    assert text.startswith("error: ") and message in text


@pytest.mark.parametrize("latency_s, low, high", [(0.05, 0.05, 0.05), ([0.02, 0.12], 0.02, 0.12)])
def test_the_calculator_answers_after_its_latency(latency_s, low, high):
    """``latency_s`` (a remote service's answer time) delays each call that long, or by a time drawn from [low, high]
    for each call: never sooner, and drawn anew (eight draws of a 0.1 s range are not all alike)."""
    tool = builtin_tool("calculator", {"latency_s": latency_s})
    seconds = []
    for _ in range(8):
        started = time.monotonic()
        assert call_tool(tool, {"expression": "6*7"}).text == "42"
        seconds.append(time.monotonic() - started)
    assert min(seconds) >= low
    if high > low:
        assert max(seconds) - min(seconds) > 0.01


def test_a_tool_that_raises_is_an_error_message_not_an_exception():
    class Broken(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            raise KeyError("state")

    released = []
    broken = Broken({}, {"function": {"name": "broken"}})
    broken.release = lambda instance_id, **kwargs: released.append(instance_id) or _done()
    assert call_tool(broken, {}).text == "error: broken failed: KeyError: 'state'" and len(released) == 1


async def _done():
    return None


def test_the_tool_yaml_loads_verls_format_and_names_the_file_and_tool_in_errors(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(CALCULATOR_YAML)
    assert call_tool(load_tools(path)["calculator"], {"expression": "6*7"}).text == "42"
    for text, message in [
        (CALCULATOR_YAML.replace("calculator.CalculatorTool", "calculator.Nope"), "tool 0 (calculator): cannot import"),
        (CALCULATOR_YAML.replace("rl_core.agent.tools.calculator.CalculatorTool", "pathlib.Path"), "is not a BaseTool"),
        (CALCULATOR_YAML + CALCULATOR_YAML.split("tools:\n")[1], "tool 1 (calculator): a second tool named"),
        ("tools: []", "expected `tools:` with a list"),
        (
            CALCULATOR_YAML.replace("calculator.CalculatorTool", "python_sandbox.PythonTool").replace(
                "{type: native}", "{timeout: 3}"
            ),
            "unknown config key(s) ['timeout']",
        ),
    ]:
        path.write_text(text)
        with pytest.raises(ToolConfigError, match=f"tool config {path}") as error:
            load_tools(path)
        assert message in str(error.value)


@pytest.fixture(scope="module")
def python():
    return builtin_tool(
        "python", {"timeout_s": 3, "memory_mb": 256, "max_output_chars": 1000, "run_as_uid": SANDBOX_UID}
    )


def run(tool, code: str) -> tuple[str, float]:
    started = time.monotonic()
    return call_tool(tool, {"code": code}).text, time.monotonic() - started


def running_processes_of(uid: int) -> list[int]:
    """Processes of ``uid`` that have not ended (zombies have: nothing may reap them here)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(entry.path, "status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
                found.append(int(entry.name))
    return found


def test_the_python_tool_runs_code_isolated(python, monkeypatch):
    monkeypatch.setenv("PPOFLOW_PARENT_SECRET", "hunter2")
    assert run(python, "print(6 * 7)")[0] == "42\n"
    text, _ = run(python, "import os; print(sorted(os.environ))")
    assert "PPOFLOW_PARENT_SECRET" not in text and "PATH" not in text
    code = "import socket\ntry:\n  socket.create_connection(('1.1.1.1', 53), 2)\nexcept OSError as e:\n  print(e)"
    assert "Network is unreachable" in run(python, code)[0]
    text, _ = run(python, "import os, pathlib; print(os.getuid()); print(pathlib.Path.cwd())")
    uid, folder = text.split()
    if os.geteuid() == 0:
        assert int(uid) == SANDBOX_UID  # root hands the code to the configured unprivileged user
    assert folder.startswith("/tmp/ppoflow-sandbox-") and not Path(folder).exists()  # removed after the call


@pytest.mark.parametrize(
    "code, message",
    [
        ("x = bytearray(2 * 1024**3)", "MemoryError"),
        ("while True: pass", "timed out after 3 s"),
        ("import os\nwhile True:\n  try: os.fork()\n  except OSError: pass", "timed out after 3 s"),
        ("open('big', 'wb').write(b'0' * (32 << 20))", "File too large"),
        ("print('x' * 5000)", "output longer than 1000 characters"),
        ("raise ValueError('boom')", "ValueError: boom"),
    ],
)
def test_the_python_tools_limits_end_a_call_with_an_error_and_leave_no_process(python, code, message):
    text, seconds = run(python, code)
    assert "error: " in text and message in text and seconds < 3 + 1, (text, seconds)
    if os.geteuid() == 0:
        # the code's PID namespace dies with the killed launcher; the kernel kills its processes (a fork bomb's
        # thousands) asynchronously, which takes a moment on a loaded machine: none may be left soon after
        deadline = time.monotonic() + 5
        while running_processes_of(SANDBOX_UID) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running_processes_of(SANDBOX_UID) == []


def test_the_python_tool_refuses_to_run_where_it_cannot_isolate(python, tmp_path, monkeypatch):
    """Namespaces denied (as a host without user namespaces would): the launcher's unshare is made to fail with EPERM
    (a copy of the real launcher, only that call replaced); the code must not run."""
    launcher = python_sandbox.LAUNCHER.read_text().replace(
        "    libc = ctypes.CDLL(None, use_errno=True)\n    isolate",
        "    libc = type('Denied', (), {'unshare': staticmethod(lambda flags: ctypes.set_errno(1) or -1)})()\n"
        "    isolate",
    )
    assert "Denied" in launcher
    (tmp_path / "launcher.py").write_text(launcher)
    monkeypatch.setattr(python_sandbox, "LAUNCHER", tmp_path / "launcher.py")
    marker = tmp_path / "ran"
    text, _ = run(python, f"open({str(marker)!r}, 'w')")
    assert text.startswith("error: the python tool cannot isolate its sandbox here")
    assert "Operation not permitted" in text
    assert not marker.exists()
