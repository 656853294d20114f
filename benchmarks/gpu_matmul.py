"""Measured matmul and attention-core rates on this machine's GPU against the rates the cost model gives them.

Run where a GPU is lent: ``python benchmarks/gpu_matmul.py`` (under a minute on one H100/H200). For each local width
``d`` it times the forward matmuls of one transformer block at 8192 tokens (``tokens x d @ d x d`` and
``tokens x d @ d x 4d``) in bf16 and in FP8 (``torch._scaled_mm``, per-tensor scales, e4m3 both sides), and the
causal SDPA core at head dims 64 and 128 for a few sequence lengths (the figures ``topology.head_dims`` reads off
the kernel papers), and prints each beside the cost model's rate:
``cost_models.compute.achievable_flops`` (bf16), the FP8 peak times ``Calibration.fp8_at`` (FP8), and
``attention_efficiency`` with Tessera's kernels (attention: counted on the FLOPs a causal kernel performs,
``CAUSAL_WORK`` of the full product).

The model's constants are fitted on whole training runs (``benchmarks/published.py``), so an isolated kernel
may run faster than the curve says: the table shows how much of the gap between a run and its matmuls the
constants carry. Writes ``benchmarks/results/gpu-matmul-<date>.md``. Never needed for CI.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TOKENS = 8192
WIDTHS = (512, 1024, 2048, 4096, 8192)
SEQ_LENS = (1024, 2048, 4096, 8192)
HEAD_DIMS = (64, 128)
ATTENTION_WIDTH = 2048  # heads x head dim of the timed calls, as the FlashAttention-2 paper's benchmark


def timed_s(fn, repeats: int = 20) -> float:
    """Mean seconds of ``fn`` over ``repeats`` calls after three warm-ups, timed with CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def matmul_rates(m: int, k: int, n: int) -> tuple[float, float | str]:
    """(bf16, FP8) FLOP/s of an ``m x k @ k x n`` product; FP8 is the error's text where ``_scaled_mm`` refuses."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    flops = 2 * m * k * n
    bf16 = flops / timed_s(lambda: a @ b.t())
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        fp8 = flops / timed_s(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    except (RuntimeError, AttributeError) as error:
        fp8 = f"{type(error).__name__}: {error}".splitlines()[0][:120]
    return bf16, fp8


def sdpa_backend(seq_len: int, head_dim: int = 128) -> str:
    """The backend torch's SDPA chooses for a causal bf16 call at ``seq_len`` with grads (``torch._fused_sdp_choice``):
    what the cost model's ``TESSERA.attention_kernels`` assumes (cuDNN on sm90/sm100 with a cuDNN past 9.15.0)."""
    from torch.nn.attention import SDPBackend

    q = torch.randn(1, ATTENTION_WIDTH // head_dim, seq_len, head_dim, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name


def attention_rate(seq_len: int, head_dim: int = 128, batch: int = 0) -> float:
    """Forward + backward FLOP/s of causal SDPA at ``seq_len`` on heads ``head_dim`` wide, counted as the cost model
    counts."""
    from tessera.cost_models.compute import BACKWARD_CORE_FLOPS, CAUSAL_WORK

    batch, heads = batch or max(1, TOKENS // seq_len), ATTENTION_WIDTH // head_dim
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    forward_flops = 4 * batch * heads * seq_len * seq_len * head_dim * CAUSAL_WORK
    return forward_flops * (1 + BACKWARD_CORE_FLOPS) / timed_s(step, repeats=10)


def model_matmul_flops(device, width: int) -> tuple[float, float]:
    """(bf16, FP8) FLOP/s the cost model gives a matmul of local width ``width`` on ``device``."""
    from tessera.cost_models.compute import achievable_flops, device_calibration

    return (achievable_flops(device, "bf16", width=width),
            device.peak_flops("fp8") * device_calibration(device).fp8_at(width))


def model_attention_flops(device, seq_len: int, head_dim: int = 128) -> float:
    """FLOP/s the cost model gives Tessera's causal attention core at ``seq_len`` on heads ``head_dim`` wide, on the
    FLOPs the kernel performs."""
    from tessera.cost_models.compute import CAUSAL_WORK, attention_efficiency
    from tessera.cost_models.profiles import TESSERA
    from tessera.topology.head_dims import HeadDims

    efficiency = attention_efficiency(device, "bf16", kernels=TESSERA.attention_kernels, seq_len=seq_len,
                                      head_widths=((1.0, HeadDims(head_dim, head_dim)),))
    return device.peak_flops("bf16") * efficiency * CAUSAL_WORK


def main(argv: list[str] | None = None) -> Path:
    from gpu_check import catalog_cluster

    from tessera.topology import load_cluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "results", help="folder for the .md result")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: this script measures a GPU's kernels (run it where one is lent)")
    name = torch.cuda.get_device_name()
    device = load_cluster(catalog_cluster(name)).device
    tf = 1e12
    lines = [f"# Kernel rates on {name} against the cost model ({datetime.date.today().isoformat()})", "",
             f"Catalog part {device.name}: bf16 peak {device.peak_flops('bf16') / tf:.0f}, FP8 peak "
             f"{device.peak_flops('fp8') / tf:.0f} TFLOP/s. torch {torch.__version__}. Command: "
             "`python benchmarks/gpu_matmul.py`. Means of 20 calls after 3 warm-ups (CUDA events).", "",
             f"## Matmuls at {TOKENS} tokens (TFLOP/s; model = what the cost model gives width d)", "",
             "| d | shape | bf16 measured | bf16 model | model/measured | FP8 measured | FP8 model | model/measured |",
             "|---|---|---|---|---|---|---|---|"]
    for d in WIDTHS:
        for n in (d, 4 * d):
            bf16, fp8 = matmul_rates(TOKENS, d, n)
            bf16_model, fp8_model = model_matmul_flops(device, d)
            fp8_cells = (f"{fp8 / tf:.0f} | {fp8_model / tf:.0f} | {fp8_model / fp8:.2f}" if isinstance(fp8, float)
                         else f"{fp8} | {fp8_model / tf:.0f} | -")
            line = (f"| {d} | {TOKENS}x{d} @ {d}x{n} | {bf16 / tf:.0f} | {bf16_model / tf:.0f} | "
                    f"{bf16_model / bf16:.2f} | {fp8_cells} |")
            lines.append(line)
            print(line, flush=True)
    lines += ["", f"## Causal attention core, forward + backward, {ATTENTION_WIDTH} wide (heads x head dim), {TOKENS} "
              "tokens per call (TFLOP/s; SDPA's backend: the one torch chose, which Tessera's runtime runs; the model "
              "prices cuDNN on Hopper and Blackwell)", "",
              "| head dim | seq len | SDPA's backend | measured | model | model/measured |", "|---|---|---|---|---|---|"]
    for head_dim in HEAD_DIMS:
        for seq_len in SEQ_LENS:
            measured = attention_rate(seq_len, head_dim)
            model = model_attention_flops(device, seq_len, head_dim)
            line = (f"| {head_dim} | {seq_len} | {sdpa_backend(seq_len, head_dim)} | {measured / tf:.0f} | "
                    f"{model / tf:.0f} | {model / measured:.2f} |")
            lines.append(line)
            print(line, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-matmul-{datetime.date.today().isoformat()}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"written {path}")
    return path


if __name__ == "__main__":
    main()
