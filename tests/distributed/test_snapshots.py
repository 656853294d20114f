"""In-memory snapshots (``runtime.snapshots``) and recovery from peers (``runtime.snapshot_recovery``).

Four ranks are two simulated nodes (ranks 0-1 and 2-3), each with its own store folder. They train with a
snapshot every step and a disk checkpoint every ``DISK_EVERY`` steps. Rank 3 (node 1) dies in the middle of
writing its own file of the snapshot after step ``LAST_COMMITTED + 1``: its file is torn, the ranks never agree on
that snapshot, nothing of it is copied to the buddy node or committed (the other ranks are then killed, as
torchrun's restart does). From the stores this leaves, three restarts, each on its own copy:

- **a rank killed mid-snapshot** (same world: 4 ranks, both stores intact, same plan): the half-written snapshot
  is ignored and the previous one (step ``LAST_COMMITTED``) is loaded, every rank getting its own RNG back;
- **a node killed after step** ``LAST_COMMITTED`` (node 1's store deleted; the two survivors, another plan): it
  resumes from the snapshot of step ``LAST_COMMITTED`` -- not the disk checkpoint of step ``DISK_EVERY`` --
  resharded from tp x dp on 4 ranks to ZeRO-3 on 2;
- **the buddy lost too** (node 1's copies in node 0's store torn: one truncated, one with a byte changed): it
  says so and falls back to the disk checkpoint of step ``DISK_EVERY``.

Every loss before and after each restart equals an uninterrupted single-process run. Batches are drawn with the
global RNG from a pool, so resumed losses match only if the snapshot restored the RNG; the learning rate decays
every step (``SCHEDULE``), so they match only if it restored the scheduler too. Economy: one spawn of 4
ranks to train, one of 4 ranks for the same-world restart, one of 2 ranks running both survivor restarts; the
store checks (memory budget, foreign folders, clean finish) run in the test process.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tessera.errors import ConfigError
from tessera.runtime import snapshots
from tessera.runtime.apply import apply_plan
from tessera.runtime.elastic import resume_if_possible
from tessera.runtime.launch import WorkerError, spawn
from tessera.runtime.snapshots import SnapshotConfig

from .harness import FP32_TOL, GPT, LR, make_batches, make_model, make_plan

pytestmark = pytest.mark.distributed

SEED, DATA_SEED, POOL, STEPS, DISK_EVERY, LAST_COMMITTED = 0, 5, 6, 10, 5, 7
BEFORE, AFTER = "dp=2,tp=2,mbs=4", "dp=2,zero=3,mbs=2"  # 4 ranks (2 nodes) -> 2 ranks (node 0)
RANKS_PER_NODE = 2


def SCHEDULE(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning rate decays every step: a scheduler restarted from its first step would train another run."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))


def draw(pool: list) -> tuple[torch.Tensor, torch.Tensor]:
    return pool[int(torch.randint(len(pool), ()))]


def reference_losses() -> list[float]:
    torch.manual_seed(SEED)
    model = make_model(GPT, SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = SCHEDULE(optimizer)
    torch.manual_seed(DATA_SEED)
    pool, losses = make_batches(GPT, POOL), []
    for _ in range(STEPS):
        inputs, targets = draw(pool)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def _log(path: Path, **event) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(event) + "\n")


def _start(strategy: str, stores: Path, seed: int):
    """A rank of ``strategy`` with snapshots every step into its node's store ``stores/node<N>``."""
    rank = dist.get_rank()
    model = make_model(GPT, seed + rank)  # rank 0's weights win (apply_plan broadcasts them)
    pm = apply_plan(model, make_plan(GPT, model, strategy), lr_scheduler_factory=SCHEDULE)
    store = stores / f"node{rank // RANKS_PER_NODE}"
    pm.enable_snapshots(SnapshotConfig(every=1, store=store, ranks_per_node=RANKS_PER_NODE),
                        data_state=lambda: {"batches_drawn": pm.step})
    return pm, store


