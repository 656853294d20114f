"""A plan as Megatron-LM command-line arguments; Megatron-LM arguments read back into a ``Strategy`` are
``planner.frameworks.megatron_import``'s, its pipeline layouts ``planner.frameworks.megatron_layout``'s.

The argument names, types and rules are Megatron-LM ``core_v0.14.0``'s (``megatron/training/arguments.py``:
``_add_distributed_args``, ``_add_training_args``, ``validate_args``); ``megatron_import.megatron_parser`` declares
only the arguments Tessera reads, with those names and types. Megatron-LM derives ``dp = world / (tp * pp * cp)`` and
carves expert parallelism out of it, as ``Strategy`` does.

What the arguments express, and the nearest setting where they cannot:

- ZeRO: stage 1 is ``--use-distributed-optimizer``; stages 2 and 3 are Megatron-FSDP
  (``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads|optim_grads_params``).
- Pipeline chunks: ``--num-virtual-stages-per-pipeline-rank V``; uneven chunks are a
  ``--pipeline-model-parallel-layout`` (``E`` embedding, ``t`` a block, ``L`` the loss, ``|`` between chunks, chunk
  ``c`` on pipeline rank ``c % pp``); read back, ``--account-for-embedding-in-pipeline-split`` and
  ``--account-for-loss-in-pipeline-split`` split the blocks with those layers counted (``megatron_layout.even_split``).
  Megatron-LM has no GPipe nor zero-bubble schedule: nearest is 1F1B.
- Recomputation is one setting for every block: ``selective``, ``full`` (``uniform`` of 1 layer), or the first
  ``k`` blocks of every chunk in full (``block`` method). A per-block mix that is none of these is rendered as the
  ``block`` method with ``k`` = the most full blocks of any chunk (selective blocks then recompute nothing).
- Activation offload is ``--cpu-offloading --cpu-offloading-num-layers N``: the first ``N`` blocks (``N`` below
  ``--num-layers``; Transformer Engine's offload context), neither with pipelining nor with recomputation
  (``TransformerConfig.__post_init__`` refuses both). Offloaded blocks at other positions become the first ones;
  with pipelining or recomputation the nearest is full recomputation of the offloaded blocks.
- Megatron-FSDP reshards every block after its forward (``optim_grads_params``): a per-block reshard mix
  (``block_reshard``) is rendered as every block resharding.
- Experts on their own tensor-parallel degree (``Strategy.etp``, "MoE parallel folding") are
  ``--expert-tensor-parallel-size``.
- Expert all-to-alls: the export asks for the ``alltoall`` dispatcher the cost model prices (Megatron-LM's default
  is ``allgather``); an imported ``flex`` dispatcher with ``--moe-enable-deepep`` and
  ``--overlap-moe-expert-parallel-comm`` are priced as Megatron-Core runs them (``profiles.MEGATRON_DEEPEP``,
  ``MEGATRON_EP_OVERLAP``).
- Sequence parallelism in Megatron-LM keeps each column-parallel input's shard and gathers it again in the
  backward (``Strategy.sp_regather``): the strategy Megatron-LM runs carries it.
- What the arguments configure of the framework itself (``profiles.ADJUSTABLE``) adjusts the profile an imported run
  is priced with (``megatron:dp_overlap=false``): data-parallel overlap, off in Megatron-LM unless
  ``--overlap-grad-reduce`` (and, under the distributed optimizer, ``--overlap-param-gather``) ask for it; the
  gradient buffer's dtype; the precision-aware optimizer's master weights and moments; ``--fp8-param-gather``. The
  export asks for the overlap the Megatron-Core profile prices.
- Selective recomputation is the attention core's (``--recompute-modules`` ``core_attn``, Megatron-Core's default);
  the other modules it takes (``mla_up_proj``, ``mlp``, ``layernorm``, ``shared_experts``, ``moe_act``, ``moe``) are
  priced as ``Strategy.recompute_modules`` (``cost_models.module_recompute``).
"""

from __future__ import annotations

import shlex

from tessera.cost_models.types import Strategy
from tessera.planner.frameworks.common import (
    FrameworkExport, PlanLike, chunk_block_counts, chunk_policies, expand_recompute, kept_blocks, offload_as_full,
    strategy_with, uniform_policy,
)
from tessera.planner.frameworks.megatron_layout import layout_string


MEGATRON_VERSION = "core_v0.14.0"
"""The Megatron-LM release whose argument names and rules this module follows."""
SHARDING = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
"""``--data-parallel-sharding-strategy`` (Megatron-FSDP) -> ZeRO stage."""
FP8_RECIPES = {"delayed": "delayed", "current": "tensorwise", "block": "blockwise", "mx": "mxfp8"}
"""Tessera's FP8 scalings (``TrainingConfig.fp8_scaling``) -> Megatron-LM's ``--fp8-recipe`` (rowwise has none)."""


