"""The stack's launcher (flows/launcher.py): a real launcher process on its Unix socket, and real ``ppoflow train``
commands handed to it. It runs a copy of the project's code, so that a test may change a source file."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
from prefect.settings import PREFECT_API_URL

from flows.launcher import PACKAGES, changed_sources, project_sources, refusal
from infra.stack import launcher_fits, unix_socket_answers
from tests.conftest import ROOT

STACK_VARIABLES = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS", "PPOFLOW_LAUNCHER")


def wait_until_answering(socket_path, seconds: float = 180.0) -> None:
    deadline = time.monotonic() + seconds
    while not unix_socket_answers(socket_path):
        assert time.monotonic() < deadline, f"the launcher did not answer on {socket_path}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    """(the code's folder, a command's environment, the launcher's process)."""
    root = tmp_path_factory.mktemp("launcher")
    code = root / "code"
    for folder in (*PACKAGES, "configs"):
        shutil.copytree(ROOT / folder, code / folder, ignore=shutil.ignore_patterns("__pycache__"))
    home = root / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in STACK_VARIABLES}
    env.update(PPOFLOW_HOME=str(home), PYTHONPATH=str(code))
    socket_path = home / "launcher.sock"
    with open(root / "launcher.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "flows.launcher", str(socket_path)], env=env, cwd=root, stdout=log, stderr=log
        )
    try:
        wait_until_answering(socket_path)
        yield code, env, process
    finally:
        process.terminate()
        process.wait(timeout=30)


def ppoflow_train(env: dict, cwd, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--verbose", *overrides],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_command_runs_in_a_forked_process_with_its_own_streams_folder_environment_and_exit_code(launcher, tmp_path):
    code, env, process = launcher
    # the command's folder (a relative path resolved there), its environment (a variable the launcher lacks), its
    # stdout and stderr (what it prints arrives on the command's pipes), its exit code (2: a refused input)
    marked = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/marker.db"}
    result = ppoflow_train(marked, tmp_path, "data.train_files=nothing.parquet")
    assert result.returncode == 2, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    child = int(re.search(r"runs in a process of the stack's launcher \(pid (\d+)", first).group(1))
    assert child not in (process.pid, os.getpid())
    assert f"MLflow sqlite:///{tmp_path}/marker.db" in result.stdout
    assert f"data.train_files: {tmp_path}/nothing.parquet: no such dataset file" in result.stderr
    assert process.poll() is None  # the launcher serves the next command

    # PPOFLOW_LAUNCHER=0: the command runs in its own process, with the same result
    own = ppoflow_train({**env, "PPOFLOW_LAUNCHER": "0"}, tmp_path, "data.train_files=nothing.parquet")
    assert own.returncode == 2 and "launcher" not in own.stdout
    assert f"{tmp_path}/nothing.parquet: no such dataset file" in own.stderr


@pytest.fixture
def silent_port():
    """A loopback port whose connections wait for their whole time-out: it listens, but its one-connection queue is
    full and never accepted, so the kernel drops the next connection's SYNs (a free port would refuse at once)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    queued = [socket.socket() for _ in range(2)]
    for waiting in queued:
        waiting.setblocking(False)
        waiting.connect_ex(("127.0.0.1", port))
    try:
        yield port
    finally:
        for waiting in queued:
            waiting.close()
        listener.close()


def test_a_killed_command_stops_its_process_in_the_launcher(launcher, tmp_path, prefect_api, silent_port):
    code, env, process = launcher
    # a run that waits (10 s) for a Ray cluster that does not answer; its command is killed once the run has begun
    command = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "train", "--verbose", f"trainer.ray.address=127.0.0.1:{silent_port}"],
        env={**env, "PREFECT_API_URL": PREFECT_API_URL.value()},  # the session's server: none started by the run
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first = command.stdout.readline()
    assert "runs in a process of the stack's launcher" in first, first
    for line in command.stdout:  # until the flow is about to run (its modules imported; Ray is being waited for)
        if "Prefect's server up" in line:
            break
    command.kill()
    command.wait()
    # the child holds the command's stdout until it ends: what it printed last is why it ended
    rest = command.stdout.read()
    assert "ppoflow train: stopped by SIGTERM; the run is marked KILLED" in rest, rest[-2000:]
    assert "did not answer within" not in rest  # not the cluster's time-out: the command's end


def test_a_changed_source_file_makes_the_launcher_start_again_with_the_new_code(launcher, tmp_path):
    code, env, process = launcher
    source = code / "flows" / "demo.py"
    os.utime(source, ns=(time.time_ns(), time.time_ns() + 10**9))
    refused = ppoflow_train(env, tmp_path, "trainer.total_training_steps=-1")
    assert refused.returncode == 2  # it ran in its own process
    assert refused.stdout.splitlines()[0] == (
        "ppoflow train: runs in its own process: the stack's launcher refused (flows/demo.py changed since the "
        "launcher imported it (it restarts))"
    )
    time.sleep(0.5)  # the launcher replaces itself (the same pid) and imports again
    wait_until_answering(env["PPOFLOW_HOME"] + "/launcher.sock")
    again = ppoflow_train(env, tmp_path, "trainer.total_training_steps=-1")
    assert again.returncode == 2 and "runs in a process of the stack's launcher" in again.stdout.splitlines()[0]
    assert process.poll() is None


def test_what_the_launcher_refuses_and_which_sources_it_watches(tmp_path, monkeypatch):
    module = tmp_path / "module.py"
    module.write_text("x = 1\n")
    sources = {str(module): module.stat().st_mtime_ns}
    assert changed_sources(sources) == []
    os.utime(module, ns=(time.time_ns(), module.stat().st_mtime_ns + 1))
    assert changed_sources(sources) == [str(module)]
    module.unlink()
    assert changed_sources(sources) == [str(module)]

    watched = project_sources()  # this process's imported project modules, none of its libraries
    assert str(ROOT / "flows" / "launcher.py") in watched
    assert all(any(f"/{package}/" in file for package in PACKAGES) for file in watched)
    assert not any("site-packages" in file for file in watched)

    request = {"python": sys.executable, "code": str(ROOT)}
    assert "Python" in refusal({**request, "python": "/usr/bin/python9"}, {})
    assert "code is at /elsewhere" in refusal({**request, "code": "/elsewhere"}, {})

    # a home whose socket path is longer than a Unix socket's address: `ppoflow up` starts no launcher (and says so)
    monkeypatch.setenv("PPOFLOW_HOME", "/tmp/" + "h" * 88)  # 107 bytes with "/launcher.sock"
    assert launcher_fits()
    monkeypatch.setenv("PPOFLOW_HOME", "/tmp/" + "h" * 89)
    assert not launcher_fits()
