"""The step checkpoint folder of a run: ``<root>/global_step_N/`` + the ``latest`` pointer.

A step checkpoint holds the workers' folders (``actor/``, ``critic/``: HF safetensors weights, optimizer,
scheduler, RNG) and ``trainer_state.json`` (global step, data position, KL controller, tracking run id, ...).
Writing is crash-safe: everything goes to ``.tmp_global_step_N/``, which is renamed when complete; then the
pointer file ``latest_checkpointed_iteration.txt`` is replaced atomically. A crash at any point leaves the
previous checkpoint and pointer intact. A pointer to a missing or incomplete folder is an error, never a
silent fresh start.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

POINTER_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint or the pointer to it is missing or incomplete."""


class StepCheckpoints:
    def __init__(self, root: str | Path, max_to_keep: int | None = None):
        self.root = Path(root)
        self.max_to_keep = max_to_keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def staging_dir(self, step: int) -> Path:
        """An empty temporary folder for step ``step``'s checkpoint; workers write their parts below it."""
        staging = self.root / f".tmp_global_step_{step}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        return staging

    def commit(self, step: int, trainer_state: dict[str, Any]) -> Path:
        """Finish step ``step``'s checkpoint: state file, rename into place, pointer, pruning. Returns its folder."""
        staging = self.root / f".tmp_global_step_{step}"
        if not staging.is_dir():
            raise CheckpointError(f"no staged checkpoint for step {step} in {self.root}")
        (staging / STATE_FILE).write_text(json.dumps({**trainer_state, "global_step": step}, indent=1))
        final = self.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        pointer_tmp = self.root / f".{POINTER_FILE}.tmp"
        pointer_tmp.write_text(str(step))
        os.replace(pointer_tmp, self.root / POINTER_FILE)
        self._prune(step)
        return final

    def latest_step(self) -> int | None:
        """The step the pointer names, checked to be complete; None when there is no pointer."""
        pointer = self.root / POINTER_FILE
        if not pointer.exists():
            return None
        text = pointer.read_text().strip()
        if not text.isdigit():
            raise CheckpointError(f"{pointer} holds {text!r}, not a step number")
        step = int(text)
        self.check_complete(self.step_dir(step))
        return step

    @staticmethod
    def check_complete(folder: Path) -> None:
        if not folder.is_dir():
            raise CheckpointError(f"the latest checkpoint {folder} does not exist; restore it, point trainer.resume_from_path at "
                                  f"another global_step_N folder, or set trainer.resume_mode=disable to start over")
        if not (folder / STATE_FILE).is_file():
            raise CheckpointError(f"checkpoint {folder} is incomplete (no {STATE_FILE}); it was not written by a finished save")

    def trainer_state(self, folder: Path) -> dict[str, Any]:
        self.check_complete(folder)
        return json.loads((folder / STATE_FILE).read_text())

    def _prune(self, newest: int) -> None:
        if not self.max_to_keep or self.max_to_keep <= 0:
            return
        steps = sorted(int(p.name.removeprefix("global_step_")) for p in self.root.glob("global_step_*") if p.name.removeprefix("global_step_").isdigit())
        for step in steps[: -self.max_to_keep]:
            if step != newest:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)
