"""Per-layer plans against the best uniform plan on models whose blocks are not alike (issue 21).

Run: ``.venv/bin/python benchmarks/per_layer.py`` (a few minutes; ``--quick`` for the first cluster of each model).
Prints a table and writes ``benchmarks/results/per-layer-<hardware>-<date>.md``.

Each model is planned three ways on GPU presets, every plan at its own optimum within memory:

- **uniform**: the best strategy with one activation policy for every block, even stages and every ZeRO-3
  block resharding (the enumeration alone, no integer program);
- **per-layer (recompute)**: the search with the integer programs on the per-block options the runtime runs
  today (recomputation per block, uneven stage sizes; ``refine.RUNTIME_BLOCK_OPTIONS``);
- **per-layer (all)**: also activation offload and per-block ZeRO-3 resharding (``refine.ALL_BLOCK_OPTIONS``).

The models are built at the ``LayerStats`` level from captured blocks (capture of one block of each kind, then
repeated: identical blocks share their statistics anyway), so the benchmark states exactly which shape it plans:

- ``deepseek-v3-dense3``: DeepSeek-V3's 61 layers with its first 3 dense (FFN 18432) as the technical report
  has them (arXiv:2412.19437 Sec. 4.2), the other 58 the ``deepseek-v3`` preset's MoE block;
- ``gemma3-27b-shaped``: Gemma 3 27B's shape (Gemma Team 2025, "Gemma 3 Technical Report", arXiv:2503.19786:
  62 layers, 5 local sliding-window layers of window 1024 per global one, vocabulary 262,144; width 5376,
  32 heads, 16 KV heads, FFN 21504 from the released config) on Tessera's Llama block: a local block is the
  global block with its attention core cut to the window (causal: ``s w - w^2 / 2`` of ``s^2 / 2`` query-key
  pairs), at 32K tokens;
- ``llama-256k-vocab``: Llama 3 8B's blocks with a 256K vocabulary (Gemma's 256,000) at 8K tokens: uniform
  blocks, a heavy embedding and head;
- uniform controls (``llama3-8b``, ``llama3-70b``): the per-layer plan must never be slower than the uniform one.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # the checkout's parent: ``import tessera`` resolves to this repo

from tessera.cost_models import TrainingConfig  # noqa: E402
from tessera.cost_models.types import LayerStats  # noqa: E402
from tessera.planner.capture import capture_preset  # noqa: E402
from tessera.planner.layer_graph import LayerGraph  # noqa: E402
from tessera.planner.refine import ALL_BLOCK_OPTIONS, RUNTIME_BLOCK_OPTIONS  # noqa: E402
from tessera.planner.search import best_candidate, rank_candidates, search  # noqa: E402
from tessera.topology.presets import load_cluster  # noqa: E402

DEEPSEEK_DENSE = "llama:layers=1,hidden=7168,heads=128,kv_heads=128,ffn=18432,vocab=129280,seq=4096,theta=10000"
GEMMA3 = "llama:layers=1,hidden=5376,heads=32,kv_heads=16,ffn=21504,vocab=262144,seq=32768"
LLAMA_256K = "llama:layers=1,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=256000,seq=8192"
GEMMA3_WINDOW, GEMMA3_LOCAL_PER_GLOBAL, GEMMA3_LAYERS = 1024, 5, 62


def stack(one_block: LayerGraph, blocks: list[LayerStats], name: str) -> LayerGraph:
    """``one_block``'s embedding, norm, head and loss around ``blocks`` (renamed ``blocks.i`` in order)."""
    layers = list(one_block.layers)
    first = next(i for i, layer in enumerate(layers) if layer.kind == "block")
    renamed = [block.model_copy(update={"fqn": f"blocks.{i}"}) for i, block in enumerate(blocks)]
    ordered = [*layers[:first], *renamed, *layers[first + 1:]]
    edges = tuple((a.fqn, b.fqn) for a, b in zip(ordered, ordered[1:]))
    return one_block.model_copy(update={"model_name": name, "layers": tuple(ordered), "edges": edges, "seq_scaling": ()})


def block_of(graph: LayerGraph) -> LayerStats:
    return next(layer for layer in graph.layers if layer.kind == "block")


def deepseek_v3_dense3() -> tuple[LayerGraph, int]:
    moe = capture_preset("deepseek-v3:layers=1", seq_len=4096)
    dense = block_of(capture_preset(DEEPSEEK_DENSE, seq_len=4096)).model_copy(update={"block_kind": "attention"})
    return stack(moe, [dense] * 3 + [block_of(moe)] * 58, "deepseek-v3-dense3"), 4096


