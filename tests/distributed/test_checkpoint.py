"""Sharded checkpoints (``runtime.checkpoint``): saved on 4 ranks under DDP, ZeRO-3, TP, PP and FSDP x TP; loaded
under a different plan on 2 ranks and in one process; resumed training equals uninterrupted training; a
corrupted, truncated or interrupted checkpoint is reported by file and the previous complete one is used.

Economy: one spawn of 4 ranks saves every plan (and resumes two of them under the same plan), one spawn of 2
ranks reloads every checkpoint under another plan and runs the corruption cases; the one-process loads run
in the test process. The batch of each step is drawn with the global torch RNG from a pool, so resumed losses
match only if the RNG state is restored too (the data order depends on it).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.cost_models.types import Strategy
from tessera.errors import CheckpointError
from tessera.runtime.apply import apply_plan
from tessera.runtime.checkpoint import export_model_state_dict
from tessera.runtime.checkpoint_files import LOCK_FILE, MARKER, read_manifest
from tessera.runtime.elastic import fit_cluster_to_world
from tessera.topology import load_cluster

from .harness import FP32_TOL, GPT, LR, PARAM_TOL, full_tensors, make_batches, make_model, make_plan

pytestmark = pytest.mark.distributed

SEED, DATA_SEED, POOL, SAVE_AT, STEPS = 0, 5, 6, 3, 5
SAVED = {  # saved on 4 ranks
    "ddp": "dp=4,zero=0,mbs=2",
    "zero3": "dp=4,zero=3,mbs=2",
    "tp": "dp=1,tp=4,mbs=4",
    "pp": "dp=1,pp=4,mbs=1,schedule=1f1b",
    "fsdp_tp": "dp=2,tp=2,sp=true,zero=3,mbs=4",
}
RELOADED = {  # the same checkpoints loaded on 2 ranks under another plan
    "ddp": "dp=1,pp=2,mbs=1,schedule=interleaved:2",  # two chunk modules per rank, one optimizer
    "zero3": "dp=1,tp=2,mbs=4",
    "tp": "dp=2,zero=3,mbs=2",
    "pp": "dp=2,zero=0,mbs=4",
    "fsdp_tp": "dp=1,pp=2,mbs=2,schedule=1f1b",  # the example: tp 2 x dp 2 on 4 ranks -> pp 2 on 2
}
ASYNC = "ddp"  # saved with dcp.async_save while training goes on
EXACT = ("pp", "fsdp_tp")  # also resumed on 4 ranks under the same plan: bitwise equal losses
ONE_PROCESS = "dp=1,mbs=8"
CORRUPTED_PLAN = "dp=2,zero=3,mbs=2"
ADAMW_STATES = 3  # parameter, exp_avg, exp_avg_sq per parameter element, fp32


def draw(pool: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's batch, chosen with the global RNG (restored by a checkpoint)."""
    return pool[int(torch.randint(len(pool), ()))]


