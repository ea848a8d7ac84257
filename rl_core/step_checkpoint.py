"""The step checkpoint folder of a run: ``<root>/global_step_N/`` + the ``latest`` pointer.

A step checkpoint holds the workers' folders (``actor/``, ``critic/``: HF safetensors weights, optimizer,
scheduler, RNG) and ``trainer_state.json`` (global step, data position, KL controller, tracking run id, ...).
Writing is crash-safe: everything goes to ``.tmp_global_step_N/``, which is renamed when complete (a step written
again sets its old folder aside first, and a crash in between puts it back); then the pointer file
``latest_checkpointed_iteration.txt`` is replaced atomically. A crash at any point leaves the previous checkpoint and
pointer intact. A pointer to a missing or incomplete folder is an error, never a
silent fresh start.

Each checkpoint verifies itself: ``manifest.json`` (every file's size and SHA-256) is written last, and
:meth:`StepCheckpoints.latest_intact` skips a damaged latest checkpoint for the newest intact one. One run at a
time uses a folder: :meth:`StepCheckpoints.lock` holds an exclusive lock (released by the kernel when the
process dies, even by SIGKILL) and names its holder to the second run; a holder still named in the lock file
when the next run takes it died without letting go (killed).

A folder at a URL (``s3://bucket/prefix``: rl_core/remote_folder.py) is worked on in a local copy
(``trainer.checkpoint_cache_dir``): read back once, at the first look at its steps (what is remote replaces what the
copy holds), and each committed step uploaded before the remote pointer names it. The lock is the local copy's: it
keeps out a second run on this machine, not on another.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any, TextIO

from rl_core.remote_folder import RemoteFolder, is_remote, local_copy_folder

POINTER_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".lock"
# in a lock's holder: the pid of the command that took the folder for the very run it prepares
PRESTART_MARK = "prestarted_by"


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Every file under ``folder`` with its size and SHA-256, in ``manifest.json`` (written last)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    manifest = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": file_digest(p)} for p in files}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))


def damage(folder: Path) -> str | None:
    """What is wrong with the checkpoint ``folder`` (a missing, truncated or changed file), or None when intact.
    A checkpoint written before manifests existed is taken as intact when its state file is there."""
    if not (folder / STATE_FILE).is_file():
        return f"no {STATE_FILE}"
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        return None
    for name, expected in json.loads(manifest_path.read_text()).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{name} has {path.stat().st_size} bytes, not {expected['size']}"
        if file_digest(path) != expected["sha256"]:
            return f"{name} does not match its checksum"
    return None


class CheckpointError(RuntimeError):
    """A checkpoint or the pointer to it is missing, incomplete or damaged, or another run uses the folder."""


def _holder(handle: TextIO) -> dict[str, Any]:
    handle.seek(0)
    text = handle.read().strip()
    return json.loads(text) if text.startswith("{") else {}


class FolderLock:
    """A checkpoint folder held by this process. The lock file names the holder while it runs and is emptied on
    release, so a holder found there by the next run (``previous``) is one that died without releasing (SIGKILL)."""

    def __init__(self, handle: TextIO, previous: dict[str, Any] | None):
        self.handle, self.previous, self.holder = handle, previous, {}

    def describe(self, **holder: Any) -> None:
        """Add to what the lock file says about its holder (e.g. the MLflow run, once it exists)."""
        self.holder.update(holder)
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(json.dumps(self.holder, default=str))
        self.handle.flush()

    def release(self) -> None:
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.close()


def run_checkpoints(trainer: Any) -> StepCheckpoints:
    """The step checkpoints of a run, from its config's ``trainer`` section."""
    return StepCheckpoints(trainer.default_local_dir, trainer.max_ckpt_to_keep, trainer.checkpoint_cache_dir)


