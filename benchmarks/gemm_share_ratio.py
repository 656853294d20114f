"""The B200's share of its peak in GEMMs over the H100's, from XLA's measured GEMM table (``catalog.yaml``
``matmul_scale``).

Run: ``.venv/bin/python benchmarks/gemm_share_ratio.py --xla-table FILE``, where FILE is
``xla/service/gpu/model/matmul_interpolator_data.h`` of openxla/xla at commit 71feeddf7cc3 (``git show
71feeddf7cc3:xla/service/gpu/model/matmul_interpolator_data.h > FILE`` in a checkout of openxla/xla or of its ROCm
fork). Never vendored. Its ``sm_100`` table is the B200's, its ``sm_90`` the H100 SXM's, over the same shapes
(batch x m x n x k); each rate is taken over the catalog's dense peak of that part.

Prints the median B200/H100 ratio of bf16 shares over the shapes of at least 4096^3 multiply-adds (the catalog's
factor) and over all shapes, both parts' rates at 4096^3 with the B200's FP8 share there, and the highest H100
FP8 rate over the H100's FP8 peak (above 1: the table's sm_90 FP8 rates give no ratio). Then, for each part, the FP8
half-width that the table's FP8-over-bf16 share ratio implies beside the bf16 half-width of
``compute.GPU_CALIBRATION`` (``docs/calibration-log.md``, 2026-12-07: tried, not kept).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from pathlib import Path

from tessera.cost_models.compute import GPU_CALIBRATION
from tessera.topology.hardware import device

PARTS = {"sm_100": "B200-SXM-180GB", "sm_90": "H100-SXM-80GB"}
BF16, FP8 = "bf16xbf16->bf16", "f8e4m3fnxf8e4m3fn->bf16"
ENTRY = re.compile(r'key: "(sm_\d+)"|entries \{\s*b: (\d+)\s*m: (\d+)\s*n: (\d+)\s*k: (\d+)((?:\s*flops \{[^}]*\})+)')
RATE = re.compile(r'key: "([^"]+)" value: (\d+)')


def shares(text: str) -> dict[tuple[str, tuple[int, ...]], dict[str, float]]:
    """``{(arch, (b, m, n, k)): {dtype key: rate over the part's peak in that dtype}}`` for the two parts."""
    table, arch = {}, None
    for match in ENTRY.finditer(text):
        if match.group(1):
            arch = match.group(1)
        elif arch in PARTS:
            part = device(PARTS[arch])
            rates = {key: float(value) for key, value in RATE.findall(match.group(6))}
            table[arch, tuple(map(int, match.group(2, 3, 4, 5)))] = {
                key: rate / part.peak_flops("fp8" if key.startswith("f8") else "bf16") for key, rate in rates.items()}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--xla-table", type=Path, required=True, help="matmul_interpolator_data.h at 71feeddf7cc3")
    table = shares(parser.parse_args().xla_table.read_text())
    shapes = sorted({shape for arch, shape in table if ("sm_100", shape) in table and ("sm_90", shape) in table})
    ratio = {shape: table["sm_100", shape][BF16] / table["sm_90", shape][BF16] for shape in shapes}
    large = [r for shape, r in ratio.items() if shape[0] * shape[1] * shape[2] * shape[3] >= 4096**3]
    cube = (1, 4096, 4096, 4096)
    b200, h100 = device(PARTS["sm_100"]), device(PARTS["sm_90"])
    print(f"bf16 share ratio B200/H100, {len(large)} shapes of >= 4096^3 multiply-adds: median "
          f"{statistics.median(large):.3f} ({min(large):.2f}-{max(large):.2f})")
    print(f"bf16 share ratio B200/H100, all {len(shapes)} shapes: median {statistics.median(ratio.values()):.3f}")
    print(f"at 4096^3: B200 {table['sm_100', cube][BF16] * b200.peak_flops('bf16') / 1e12:.0f} TFLOP/s "
          f"({table['sm_100', cube][BF16]:.2f} of peak), H100 {table['sm_90', cube][BF16] * h100.peak_flops('bf16') / 1e12:.0f} "
          f"({table['sm_90', cube][BF16]:.2f}); B200 FP8 {table['sm_100', cube][FP8]:.2f} of its FP8 peak")
    print(f"highest H100 FP8 rate over its FP8 peak: "
          f"{max(v[FP8] for (arch, _), v in table.items() if arch == 'sm_90' and FP8 in v):.2f}")
    for arch in PARTS:
        for tokens in (2048, 4096, 8192):
            print(f"{arch}, shapes of at least {tokens} tokens: FP8 half-width {fp8_half_width(table, arch, tokens):.0f}")


def fp8_half_width(table: dict, arch: str, min_tokens: int) -> float:
    """The FP8 half-width whose curve over the bf16 curve (``(w + h) / (w + h8)``, ``w`` a GEMM's narrower weight
    dimension) best fits, in log, ``arch``'s FP8-over-bf16 share ratio on the shapes of at least ``min_tokens`` rows,
    each ratio over the median ratio of the shapes at least 4096 wide and 8192 rows (where both have saturated)."""
    half = GPU_CALIBRATION.half_width
    ratios = [(shape, v[FP8] / v[BF16]) for (a, shape), v in table.items() if a == arch and BF16 in v and FP8 in v]
    top = statistics.median(r for (b, m, n, k), r in ratios if min(n, k) >= 4096 and b * m >= 8192)
    points = [(min(n, k), r / top) for (b, m, n, k), r in ratios if b * m >= min_tokens]
    return min(range(0, 3001, 10), key=lambda h8: sum((math.log((w + half) / (w + h8)) - math.log(r)) ** 2
                                                      for w, r in points))


if __name__ == "__main__":
    main()
