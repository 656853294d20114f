"""Hostile and careless input to checkpoints (issue 17), in one process on real checkpoints of a tiny model.

A received checkpoint runs no code (crafted pickles in DCP's ``.metadata`` and in its non-tensor values, a model
factory named in ``plan.json``); a checkpoint root is Tessera's own (only ``step-NNNNNNNN`` folders are managed,
by step number; ``keep_last`` must keep the new one; one writer at a time); a failed save (a full disk) raises
``CheckpointError`` and leaves nothing behind; a corrupt newest checkpoint is moved aside so the step can be
saved again. The command-line and planning inputs are in ``test_hostile_input_cli.py`` and
``test_hostile_input_plans.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tessera
from tessera.errors import CheckpointError, ConfigError
from tessera.models import build_model
from tessera.runtime.checkpoint import export_model_state_dict
from tessera.runtime.checkpoint_files import (
    DATA_FILE, LOCK_FILE, MANIFEST, MARKER, PLAN_FILE, RNG_FOLDER, RootLock, check_checkpoint, complete_checkpoints,
    read_manifest,
)
from tessera.runtime.checkpoint_reader import read_state

MODEL, CLUSTER, BATCH, SEQ = "gpt-tiny", "cpu:ranks=1", 2, 16


@pytest.fixture(scope="module")
def pm():
    torch.manual_seed(0)
    return tessera.auto_parallelize(MODEL, CLUSTER, global_batch=BATCH, seq_len=SEQ)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def save_at(pm, root: Path, step: int, **kwargs) -> Path:
    pm.step = step
    return pm.save(root, **kwargs).wait()


def reseal(folder: Path) -> None:
    """Recompute the manifest and marker after tampering, as an attacker who sends a checkpoint would."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for name, record in manifest["files"].items():
        data = (folder / name).read_bytes()
        record.update(size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    text = json.dumps(manifest, indent=2)
    (folder / MANIFEST).write_text(text)
    (folder / MARKER).write_text(hashlib.sha256(text.encode()).hexdigest())


class RunsCode:
    """Unpickling this writes a file: proof that code ran."""

    def __init__(self, proof: Path) -> None:
        self.proof = proof

    def __reduce__(self):
        return exec, (f"open({str(self.proof)!r}, 'w').write('ran')",)


# ------------------------------------------------------------------------------------------------ no code runs


def test_a_crafted_metadata_pickle_is_refused_without_running(pm, tmp_path):
    folder = save_at(pm, tmp_path / "ckpt", 1)
    proof = tmp_path / "proof"
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(proof)))
    reseal(folder)
    assert check_checkpoint(folder, verify=True, group=None) is None  # the manifest does not help
    with pytest.raises(CheckpointError, match=r"\.metadata names builtins\.exec.*refusing"):
        pm.load(folder)
    with pytest.raises(CheckpointError, match=r"builtins\.exec"):
        export_model_state_dict(folder, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"builtins\.exec"):  # refused before a relaunch line is printed
        tessera.resume(folder, CLUSTER)
    assert not proof.exists()
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.parametrize("name", [DATA_FILE, f"{RNG_FOLDER}/rank-00000.pt"])
def test_a_crafted_data_or_rng_file_is_refused_before_anything_is_loaded(pm, tmp_path, name):
    """The data position and the RNG states are read with ``weights_only=True``; a crafted file is one line naming
    what it names (not torch's advice to load it unsafely), and the model keeps its weights."""
    folder = save_at(pm, tmp_path / "ckpt", 1, data_state={"epoch": 1})
    proof = tmp_path / "proof"
    (folder / name).write_bytes(pickle.dumps(RunsCode(proof), protocol=2))  # torch's reader names its GLOBAL
    reseal(folder)
    before = {fqn: p.detach().clone() for fqn, p in pm.named_parameters()}
    pm.train_step(batch())  # the weights move away from the checkpoint's
    moved = {fqn: p.detach().clone() for fqn, p in pm.named_parameters()}
    with pytest.raises(CheckpointError, match=rf"{name.split('/')[-1]} is not plain data \(it names (builtins\.)?exec\)") \
            as raised:
        pm.load(folder)
    assert "weights_only" not in str(raised.value) and not proof.exists()
    if name == DATA_FILE:  # read first: nothing was loaded
        assert all(torch.equal(p, moved[fqn]) for fqn, p in pm.named_parameters())
    assert any(not torch.equal(moved[fqn], before[fqn]) for fqn in before)
    pm.step = 0