class StepCheckpoints:
    def __init__(self, location: str | Path, max_to_keep: int | None = None, cache_dir: str | Path | None = None):
        """``location``: a local folder, or a URL (then ``cache_dir`` holds its local copy)."""
        self.location = str(location)
        self.is_remote = is_remote(self.location)
        if self.is_remote and cache_dir is None:
            raise ValueError(f"{self.location}: a checkpoint folder at a URL needs a cache_dir for its local copy")
        self.root = local_copy_folder(self.location, cache_dir) if self.is_remote else Path(location)
        self.max_to_keep = max_to_keep
        self._read_back = not self.is_remote

    @cached_property
    def remote(self) -> RemoteFolder:
        return RemoteFolder(self.location)

    def address(self, step: int) -> str:
        """Where step ``step``'s checkpoint is, as a user names it: its URL, or its local folder's absolute path."""
        if self.is_remote:
            return f"{self.location.rstrip('/')}/{self.step_dir(step).name}"
        return str(self.step_dir(step).resolve())

    def local_folder(self, path: str) -> Path:
        """The local folder of a checkpoint named by a path, or by a URL inside this folder (its local copy)."""
        if not is_remote(path):
            return Path(path).expanduser()
        relative = path.rstrip("/").removeprefix(self.location.rstrip("/") + "/")
        if not self.is_remote or relative == path.rstrip("/"):
            raise CheckpointError(
                f"{path}: a checkpoint at a URL is resumed from inside the run's own trainer.default_local_dir "
                f"({self.location}); point that at its folder"
            )
        self._read_back_remote()
        return self.root / relative

    def _read_back_remote(self) -> None:
        """A folder at a URL: its step folders (those whose manifest differs from the copy's) and pointer into the local
        copy, whose other steps are deleted; once per object (its own commits keep both the same after)."""
        if self._read_back:
            return
        self._read_back = True
        self.root.mkdir(parents=True, exist_ok=True)
        remote_steps = {name for name in self.remote.folders() if name.startswith("global_step_")}
        for name in sorted(remote_steps):
            local = self.root / name
            local_manifest = (local / MANIFEST_FILE).read_text() if (local / MANIFEST_FILE).is_file() else None
            if local_manifest is None or self.remote.read_text(f"{name}/{MANIFEST_FILE}") != local_manifest:
                self.remote.download(name, local)
        for local in self.root.glob("global_step_*"):
            if local.name not in remote_steps:
                shutil.rmtree(local)
        pointer = self.remote.read_text(POINTER_FILE)
        if pointer is None:
            (self.root / POINTER_FILE).unlink(missing_ok=True)
        else:
            (self.root / POINTER_FILE).write_text(pointer)

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    def _aside(self, step: int) -> Path:
        """Where a step's previous folder waits while the same step is written again."""
        return self.root / f".replaced_global_step_{step}"

    def _restore_set_aside(self) -> None:
        """A crash between setting a step's old folder aside and renaming the new one into place: the old one goes
        back."""
        for aside in self.root.glob(".replaced_global_step_*"):
            final = self.root / aside.name.removeprefix(".replaced_")
            if final.exists():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(aside, final)

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
        self._read_back_remote()
        (staging / STATE_FILE).write_text(json.dumps({**trainer_state, "global_step": step}, indent=1))
        write_manifest(staging)
        final = self.step_dir(step)
        replaced = self._aside(step)
        # a step written again (a resumed run): the old folder stays whole until the new one is in place
        if final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(staging, final)
        shutil.rmtree(replaced, ignore_errors=True)
        pointer_tmp = self.root / f".{POINTER_FILE}.tmp"
        pointer_tmp.write_text(str(step))
        os.replace(pointer_tmp, self.root / POINTER_FILE)
        if self.is_remote:  # the step whole (its state file last), then the pointer that names it
            self.remote.upload(final, final.name, last=(MANIFEST_FILE, STATE_FILE))
            self.remote.write_text(POINTER_FILE, str(step))
        for pruned in self._prune(step):
            if self.is_remote:
                self.remote.remove(self.step_dir(pruned).name)
        return final

    def pointer_step(self) -> int | None:
        """The step the pointer names (None when there is no pointer)."""
        self._read_back_remote()
        self._restore_set_aside()
        pointer = self.root / POINTER_FILE
        if not pointer.exists():
            return None
        text = pointer.read_text().strip()
        if not text.isdigit():
            raise CheckpointError(f"{pointer} holds {text!r}, not a step number")
        return int(text)

    def latest_step(self) -> int | None:
        """The step the pointer names, checked to be complete; None when there is no pointer."""
        step = self.pointer_step()
        if step is not None:
            self.check_complete(self.step_dir(step))
        return step

    def latest_intact(self) -> tuple[int | None, list[tuple[int, str]]]:
        """(the newest intact step, [(step, what is wrong)] of the damaged ones skipped on the way). The pointer's step
        first; when it is damaged, the other ``global_step_N`` folders, newest first. (None, ...) when there is no
        pointer; a CheckpointError when nothing intact is left."""
        step = self.pointer_step()
        if step is None:
            return None, []
        if not self.step_dir(step).is_dir():  # a dangling pointer is an error, never a silent step back
            self.check_complete(self.step_dir(step))
        others = sorted(self.steps(), reverse=True)
        skipped = []
        for candidate in [step] + [s for s in others if s < step]:
            problem = damage(self.step_dir(candidate))
            if problem is None:
                return candidate, skipped
            skipped.append((candidate, problem))
        raise CheckpointError(
            f"every checkpoint in {self.root} is damaged ({'; '.join(f'global_step_{s}: {p}' for s, p in skipped)}); "
            "restore one, or set trainer.resume_mode=disable to start over"
        )

    def check_intact(self, folder: Path) -> None:
        """A CheckpointError naming the damage when ``folder`` is not a complete, intact checkpoint."""
        self.check_complete(folder)
        problem = damage(folder)
        if problem:
            try:
                intact, _ = self.latest_intact()
            except CheckpointError:
                intact = None
            hint = f" (global_step_{intact} is intact)" if intact is not None else ""
            raise CheckpointError(
                f"checkpoint {folder} is damaged: {problem}; point trainer.resume_from_path at an intact global_step_N "
                f"folder{hint}"
            )

    def lock(self, holder: dict[str, Any]) -> FolderLock:
        """Take the folder for this process (until :meth:`FolderLock.release`, or the process ends); a CheckpointError
        naming the run that holds it otherwise. ``holder`` (run, pid, ...) is what a second run is told."""
        self.root.mkdir(parents=True, exist_ok=True)
        handle = open(self.root / LOCK_FILE, "a+")  # noqa: SIM115 (held until FolderLock.release)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = _holder(handle)
            handle.close()
            raise CheckpointError(self.in_use_message(other)) from None
        folder_lock = FolderLock(handle, previous=_holder(handle) or None)
        folder_lock.describe(pid=os.getpid(), started=time.strftime("%Y-%m-%d %H:%M:%S"), **holder)
        return folder_lock

    def holder(self) -> dict[str, Any] | None:
        """What the run holding this folder says of itself (run, pid, start), or None when no process holds it. Looks
        without taking the folder and without creating anything."""
        try:
            handle = open(self.root / LOCK_FILE)  # noqa: SIM115 (the with below, past the OSError)
        except OSError:
            return None
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _holder(handle)
            return None

    def in_use_message(self, holder: dict[str, Any]) -> str:
        return (
            f"folder {self.root} is in use by run {holder.get('run', '?')} (pid {holder.get('pid', '?')}, started "
            f"{holder.get('started', '?')}): wait for it to end, or give this run another trainer.experiment_name or "
            "trainer.default_local_dir"
        )

    @contextmanager
    def locked(self, holder: dict[str, Any]) -> Iterator[FolderLock]:
        """:meth:`lock` for the duration of a ``with`` block."""
        folder_lock = self.lock(holder)
        try:
            yield folder_lock
        finally:
            folder_lock.release()

    @staticmethod
    def check_complete(folder: Path) -> None:
        if not folder.is_dir():
            raise CheckpointError(
                f"the latest checkpoint {folder} does not exist; restore it, point trainer.resume_from_path at another "
                "global_step_N folder, or set trainer.resume_mode=disable to start over"
            )
        if not (folder / STATE_FILE).is_file():
            raise CheckpointError(
                f"checkpoint {folder} is incomplete (no {STATE_FILE}); it was not written by a finished save"
            )

    def trainer_state(self, folder: Path) -> dict[str, Any]:
        self.check_complete(folder)
        return json.loads((folder / STATE_FILE).read_text())

    def steps(self) -> list[int]:
        """The step numbers of the ``global_step_N`` folders, in order."""
        self._read_back_remote()
        names = (p.name.removeprefix("global_step_") for p in self.root.glob("global_step_*"))
        return sorted(int(name) for name in names if name.isdigit())

    def run_of(self, step: int) -> str | None:
        """The MLflow run that wrote step ``step``'s checkpoint (None when its state file is unreadable)."""
        try:
            return json.loads((self.step_dir(step) / STATE_FILE).read_text()).get("mlflow_run_id")
        except (OSError, ValueError):
            return None

    def _prune(self, newest: int) -> list[int]:
        """Keep the ``max_to_keep`` newest checkpoints of the run that wrote ``newest``; another run's in the same
        folder (a run started with resume_mode=disable) are not this run's to delete. Returns the steps deleted."""
        if not self.max_to_keep or self.max_to_keep <= 0:
            return []
        run = self.run_of(newest)
        own = [step for step in self.steps() if self.run_of(step) == run]
        pruned = [step for step in own[: -self.max_to_keep] if step != newest]
        for step in pruned:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)
        return pruned