def reference() -> dict:
    """Plain single-process training on the drawn batches: losses, and parameters after ``SAVE_AT`` steps."""
    torch.manual_seed(SEED)
    model = make_model(GPT, SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    torch.manual_seed(DATA_SEED)
    pool, losses, params = make_batches(GPT, POOL), [], {}
    for step in range(STEPS):
        inputs, targets = draw(pool)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 == SAVE_AT:
            params = full_tensors(model.named_parameters())
    return {"losses": losses, "params": params}


# ------------------------------------------------------------------------------------------------ rank bodies


def train_and_save(name: str, strategy: str, root: Path) -> dict:
    """Train ``STEPS`` steps under ``strategy``, saving after ``SAVE_AT``; every rank's losses and save time."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = make_model(GPT, SEED + rank)  # rank 0's weights win (apply_plan broadcasts them)
    pm = apply_plan(model, make_plan(GPT, model, strategy))
    torch.manual_seed(DATA_SEED)
    pool, losses, pending, blocked_s = make_batches(GPT, POOL), [], None, 0.0
    for _ in range(STEPS):
        losses.append(pm.train_step(draw(pool)))
        if pm.step == SAVE_AT:
            started = time.perf_counter()
            pending = pm.save(root / name, data_state={"batches_drawn": pm.step}, async_save=name == ASYNC)
            blocked_s = time.perf_counter() - started
    pending.wait()
    return {"losses": losses, "blocked_s": blocked_s}


def resume(name: str, strategy: str, root: Path) -> dict:
    """Build ``strategy`` from other weights and another RNG state, load ``root/name``, train to ``STEPS``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = make_model(GPT, 100 + rank)  # wrong weights on purpose: the checkpoint must replace them
    pm = apply_plan(model, make_plan(GPT, model, strategy))
    torch.manual_seed(999)  # a wrong RNG state on purpose: the checkpoint's must be restored
    started = time.perf_counter()
    info = pm.load(root / name)
    load_s = time.perf_counter() - started
    pool = make_batches(GPT, POOL)
    losses = [pm.train_step(draw(pool)) for _ in range(pm.step, STEPS)]
    return {"losses": losses, "step": info.step, "data_state": info.data_state, "load_s": load_s,
            "saved_strategy": info.saved_strategy, "saved_world_size": info.saved_world_size}


def corrupt_largest_file(folder: Path, *, truncate: bool) -> str:
    """Flip bytes in the middle of (or cut in half) the folder's largest shard file; its name."""
    target = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    if truncate:
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2 : len(data) // 2 + 8] = bytes(255 - b for b in data[len(data) // 2 : len(data) // 2 + 8])
    target.write_bytes(bytes(data))
    return target.name


def corruption_cases(root: Path) -> dict:
    """Two checkpoints (steps 0 and 1); corrupt the newest, then truncate the older one."""
    rank = dist.get_rank()
    model = make_model(GPT, SEED)
    pm = apply_plan(model, make_plan(GPT, model, CORRUPTED_PLAN))
    batch = make_batches(GPT, 1)[0]
    pm.save(root)
    first_loss = pm.train_step(batch)
    pm.save(root)
    newest, older = root / "step-00000001", root / "step-00000000"
    out = {"corrupted": corrupt_largest_file(newest, truncate=False) if rank == 0 else None}
    dist.barrier()
    out["explicit_error"] = _error_of(lambda: pm.load(newest))
    info = pm.load(root)  # falls back to step 0
    out.update(fallback_step=info.step, skipped=info.skipped, replayed_loss=pm.train_step(batch),
               first_loss=first_loss)
    out["truncated"] = corrupt_largest_file(older, truncate=True) if rank == 0 else None
    dist.barrier()
    out["nothing_intact_error"] = _error_of(lambda: pm.load(root))
    return out


def _error_of(action) -> str:
    try:
        action()
    except CheckpointError as error:
        return str(error)
    return "no error"


def world_of_four(root: Path) -> dict:
    results = {name: train_and_save(name, strategy, root) for name, strategy in SAVED.items()}
    results.update({f"exact-{name}": resume(name, SAVED[name], root) for name in EXACT})
    return results


def world_of_two(root: Path) -> dict:
    results = {name: resume(name, strategy, root) for name, strategy in RELOADED.items()}
    results["corruption"] = corruption_cases(root / "corruption")
    return results


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def expected() -> dict:
    return reference()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def saved(root) -> list[dict]:
    from tessera.runtime.launch import spawn

    return spawn(world_of_four, nprocs=4, args=(root,), timeout_s=400)


@pytest.fixture(scope="module")
def reloaded(saved, root) -> list[dict]:
    from tessera.runtime.launch import spawn

    return spawn(world_of_two, nprocs=2, args=(root,), timeout_s=300)


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name", list(SAVED))
def test_training_before_and_after_the_save_matches_single_process(saved, expected, name):
    for rank_results in saved:
        torch.testing.assert_close(rank_results[name]["losses"], expected["losses"], **FP32_TOL)


def stored_tensor_bytes(folder: Path) -> tuple[int, dict[str, int]]:
    """Bytes of tensor elements the chunks of every saved tensor cover, and on-disk tensor bytes per file."""
    import math

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(folder).read_metadata()
    covered, per_file = 0, {}
    for item in metadata.state_dict_metadata.values():
        if isinstance(item, TensorStorageMetadata):
            assert sum(math.prod(chunk.sizes) for chunk in item.chunks) == math.prod(item.size)  # once, no gaps
            covered += math.prod(item.size) * item.properties.dtype.itemsize
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata):
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
    return covered, per_file