def test_a_crafted_non_tensor_value_is_refused_without_running(tmp_path):
    proof = tmp_path / "proof"
    dcp.save({"lr": RunsCode(proof)}, checkpoint_id=tmp_path / "c", no_dist=True)  # pickled, not run, at save
    assert not proof.exists()
    with pytest.raises(CheckpointError, match="'lr' is not plain data \\(it names .*exec\\)"):
        read_state({"lr": None}, tmp_path / "c", None)
    assert not proof.exists()


def test_the_real_metadata_and_plain_values_still_load(tmp_path):
    dcp.save({"lr": 0.5, "betas": (0.9, 0.95), "w": torch.arange(4.0)}, checkpoint_id=tmp_path, no_dist=True)
    state = {"lr": None, "betas": None, "w": torch.zeros(4)}
    read_state(state, tmp_path, None)
    assert state["lr"] == 0.5 and state["betas"] == (0.9, 0.95) and state["w"].tolist() == [0, 1, 2, 3]


def test_metadata_pointing_outside_the_folder_is_refused(pm, tmp_path):
    folder = save_at(pm, tmp_path / "ckpt", 1)
    with (folder / ".metadata").open("rb") as handle:
        metadata = pickle.load(handle)  # our own file: safe to unpickle here
    for info in metadata.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(folder)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        pm.load(folder)


def test_manifest_entries_outside_the_folder_and_links_are_corrupt(pm, tmp_path):
    folder = save_at(pm, tmp_path / "ckpt", 1)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"]["../../outside"] = {"size_bytes": 1, "sha256": "0" * 64}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    (folder / MARKER).write_text(hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest())
    assert "unreadable" in check_checkpoint(folder, verify=True, group=None)
    other = save_at(pm, tmp_path / "other", 1)
    (other / "data.pt").unlink()
    (other / "data.pt").symlink_to("/etc/hostname")
    assert "symbolic link" in check_checkpoint(other, verify=False, group=None)


def test_a_partial_save_folder_linked_elsewhere_is_refused_and_its_target_kept(pm, tmp_path):
    # A received root can hold the next step's partial folder as a link to a folder of the user's: the save emptied
    # nothing (rmtree refuses a link) and wrote the checkpoint through it, over the user's plan.json.
    root, users = tmp_path / "ckpt", tmp_path / "project"
    save_at(pm, root, 1)
    users.mkdir()
    (users / "plan.json").write_text("mine")
    (root / ".step-00000002.partial").symlink_to(users)
    with pytest.raises(CheckpointError, match="step-00000002.partial is a link, not a save Tessera left unfinished"):
        save_at(pm, root, 2)
    assert [p.name for p in users.iterdir()] == ["plan.json"] and (users / "plan.json").read_text() == "mine"


def test_files_a_manifest_leaves_out_and_linked_folders_are_corrupt(pm, tmp_path):
    # A crafted manifest could leave out plan.json (then a link to /dev/zero: read forever) or .metadata (a FIFO:
    # the open blocks); a folder on the way to a listed file could be a link out of the checkpoint.
    folder = save_at(pm, tmp_path / "ckpt", 1)
    (folder / "plan.json").unlink()
    (folder / "plan.json").symlink_to("/dev/zero")
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["files"]["plan.json"]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    reseal(folder)
    assert "plan.json is a link or special file its manifest.json does not list" in check_checkpoint(
        folder, verify=False, group=None)
    (folder / "plan.json").unlink()
    (folder / "plan.json").write_text("{}")  # a plain plan.json the manifest leaves out
    assert "plan.json is not in its manifest.json" in check_checkpoint(folder, verify=False, group=None)
    other = save_at(pm, tmp_path / "other", 1)
    (other / ".DS_Store").write_bytes(b"\0")  # a stray no load reads: not a reason to fall back to an older step
    assert check_checkpoint(other, verify=True, group=None) is None
    shutil.move(other / "rng", tmp_path / "elsewhere")
    (other / "rng").symlink_to(tmp_path / "elsewhere")
    assert "a folder on the way to file rng/rank-00000.pt is a symbolic link" in check_checkpoint(
        other, verify=True, group=None)