def local_attention(block: LayerStats, *, seq_len: int, window: int) -> LayerStats:
    """``block`` with its attention core cut to a causal sliding window (FLOPs of the core, forward and
    backward; its saved bytes are flash attention's, which do not grow with the pairs)."""
    pairs = seq_len * window - window**2 / 2 if window < seq_len else seq_len**2 / 2
    cut = block.selective_recompute_flops * (1 - pairs / (seq_len**2 / 2))
    return block.model_copy(update={
        "forward_flops": block.forward_flops - cut, "backward_flops": block.backward_flops - 2 * cut,
        "selective_recompute_flops": block.selective_recompute_flops - cut, "block_kind": "local-attention",
        "signature": block.signature + f"-local{window}",
    })


def gemma3_shaped() -> tuple[LayerGraph, int]:
    seq = 32768
    graph = capture_preset(GEMMA3, seq_len=seq)
    global_block = block_of(graph).model_copy(update={"block_kind": "attention"})
    local = local_attention(global_block, seq_len=seq, window=GEMMA3_WINDOW)
    pattern = [global_block if (i + 1) % (GEMMA3_LOCAL_PER_GLOBAL + 1) == 0 else local for i in range(GEMMA3_LAYERS)]
    return stack(graph, pattern, "gemma3-27b-shaped"), seq


def llama_256k_vocab() -> tuple[LayerGraph, int]:
    graph = capture_preset(LLAMA_256K, seq_len=8192)
    return stack(graph, [block_of(graph)] * 32, "llama-256k-vocab"), 8192


def preset(name: str, seq: int):
    return lambda: (capture_preset(name, seq_len=seq), seq)


# (builder, [(cluster, global batch)], uniform control?)
MODELS = [
    (deepseek_v3_dense3, [("dgx-h100:nodes=32", 1024), ("dgx-h100:nodes=128", 4096)], False),
    (gemma3_shaped, [("dgx-h100:nodes=4", 64), ("dgx-h100:nodes=16", 256)], False),
    (llama_256k_vocab, [("dgx-h100:nodes=1", 64), ("dgx-a100:nodes=4", 256)], False),
    (preset("llama3-8b", 8192), [("dgx-h100:nodes=1", 64)], True),
    (preset("llama3-70b", 8192), [("dgx-h100:nodes=8", 512)], True),
]


def compare(graph: LayerGraph, cluster_spec: str, batch: int, seq: int) -> dict:
    """The uniform optimum and the two per-layer optima, with their search times."""
    cluster = load_cluster(cluster_spec)
    training = TrainingConfig(global_batch=batch, seq_len=seq)
    t = time.perf_counter()
    uniform = best_candidate(rank_candidates(graph, cluster, training))
    uniform_s = time.perf_counter() - t
    row = {"uniform": uniform, "uniform_s": uniform_s}
    for label, options in (("recompute", RUNTIME_BLOCK_OPTIONS), ("all", ALL_BLOCK_OPTIONS)):
        t = time.perf_counter()
        plan = search(graph, cluster, training, block_options=options)
        row[label] = (plan.strategy, plan.estimate)
        row[f"{label}_s"] = time.perf_counter() - t
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first cluster of each model")
    args = parser.parse_args()
    lines, failures = [], []
    for build, points, control in MODELS:
        graph, seq = build()
        for cluster_spec, batch in points[:1] if args.quick else points:
            row = compare(graph, cluster_spec, batch, seq)
            u = row["uniform"][1].step_time_s
            cells = [graph.model_name, cluster_spec, str(batch), f"{u:.3f}"]
            for label in ("recompute", "all"):
                strategy, est = row[label]
                cells += [f"{est.step_time_s:.3f}", f"{u / est.step_time_s:.3f}x", f"{row[label + '_s']:.1f}"]
                if est.step_time_s > u * (1 + 1e-9) and control:
                    failures.append(f"{graph.model_name} {cluster_spec} {label}: {est.step_time_s} > uniform {u}")
            cells += [row["uniform"][0].to_string(), row["all"][0].to_string()]
            line = "| " + " | ".join(cells) + " |"
            print(line, flush=True)
            lines.append(line)
    write_results(lines)
    if failures:
        raise SystemExit("per-layer plan slower than the uniform one on a uniform stack:\n" + "\n".join(failures))


def write_results(lines: list[str]) -> None:
    today = datetime.date.today().isoformat()
    out = HERE / "results" / f"per-layer-{platform.machine()}-cpu-{today}.md"
    header = ("| model | cluster | batch | uniform step s | per-layer (recompute) s | gain | search s "
              "| per-layer (all) s | gain | search s | uniform strategy | per-layer (all) strategy |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|")
    load = os.getloadavg()[0]
    out.write_text(
        f"# Per-layer plans against the best uniform plan ({today})\n\n"
        f"`.venv/bin/python benchmarks/per_layer.py` on {platform.machine()}, {os.cpu_count()} cores, "
        f"load average {load:.1f} at the end. Predicted step times (cost model), each plan at its optimum; "
        "gain = uniform step / per-layer step; search s = wall time of that search (capture excluded).\n\n"
        + header + "\n" + "\n".join(lines) + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