def _torn_own_file(write):
    """Rank 3's ``snapshots._write_file`` (``write``: the real one): its own file of the next snapshot is written
    halfway, then the process dies."""

    def torn(folder: int, name: str, content) -> None:
        if name != "rank-00003.snap":
            return write(folder, name, content)
        handle = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=folder)
        os.write(handle, memoryview(content.numpy())[:content.numel() // 2])
        os._exit(1)

    return torn


def train_then_lose_rank_three_mid_snapshot(stores: Path, disk: Path, log: Path) -> None:
    """4 ranks; rank 3 dies halfway through writing its file of the snapshot after step ``LAST_COMMITTED + 1``."""
    pm, store = _start(BEFORE, stores, SEED)
    torch.manual_seed(DATA_SEED)
    pool = make_batches(GPT, POOL)
    while pm.step < STEPS:
        if pm.step == LAST_COMMITTED:
            pm.wait_for_snapshot()  # each rank's part of the snapshot of LAST_COMMITTED (a leader's: its commit)
            dist.barrier()  # ... on every rank: that snapshot is committed on both nodes
            if dist.get_rank() == 3:
                snapshots._write_file = _torn_own_file(snapshots._write_file)
        loss = pm.train_step(draw(pool))  # starts the snapshot of pm.step in the background
        if dist.get_rank() == 0:
            _log(log, phase="before", step=pm.step - 1, loss=loss)
        if pm.step % DISK_EVERY == 0:
            pm.save(disk)


def recover_and_finish(stores: Path, disk: Path, log: Path, phase: str, strategy: str = AFTER) -> dict:
    """Recover under ``strategy``, train to the end, finish cleanly."""
    pm, store = _start(strategy, stores, 100)  # other weights: the snapshot must replace them
    torch.manual_seed(999 + dist.get_rank())  # another RNG state: the snapshot's must be restored
    info = resume_if_possible(pm, disk)
    pool = make_batches(GPT, POOL)
    while pm.step < STEPS:
        loss = pm.train_step(draw(pool))
        if dist.get_rank() == 0:
            _log(log, phase=phase, step=pm.step - 1, loss=loss)
    pm.close()
    return {"step": info.step, "path": info.path, "skipped": list(info.skipped), "data": info.data_state,
            "saved_world_size": info.saved_world_size, "store_left": store.exists()}


def both_recoveries(runs: list[tuple[Path, str]], disk: Path, log: Path) -> dict:
    return {phase: recover_and_finish(stores, disk, log, phase) for stores, phase in runs}


def lose_the_buddy_copies(stores: Path) -> None:
    """Node 0's copies of node 1's files (ranks 2 and 3) are torn -- one truncated, one with a byte changed --
    in every committed snapshot: as if node 1's buddy had failed with it; recovery must see both as not held."""
    for path in (stores / "node0").glob("step-*/rank-00002.snap"):
        path.write_bytes(path.read_bytes()[:-1])
    for path in (stores / "node0").glob("step-*/rank-00003.snap"):
        content = bytearray(path.read_bytes())
        content[-1] ^= 0xFF
        path.write_bytes(bytes(content))


def _listing(store: Path) -> dict[str, list[str]]:
    return {folder.name: sorted(p.name for p in folder.iterdir()) for folder in sorted(store.iterdir()) if folder.is_dir()}


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fault-run")
    stores, disk, log = root / "stores", root / "disk", root / "losses.jsonl"
    started, cpu = time.monotonic(), _ranks_cpu_s()
    with pytest.raises(WorkerError) as lost:
        spawn(train_then_lose_rank_three_mid_snapshot, nprocs=4, args=(stores, disk, log), timeout_s=300)
    left = {node: _listing(stores / node) for node in ("node0", "node1")}
    committed, half = f"step-{LAST_COMMITTED:08d}", f".step-{LAST_COMMITTED + 1:08d}.partial"
    torn = {"torn": (stores / "node1" / half / "rank-00003.snap").stat().st_size,
            "whole": (stores / "node1" / committed / "rank-00003.snap").stat().st_size,
            "manifests": [(stores / node / committed / "manifest.json").read_text() for node in ("node0", "node1")]}
    same_world = root / "stores-same-world"
    shutil.copytree(stores, same_world)
    same = spawn(recover_and_finish, nprocs=4, args=(same_world, disk, log, "same world", BEFORE), timeout_s=300)
    shutil.rmtree(stores / "node1")  # the node is gone, and its host memory with it
    buddy_lost = root / "stores-buddy-lost"
    shutil.copytree(stores, buddy_lost)
    lose_the_buddy_copies(buddy_lost)
    results = spawn(both_recoveries, nprocs=2, args=([(stores, "snapshot"), (buddy_lost, "disk")], disk, log),
                    timeout_s=300)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return {"error": str(lost.value), "left": left, "torn": torn, "same world": same[0], "results": results, "events": events,
            "stores": [stores, buddy_lost, same_world], "seconds": time.monotonic() - started,
            "cpu_s": _ranks_cpu_s() - cpu}


def _ranks_cpu_s() -> float:
    """CPU seconds of the finished rank processes so far (a cost the machine's other load does not inflate)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_rank_three_died_mid_snapshot_and_left_the_previous_snapshot_committed(fault_run):
    assert "rank 3" in fault_run["error"], fault_run["error"]
    half = f".step-{LAST_COMMITTED + 1:08d}.partial"
    for node, folders in fault_run["left"].items():
        steps = [name for name in folders if name.startswith("step-")]
        assert steps == [f"step-{LAST_COMMITTED - 1:08d}", f"step-{LAST_COMMITTED:08d}"], (node, folders)
        assert "COMPLETE" not in folders[half], (node, folders)  # written, never committed
    assert "rank-00003.snap" in fault_run["left"]["node1"][half]  # rank 3 had begun its own file...
    assert 0 < fault_run["torn"]["torn"] < fault_run["torn"]["whole"]  # ... and died halfway through it


def test_every_node_commits_the_same_manifest(fault_run):
    # recovery combines the files of several stores only under one manifest text
    node0, node1 = fault_run["torn"]["manifests"]
    assert node0 == node1 and len(json.loads(node0)["files"]) == 4 + 2  # every rank's file, rank 0's plan and data


def test_a_rank_killed_mid_snapshot_resumes_from_the_previous_snapshot_in_the_same_world(fault_run):
    result = fault_run["same world"]
    assert result["step"] == LAST_COMMITTED and result["saved_world_size"] == 4, result
    assert result["path"].startswith(f"snapshot step-{LAST_COMMITTED:08d}") and not result["skipped"], result
    _assert_losses_match(fault_run["events"], "same world", first=LAST_COMMITTED)


def test_the_survivors_of_a_lost_node_resume_from_the_last_snapshot_under_a_new_plan(fault_run):
    result = fault_run["results"][0]["snapshot"]
    assert result["step"] == LAST_COMMITTED, result  # not the disk checkpoint of step 5, nor the half-written 8
    assert result["path"].startswith(f"snapshot step-{LAST_COMMITTED:08d}") and result["saved_world_size"] == 4, result
    assert result["data"] == {"batches_drawn": LAST_COMMITTED}
    _assert_losses_match(fault_run["events"], "snapshot", first=LAST_COMMITTED)


def test_a_node_lost_with_its_buddy_falls_back_to_the_disk_checkpoint_and_says_why(fault_run):
    result = fault_run["results"][0]["disk"]
    assert result["step"] == DISK_EVERY and result["path"].endswith(f"disk/step-{DISK_EVERY:08d}"), result
    assert any("its buddy are both gone" in reason for reason in result["skipped"]), result["skipped"]
    _assert_losses_match(fault_run["events"], "disk", first=DISK_EVERY)


def test_a_clean_finish_leaves_no_snapshot_files(fault_run):
    for rank_result in fault_run["results"]:
        assert not any(run["store_left"] for run in rank_result.values()), rank_result
    assert not fault_run["same world"]["store_left"]
    for stores in fault_run["stores"]:
        assert not (stores / "node0").exists()


def test_the_fault_run_stays_within_its_time_budget(fault_run):
    print(f"fault run: {fault_run['seconds']:.0f} s, {fault_run['cpu_s']:.0f} CPU-s in its ranks")
    # CPU, not wall time: a shared machine's load stretches the wall clock (measured: 401 s at load 25 for 124 CPU-s)
    assert fault_run["cpu_s"] < 240, fault_run["cpu_s"]  # ~75 s of wall time on an idle 2-core machine


def _assert_losses_match(events: list[dict], phase: str, *, first: int) -> None:
    expected = reference_losses()
    before = [e for e in events if e["phase"] == "before"]
    after = [e for e in events if e["phase"] == phase]
    assert [e["step"] for e in before][:LAST_COMMITTED + 1] == list(range(LAST_COMMITTED + 1))
    assert [e["step"] for e in after] == list(range(first, STEPS)), after
    for event in before + after:
        torch.testing.assert_close(event["loss"], expected[event["step"]], **FP32_TOL, msg=str(event))


# ------------------------------------------------------------------------------------------------ one process


def _one_process(store: Path, **config):
    model = make_model(GPT, SEED)
    pm = apply_plan(model, make_plan(GPT, model, "dp=1,mbs=8"))
    pm.enable_snapshots(SnapshotConfig(store=store, **{"every": 1, **config}))
    return pm


def test_without_an_interval_the_reliability_model_chooses_it_for_the_plan(tmp_path):
    from tessera.cost_models.reliability import LLAMA3_GPU_MTBF_S, host_snapshot_rate, snapshot_plan
    from tessera.topology import load_cluster

    pm = _one_process(tmp_path / "store", every=None)
    assert pm.plan.cluster == "test"  # the harness's cluster, not loadable here: priced at the cpu preset's rate
    host_rate = host_snapshot_rate(load_cluster("cpu").device)
    assert host_rate is not None  # CPU ranks: training pays the snapshot's whole work
    chosen = [snapshot_plan(pm.plan.param_count, num_devices=1, devices_per_node=1, mtbf_s=LLAMA3_GPU_MTBF_S,
                            step_time_s=pm.plan.estimate.step_time_s, host_rate=rate)[1].every_steps
              for rate in (host_rate, None)]
    assert pm.snapshots.config.every == chosen[0] > chosen[1] > 1  # one reliable CPU rank: snapshots now and then
    expected = chosen[0]
    pm.close()
    often = _one_process(tmp_path / "store", every=None, mtbf_hours=0.01)  # a job failing every 36 s
    assert often.snapshots.config.every < expected
    often.close()
    with pytest.raises(ConfigError, match=r"pass SnapshotConfig\(every=k\)"):
        snapshots.Snapshotter(SnapshotConfig(store=tmp_path / "store"))


def test_a_store_holding_files_tessera_did_not_write_is_refused_and_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds files Tessera did not write"):
        _one_process(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_the_host_memory_budget_is_checked_before_the_first_snapshot_is_written(tmp_path):
    pm = _one_process(tmp_path / "store", host_memory_budget_bytes=1000)
    with pytest.raises(ConfigError, match=r"snapshots need .* GB of host memory on node 0 .* the budget is"):
        pm.train_step(make_batches(GPT, 1)[0])
    assert not any((tmp_path / "store").glob("*step-*"))


def test_one_process_snapshots_recover_and_finish_without_files(tmp_path):
    pm = _one_process(tmp_path / "store", every=2)
    batches = make_batches(GPT, 3)
    for batch in batches:
        pm.train_step(batch)
    pm.wait_for_snapshot()
    assert sorted(p.name for p in (tmp_path / "store").glob("step-*")) == ["step-00000002"]
    os.close(pm.snapshots._lock)  # the first run is gone (its process would have released the lock)
    again = _one_process(tmp_path / "store")  # a restart in the same store
    info = resume_if_possible(again, None)
    assert info.step == 2 and "snapshot" in info.path
    again.close()
    assert not (tmp_path / "store").exists()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread nice values are read from Linux's /proc")
def test_the_snapshot_thread_yields_to_training_and_counts_its_cpu_time(tmp_path, caplog):
    pm = _one_process(tmp_path / "store")
    pm.train_step(make_batches(GPT, 1)[0])
    pm.wait_for_snapshot()
    worker = next(t for t in threading.enumerate() if t.name == "tessera-snapshot" and t.is_alive())
    stat = Path(f"/proc/self/task/{worker.native_id}/stat").read_text()
    assert int(stat.rsplit(")", 1)[1].split()[16]) == 19  # field 19 of stat: the thread's nice value
    assert pm.snapshots.background_cpu_s > 0 and pm.snapshots.taken == 1 and pm.snapshots.training_thread_s > 0
    with caplog.at_level(logging.INFO, logger="tessera.runtime.snapshots"):
        pm.close()
    assert "snapshots: 1 taken, every 1 step(s); per snapshot" in caplog.text  # what they cost, measured


# ---------------------------------------------------------------------------------- the same step again


def snapshot_one_step_repeatedly(stores: Path, takes: int) -> dict:
    """4 ranks as 2 nodes, DDP: one step, then ``takes`` snapshots of that same step back to back, each leader
    slow to commit (the other rank of its node runs ahead into the next take). What each node's store holds."""
    from tessera.runtime import snapshot_store

    pm, store = _start("dp=4,mbs=2", stores, SEED)
    pm.snapshots, manager = None, pm.snapshots  # snapshots taken by hand below
    pm.train_step(make_batches(GPT, 1)[0])
    if manager.layout.is_leader(manager.rank):
        commit = snapshots.commit_snapshot

        def slow_commit(*args, **kwargs):
            time.sleep(0.2)
            return commit(*args, **kwargs)

        snapshots.commit_snapshot = slow_commit
    for _ in range(takes):
        manager.snapshot(pm)
        manager.wait()
    dist.barrier()
    manager.wait()
    committed = snapshot_store.committed_snapshots(store)
    manifest, held = snapshot_store.held_files(committed[0])
    listing = sorted(p.name for p in store.iterdir() if p.name.startswith("."))
    return {"committed": [p.name for p in committed], "held": sorted(held), "listed": sorted(manifest.files),
            "hidden": listing}


def test_a_step_snapshotted_again_commits_every_file_on_every_node(tmp_path):
    """A take of the same step gets its own partial folder: a rank ahead of its leader does not write into the
    previous take's folder, which the leader commits and then replaces (its files were lost, or its copy from the
    buddy failed with 'No such file or directory')."""
    results = spawn(snapshot_one_step_repeatedly, nprocs=4, args=(tmp_path, 4), timeout_s=300)
    for node in (results[0], results[2]):
        assert node["committed"] == ["step-00000001"]
        assert node["held"] == node["listed"]  # the whole snapshot: every rank's file, the plan, the data position
        assert not [name for name in node["hidden"] if name.endswith(".partial")]


# ---------------------------------------------------------------------------------- no room to assemble


def restart_with_little_room(stores: Path, disk: Path, strategy: str, free: int | None) -> dict:
    """4 ranks as 4 nodes (each store holds its own file and the previous node's) under ``strategy``: a disk
    checkpoint after step 1, a snapshot after step 2, then a restart under the same plan whose stores have
    ``free`` bytes (``None``: a third of this rank's own snapshot file) to assemble the files its ranks read."""
    from tessera.runtime import snapshot_recovery

    config = SnapshotConfig(every=1, store=stores / f"node{dist.get_rank()}", ranks_per_node=1)
    model = make_model(GPT, SEED)
    pm = apply_plan(model, make_plan(GPT, model, strategy))
    pm.enable_snapshots(config)
    batches = make_batches(GPT, 2)
    pm.train_step(batches[0])
    pm.save(disk)
    pm.train_step(batches[1])
    pm.wait_for_snapshot()
    dist.barrier()
    os.close(pm.snapshots._lock)  # the run dies here (its process would have released the lock)
    own_file = next(config.store.glob(f"step-*2/rank-{dist.get_rank():05d}.snap")).stat().st_size
    again = apply_plan(make_model(GPT, 100), make_plan(GPT, model, strategy))
    again.enable_snapshots(config)
    snapshot_recovery.free_bytes = lambda store: own_file // 3 if free is None else free
    info = resume_if_possible(again, disk)
    left = sorted(p.name for p in config.store.iterdir() if p.name.startswith("step-"))
    same = all(torch.equal(a.to_local() if isinstance(a, DTensor) else a, b.to_local() if isinstance(b, DTensor) else b)
               for a, b in zip(again.module.parameters(), pm.module.parameters()))
    again.close()
    return {"step": info.step, "path": info.path, "skipped": list(info.skipped), "left": left, "same": same}


def both_restarts_with_little_room(root: Path) -> dict:
    return {"ddp": restart_with_little_room(root / "ddp", root / "ddp-disk", "dp=4,mbs=2", 1000),
            "zero3": restart_with_little_room(root / "zero3", root / "zero3-disk", "dp=4,zero=3,mbs=2", None)}


@pytest.fixture(scope="module")
def little_room(tmp_path_factory) -> list[dict]:
    return spawn(both_restarts_with_little_room, nprocs=4, args=(tmp_path_factory.mktemp("little-room"),),
                 timeout_s=300)


def test_a_store_without_room_for_the_files_its_ranks_read_falls_back_to_disk_and_says_why(little_room):
    for result in (rank["ddp"] for rank in little_room):  # DDP: every rank reads every rank's chunks
        assert result["step"] == 1 and result["path"].endswith("ddp-disk/step-00000001"), result
        assert any("needs" in reason and "GB free" in reason for reason in result["skipped"]), result["skipped"]
        assert result["left"] == [], result  # the unusable snapshots are gone: none can shadow the run's new ones


def test_each_node_assembles_only_the_files_its_ranks_read(little_room):
    # ZeRO-3 under the same plan: each rank reads its own file only, which its node holds; room for a third of one
    # file is enough (the whole snapshot, or even the previous node's file, would not fit)
    for result in (rank["zero3"] for rank in little_room):
        assert result["step"] == 2 and result["path"].startswith("snapshot step-00000002"), result
        assert result["same"], "the restored shards are the saved ones"


def test_the_default_interval_on_cpu_ranks_uses_the_plans_profiled_cluster(tmp_path):
    import yaml

    from tessera.cost_models.reliability import SnapshotWork, host_snapshot_rate
    from tessera.runtime import snapshot_config
    from tessera.topology import load_cluster
    from tessera.topology.clusterfile import cluster_to_raw

    cpu = load_cluster("cpu:ranks=2")
    profiled = cpu.model_copy(update={"device": cpu.device.model_copy(update={
        "snapshot_fixed_s": 0.004, "snapshot_bytes_per_s": 0.8e9, "snapshot_swap_bytes_per_s": 0.6e9})})
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cluster_to_raw(profiled)))
    model = make_model(GPT, SEED)
    plan = make_plan(GPT, model, "dp=1,mbs=8").model_copy(update={"cluster": str(path)})
    assert snapshot_config._host_rate(plan) == SnapshotWork(0.004, 0.8e9, 0.6e9)  # what tessera profile measured
    assert snapshot_config._host_rate(plan.model_copy(update={"cluster": str(tmp_path / "gone.yaml")})) == (
        host_snapshot_rate(load_cluster("cpu").device))  # unreadable: the cpu preset's rate
    assert snapshot_config._host_rate(plan.model_copy(update={"device_name": "H100-SXM-80GB"})) is None