def test_a_device_or_fifo_where_a_plan_or_metadata_is_read_is_refused_at_once(tmp_path):
    from tessera.planner.plan import Plan
    from tessera.runtime.checkpoint_reader import load_metadata

    with pytest.raises(ConfigError, match="cannot read plan file /dev/zero: not a plain file"):
        Plan.from_json(Path("/dev/zero"))
    os.mkfifo(tmp_path / ".metadata")
    with pytest.raises(CheckpointError, match="metadata is unreadable .*not a plain file"):
        load_metadata(tmp_path)


FACTORY = """
from pathlib import Path
Path({proof!r}).write_text("ran")
from tessera.models import build_model

def make():
    return build_model("gpt-tiny", device="meta")
"""


def test_resume_runs_a_factory_named_in_the_checkpoint_only_when_trusted(pm, tmp_path, capsys):
    root, proof = tmp_path / "ckpt", tmp_path / "proof"
    folder = save_at(pm, root, 1)
    factory = tmp_path / "evil.py"
    factory.write_text(FACTORY.format(proof=str(proof)))
    plan = json.loads((folder / PLAN_FILE).read_text())
    plan["model_name"] = f"{factory}:make"
    (folder / PLAN_FILE).write_text(json.dumps(plan))
    reseal(folder)
    with pytest.raises(CheckpointError, match="names the model factory .*--trust-model-factory"):
        tessera.resume(root, CLUSTER)
    from tessera.cli import main

    assert main(["resume", str(root), "--cluster", CLUSTER]) == 2
    assert "would import and run that code" in capsys.readouterr().err
    assert not proof.exists()
    resumed = tessera.resume(root, CLUSTER, trust_model_factory=True)
    assert proof.exists() and resumed.step == 1
    assert tessera.resume(root, CLUSTER, model=MODEL).step == 1  # naming a model runs nothing from the checkpoint


MADE = """
from tessera.models import build_model

def make():
    return build_model("gpt-tiny", device="meta")
"""


def folders_with_a_factory(tmp_path: Path) -> tuple[Path, Path]:
    """A folder holding ``model.py:make`` (a space in its name, which a spec's path may hold) and another one."""
    made, elsewhere = tmp_path / "made here", tmp_path / "elsewhere"
    made.mkdir()
    elsewhere.mkdir()
    (made / "model.py").write_text(MADE)
    return made, elsewhere


