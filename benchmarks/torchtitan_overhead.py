"""Runtime overhead against a real peer: Tessera vs torchtitan's own parallelisation of torchtitan's Llama 3.

Run: ``.venv/bin/python benchmarks/torchtitan_overhead.py [--ranks 4] [--pairs 12] [--only fsdp,tp,fsdp-tp]``

On ``--ranks`` gloo ranks (CPU), every rank builds torchtitan's Llama 3 ``debugmodel`` (dim 256, 6 layers, 16
heads, vocabulary 2048, fused QKV; plain SDPA attention, since flex attention has no CPU backward) twice from
one seed: once parallelised by Tessera (``tessera.auto_parallelize`` with the strategy pinned), once by
torchtitan itself (``torchtitan.models.llama3.parallelize_llama`` on torchtitan's ``ParallelDims`` mesh:
``Module.parallelize`` for tensor/sequence parallelism, ``apply_fsdp_to_decoder`` for FSDP, its
``cross_entropy_loss`` summed and divided by the global token count as its trainer does). Both train on the
same batches with AdamW. Steps alternate one by one (``--pairs`` pairs after ``WARMUP`` steps each, the order
flipped every pair) so drift in machine load hits both alike; a step's time is the slowest rank's. We report
medians, the median of the per-pair ratios Tessera / torchtitan and its interquartile range; goal <= 1.05.
Both must produce the same losses (they train the same model). Writes
``benchmarks/results/torchtitan-overhead-<hardware>-<date>.md`` with the command and the machine load.

Where torchtitan 0.3.0 cannot run as shipped on CPU ranks with torch 2.13, the smallest change is made and
said here: its ``ParallelDims`` builds the mesh on ``torchtitan.tools.utils.device_type``, which is "cuda"
when no accelerator exists (set to "cpu" while the mesh is built); its size-1 mesh axes use the "fake"
process-group backend, registered by ``torch.testing._internal.distributed.fake_pg``; its FSDP sums gradients
(``set_gradient_divide_factor(1.0)``), which FSDP2 sends as ``PREMUL_SUM``, which gloo lacks: we also set
``set_force_sum_reduction_for_comms(True)``, the same sum as plain ``SUM`` (what torchtitan sets for its
symmetric-memory FSDP). Its default ``spmd_backend="spmd_types"`` fails inside ``fully_shard`` on torch 2.13
("all parameters must be DTensors on the full SPMD mesh"), so torchtitan runs its DTensor backend
``"partial_dtensor"``. Gradient clipping (torchtitan's trainer clips at 1.0 by default) is off on both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from runtime_overhead import timed  # noqa: E402 (the slowest rank's seconds of one step, and its loss)

GLOBAL_BATCH, SEQ_LEN, LR, SEED = 8, 128, 1e-3, 0
WARMUP, BATCHES = 2, 4  # warm-up steps per side; distinct batches, cycled
NO_OVERLAP = "tp_overlap=false,sp_regather=false"  # torchtitan overlaps TP only when compiled (async TP)
STRATEGIES = {  # every field pinned; sp as torchtitan enables it by default under tensor parallelism
    "fsdp": "dp=4,zero=3,mbs=2,recompute=none",
    "tp": f"dp=1,tp=4,sp=true,zero=0,mbs=8,recompute=none,{NO_OVERLAP}",
    "fsdp-tp": f"dp=2,tp=2,sp=true,zero=3,mbs=4,recompute=none,{NO_OVERLAP}",
}
LOSS_RTOL = 1e-4  # two fp32 implementations of the same step (different reduction orders): ~1e-6 apart


def llama3_config(*, seq_len: int, layers: int | None = None, sequence_parallel: bool | None = None):
    """torchtitan's Llama 3 ``debugmodel`` config with SDPA attention and RoPE tables of ``seq_len``.

    ``layers`` keeps the first ``layers`` blocks; ``sequence_parallel`` (not None) declares torchtitan's
    sharding on every sub-config, as its trainer does before building a model it will parallelise.
    """
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()  # causal SDPA, no masks
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=seq_len)
    if sequence_parallel is not None:
        set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    return config


def build_llama3(config, seed: int = SEED) -> torch.nn.Module:
    """The model on CPU, initialised by torchtitan's ``init_states`` from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


