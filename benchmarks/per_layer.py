"""Per-layer plans against the best uniform plan on models whose blocks are not alike (issue 21).

Run: ``.venv/bin/python benchmarks/per_layer.py`` (a few minutes; ``--quick`` for the first cluster of each model).
Prints a table and writes ``benchmarks/results/per-layer-<hardware>-<date>.md``.

Each model is planned three ways on GPU presets, every plan at its own optimum within memory:

- **uniform**: the best strategy with one activation policy for every block, even stages and every ZeRO-3
  block resharding (the enumeration alone, no integer program);
- **per-layer (recompute)**: the search with the integer programs on the per-block options the runtime runs
  today (recomputation per block, uneven stage sizes; ``refine.RUNTIME_BLOCK_OPTIONS``);
- **per-layer (all)**: also activation offload and per-block ZeRO-3 resharding (``refine.ALL_BLOCK_OPTIONS``).

The models (captures of presets and of one Hugging Face config):

- ``deepseek-v3``: the preset (arXiv:2412.19437 Sec. 4.2), its first 3 layers dense (FFN 18432), the other 58
  MoE (two block signatures);
- ``gemma3-27b (hf, 5 local : 1 global)``: Hugging Face's Gemma 3 27B (``gemma3_text``, its published config:
  62 layers, 5 sliding-window layers of 1024 tokens per global one, vocabulary 262,208) at 32K tokens, captured as
  built for FlashAttention 2: capture measures SDPA and prices each local block's attention core at the window's
  share of the pairs (``LayerGraph.windowed_attention``, ``planner.layer_info.with_windowed_attention``:
  ``s w - w^2 / 2`` of ``s^2 / 2`` query-key pairs, forward and backward);
- ``llama-256k-vocab``: Llama 3 8B's blocks with a 256K vocabulary (Gemma's 256,000) at 8K tokens: uniform
  blocks, a heavy embedding and head;
- ``gemma3-27b``: the preset itself (every layer global, vocabulary 262,144) at 8K tokens, free and with the
  pipeline pinned to interleaved chunks (``pp=4,schedule=interleaved:2``, as large runs use): there the integer
  program sizes the chunks, so the embedding's and the head's chunks hold fewer blocks (the uniform plan's chunks
  are even); the 256K Llama likewise, pinned;
- uniform controls (``llama3-8b``, ``llama3-70b``, and ``gpt3-13b`` at 1K tokens on 512 A100s, where ZeRO-3's
  all-gathers outlast the compute): the per-layer plan must never be slower than the uniform one.
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

LLAMA_256K = "llama:layers=1,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=256000,seq=8192"
GEMMA3_SEQ = 32768


def stack(one_block: LayerGraph, blocks: list[LayerStats], name: str) -> LayerGraph:
    """``one_block``'s embedding, norm, head and loss around ``blocks`` (renamed ``blocks.i`` in order)."""
    layers = list(one_block.layers)
    first = next(i for i, layer in enumerate(layers) if layer.kind == "block")
    renamed = [block.model_copy(update={"fqn": f"blocks.{i}"}) for i, block in enumerate(blocks)]
    ordered = [*layers[:first], *renamed, *layers[first + 1:]]
    edges = tuple((a.fqn, b.fqn) for a, b in zip(ordered, ordered[1:]))
    return one_block.model_copy(update={"model_name": name, "layers": tuple(ordered), "edges": edges, "seq_scaling": ()})


GEMMA3_27B_HF = ("hf:gemma3_text:num_hidden_layers=62,hidden_size=5376,intermediate_size=21504,num_attention_heads=32,"
                 "num_key_value_heads=16,head_dim=128,vocab_size=262208,sliding_window=1024,"
                 "max_position_embeddings=131072,attn_implementation=flash_attention_2")
"""Gemma 3 27B as Hugging Face declares it (its ``config.json``: 62 layers, ``layer_types`` 5 sliding : 1 full by
default, window 1024), built to train with FlashAttention 2, which computes only the pairs inside each window."""


def gemma3_local_global() -> tuple[LayerGraph, int]:
    graph = capture_preset(GEMMA3_27B_HF, seq_len=GEMMA3_SEQ)
    return graph.model_copy(update={"model_name": "gemma3-27b (hf, 5 local : 1 global)"}), GEMMA3_SEQ


