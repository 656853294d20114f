"""The snapshot file format (runtime/snapshot_format.py): one rank's chunks behind a JSON header, read back without
running code, resharded by overlap; one process, no process group (the 4-rank round trip is
tests/distributed/test_snapshots.py)."""

import json
import os
import random

import pytest
import torch

from tessera.errors import CheckpointError
from tessera.runtime.snapshot_format import ALIGN, Chunk, Shard, load_shards
from tessera.runtime.snapshot_staging import StagedShards, write_shard
from tessera.runtime.snapshot_store import MappedFiles
from tessera.runtime.snapshot_table import agree_on_table, snapshot_record, table_manifest


def _state() -> dict:
    return {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.tensor([1, 2], dtype=torch.int64)},
            "optim": {"state.w.step": torch.tensor(3.0), "param_groups.w.betas": (0.9, 0.999),
                      "param_groups.w.lr": 1e-3, "param_groups.w.foreach": None}}


def _write(path, state) -> StagedShards:
    staged = StagedShards(state, None, assignments={})
    staged.refill()
    record = write_shard(path, staged.file)
    assert staged.record() == record  # the cached header hash plus the chunks' is the file's
    return staged


def _target() -> dict:
    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.int64)},
            "optim": {"state.w.step": torch.tensor(0.0), "param_groups.w.betas": None, "param_groups.w.lr": None,
                      "param_groups.w.foreach": 0}}


def test_a_state_round_trips_with_its_values_and_rng(tmp_path):
    state = _state()
    random.gauss(0.0, 1.0)  # Python's generator now caches a Gaussian: the packed state must keep it
    _write(tmp_path / "rank-00000.snap", state)
    target = _target()
    shard = Shard(tmp_path / "rank-00000.snap")
    load_shards(target, [shard])
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and torch.equal(target["model"]["b"], state["model"]["b"])
    assert target["optim"]["state.w.step"] == 3.0
    assert target["optim"]["param_groups.w.betas"] == (0.9, 0.999)  # a tuple again, not a list
    assert target["optim"]["param_groups.w.lr"] == 1e-3 and target["optim"]["param_groups.w.foreach"] is None
    tensors, python = shard.rng()
    assert torch.equal(tensors["rng.cpu"], torch.get_rng_state()) and python == random.getstate()
    assert python[2] is not None
    assert all(chunk.start % ALIGN == 0 for chunk in shard.header.chunks)


def test_a_refill_rewrites_the_same_buffer_with_the_new_state_and_rng(tmp_path):
    state = _state()
    staged = _write(tmp_path / "a.snap", state)
    buffer, before = staged.file.data_ptr(), staged.record()
    state["model"]["w"].add_(1.0)
    random.random()
    staged.refill()
    assert staged.file.data_ptr() == buffer and staged.record() != before
    write_shard(tmp_path / "b.snap", staged.file)
    target = _target()
    shard = Shard(tmp_path / "b.snap")
    load_shards(target, [shard])
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    assert shard.rng()[1] == random.getstate()