@pytest.mark.parametrize("name", list(SAVED))
def test_each_rank_writes_only_its_shards_and_nothing_twice(saved, root, name):
    # Every element of the model and of AdamW's state (exp_avg, exp_avg_sq, a scalar step per parameter) is
    # stored exactly once: DCP de-duplicates replicated tensors (DDP, norms under tp). Under ZeRO-3 and tp=4
    # every rank holds about a quarter of the state, so every rank writes a real share of the files.
    folder = root / name / f"step-{SAVE_AT:08d}"
    params = list(make_model(GPT, device="meta").parameters())
    covered, per_file = stored_tensor_bytes(folder)
    assert covered == 4 * (ADAMW_STATES * sum(p.numel() for p in params) + len(params))
    if name in ("zero3", "tp"):
        assert len(per_file) == 4 and min(per_file.values()) > 0.15 * sum(per_file.values()), per_file
    manifest = read_manifest(folder)
    assert (manifest.step, manifest.world_size) == (SAVE_AT, 4)
    assert Strategy.parse(manifest.strategy) == Strategy.parse(SAVED[name])
    assert {"plan.json", "data.pt", ".metadata"} <= set(manifest.files) and (folder / MARKER).exists()


@pytest.mark.parametrize("name", EXACT)
def test_resuming_under_the_same_plan_gives_exactly_the_uninterrupted_losses(saved, name):
    for rank_results in saved:
        assert rank_results[f"exact-{name}"]["losses"] == rank_results[name]["losses"][SAVE_AT:]


@pytest.mark.parametrize("name", list(SAVED))
def test_loads_under_another_plan_on_two_ranks_and_continues_identically(saved, reloaded, expected, name):
    # Another plan sums in another order: equal to the uninterrupted run within fp32 rounding (harness.FP32_TOL).
    for rank_results in reloaded:
        result = rank_results[name]
        assert (result["step"], result["data_state"], result["saved_world_size"]) == (SAVE_AT, {"batches_drawn": 3}, 4)
        torch.testing.assert_close(result["losses"], saved[0][name]["losses"][SAVE_AT:], **FP32_TOL)
        torch.testing.assert_close(result["losses"], expected["losses"][SAVE_AT:], **FP32_TOL)


@pytest.mark.parametrize("name", list(SAVED))
def test_loads_in_one_process_without_a_process_group(saved, root, expected, name):
    result = resume(name, ONE_PROCESS, root)
    assert result["step"] == SAVE_AT
    torch.testing.assert_close(result["losses"], expected["losses"][SAVE_AT:], **FP32_TOL)


def test_export_to_one_file_loads_into_the_plain_model(saved, root, expected, tmp_path):
    out = export_model_state_dict(root / "fsdp_tp", tmp_path / "model.pt")
    model = make_model(GPT, 100)
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    torch.testing.assert_close(full_tensors(model.named_parameters()), expected["params"], **PARAM_TOL)


def test_a_corrupted_checkpoint_is_named_and_the_previous_complete_one_is_used(reloaded):
    result = reloaded[0]["corruption"]
    error = result["explicit_error"]
    assert "step-00000001 is corrupt" in error and result["corrupted"] in error and "SHA-256" in error, error
    assert "last complete checkpoint before it is" in error and "step-00000000" in error, error
    assert result["fallback_step"] == 0 and "step-00000001" in result["skipped"][0]
    assert result["replayed_loss"] == result["first_loss"]  # the step-0 state really was loaded
    assert all(r["corruption"]["explicit_error"] == error for r in reloaded)  # every rank raised the same


def test_a_truncated_checkpoint_is_named_with_its_sizes(reloaded):
    error = reloaded[0]["corruption"]["nothing_intact_error"]
    assert error.startswith("no intact checkpoint in"), error
    assert reloaded[0]["corruption"]["truncated"] in error and "truncated" in error, error


