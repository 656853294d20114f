"""Predicted vs measured peak memory and step time of single-device configurations on this machine's GPU.

Run where a GPU is lent: ``.venv/bin/python benchmarks/gpu_check.py && .venv/bin/python -m pytest tests/gpu`` (a few
minutes on one H100/H200; ``--only REGEX`` picks configurations, ``--steps N`` timed steps each). Every configuration of ``CONFIGS`` (a model, micro-batch,
recomputation and precision; 22 of them) is planned with everything pinned on a one-device cluster of the GPU's
catalog part (``catalog_cluster``: the name torch reports -> the catalog entry), applied by Tessera's runtime on that
one device (``tessera.runtime.apply.apply_plan``, no process group), warmed up, timed over ``--steps`` steps
(``torch.cuda.synchronize`` around each) and measured: ``torch.cuda.max_memory_allocated`` over one more step,
against the estimate's peak less its fixed allowance for what torch does not allocate (CUDA context, NCCL buffers;
``cost_models.memory.GPU_RESERVE_BYTES``). A configuration that fails is a row with its error, not the end of the run.

``--device cpu`` runs the same harness on this machine's CPU (small configurations, ``CPU_CONFIGS``; memory from the
CPU allocator's events, ``memory_meter.AllocatorMeter``): a dry run that checks the script where no GPU is, as
``tests/unit/test_gpu_check.py`` does. Writes ``benchmarks/results/gpu-check-<device>-<date>.md`` and ``.json``.
Never needed for CI.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SMALL_GPT = "gpt:layers=12,hidden=1024,heads=16,vocab=32768,seq=1024"
SMALL_LLAMA = "llama:layers=8,hidden=2048,heads=16,kv_heads=4,ffn=5632,vocab=32000,seq=2048"
LLAMA_8B_2 = "llama3-8b:layers=2"
# (name, model spec, sequence length, micro-batch, recompute, precision); two micro-batches per step each
CONFIGS = [
    *((f"gpt-{p}-mbs{m}-{r}", SMALL_GPT, 1024, m, r, p) for p in ("bf16",) for m in (1, 4, 8) for r in ("none", "full")),
    ("gpt-bf16-mbs4-selective", SMALL_GPT, 1024, 4, "selective", "bf16"),
    *((f"gpt-fp32-mbs{m}-none", SMALL_GPT, 1024, m, "none", "fp32") for m in (1, 4)),
    *((f"llama-{p}-mbs{m}-{r}", SMALL_LLAMA, 2048, m, r, p) for p in ("bf16",) for m in (1, 4, 8) for r in ("none", "full")),
    ("llama-bf16-mbs4-selective", SMALL_LLAMA, 2048, 4, "selective", "bf16"),
    *((f"llama-fp32-mbs{m}-none", SMALL_LLAMA, 2048, m, "none", "fp32") for m in (1, 2)),
    *((f"llama3-8b-2blocks-bf16-mbs{m}-none", LLAMA_8B_2, 4096, m, "none", "bf16") for m in (1, 2)),
    ("gpt-fp8-mbs4-none", SMALL_GPT, 1024, 4, "none", "fp8"),  # torchao float8 (runtime.float8)
    ("llama-fp8-mbs4-none", SMALL_LLAMA, 2048, 4, "none", "fp8"),
]
CPU_WEIGHTY = "gpt:layers=4,hidden=768,heads=12,vocab=4096,seq=64"  # 34M parameters: weight copies are visible
CPU_FP8 = "gpt:layers=2,hidden=128,heads=4,vocab=4096,seq=64"  # small: torch's CPU FP8 matmul is a reference loop
CPU_CONFIGS = [
    *((f"tiny-fp32-mbs{m}-{r}", "gpt-tiny:layers=2", 64, m, r, "fp32") for m in (1, 2) for r in ("none", "full")),
    *((f"weighty-{p}-mbs1-none", CPU_WEIGHTY, 64, 1, "none", p) for p in ("fp32", "bf16")),
    *((f"small-{p}-mbs2-{r}", CPU_FP8, 64, 2, r, p) for p in ("bf16", "fp8") for r in ("none", "full")),
]
CATALOG_PARTS = (  # (words of torch's device name, preset, gpu= variant or None), first match wins
    (("H200",), "dgx-h200", None), (("H100", "NVL"), "dgx-h100", "H100-NVL-94GB"), (("H100",), "dgx-h100", None),
    (("A100-SXM4-40GB",), "dgx-a100", "A100-SXM-40GB"), (("A100-SXM4-80GB",), "dgx-a100", None), (("B200",), "dgx-b200", None),
    (("GB200",), "gb200-nvl72", None), (("B300",), "dgx-b300", None), (("GB300",), "gb300-nvl72", None),
)
UNCATALOGUED = ("PCIe", "GH200", "H200 NVL")
"""Parts whose names contain a catalogued one's but whose figures differ (PCIe clocks and power, Grace Hopper)."""