def _handmade(path, chunks: list[tuple[Chunk, torch.Tensor]]) -> None:
    """A file whose chunks the test chooses (as other ranks' shards would be)."""
    header = json.dumps({"format": "tessera-snapshot-2", "rank": 0, "chunks": [c.model_dump() for c, _ in chunks],
                         "values": {}}).encode()
    size = max(c.start + c.nbytes for c, _ in chunks)
    data = torch.zeros(-(-size // ALIGN) * ALIGN, dtype=torch.uint8)
    for chunk, tensor in chunks:
        data[chunk.start:chunk.start + chunk.nbytes] = tensor.contiguous().view(torch.uint8).flatten()
    head = 8 + len(header)
    prefix = len(header).to_bytes(8, "little") + header + bytes(-(-head // ALIGN) * ALIGN - head)
    write_shard(path, torch.cat([torch.frombuffer(bytearray(prefix), dtype=torch.uint8), data]))


def test_chunks_from_several_files_are_resharded_into_the_target_by_overlap(tmp_path):
    full = torch.arange(24.0).reshape(4, 6)
    # saved as row halves by two "ranks"; the second file also holds column halves of the bottom rows
    top = Chunk(key="model.w", dtype="float32", global_shape=(4, 6), offsets=(0, 0), shape=(2, 6), start=0)
    left = Chunk(key="model.w", dtype="float32", global_shape=(4, 6), offsets=(2, 0), shape=(2, 3), start=0)
    right = Chunk(key="model.w", dtype="float32", global_shape=(4, 6), offsets=(2, 3), shape=(2, 3), start=64)
    _handmade(tmp_path / "a.snap", [(top, full[:2])])
    _handmade(tmp_path / "b.snap", [(left, full[2:, :3]), (right, full[2:, 3:])])
    target = {"model": {"w": torch.zeros(4, 6)}}
    load_shards(target, [Shard(tmp_path / "a.snap"), Shard(tmp_path / "b.snap")])
    assert torch.equal(target["model"]["w"], full)
    with pytest.raises(CheckpointError, match="holds 12 of the 24 elements of model.w"):
        load_shards({"model": {"w": torch.zeros(4, 6)}}, [Shard(tmp_path / "b.snap")])
    with pytest.raises(CheckpointError, match=r"model.w has shape \[4, 6\], this model's \[4, 7\]"):
        load_shards({"model": {"w": torch.zeros(4, 7)}}, [Shard(tmp_path / "a.snap")])


def test_a_header_pointing_outside_its_data_or_naming_no_dtype_is_refused(tmp_path):
    chunk = Chunk(key="model.w", dtype="float32", global_shape=(4,), offsets=(0,), shape=(4,), start=0)
    _handmade(tmp_path / "ok.snap", [(chunk, torch.ones(4))])
    raw = (tmp_path / "ok.snap").read_bytes()
    for name, old, new, why in (("far.snap", b'"start": 0', b'"start":64', "lies outside the file's data"),
                                ("dtype.snap", b'"float32"', b'"Tensor1"', "'Tensor1' is not a torch dtype")):
        assert len(old) == len(new) and old in raw
        (tmp_path / name).write_bytes(raw.replace(old, new))
        with pytest.raises(CheckpointError, match=f"snapshot file .*{name} is unreadable .*{why}"):
            Shard(tmp_path / name)


def _groups(lr: float) -> list[dict]:
    """The optimizer's param groups behind ``_state()``'s settings: one group, parameter ``w``."""
    return [{"params": [object()], "betas": (0.9, 0.999), "lr": lr, "foreach": None}]


def test_a_new_learning_rate_and_scheduler_state_rewrite_only_the_header_in_place(tmp_path):
    scheduler = {"last_epoch": 3, "_last_lr": [5e-4], "best": float("inf"), "phases": ({"end_step": 2.0},)}
    staged = StagedShards(_state(), None, assignments={}, param_groups=_groups(1e-3), lr_scheduler=None)
    buffer = staged.file.data_ptr()
    assert staged.refill(_groups(1e-3), None)
    first = staged.record()
    assert staged.refill(_groups(5e-4), scheduler)
    assert staged.file.data_ptr() == buffer and staged.record() != first
    assert write_shard(tmp_path / "a.snap", staged.file) == staged.record()  # the header's new hash is the file's
    shard = Shard(tmp_path / "a.snap")
    assert shard.header.group_params == (("w",),) and not any(k.startswith("param_groups") for k in shard.header.values)
    target = _target()
    load_shards(target, [shard])
    assert target["optim"]["param_groups.w.lr"] == 5e-4 and target["optim"]["param_groups.w.betas"] == (0.9, 0.999)
    assert shard.lr_scheduler() == scheduler  # a tuple, a dict and an infinity come back as they were


def test_settings_that_do_not_match_the_groups_stay_fixed_and_a_change_asks_for_a_new_staging():
    groups = _groups(1e-3)
    groups[0]["eps"] = 1e-8  # a setting DCP's values do not have: these values are not these groups'
    staged = StagedShards(_state(), None, assignments={}, param_groups=groups)
    assert staged.refill(groups, None)
    groups[0]["lr"] = 5e-4
    assert not staged.refill(groups, None)


def test_a_scheduler_state_outgrowing_the_header_asks_for_a_new_staging():
    staged = StagedShards(_state(), None, assignments={}, param_groups=_groups(1e-3))
    assert not staged.refill(_groups(1e-3), {"history": list(range(1000))})
    again = StagedShards(_state(), None, assignments={}, param_groups=_groups(1e-3),
                         lr_scheduler={"history": list(range(1000))})
    assert again.refill(_groups(1e-3), {"history": list(range(1000))})


def test_a_setting_the_snapshot_lacks_keeps_the_runs_value_and_the_groups_must_be_given(tmp_path):
    staged = StagedShards(_state(), None, assignments={}, param_groups=_groups(1e-3))
    assert not staged.refill()  # the header keeps the groups' settings: a refill without them would drop them
    assert staged.refill(_groups(1e-3), None)
    write_shard(tmp_path / "a.snap", staged.file)
    target = _target()
    target["optim"]["param_groups.w.initial_lr"] = 5e-4  # added since (a scheduler passed on the restart)
    load_shards(target, [Shard(tmp_path / "a.snap")])
    assert target["optim"]["param_groups.w.initial_lr"] == 5e-4 and target["optim"]["param_groups.w.lr"] == 1e-3


def test_a_rank_reads_the_fewest_files_that_hold_its_chunks_and_settings():
    from tessera.runtime.snapshot_format import files_to_read

    scalar, settings = ((), ()), ("settings.w", ((), ()))
    chunks = {"a": [("step", scalar)], "b": [("step", scalar), ("w", ((4,), (4,)))], "own": [("w", ((0,), (4,)))],
              "c": [settings]}
    # step is in a and b, w[4:8] only in b: b alone covers both (a is not read), and own comes first
    assert files_to_read({"step": scalar, "w": ((4,), (4,))}, chunks, first="own") == {"own", "b"}
    # a parameter whose shard here is empty still needs its param-group settings from a file that has them
    assert files_to_read({"w": ((0,), (0,)), "settings.w": scalar}, chunks, first="own") == {"own", "c"}
    assert files_to_read({"w": ((0,), (2,))}, chunks, first="b") == {"b", "own"}


def test_a_mapped_store_file_is_its_bytes_and_stays_mapped_while_it_is_recycled(tmp_path):
    files, folder = MappedFiles(mappings=2), os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        mapped = files.open(folder, ".rank-00002.snap.arriving", 4096)
        mapped[:] = torch.arange(4096) % 251  # what a receive writes
        os.rename(tmp_path / ".rank-00002.snap.arriving", tmp_path / "rank-00002.snap")
        assert (tmp_path / "rank-00002.snap").read_bytes() == bytes(i % 251 for i in range(4096))
        os.rename(tmp_path / "rank-00002.snap", tmp_path / "again.snap")  # through the spare: the same inode
        assert files.open(folder, "again.snap", 4096) is mapped
        assert files.open(folder, "again.snap", 100).numel() == 100  # another size: cut and mapped again
        assert (tmp_path / "again.snap").stat().st_size == 100
        assert files.open(folder, "empty.snap", 0).numel() == 0
        files.open(folder, "third.snap", 8)  # beyond two mappings the oldest is let go
        assert len(files._files) == 2
    finally:
        files.close()
        os.close(folder)


def test_a_deleted_file_is_let_go_so_its_memory_is_freed(tmp_path):
    files, folder = MappedFiles(mappings=4), os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        files.open(folder, "pruned.snap", 4096)
        (tmp_path / "pruned.snap").unlink()  # pruned instead of recycled
        files.open(folder, "next.snap", 4096)
        assert len(files._files) == 1  # only next.snap's mapping is kept: the deleted file's pages can go
    finally:
        files.close()
        os.close(folder)


def test_the_snapshot_table_carries_every_files_size_and_hash_through_the_sum():
    records = {"rank-00000.snap": snapshot_record(b"shard"), "plan.json": snapshot_record(b"{}"),
               "data.pt": snapshot_record(bytes(range(256)))}
    table = agree_on_table(records, None, rank=0, world=1, group=None)
    manifest = table_manifest(table, step=7, world=1, strategy="dp=1")
    assert manifest.files == records and manifest.step == 7
    with pytest.raises(CheckpointError, match="disk full"):
        agree_on_table({}, "disk full", rank=0, world=1, group=None)
