"""The ``python`` tool: runs the policy's code in a fresh interpreter, isolated (``sandbox_launcher.py``): no network,
no inherited environment, a temporary working folder, limits on memory, CPU, processes, file size and output, an
unprivileged user when started as root, and the whole process group killed at a wall-clock timeout. Where it cannot
isolate (namespaces not allowed) it refuses to run: fail closed.

Config (the tool YAML's ``config``): ``timeout_s`` (10), ``memory_mb`` (512), ``max_processes`` (16), ``max_file_mb``
(16), ``max_output_chars`` (4096), ``run_as_uid`` (65534, nobody; when root)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from rl_core.agent.tools.base import BaseTool, ToolError, ToolResponse

SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a sandbox (no network, no files kept) and return what it prints",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "a Python program; print the answer"}},
            "required": ["code"],
        },
    },
}
DEFAULTS = {
    "timeout_s": 10.0,
    "memory_mb": 512,
    "max_processes": 16,
    "max_file_mb": 16,
    "max_output_chars": 4096,
    "run_as_uid": 65534,
}
LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
REFUSED = 97


def readable_by_others(path: Path) -> bool:
    """Every folder above ``path`` can be entered and the file read and run by a user that owns none of them."""
    mode_ok = all(parent.stat().st_mode & stat.S_IXOTH for parent in path.parents)
    return mode_ok and path.stat().st_mode & (stat.S_IROTH | stat.S_IXOTH) == stat.S_IROTH | stat.S_IXOTH


def sandbox_interpreter() -> str | None:
    """The Python the code runs in: this one, unless the sandbox's unprivileged user cannot reach it (a root-owned
    venv or pyenv under /root), then the system's; None when there is none it can run."""
    if os.geteuid() != 0:
        return sys.executable
    for candidate in (sys.executable, getattr(sys, "_base_executable", sys.executable), "/usr/bin/python3"):
        path = Path(candidate).resolve()
        if path.is_file() and readable_by_others(path):
            return str(path)
    return None


async def read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """(at most ``cap`` bytes of ``stream``, whether there was more); stops reading past the cap."""
    data = b""
    while len(data) <= cap:
        chunk = await stream.read(65536)
        if not chunk:
            return data, False
        data += chunk
    return data[:cap], True


class PythonTool(BaseTool):
    idempotent = True  # each call runs in a fresh sandbox and keeps nothing

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]):
        super().__init__(config, tool_schema)
        unknown = set(self.config) - set(DEFAULTS) - {"type"}
        if unknown:
            raise ValueError(f"python tool: unknown config key(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        self.settings = {**DEFAULTS, **{k: v for k, v in self.config.items() if k in DEFAULTS}}

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        code = parameters.get("code")
        if not isinstance(code, str):
            raise ToolError("python takes {'code': '<a Python program>'}")
        text, metrics = await self.run(code)
        return ToolResponse(text), 0.0, metrics

    async def run(self, code: str) -> tuple[str, dict[str, Any]]:
        settings = self.settings
        interpreter = sandbox_interpreter()
        if interpreter is None:
            return "error: the python tool found no Python its unprivileged user may run, so it does not run", {}
        workdir = tempfile.mkdtemp(prefix="ppoflow-sandbox-")
        if os.geteuid() == 0:
            os.chown(workdir, settings["run_as_uid"], settings["run_as_uid"])
        limits = {
            "memory_mb": int(settings["memory_mb"]),
            "cpu_s": max(1, math.ceil(settings["timeout_s"])),
            "max_processes": int(settings["max_processes"]),
            "max_file_mb": int(settings["max_file_mb"]),
        }
        spec = {"code": code, "workdir": workdir, "uid": settings["run_as_uid"], "limits": limits}
        spec["python"] = interpreter
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-S",
            str(LAUNCHER),
            json.dumps(spec),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            env={},
        )
        cap = int(settings["max_output_chars"])
        try:
            (out, cut), (err, _) = await asyncio.wait_for(
                asyncio.gather(read_capped(process.stdout, cap), read_capped(process.stderr, cap)),
                settings["timeout_s"],
            )
            if not cut:
                await asyncio.wait_for(process.wait(), settings["timeout_s"])
        except asyncio.TimeoutError:
            return f"error: timed out after {settings['timeout_s']:g} s (the program was killed)", {"timeout": 1}
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the launcher; the code's processes die with it
            except ProcessLookupError:
                pass
            await process.wait()
            shutil.rmtree(workdir, ignore_errors=True)
        return self.answer(process.returncode, out, err, cut), {"exit_code": process.returncode}

    def answer(self, returncode: int, out: bytes, err: bytes, cut: bool) -> str:
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace").strip()
        if cut:
            return f"{stdout}\nerror: output longer than {self.settings['max_output_chars']} characters (cut, killed)"
        if returncode == REFUSED and stderr.startswith("sandbox refused"):
            return f"error: the python tool cannot isolate its sandbox here, so it does not run ({stderr})"
        if returncode > 128:
            name = signal.Signals(returncode - 128).name
            reason = {"SIGXCPU": " (CPU time limit)", "SIGXFSZ": " (file size limit)"}.get(name, "")
            return f"{stdout}error: killed by {name}{reason}"
        if returncode != 0:
            return f"{stdout}error: exit code {returncode}: {stderr.splitlines()[-1] if stderr else ''}"
        return stdout