def llama_256k_vocab() -> tuple[LayerGraph, int]:
    graph = capture_preset(LLAMA_256K, seq_len=8192)
    block = next(layer for layer in graph.layers if layer.kind == "block")
    return stack(graph, [block] * 32, "llama-256k-vocab"), 8192


def preset(name: str, seq: int):
    return lambda: (capture_preset(name, seq_len=seq), seq)


INTERLEAVED = {"pp": 4, "schedule": "interleaved", "virtual_stages": 2}
"""Pins of the interleaved rows (the uniform and the per-layer plans under the same pins)."""

# (name, builder, [(cluster, global batch[, pins])], uniform control?)
MODELS = [
    ("deepseek-v3", preset("deepseek-v3", 4096), [("dgx-h100:nodes=32", 1024), ("dgx-h100:nodes=128", 4096)], False),
    ("gemma3-27b (hf, 5 local : 1 global)", gemma3_local_global, [("dgx-h100:nodes=4", 64), ("dgx-h100:nodes=16", 256)], False),
    ("llama-256k-vocab", llama_256k_vocab, [("dgx-h100:nodes=1", 64), ("dgx-a100:nodes=4", 256), ("dgx-a100:nodes=4", 256, INTERLEAVED)],
     False),
    ("gemma3-27b", preset("gemma3-27b", 8192), [("dgx-h100:nodes=4", 128), ("dgx-h100:nodes=4", 128, INTERLEAVED)], False),
    ("llama3-8b", preset("llama3-8b", 8192), [("dgx-h100:nodes=1", 64)], True),
    ("llama3-70b", preset("llama3-70b", 8192), [("dgx-h100:nodes=8", 512)], True),
    ("gpt3-13b", preset("gpt3-13b", 1024), [("dgx-a100:nodes=64", 512)], True),  # short sequences, ZeRO-3 traffic exposed
]


def compare(graph: LayerGraph, cluster_spec: str, batch: int, seq: int, pins: dict | None = None) -> dict:
    """The uniform optimum and the two per-layer optima (each under ``pins``), with their search times."""
    cluster = load_cluster(cluster_spec)
    training = TrainingConfig(global_batch=batch, seq_len=seq)
    t = time.perf_counter()
    uniform = best_candidate(rank_candidates(graph, cluster, training, pins=pins))
    uniform_s = time.perf_counter() - t
    row = {"uniform": uniform, "uniform_s": uniform_s}
    for label, options in (("recompute", RUNTIME_BLOCK_OPTIONS), ("all", ALL_BLOCK_OPTIONS)):
        t = time.perf_counter()
        plan = search(graph, cluster, training, pins=pins, block_options=options)
        row[label] = (plan.strategy, plan.estimate)
        row[f"{label}_s"] = time.perf_counter() - t
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first cluster of each model")
    parser.add_argument("--only", default="", help="only the models whose name contains this (e.g. 256k); prints, writes no results file")
    args = parser.parse_args()
    lines, failures = [], []
    for name, build, points, control in MODELS:
        if args.only and args.only not in name:
            continue
        graph, seq = build()
        for cluster_spec, batch, *pinned in points[:1] if args.quick else points:
            pins = pinned[0] if pinned else None
            row = compare(graph, cluster_spec, batch, seq, pins)
            u = row["uniform"][1].step_time_s
            where = cluster_spec + (" (" + ",".join(f"{k}={v}" for k, v in pins.items()) + ")" if pins else "")
            cells = [graph.model_name, where, str(batch), f"{u:.3f}"]
            for label in ("recompute", "all"):
                strategy, est = row[label]
                cells += [f"{est.step_time_s:.3f}", f"{u / est.step_time_s:.3f}x", f"{row[label + '_s']:.1f}"]
                if est.step_time_s > u * (1 + 1e-9) and control:
                    failures.append(f"{graph.model_name} {cluster_spec} {label}: {est.step_time_s} > uniform {u}")
            cells += [row["uniform"][0].to_string(), row["all"][0].to_string()]
            line = "| " + " | ".join(cells) + " |"
            print(line, flush=True)
            lines.append(line)
    if not args.only:  # a subset would overwrite the full table
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