def to_megatron_args(plan: PlanLike) -> FrameworkExport:
    """The plan as Megatron-LM arguments (one shell line, each word quoted), a comment for every difference."""
    s, t = plan.strategy, plan.training
    chunks = chunk_block_counts(plan)
    args = ["--tensor-model-parallel-size", s.tp, "--pipeline-model-parallel-size", s.pp]
    args += ["--context-parallel-size", s.cp] * (s.cp > 1) + ["--expert-model-parallel-size", s.ep] * (s.ep > 1)
    args += ["--moe-token-dispatcher-type", "alltoall"] * (s.ep > 1)  # the all-to-alls priced (default: allgather)
    args += ["--expert-tensor-parallel-size", s.etp] * (s.etp is not None)
    args += ["--sequence-parallel"] * s.sp + ["--tp-comm-overlap"] * s.tp_overlap
    args += ["--num-layers", sum(chunks), "--seq-length", t.seq_len]
    args += ["--micro-batch-size", s.micro_batch, "--global-batch-size", t.global_batch]
    precision, notes = _precision_args(t)
    args += precision + _zero_args(s.zero)
    pipeline, pipeline_notes, update = _pipeline_args(s, chunks)
    notes += pipeline_notes
    recompute, recompute_notes, recompute_update = _recompute_args(plan, chunks)
    notes += recompute_notes
    recompute, module_update = _named_pieces(s, recompute, notes)
    recompute_update |= module_update
    if kept_blocks(s):
        notes.append(f"block_reshard keeps {kept_blocks(s)} blocks gathered to their backward: Megatron-FSDP reshards "
                     "every block after its forward; nearest is every block resharding")
        update["block_reshard"] = ()
    if s.pipeline_passes > 1:
        notes.append(f"pipeline_passes={s.pipeline_passes}: Megatron-LM runs all of a step's micro-batches in one "
                     "pipeline schedule (one fill and drain)")
        update["pipeline_passes"] = 1
    runs = strategy_with(s, sp_regather=s.sp, **update, **recompute_update)
    if s.sp and not s.sp_regather:
        notes.append("Megatron-LM's sequence parallelism keeps each column-parallel input's shard and gathers it "
                     "again in the backward (Tessera's runtime keeps the gathered input): the strategy it runs has sp_regather")
    words = [str(word) for word in args + pipeline + recompute]
    header = [f"# Megatron-LM ({MEGATRON_VERSION}) arguments for {plan.model_name} on {plan.cluster}: "
              f"{s.to_string()}", "# (add your model, data and optimizer arguments; dp = world / (tp * pp * cp))"]
    text = "\n".join(header + [f"# {note}" for note in notes] + [shell_lines(words)])
    return FrameworkExport(framework="megatron", text=text, strategy=runs, notes=tuple(notes))


def shell_lines(words: list[str]) -> str:
    """The words shell-quoted, one flag and its values per line, lines joined by `` \\`` continuations."""
    groups: list[list[str]] = []
    for word in words:
        if word.startswith("--") or not groups:
            groups.append([])
        groups[-1].append(word)
    return " \\\n  ".join(shlex.join(group) for group in groups)