def test_a_factory_plan_names_its_file_by_absolute_path_and_resumes_from_any_folder(tmp_path, monkeypatch, capsys):
    made, elsewhere = folders_with_a_factory(tmp_path)
    monkeypatch.chdir(made)
    from tessera.cli import main

    workload = ["--cluster", CLUSTER, "--global-batch", str(BATCH), "--seq-len", str(SEQ)]
    assert main(["plan", "--model", "model.py:make", *workload, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_name"] == f"{made / 'model.py'}:make"
    torch.manual_seed(0)
    trained = tessera.auto_parallelize("model.py:make", CLUSTER, global_batch=BATCH, seq_len=SEQ)
    root = tmp_path / "ckpt"
    save_at(trained, root, 1)
    monkeypatch.chdir(elsewhere)
    assert tessera.resume(root, CLUSTER, trust_model_factory=True).step == 1
    for named in (["--model", str(made / "model.py") + ":make"], ["--trust-model-factory"]):
        assert main(["resume", str(root), *workload[:2], *named]) == 0
        relaunch = capsys.readouterr().out.rsplit("torchrun", 1)[1]
        assert shlex.quote(f"{made / 'model.py'}:make") in relaunch  # the relaunch lines name it for any folder too


def test_an_older_plan_naming_its_factory_by_relative_path_resumes_from_its_folder_only(pm, tmp_path, monkeypatch,
                                                                                         capsys):
    made, elsewhere = folders_with_a_factory(tmp_path)
    root = tmp_path / "ckpt"
    folder = save_at(pm, root, 1)
    plan = json.loads((folder / PLAN_FILE).read_text())
    plan["model_name"] = "model.py:make"  # as Tessera recorded it before it recorded absolute paths
    (folder / PLAN_FILE).write_text(json.dumps(plan))
    reseal(folder)
    monkeypatch.chdir(elsewhere)
    looked = re.escape(str(elsewhere / "model.py"))
    with pytest.raises(CheckpointError, match=f"looked for {looked} .*run from the folder it is relative to"):
        tessera.resume(root, CLUSTER, trust_model_factory=True)
    from tessera.cli import main

    assert main(["resume", str(root), "--cluster", CLUSTER, "--trust-model-factory"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "/path/to/model.py:make" in err
    monkeypatch.chdir(made)
    with pytest.raises(CheckpointError, match="would import and run that code"):  # found, and still not run unasked
        tessera.resume(root, CLUSTER)
    assert tessera.resume(root, CLUSTER, trust_model_factory=True).step == 1


# ------------------------------------------------------------------------------------------------ Tessera's own folders


@pytest.mark.parametrize("keep_last", [0, -1, True, 1.5])
def test_keep_last_that_would_delete_the_new_checkpoint_is_refused(pm, tmp_path, keep_last):
    root = tmp_path / "ckpt"
    first = save_at(pm, root, 1)
    with pytest.raises(CheckpointError, match=f"keep_last={keep_last!r} would delete"):
        save_at(pm, root, 2, keep_last=keep_last)
    assert complete_checkpoints(root) == [first] and check_checkpoint(first, verify=True, group=None) is None


def test_keep_last_prunes_only_tesseras_checkpoints_by_step_number(pm, tmp_path):
    root = tmp_path / "ckpt"
    for name in ("step-old", "step-1", "step-00000000-mine"):  # the user's, with a COMPLETE file of their own
        (root / name).mkdir(parents=True)
        (root / name / MARKER).write_text("mine")
    forged = root / "step-00000005"  # Tessera's name, but not a checkpoint Tessera wrote
    forged.mkdir()
    (forged / MARKER).write_text("mine")
    save_at(pm, root, 99_999_999)
    save_at(pm, root, 100_000_000)  # nine digits: newer by number, older by string
    save_at(pm, root, 100_000_001, keep_last=2)
    assert [p.name for p in complete_checkpoints(root)][:2] == ["step-100000001", "step-100000000"]
    assert not (root / "step-99999999").exists()
    assert all((root / name / MARKER).read_text() == "mine" for name in ("step-old", "step-1", "step-00000000-mine",
                                                                          "step-00000005"))
    assert pm.load(root).step == 100_000_001


def test_one_writer_per_root(pm, tmp_path):
    root = tmp_path / "ckpt"
    held = RootLock.acquire(root, None)  # another save in flight (another job or ParallelModel)
    try:
        with pytest.raises(CheckpointError, match=f"another save is writing into {root}"):
            save_at(pm, root, 1)
        assert not complete_checkpoints(root) and sorted(p.name for p in root.iterdir()) == [LOCK_FILE]
    finally:
        held.release()
    assert save_at(pm, root, 1).name == "step-00000001"
    pm.step = 2
    pending = pm.save(root, async_save=True)  # the lock is held until the background commit is done...
    pm.step = 99  # training moves on while the save is written
    assert pending.wait().name == "step-00000002" and read_manifest(pending.path).step == 2
    assert save_at(pm, root, 3).name == "step-00000003"  # ...and released after it


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_lock_file_linked_to_a_users_file_is_refused_and_the_file_kept(pm, tmp_path, link):
    # A received checkpoint folder can hold the lock's name as a link to ~/.bashrc; the save wrote its pid into it.
    precious = tmp_path / "bashrc"
    precious.write_text("PRECIOUS\n")
    root = tmp_path / "ckpt"
    root.mkdir()
    (os.symlink if link == "symbolic" else os.link)(precious, root / LOCK_FILE)
    with pytest.raises(CheckpointError, match=f"{LOCK_FILE} is (a symbolic link|not a plain file).*remove"):
        save_at(pm, root, 1)
    assert precious.read_text() == "PRECIOUS\n" and not complete_checkpoints(root)


def test_a_snapshot_store_made_by_someone_else_or_open_to_others_is_refused(tmp_path, monkeypatch):
    # /dev/shm is every user's: a store another user made first (or left writable) could be read or planted in.
    from tessera.errors import ConfigError
    from tessera.runtime import snapshot_config
    from tessera.runtime.snapshot_store import STORE_MARKER, open_store

    monkeypatch.setattr(snapshot_config, "SNAPSHOT_ROOT", tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    store = snapshot_config.default_store()
    os.close(open_store(store))  # made here: the user's folders, for the user alone
    assert all(folder.stat().st_mode & 0o777 == 0o700 for folder in (store, store.parent))
    assert (store / STORE_MARKER).exists()
    store.parent.chmod(0o777)  # one of yours others may write or read (an earlier version made them 0755)
    os.close(open_store(store))
    assert store.parent.stat().st_mode & 0o777 == 0o700  # made yours alone
    other = tmp_path / "theirs"
    other.mkdir()
    (store.parent / "job-2").symlink_to(other)  # a link planted where a run's store goes
    with pytest.raises(ConfigError, match="job-2 is not a folder of yours .owner uid .*a link"):
        open_store(store.parent / "job-2")
    planted = tmp_path / "planted"
    planted.write_text("mine")
    (store / STORE_MARKER).unlink()
    (store / STORE_MARKER).symlink_to(planted)
    with pytest.raises(ConfigError, match="a link there is not Tessera's"):
        open_store(store)
    assert planted.read_text() == "mine"


@pytest.mark.parametrize("planted", ["symbolic", "hard"])
def test_a_link_recycled_into_a_snapshot_is_replaced_not_written_through(tmp_path, planted):
    # An older snapshot's file swapped for a link is renamed into the spare, then into a new snapshot's folder, where
    # the writer opened it without O_NOFOLLOW and wrote the snapshot into the link's target.
    from tessera.runtime.snapshot_store import open_store_file

    precious, folder = tmp_path / "notes", tmp_path / "partial"
    precious.write_text("mine")
    folder.mkdir()
    (os.symlink if planted == "symbolic" else os.link)(precious, folder / "rank-00000.snap")
    handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        written = open_store_file(handle, "rank-00000.snap", os.O_WRONLY)
        os.write(written, b"snapshot")
        os.close(written)
    finally:
        os.close(handle)
    assert precious.read_text() == "mine" and (folder / "rank-00000.snap").read_bytes() == b"snapshot"
    assert not (folder / "rank-00000.snap").is_symlink()


def test_a_store_folder_the_user_made_keeps_its_permissions_and_stays_after_the_run(tmp_path):
    from tessera.runtime.snapshot_store import open_store, remove_store

    mine, new = tmp_path / "mine", tmp_path / "new"
    mine.mkdir(mode=0o750)
    mine.chmod(0o750)
    for store in (mine, new):
        os.close(open_store(store))
        remove_store(store)
    assert mine.is_dir() and mine.stat().st_mode & 0o777 == 0o750 and not any(mine.iterdir())
    assert not new.exists()  # Tessera's own: removed
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)  # others could plant the files snapshots are read from
    with pytest.raises(ConfigError, match="can be written by other users .*chmod go-w"):
        open_store(shared)


def test_a_plan_made_for_another_model_is_refused_before_anything_changes():
    # A plan file from another run applied to this model trained it under the other model's predictions and saved
    # checkpoints naming the other model.
    from tessera.runtime.apply import apply_plan

    plan = tessera.plan("gpt-tiny:layers=2", CLUSTER, global_batch=BATCH, seq_len=SEQ)
    model = build_model("gpt-tiny:layers=4")
    with pytest.raises(ConfigError, match=r"this plan was made for gpt-tiny:layers=2 \(.* parameters\) but this "
                                          r"\w+ has .* parameters; plan this model"):
        apply_plan(model, plan)
    apply_plan(build_model("gpt-tiny:layers=2"), plan)  # the model it was made for


def test_a_checkpoint_of_a_larger_model_is_refused_not_loaded_in_part(pm, tmp_path):
    # DCP loads what the model asks for: the saved blocks a smaller model lacks were dropped without a word.
    root = tmp_path / "ckpt"
    save_at(pm, root, 1)
    torch.manual_seed(0)
    smaller = tessera.auto_parallelize("gpt-tiny:layers=1", CLUSTER, global_batch=BATCH, seq_len=SEQ)
    before = {name: p.detach().clone() for name, p in smaller.module.named_parameters()}
    with pytest.raises(CheckpointError, match=r"holds \d+ model tensor\(s\) this model has no place for \(first: "
                                              r"blocks\.1\..*\): it was saved from another model"):
        smaller.load(root)
    assert all(torch.equal(before[name], p) for name, p in smaller.module.named_parameters())


def test_a_corrupt_newest_checkpoint_is_moved_aside_and_its_step_saved_again(pm, tmp_path):
    root = tmp_path / "ckpt"
    save_at(pm, root, 1)
    newest = save_at(pm, root, 2)
    data = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data.write_bytes(bytes(data.stat().st_size))  # same size, other bytes
    info = pm.load(root)
    assert info.step == 1 and "moved aside to" in info.skipped[0]
    aside = [p.name for p in root.iterdir() if p.name.startswith("step-00000002.corrupt-")]
    assert len(aside) == 1 and (root / aside[0] / data.name).exists()  # kept for inspection, not deleted
    pm.train_step(batch())
    assert pm.step == 2 and pm.save(root).wait() == newest  # the elastic run does not crash-loop
    assert pm.load(root).step == 2


def test_a_file_where_a_checkpoint_folder_is_expected_is_named(tmp_path):
    (tmp_path / "afile").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        export_model_state_dict(tmp_path / "afile", tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"resume_from='.*afile' is a file, not a checkpoint folder"):
        tessera.auto_parallelize(MODEL, CLUSTER, global_batch=BATCH, seq_len=SEQ, resume_from=tmp_path / "afile")


def test_export_neither_replaces_a_file_nor_leaves_half_of_one(pm, tmp_path):
    folder = save_at(pm, tmp_path / "ckpt", 1)
    out = tmp_path / "model.pt"
    out.write_text("the user's")
    with pytest.raises(CheckpointError, match="already exists.*--overwrite"):
        export_model_state_dict(folder, out)
    assert out.read_text() == "the user's"
    export_model_state_dict(folder, out, overwrite=True)
    assert set(torch.load(out, weights_only=True)) == set(pm.module.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "model.pt"]  # no temporary file left
    export_model_state_dict(folder, tmp_path / "again.pt")
    assert out.read_bytes() == (tmp_path / "again.pt").read_bytes()  # the same bytes, whatever the temporary name


# ------------------------------------------------------------------------------------------------ a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs: room for one checkpoint of the tiny model (about 1.6 MB), not two."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()[:200]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_raises_checkpoint_error_and_removes_the_partial(pm, small_disk):
    root = small_disk / "ckpt"
    first = save_at(pm, root, 1)
    free = shutil.disk_usage(small_disk).free
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_at(pm, root, 2)
    assert sorted(p.name for p in root.iterdir()) == [LOCK_FILE, first.name]  # no partial left filling the disk
    assert shutil.disk_usage(small_disk).free == free
    assert check_checkpoint(first, verify=True, group=None) is None and pm.load(root).step == 1
    assert read_manifest(first).step == 1 and os.access(root, os.W_OK)


def test_a_failing_cleanup_after_a_failed_async_commit_still_answers_the_waiter():
    # A process group destroyed under an async save made the commit fail and its cleanup raise too: the future was
    # never completed, and the program hung at exit in the hook that waits for it.
    from concurrent.futures import Future

    from tessera.runtime.checkpoint import _then

    written: Future = Future()
    written.set_result(None)

    def fail() -> None:
        raise ValueError("Default process group has not been initialized")

    done = _then(written, fail, cleanup=fail, finally_=lambda: None)
    with pytest.raises(ValueError, match="not been initialized") as caught:
        done.result(timeout=10)
    assert any("then, cleaning up: ValueError" in note for note in caught.value.__notes__)
