"""A folder on remote storage, for step checkpoints at a URL (``s3://bucket/prefix``, ``gs://...``: any fsspec
filesystem whose package is installed; s3fs comes with the ``team`` extra).

Checkpoints at a URL are written and read through a local working copy (rl_core/step_checkpoint.py): the workers
write a step's parts to local disk as always, and the committed step folder is then uploaded file by file, its
``trainer_state.json`` last (a step folder without it is incomplete), and the pointer object after it: an object
store has no atomic rename, but a single object's write is atomic, so a crash mid-upload leaves the previous pointer
and its checkpoint intact. The manifest's SHA-256 sums check what is read back.
"""

from __future__ import annotations

import shutil
from pathlib import Path

LOCAL_SCHEMES = ("", "file", "local")


def is_remote(location: str) -> bool:
    """Whether ``location`` is a URL of remote storage (``s3://...``), not a local path (``file://`` is local)."""
    scheme, separator, _ = str(location).partition("://")
    return bool(separator) and scheme not in LOCAL_SCHEMES


def local_copy_folder(url: str, cache_dir: str | Path) -> Path:
    """Where the local working copy of the remote folder ``url`` lives: ``<cache_dir>/<scheme>/<bucket>/<prefix>``."""
    scheme, _, rest = url.partition("://")
    return Path(cache_dir).expanduser().absolute() / scheme / rest.strip("/")


class RemoteStorageError(RuntimeError):
    """The remote folder cannot be reached (no package for its scheme, no credentials, no such bucket, ...)."""


class RemoteFolder:
    """Files under ``url``, by names relative to it (``global_step_3/actor/model.safetensors``)."""

    def __init__(self, url: str):
        import fsspec

        self.url = url.rstrip("/")
        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as error:
            raise RemoteStorageError(f"{self.url}: {error} (S3 comes with pip install 'ppoflow[team]')") from None

    def _key(self, name: str) -> str:
        return f"{self.path}/{name}" if name else self.path

    def _call(self, what: str, call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as error:
            raise RemoteStorageError(
                f"{self.url}: {what} failed ({type(error).__name__}: {error}); check the storage's endpoint and "
                "credentials (for S3: AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; `ppoflow up "
                "--backend postgres` prints its store's) and that the bucket exists"
            ) from None

    def check(self) -> None:
        """A RemoteStorageError naming the cause when the folder's storage cannot be listed."""
        self.fs.invalidate_cache()
        bucket = self.path.lstrip("/").split("/", 1)[0]
        try:
            self._call("listing", self.fs.ls, bucket)
        except FileNotFoundError:
            raise RemoteStorageError(
                f"{self.url}: there is no bucket {bucket!r}; create it, or choose another URL"
            ) from None

    def read_text(self, name: str) -> str | None:
        """The file's text, or None when it does not exist."""
        try:
            return self._call(f"reading {name}", self.fs.cat_file, self._key(name)).decode()
        except FileNotFoundError:
            return None

    def write_text(self, name: str, text: str) -> None:
        self._call(f"writing {name}", self.fs.pipe_file, self._key(name), text.encode())

    def folders(self) -> list[str]:
        """The names of the folders directly under the remote folder."""
        self.fs.invalidate_cache()
        try:
            entries = self._call("listing", self.fs.ls, self.path, detail=True)
        except FileNotFoundError:
            return []
        return [entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries if entry["type"] == "directory"]

    def upload(self, local: Path, name: str, last: tuple[str, ...] = ()) -> None:
        """Every file under the local folder ``local`` to the remote folder ``name``, the files named in ``last`` (paths
        relative to ``local``) after all others, in that order."""
        files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        ordered = [f for f in files if f not in last] + [f for f in last if f in files]
        for relative in ordered:
            self._call(
                f"uploading {name}/{relative}", self.fs.put_file, str(local / relative), self._key(f"{name}/{relative}")
            )

    def download(self, name: str, local: Path) -> None:
        """The remote folder ``name`` into the local folder ``local`` (replaced whole: written beside, then renamed)."""
        staging = local.with_name(f".download_{local.name}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        prefix = self._key(name)
        for remote in self._call(f"listing {name}", self.fs.find, prefix):
            target = staging / remote.removeprefix(prefix).lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            self._call(f"downloading {remote}", self.fs.get_file, remote, str(target))
        shutil.rmtree(local, ignore_errors=True)
        staging.rename(local)

    def remove(self, name: str) -> None:
        try:
            self._call(f"deleting {name}", self.fs.rm, self._key(name), recursive=True)
        except FileNotFoundError:
            pass
