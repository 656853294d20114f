"""The on-disk checkpoint format (``runtime.checkpoint_files``) in one process: commit, then detect damage.

The distributed tests save real sharded checkpoints; these write plain files, so every branch of the commit and
the checks runs in milliseconds with ``group=None`` (this process alone).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xxhash

from tessera.errors import CheckpointError
from tessera.runtime.checkpoint_files import (
    MARKER, check_checkpoint, commit_checkpoint, complete_checkpoints, has_checkpoint, partial_folder,
    read_manifest, select_checkpoint, step_folder,
)
from tessera.runtime.file_records import sha256_text


def committed(root: Path, step: int, *, keep_last: int | None = None) -> Path:
    """A checkpoint of ``step`` with two data files, committed as a save commits it."""
    partial = partial_folder(root, step)
    (partial / "rng").mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    (partial / "rng" / "rank-00000.pt").write_bytes(b"rng state")
    final = step_folder(root, step)
    commit_checkpoint(partial, final=final, step=step, strategy="dp=1", group=None, keep_last=keep_last)
    return final


def test_commit_renames_and_records_every_file(tmp_path):
    folder = committed(tmp_path, 3)
    assert folder.name == "step-00000003" and not partial_folder(tmp_path, 3).exists()
    manifest = read_manifest(folder)
    assert (manifest.step, manifest.world_size, sorted(manifest.files)) == (3, 1, ["__0_0.distcp", "rng/rank-00000.pt"])
    assert manifest.files["__0_0.distcp"].size_bytes == 2048
    assert has_checkpoint(tmp_path) and has_checkpoint(folder)
    assert check_checkpoint(folder, verify=True, group=None) is None
    assert '"xxh3_128"' not in (folder / "manifest.json").read_text()  # the manifest as it always was


def _with_snapshot_hash(folder: Path) -> None:
    """The data file's record carries an XXH3-128 (a snapshot's hash), the manifest re-sealed by its marker."""
    text = (folder / "manifest.json").read_text()
    manifest = json.loads(text)
    manifest["files"]["__0_0.distcp"] = {"size_bytes": 2048,
                                         "xxh3_128": xxhash.xxh3_128((folder / "__0_0.distcp").read_bytes()).hexdigest()}
    text = json.dumps(manifest)
    (folder / "manifest.json").write_text(text)
    (folder / MARKER).write_text(sha256_text(text))


def test_keep_last_prunes_older_checkpoints(tmp_path):
    for step in (1, 2, 3):
        committed(tmp_path, step, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000003", "step-00000002"]


@pytest.mark.parametrize("damage, reason", [
    (lambda f: (f / "__0_0.distcp").write_bytes(b"short"), "has 5 bytes but 2048 were written"),
    (lambda f: (f / "__0_0.distcp").write_bytes(bytes(2048)), "does not match the SHA-256"),
    (lambda f: (f / "rng" / "rank-00000.pt").unlink(), "rng/rank-00000.pt is missing"),
    (lambda f: (f / "manifest.json").write_text("{}"), "manifest.json is unreadable"),
    (lambda f: (f / MARKER).write_text("0" * 64), "does not match the hash in its COMPLETE marker"),
    (_with_snapshot_hash, "__0_0.distcp has no SHA-256 in manifest.json"),
])
def test_damage_is_named_and_the_previous_checkpoint_loaded(tmp_path, damage, reason):
    older, newest = committed(tmp_path, 1), committed(tmp_path, 2)
    damage(newest)
    assert reason in check_checkpoint(newest, verify=True, group=None)
    folder, skipped = select_checkpoint(tmp_path, verify=True, group=None)
    assert folder == older and len(skipped) == 1 and reason in skipped[0]
    with pytest.raises(CheckpointError, match=f"last complete checkpoint before it is {older}"):
        select_checkpoint(newest, verify=True, group=None)


def test_sizes_only_without_verify(tmp_path):
    folder = committed(tmp_path, 1)
    (folder / "__0_0.distcp").write_bytes(bytes(2048))  # same size, other bytes
    assert check_checkpoint(folder, verify=False, group=None) is None
    assert check_checkpoint(folder, verify=True, group=None) is not None


def test_interrupted_save_is_never_loaded(tmp_path):
    partial = partial_folder(tmp_path, 5)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert not has_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"only \.step-00000005\.partial: interrupted"):
        select_checkpoint(tmp_path, verify=True, group=None)
    assert "incomplete (no COMPLETE marker)" in check_checkpoint(partial, verify=True, group=None)