def _precision_args(t) -> tuple[list[str], list[str]]:
    """Megatron-LM's precision flags for ``t`` (a ``TrainingConfig``); FP8 is Transformer Engine's recipe."""
    if t.precision != "fp8":
        return {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[t.precision], []
    recipe = FP8_RECIPES.get(t.fp8_scaling)
    notes = [] if recipe else [f"fp8 scaling {t.fp8_scaling}: Megatron-LM has no such recipe; nearest is tensorwise"]
    return ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", recipe or "tensorwise"], notes


def _zero_args(zero: int) -> list[str]:
    """ZeRO's flags, with the data-parallel overlap the Megatron-Core profile prices (off by default in Megatron-LM:
    ``--overlap-grad-reduce``, and under the distributed optimizer ``--overlap-param-gather``)."""
    overlap = ["--overlap-grad-reduce"] + ["--overlap-param-gather"] * (zero >= 1)
    if zero == 1:
        return ["--use-distributed-optimizer", *overlap]
    if zero >= 2:  # Megatron-FSDP, as docs/source/api-guide/custom_fsdp.md of the release sets it up
        sharding = {2: "optim_grads", 3: "optim_grads_params"}[zero]
        return ["--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy", sharding,
                "--no-gradient-accumulation-fusion", "--ckpt-format", "fsdp_dtensor", *overlap]
    return overlap


def _pipeline_args(s: Strategy, chunks: list[int]) -> tuple[list[str], list[str], dict[str, object]]:
    """(arguments, notes, strategy changes) of the pipeline schedule and chunk sizes."""
    if s.pp == 1:
        return [], [], {}
    notes: list[str] = []
    update: dict[str, object] = {}
    if s.schedule in ("gpipe", "zero-bubble"):
        notes.append(f"schedule {s.schedule}: Megatron-LM has no such schedule; nearest is 1F1B")
        update["schedule"] = "1f1b"
    elif s.schedule == "interleaved" and s.virtual_stages == 1:
        notes.append("schedule interleaved with one chunk per rank: Megatron-LM runs that as 1F1B")
        update["schedule"] = "1f1b"
    if len(set(chunks)) > 1:
        return ["--pipeline-model-parallel-layout", layout_string(chunks)], notes, update
    return (["--num-virtual-stages-per-pipeline-rank", str(s.virtual_stages)] if s.virtual_stages > 1 else []), notes, update


def _recompute_args(plan: PlanLike, chunks: list[int]) -> tuple[list[str], list[str], dict[str, object]]:
    """(arguments, notes, strategy changes) of the per-block recomputation and offload."""
    by_chunk = chunk_policies(plan)
    flat = [p for chunk in by_chunk for p in chunk]
    if "offload" not in flat:
        return _block_recompute_args(by_chunk, chunks)
    if plan.strategy.pp == 1 and set(flat) <= {"offload", "none"}:
        return _offload_args(flat)
    args, notes, update = _block_recompute_args([[offload_as_full(p) for p in c] for c in by_chunk], chunks)
    runs = update.get("block_recompute", tuple(offload_as_full(p) for p in flat))
    update = update if "recompute" in update else {"recompute": "none", "block_recompute": runs}
    why = "pipelining" if plan.strategy.pp > 1 else "recomputation"
    note = (f"offload on {flat.count('offload')} blocks: Megatron-LM does not offload activations together with {why} "
            "(TransformerConfig refuses it); nearest is full recomputation of those blocks")
    return args, [note, *notes], update


def _named_pieces(s: Strategy, recompute: list[str], notes: list[str]) -> tuple[list[str], dict[str, object]]:
    """The recomputation arguments with ``s.recompute_modules`` named (selective granularity; ``core_attn`` where the
    blocks recompute their attention cores; the model flags Megatron-LM requires of ``mla_up_proj`` and ``moe_act``),
    and the strategy change where the blocks' policy cannot have them."""
    if not s.recompute_modules:
        return recompute, {}
    if recompute not in ([], ["--recompute-granularity", "selective"]):
        notes.append(f"recompute_modules {'/'.join(s.recompute_modules)}: Megatron-LM names modules to recompute under "
                     "selective granularity only, not with whole blocks recomputed or offloaded; nearest is keeping them")
        return recompute, {"recompute_modules": ()}
    core = ["core_attn"] if recompute else []
    needs = [flag for piece, flag in (("mla_up_proj", "--multi-latent-attention"), ("moe_act", "--moe-grouped-gemm"))
             if piece in s.recompute_modules]  # what Megatron-LM requires of the model for them
    return ["--recompute-granularity", "selective", "--recompute-modules", *core, *s.recompute_modules, *needs], {}


def _offload_args(flat: list[str]) -> tuple[list[str], list[str], dict[str, object]]:
    """``--cpu-offloading`` of the first N blocks, N below the block count (Megatron-LM's rule)."""
    count = min(flat.count("offload"), len(flat) - 1)
    runs = ("offload",) * count + ("none",) * (len(flat) - count)
    notes = [] if tuple(flat) == runs else [
        f"offload on {flat.count('offload')} of {len(flat)} blocks: Megatron-LM offloads the first "
        f"--cpu-offloading-num-layers blocks, fewer than --num-layers; nearest is the first {count}"]
    return ["--cpu-offloading", "--cpu-offloading-num-layers", str(count)], notes, {"recompute": "none", "block_recompute": runs}


def _block_recompute_args(by_chunk: list[list[str]], chunks: list[int]) -> tuple[list[str], list[str], dict[str, object]]:
    """(arguments, notes, strategy changes) of a per-block recomputation without offload."""
    policy = uniform_policy([p for chunk in by_chunk for p in chunk])
    if policy == "none" or not chunks or not sum(chunks):
        return [], [], {}
    if policy == "selective":
        return ["--recompute-granularity", "selective"], [], {}
    if policy == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], [], {}
    full = max(chunk.count("full") for chunk in by_chunk)
    # Selective blocks beside full ones become full, not none: never more memory than the plan, which fits
    first = max(len(chunk) - chunk.count("none") for chunk in by_chunk) if full else 0
    runs = expand_recompute(chunks, first)
    notes = []
    if tuple(p for chunk in by_chunk for p in chunk) != runs:
        mix = ", ".join(f"{p} on {sum(c.count(p) for c in by_chunk)}" for p in ("full", "selective", "none")
                        if any(p in c for c in by_chunk))
        where = "every block" if set(runs) == {"full"} else f"the first {first} blocks of each chunk"
        nearest = (f"full on {where} (selective blocks recomputed whole: no more memory than the plan)" if first
                   else "selective on every block")
        notes.append(f"recompute per block ({mix} blocks): Megatron-LM recomputes the same first blocks of every "
                     f"chunk, or selectively every block; nearest is {nearest}")
    if first == 0:  # selective and none only: Megatron-LM cannot mix them; selective everywhere is the leaner
        return ["--recompute-granularity", "selective"], notes, {"recompute": "selective", "block_recompute": ()}
    if set(runs) == {"full"}:
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], \
            notes, {"recompute": "full", "block_recompute": ()}
    args = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(first)]
    return args, notes, {"recompute": "none", "block_recompute": runs}