def catalog_cluster(device_name: str) -> str:
    """A one-device cluster of the catalog part named like ``device_name`` (``NVIDIA H200`` -> ``dgx-h200``)."""
    words = set(device_name.split())
    for needles, preset, variant in CATALOG_PARTS:
        if words.issuperset(needles) and not any(u in device_name for u in UNCATALOGUED):
            return f"{preset}:nodes=1,gpus_per_node=1" + (f",gpu={variant}" if variant else "")
    known = ", ".join("+".join(needles) for needles, *_ in CATALOG_PARTS)
    raise SystemExit(f"no catalog part for GPU {device_name!r} (known: {known}); add its figures to topology/catalog.yaml "
                     "and a line to CATALOG_PARTS")


def planned(spec: str, cluster: str, seq_len: int, micro_batch: int, recompute: str, precision: str):
    """The pinned single-device plan of a configuration (two micro-batches per step)."""
    from local_truth import as_plan

    from tessera.api import _prepare
    from tessera.cost_models import Strategy

    prepared = _prepare(spec, cluster, global_batch=2 * micro_batch, seq_len=seq_len, precision=precision)
    return as_plan(spec, prepared, Strategy.parse(f"dp=1,zero=0,mbs={micro_batch},recompute={recompute}"))


def measure(plan, spec: str, device: str, steps: int) -> dict:
    """Apply ``plan`` on one ``device``, warm up, time ``steps`` steps, then the peak bytes of one more step (what
    the device held before the model, a previous configuration's leftovers, subtracted)."""
    from tessera.models import build_model, model_config
    from tessera.runtime.apply import apply_plan

    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    torch.manual_seed(0)
    parallel = apply_plan(build_model(spec, device=device), plan)
    batch_shape = (plan.training.global_batch, plan.training.seq_len + 1)
    tokens = torch.randint(model_config(spec).vocab, batch_shape, generator=torch.Generator().manual_seed(1)).to(device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    parallel.train_step(batch)  # warm-up: kernels chosen, optimizer state allocated
    seconds = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        parallel.train_step(batch)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return {"step_s": statistics.median(seconds), "peak_bytes": peak_bytes(parallel, batch, device) - before}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_bytes(parallel, batch, device: str) -> int:
    """Peak bytes allocated during one training step: torch's CUDA statistics, or the CPU allocator's events."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        parallel.train_step(batch)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    from memory_meter import AllocatorMeter, resident_bytes

    resident = sum(resident_bytes(module, parallel.optimizer) for module in parallel.modules)
    with AllocatorMeter(resident) as meter:
        parallel.train_step(batch)
    return meter.peak_bytes


def check(configs: list[tuple], device: str, steps: int) -> list[dict]:
    """One row per configuration: predicted and measured step time and peak memory, or the error it raised."""
    from tessera.cost_models.memory import CPU_RESERVE_BYTES, GPU_RESERVE_BYTES

    cluster = "cpu:ranks=1" if device == "cpu" else catalog_cluster(torch.cuda.get_device_name())
    reserve = CPU_RESERVE_BYTES if device == "cpu" else GPU_RESERVE_BYTES
    rows = []
    for name, spec, seq_len, micro_batch, recompute, precision in configs:
        row = {"config": name, "model": spec, "seq_len": seq_len, "cluster": cluster}
        try:
            plan = planned(spec, cluster, seq_len, micro_batch, recompute, precision)
            row |= {"strategy": plan.strategy.to_string(), "precision": precision,
                    "predicted_step_s": plan.estimate.step_time_s,
                    "predicted_peak_bytes": plan.estimate.peak_memory_bytes - reserve}
            row |= measure(plan, spec, device, steps)
        except Exception as error:  # a failed configuration is a finding, not the end of the run
            row["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        gc.collect()  # the configuration's modules and hooks, before the next one is measured
        if device == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        print(summary_line(row), flush=True)
    return rows


def errors(row: dict) -> tuple[float, float]:
    """(step time, peak memory) errors of a measured row: predicted over measured, less one."""
    return row["predicted_step_s"] / row["step_s"] - 1, row["predicted_peak_bytes"] / row["peak_bytes"] - 1


def summary_line(row: dict) -> str:
    if "error" in row:
        return f"{row['config']}: FAILED {row['error']}"
    time_error, memory_error = errors(row)
    return (f"{row['config']}: step predicted {row['predicted_step_s']:.4f} s measured {row['step_s']:.4f} s "
            f"({time_error:+.1%}); peak predicted {row['predicted_peak_bytes'] / 2**20:.0f} MiB "
            f"measured {row['peak_bytes'] / 2**20:.0f} MiB ({memory_error:+.1%})")


def markdown(rows: list[dict], *, device: str, device_name: str, command: str) -> str:
    measured = [r for r in rows if "error" not in r]
    time_errors = [abs(errors(r)[0]) for r in measured]
    memory_errors = [abs(errors(r)[1]) for r in measured]
    lines = [f"# Single-device configurations: predicted vs measured ({datetime.date.today().isoformat()})", "",
             f"Device: {device_name} ({device}). Command: `{command}`.", ""]
    if measured:
        lines += [f"- step time: median |error| {statistics.median(time_errors):.1%}, worst {max(time_errors):.1%} "
                  f"over {len(measured)} configurations",
                  f"- peak memory: median |error| {statistics.median(memory_errors):.1%}, worst {max(memory_errors):.1%}"]
    if len(measured) < len(rows):
        lines.append(f"- failed: {len(rows) - len(measured)} configurations (their error in the table)")
    lines += ["", "| config | strategy | predicted s | measured s | error | predicted MiB | measured MiB | error |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r.get('strategy', '-')} | - | - | - | - | - | {r['error']} |")
            continue
        time_error, memory_error = errors(r)
        lines.append(f"| {r['config']} | {r['strategy']} | {r['predicted_step_s']:.4f} | {r['step_s']:.4f} | "
                     f"{time_error:+.1%} | {r['predicted_peak_bytes'] / 2**20:.0f} | "
                     f"{r['peak_bytes'] / 2**20:.0f} | {memory_error:+.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of the harness on small configurations (write it elsewhere with --out)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (the median is kept)")
    parser.add_argument("--only", metavar="REGEX", help="only the configurations whose name matches")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="folder for the .md and .json results")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; run with --device cpu for a dry run of the harness")
    configs = [c for c in (CONFIGS if args.device == "cuda" else CPU_CONFIGS) if not args.only or re.search(args.only, c[0])]
    if not configs:
        raise SystemExit(f"--only {args.only!r} matches no configuration")
    rows = check(configs, args.device, args.steps)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "this machine's CPU (dry run)"
    stem = args.out / f"gpu-check-{args.device}-{datetime.date.today().isoformat()}"
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    stem.with_suffix(".md").write_text(markdown(rows, device=args.device, device_name=device_name, command=command.strip()))
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"written {stem}.md and .json")
    return stem.with_suffix(".md")


if __name__ == "__main__":
    main()