def test_an_interrupted_save_is_never_loaded(saved, root, tmp_path):
    # A crash mid-write leaves a .partial folder, or (crash between rename and marker is impossible: the
    # marker is written first) a folder without the marker: neither is ever taken for a checkpoint.
    import shutil

    source = root / "ddp" / f"step-{SAVE_AT:08d}"
    shutil.copytree(source, tmp_path / f".step-{9:08d}.partial")
    shutil.copytree(source, tmp_path / f"step-{8:08d}")
    (tmp_path / f"step-{8:08d}" / MARKER).unlink()
    model = make_model(GPT, SEED)
    pm = apply_plan(model, make_plan(GPT, model, ONE_PROCESS))
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .*\.step-00000009\.partial"):
        pm.load(tmp_path)
    incomplete = "step-00000008 is incomplete \\(no COMPLETE marker\\): it was interrupted"
    with pytest.raises(CheckpointError, match=incomplete):
        pm.load(tmp_path / f"step-{8:08d}")
    shutil.copytree(source, tmp_path / f"step-{SAVE_AT:08d}")
    assert pm.load(tmp_path).step == SAVE_AT


def test_keep_last_prunes_older_checkpoints_and_a_step_is_saved_once(tmp_path):
    model = make_model(GPT, SEED)
    pm = apply_plan(model, make_plan(GPT, model, ONE_PROCESS))
    batch = make_batches(GPT, 1)[0]
    for _ in range(3):
        pm.save(tmp_path, keep_last=2)
        pm.train_step(batch)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE, "step-00000001", "step-00000002"]
    pm.step = 2
    with pytest.raises(CheckpointError, match="already exists; a step is saved once"):
        pm.save(tmp_path)


def test_an_elastic_restart_fits_the_cluster_to_the_live_world():
    assert fit_cluster_to_world(load_cluster("cpu:ranks=4"), 3).name == "cpu:ranks=3"
    h100 = fit_cluster_to_world(load_cluster("dgx-h100:nodes=4"), 24)
    assert (h100.name, h100.num_devices) == ("dgx-h100:nodes=3", 24)
    odd = fit_cluster_to_world(load_cluster("dgx-h100:nodes=4"), 20)  # not whole nodes: a resized copy
    assert odd.num_devices == 20 and odd.devices_per_node == 8 and "resized" in odd.name


def test_tessera_resume_replans_the_saved_run_for_one_process_and_continues(saved, root, expected):
    # The checkpoint's plan names the preset and the training (batch 8, 16 tokens): resume re-plans for
    # one device (not pp=4), builds the preset on meta, loads step 3 and the RNG state, and continues.
    import tessera

    torch.manual_seed(999)
    pm = tessera.resume(root / "pp", "cpu:ranks=4")  # fitted to the live world: one process
    assert (pm.step, pm.world_size, pm.plan.cluster) == (SAVE_AT, 1, "cpu:ranks=1")
    assert pm.resumed.saved_strategy == Strategy.parse(SAVED["pp"]).to_string()
    pool = make_batches(GPT, POOL)
    losses = [pm.train_step(draw(pool)) for _ in range(pm.step, STEPS)]
    torch.testing.assert_close(losses, expected["losses"][SAVE_AT:], **FP32_TOL)


def test_cli_resume_prints_the_new_plan_and_relaunch_line_and_export_writes_one_file(saved, root, tmp_path, capsys):
    from tessera.cli import main

    assert main(["resume", str(root / "zero3"), "--cluster", "cpu:ranks=2", "--json", str(tmp_path / "p.json")]) == 0
    printed = capsys.readouterr().out
    assert "re-planned for cpu:ranks=2" in printed and "--nproc-per-node=2" in printed
    assert f"--resume-from {root / 'zero3'}" in printed and (tmp_path / "p.json").exists()
    assert f"--plan {tmp_path / 'p.json'}" in printed  # train_from_plan.py requires it: the line ran nothing without
    assert main(["export", str(root / "tp"), str(tmp_path / "tp.pt")]) == 0
    assert set(torch.load(tmp_path / "tp.pt", weights_only=True)) == set(make_model(GPT, device="meta").state_dict())
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "x.pt")]) == 2
    assert "checkpoint folder" in capsys.readouterr().err