class Torchtitan:
    """torchtitan's parallelisation of its Llama 3 for one strategy: ``step(inputs, targets) -> loss``."""

    def __init__(self, *, dp: int, tp: int, sp: bool) -> None:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers "fake" for size-1 axes)
        import torchtitan.distributed.parallel_dims as parallel_dims_module
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.models.llama3 import parallelize_llama

        parallelism = ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp,
                                        enable_sequence_parallel=sp, spmd_backend="partial_dtensor")
        dist_utils.set_spmd_backend(parallelism.spmd_backend)  # as its trainer does
        self.dims = ParallelDims.from_config(parallelism, dist.get_world_size())
        with mock.patch.object(parallel_dims_module, "device_type", "cpu"):
            self.dims.build_mesh()
        self.model = build_llama3(llama3_config(seq_len=SEQ_LEN, sequence_parallel=sp))
        parallelize_llama(self.model, parallel_dims=self.dims, training=TrainingConfig(mixed_precision_param="float32"),
                          parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                          dump_folder=os.devnull)
        sum_gradients_without_premul(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.batch_mesh = self.dims.get_mesh("batch") if dp > 1 else None
        self.rows = GLOBAL_BATCH // dp
        self.row_start = self.rows * (self.batch_mesh.get_local_rank() if self.batch_mesh else 0)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One step of torchtitan's trainer (no clipping, no data loader): loss = local sum / global tokens."""
        from torchtitan.components.loss import cross_entropy_loss

        rows = slice(self.row_start, self.row_start + self.rows)
        inputs, targets = inputs[rows], targets[rows]  # (B/dp, T)
        self.optimizer.zero_grad()
        tokens = torch.tensor(targets.numel())
        self._sum_over_batch(tokens)
        loss = cross_entropy_loss(self.model(inputs), targets) / tokens
        loss.backward()
        self.optimizer.step()
        loss = loss.detach()
        self._sum_over_batch(loss)  # every rank returns the global mean loss, as Tessera does
        return loss.item()

    def _sum_over_batch(self, tensor: torch.Tensor) -> None:
        if self.batch_mesh is not None:
            dist.all_reduce(tensor, group=self.batch_mesh.get_group())


def sum_gradients_without_premul(model: torch.nn.Module) -> None:
    """Keep torchtitan's summed gradients on gloo: SUM, not PREMUL_SUM(1.0) (see the module docstring)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def tessera_step(strategy: str):
    """Tessera's version: ``auto_parallelize`` with every strategy field pinned; refuses if the plan differs."""
    import tessera
    from tessera.cost_models.types import Strategy

    model = build_llama3(llama3_config(seq_len=SEQ_LEN))
    parallel = tessera.auto_parallelize(model, f"cpu:ranks={dist.get_world_size()}", global_batch=GLOBAL_BATCH,
                                        seq_len=SEQ_LEN, strategy=strategy, precision="fp32")
    plan = parallel.plan
    if plan.strategy != Strategy.parse(strategy) or any(layer.recompute != "none" for layer in plan.layers):
        raise RuntimeError(f"planned {plan.strategy.to_string()} with per-layer recomputation, not {strategy}")
    return lambda inputs, targets: parallel.train_step((inputs, targets))


def compare(name: str, pairs: int) -> dict:
    """On every rank: both versions of one strategy, timed in ``pairs`` alternating pairs of steps."""
    from tessera.cost_models.types import Strategy
    from tessera.errors import TesseraError

    strategy = Strategy.parse(STRATEGIES[name])
    load_before = os.getloadavg()
    try:
        ours = tessera_step(STRATEGIES[name])
    except TesseraError as error:  # refused before any collective, alike on every rank
        return {"refused": f"{type(error).__name__}: {error}", "load": (load_before, os.getloadavg())}
    theirs = Torchtitan(dp=strategy.dp, tp=strategy.tp, sp=strategy.sp).step
    runners = {"tessera": ours, "torchtitan": theirs}
    batches = make_batches()
    losses: dict[str, list[float]] = {"tessera": [], "torchtitan": []}
    times: dict[str, list[float]] = {"tessera": [], "torchtitan": []}
    for index in range(WARMUP + pairs):
        order = list(runners) if index % 2 == 0 else list(reversed(runners))
        for runner in order:  # one step each on the same batch, the order flipped every pair
            seconds, loss = timed(runners[runner], batches[index % BATCHES])
            losses[runner].append(loss)
            if index >= WARMUP:
                times[runner].append(seconds)
    return {"times": times, "losses": losses, "load": (load_before, os.getloadavg())}


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(2048, (BATCHES, GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    return [(step[:, :-1], step[:, 1:]) for step in tokens]  # (B, T) inputs, next-token targets


def run_all(names: list[str], pairs: int) -> dict:
    """On every rank: each strategy in turn (a failure ends the spawn, with the strategy named)."""
    results = {}
    for name in names:
        try:
            results[name] = compare(name, pairs)
        except Exception as error:
            raise RuntimeError(f"strategy {name} ({STRATEGIES[name]}) failed") from error
    return results


def summarise(name: str, result: dict) -> dict:
    """The row of one strategy: medians, quartiles, the per-pair ratio and whether the losses agree."""
    row = {"name": name, "strategy": STRATEGIES[name], "load": result["load"]}
    if "refused" in result:
        return {**row, "refused": result["refused"]}
    times, losses = result["times"], result["losses"]
    ratios = sorted(ours / theirs for ours, theirs in zip(times["tessera"], times["torchtitan"]))
    deviation = max(abs(a - b) / abs(b) for a, b in zip(losses["tessera"], losses["torchtitan"]))
    return {**row, "tessera": quartiles(times["tessera"]), "torchtitan": quartiles(times["torchtitan"]),
            "ratio": quartiles(ratios), "loss_deviation": deviation, "losses": losses["torchtitan"],
            "same_losses": deviation <= LOSS_RTOL}


def quartiles(values: list[float]) -> tuple[float, float, float]:
    low, median, high = statistics.quantiles(values, n=4)
    return low, statistics.median(values), high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--only", default=",".join(STRATEGIES), help="comma-separated: " + ", ".join(STRATEGIES))
    args = parser.parse_args()
    names = [name for name in args.only.split(",") if name]
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
    from tessera.runtime.launch import spawn

    uptime_before = uptime()
    results = spawn(run_all, nprocs=args.ranks, args=(names, args.pairs), timeout_s=3000)[0]
    rows = [summarise(name, results[name]) for name in names]
    for row in rows:
        print(table_row(row), flush=True)
    write_report(rows, args, uptime_before, uptime())


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def table_row(row: dict) -> str:
    load = f"{row['load'][0][0]:.1f} -> {row['load'][1][0]:.1f}"
    if "refused" in row:
        return f"| {row['name']} | `{row['strategy']}` | Tessera refused: {row['refused']} | | | | | {load} |"
    ours, theirs, ratio = row["tessera"], row["torchtitan"], row["ratio"]
    return (f"| {row['name']} | `{row['strategy']}` | {ours[1] * 1e3:.0f} ({ours[0] * 1e3:.0f}-{ours[2] * 1e3:.0f}) | "
            f"{theirs[1] * 1e3:.0f} ({theirs[0] * 1e3:.0f}-{theirs[2] * 1e3:.0f}) | **{ratio[1]:.3f}** | "
            f"{ratio[0]:.3f}-{ratio[2]:.3f} | {'yes' if row['same_losses'] else 'NO'} "
            f"({row['loss_deviation']:.1e}) | {load} |")


def write_report(rows: list[dict], args: argparse.Namespace, uptime_before: str, uptime_after: str) -> Path:
    import torchtitan

    hardware = f"{platform.machine()}-cpu"
    path = HERE / "results" / f"torchtitan-overhead-{hardware}-{datetime.date.today().isoformat()}.md"
    command = " ".join([".venv/bin/python", "benchmarks/torchtitan_overhead.py", *sys.argv[1:]])
    losses = next((row["losses"] for row in rows if "losses" in row), [])
    lines = [
        "# Runtime overhead: Tessera vs torchtitan's own parallelisation of torchtitan's Llama 3", "",
        f"Command: `{command}`", "",
        f"Machine: {platform.processor() or platform.machine()}, {args.ranks} gloo ranks (one torch thread each) on "
        f"{os.cpu_count()} cores, shared with other jobs; torch {torch.__version__}, torchtitan "
        f"{getattr(torchtitan, '__version__', '?')}.", "",
        f"Load: `{uptime_before}` before, `{uptime_after}` after.", "",
        f"Model: torchtitan `llama3` `debugmodel` (6.2M parameters), SDPA attention, global batch {GLOBAL_BATCH} x "
        f"{SEQ_LEN} tokens, fp32, AdamW lr {LR}. {WARMUP} warm-up steps each, then {args.pairs} pairs of steps "
        "(one each on the same batch, order flipped every pair); a step's time is the slowest rank's. Times: "
        "median (interquartile range) in ms; ratio: median over pairs of Tessera / torchtitan and its "
        "interquartile range. Goal: ratio <= 1.05. Same losses: every step's loss within "
        f"{LOSS_RTOL:g} relative (largest deviation in brackets). Load: 1-minute load average before -> after "
        "the strategy ran.", "",
        "| | strategy | Tessera (ms) | torchtitan (ms) | ratio | ratio IQR | same losses | load |",
        "|---|---|---:|---:|---:|---|---|---|",
        *[table_row(row) for row in rows], "",
        f"Losses (torchtitan, first strategy): {', '.join(f'{loss:.4f}' for loss in losses[:WARMUP + 4])} ...", "",
        "How torchtitan runs here (changes for CPU ranks and torch 2.13, none in its parallelisation): "
        "see the docstring of `benchmarks/torchtitan_overhead.py`.",
    ]
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
