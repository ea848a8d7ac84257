"""Step checkpoints at a URL (rl_core/remote_folder.py, rl_core/step_checkpoint.py), on fsspec's in-memory
filesystem (``memory://``: a real fsspec filesystem, held in this process): what is uploaded, in which order, what a
fresh machine reads back, and what a damaged or half-written remote step does. The same code against a real S3 API
(moto's server) runs in tests/infra/test_team_stack.py."""

import json
import uuid

import fsspec
import pytest

from rl_core.remote_folder import RemoteFolder, RemoteStorageError, is_remote
from rl_core.step_checkpoint import MANIFEST_FILE, POINTER_FILE, STATE_FILE, CheckpointError, StepCheckpoints
from tests.chaos.test_checkpoint_and_secrets_units import make_checkpoint


@pytest.fixture()
def url():
    """A folder of its own in the in-memory filesystem, deleted after the test."""
    folder = f"memory://bucket-{uuid.uuid4().hex[:8]}/runs/demo"
    yield folder
    fs = fsspec.filesystem("memory")
    fs.rm(folder.removeprefix("memory://").split("/")[0], recursive=True)


def remote_files(url: str) -> dict[str, bytes]:
    fs, path = fsspec.core.url_to_fs(url)
    return {name.removeprefix(path).lstrip("/"): fs.cat_file(name) for name in fs.find(path)}


def local_files(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "location, remote",
    [("s3://b/p", True), ("gs://b", True), ("memory://x/y", True), ("file:///tmp/x", False), ("/tmp/x", False)],
)
def test_which_locations_are_remote(location, remote):
    assert is_remote(location) is remote


def test_committed_steps_are_uploaded_whole_then_named_by_the_pointer_and_pruned_there_too(url, tmp_path, monkeypatch):
    checkpoints = StepCheckpoints(url, max_to_keep=2, cache_dir=tmp_path / "cache")
    assert checkpoints.root == tmp_path / "cache" / "memory" / url.removeprefix("memory://")
    uploads = []
    real_put = RemoteFolder.upload

    def record(self, local, name, last=()):
        uploads.append((name, sorted(p.name for p in local.rglob("*") if p.is_file()), last))
        real_put(self, local, name, last)

    monkeypatch.setattr(RemoteFolder, "upload", record)
    for step in (1, 2, 3):
        make_checkpoint(checkpoints, step)
    assert [name for name, _, _ in uploads] == ["global_step_1", "global_step_2", "global_step_3"]
    assert uploads[0][2] == (MANIFEST_FILE, STATE_FILE)  # the state file last: without it a step is incomplete
    files = remote_files(url)
    assert files[POINTER_FILE] == b"3"
    assert {name.split("/")[0] for name in files if name != POINTER_FILE} == {"global_step_2", "global_step_3"}
    for step in (2, 3):  # byte for byte the local copy's
        local = local_files(checkpoints.step_dir(step))
        assert {f"global_step_{step}/{name}": data for name, data in local.items()} == {
            name: data for name, data in files.items() if name.startswith(f"global_step_{step}/")
        }
    assert checkpoints.address(3) == f"{url}/global_step_3"


def test_a_fresh_machine_reads_the_folder_back_and_the_remote_wins_over_a_stale_copy(url, tmp_path):
    writer = StepCheckpoints(url, max_to_keep=2, cache_dir=tmp_path / "writer")
    for step in (1, 2, 3):
        make_checkpoint(writer, step, run="run-a")

    reader = StepCheckpoints(url, max_to_keep=2, cache_dir=tmp_path / "reader")
    assert not reader.root.exists()  # nothing is read before a look at the steps
    assert reader.latest_intact() == (3, [])
    assert reader.steps() == [2, 3]
    assert reader.trainer_state(reader.step_dir(3))["mlflow_run_id"] == "run-a"
    assert local_files(reader.step_dir(3)) == local_files(writer.step_dir(3))

    # a copy left from before (another run's step 1, a different step 3): the remote replaces it
    stale = StepCheckpoints(url, max_to_keep=2, cache_dir=tmp_path / "stale")
    stale.root.mkdir(parents=True)
    for step, run in ((1, "old"), (3, "old")):
        other = StepCheckpoints(tmp_path / "elsewhere" / run / str(step))
        make_checkpoint(other, step, run=run)
        other.step_dir(step).rename(stale.root / f"global_step_{step}")
    (stale.root / POINTER_FILE).write_text("1")
    assert stale.pointer_step() == 3
    assert stale.steps() == [2, 3]
    assert stale.run_of(3) == "run-a"


def test_a_damaged_remote_step_is_skipped_and_a_half_uploaded_one_never_named(url, tmp_path, monkeypatch):
    writer = StepCheckpoints(url, max_to_keep=3, cache_dir=tmp_path / "writer")
    for step in (1, 2):
        make_checkpoint(writer, step)
    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{path}/global_step_2/actor/model.safetensors", bytes(1024))  # changed bytes, same size
    assert StepCheckpoints(url, cache_dir=tmp_path / "reader-1").latest_intact() == (
        1,
        [(2, "actor/model.safetensors does not match its checksum")],
    )

    # the upload of step 3 dies before its state file: the pointer still names step 2, step 3 counts as incomplete
    real_put = type(fs).put_file

    def die_at_the_state_file(self, local, remote, *args, **kwargs):
        if remote.endswith(STATE_FILE):
            raise ConnectionError("the network went away")
        return real_put(self, local, remote, *args, **kwargs)

    monkeypatch.setattr(type(fs), "put_file", die_at_the_state_file)
    with pytest.raises(RemoteStorageError, match="uploading global_step_3/trainer_state.json failed .*network went"):
        make_checkpoint(writer, 3)
    monkeypatch.undo()
    assert fs.cat_file(f"{path}/{POINTER_FILE}") == b"2"
    assert fs.exists(f"{path}/global_step_3/{MANIFEST_FILE}") and not fs.exists(f"{path}/global_step_3/{STATE_FILE}")
    reader = StepCheckpoints(url, cache_dir=tmp_path / "reader-2")
    assert reader.pointer_step() == 2
    assert json.loads((reader.step_dir(1) / STATE_FILE).read_text())["global_step"] == 1


def test_resume_from_path_at_a_url_is_the_local_copy_of_a_step_of_the_runs_own_folder(url, tmp_path):
    writer = StepCheckpoints(url, cache_dir=tmp_path / "writer")
    make_checkpoint(writer, 1)
    reader = StepCheckpoints(url, cache_dir=tmp_path / "reader")
    folder = reader.local_folder(f"{url}/global_step_1/")
    assert folder == reader.step_dir(1) and (folder / STATE_FILE).is_file()
    with pytest.raises(CheckpointError, match="inside the run's own trainer.default_local_dir"):
        reader.local_folder("memory://another/folder/global_step_1")
    assert StepCheckpoints(tmp_path / "local").local_folder(str(tmp_path / "x")) == tmp_path / "x"


def test_unreachable_storage_is_named_with_its_fix(tmp_path):
    with pytest.raises(RemoteStorageError, match="nosuch://bucket/x: .*pip install 'ppoflow\\[team\\]'"):
        RemoteFolder("nosuch://bucket/x")
    with pytest.raises(RemoteStorageError, match="there is no bucket 'no-bucket-here'"):
        RemoteFolder("memory://no-bucket-here/runs").check()
    with pytest.raises(ValueError, match="needs a cache_dir"):
        StepCheckpoints("memory://b/x")
