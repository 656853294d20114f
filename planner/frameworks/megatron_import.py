"""Megatron-LM arguments read back into a ``Strategy``, the profile their flags configure, and the workload
(``planner.frameworks.megatron``'s module docstring says what is read and how).
"""

from __future__ import annotations

import argparse
import difflib
import shlex
from typing import get_args

from tessera.cost_models.profiles import (
    MEGATRON, MEGATRON_DEEPEP, MEGATRON_DEEPEP_EP_OVERLAP, MEGATRON_EP_OVERLAP, adjusted_name,
)
from tessera.cost_models.types import MAX_BLOCKS, MAX_GLOBAL_BATCH, MAX_SEQ_LEN, RecomputeModule, Strategy
from tessera.errors import ConfigError, NotModelledError
from tessera.planner.frameworks.common import ImportedConfig, canonical, data_parallel, expand_recompute
from tessera.planner.frameworks.megatron import FP8_RECIPES, MEGATRON_VERSION, SHARDING
from tessera.planner.frameworks.megatron_layout import even_split, layout_mtp_layers, parse_layout
from tessera.topology.validation import MAX_DEVICES, quoted

STATE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
"""The precision-aware optimizer's state dtypes (``--exp-avg-dtype``, ``--exp-avg-sq-dtype``) and their bytes."""
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""``--recompute-modules``' choices at ``MEGATRON_VERSION`` (``TransformerConfig``'s allowed modules)."""
PRICED_MODULES = get_args(RecomputeModule)
"""Those besides ``core_attn``, which Tessera prices as ``Strategy.recompute_modules``: all of them."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one ``ConfigError`` line instead of a usage message and an exit."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        raise ConfigError(f"bad Megatron-LM arguments: {message}; fix that value")


def _count(low: int, high: int):
    def parse(text: str) -> int:
        value = int(text) if text.strip().lstrip("-").isdigit() and len(text) <= 18 else None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low:,} to {high:,}, got {quoted(text)}")
        return value
    return parse


def megatron_parser() -> argparse.ArgumentParser:
    """The Megatron-LM arguments Tessera reads, named and typed as in ``core_v0.14.0`` (``allow_abbrev=False``, as
    Megatron-LM's own parser); anything else is left over and listed."""
    parser = _Parser(prog="megatron", add_help=False, allow_abbrev=False)
    degree, blocks = _count(1, MAX_DEVICES), _count(1, MAX_BLOCKS)
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                 "--expert-model-parallel-size"):
        parser.add_argument(name, type=degree, default=1)
    parser.add_argument("--expert-tensor-parallel-size", type=degree, default=None)
    for name in ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank", "--num-layers",
                 "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
        parser.add_argument(name, type=blocks, default=None)
    parser.add_argument("--recompute-num-layers", type=_count(0, MAX_BLOCKS), default=None)
    parser.add_argument("--cpu-offloading-num-layers", type=_count(0, MAX_BLOCKS), default=0)
    parser.add_argument("--mtp-num-layers", type=_count(0, MAX_BLOCKS), default=None)
    parser.add_argument("--pipeline-model-parallel-layout", type=str, default=None)
    parser.add_argument("--micro-batch-size", type=_count(1, MAX_GLOBAL_BATCH), default=None)
    parser.add_argument("--global-batch-size", type=_count(1, MAX_GLOBAL_BATCH), default=None)
    parser.add_argument("--seq-length", type=_count(1, MAX_SEQ_LEN), default=None)
    parser.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    parser.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    parser.add_argument("--recompute-modules", nargs="*", choices=RECOMPUTE_MODULES, default=None)
    parser.add_argument("--data-parallel-sharding-strategy", choices=tuple(SHARDING), default="no_shard")
    parser.add_argument("--ckpt-format", type=str, default="torch_dist")
    parser.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default=None)
    parser.add_argument("--fp8-recipe", choices=tuple(FP8_RECIPES.values()), default="delayed")
    parser.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")
    parser.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall", "flex"), default="allgather")
    parser.add_argument("--main-grads-dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--main-params-dtype", choices=("fp32", "fp16"), default="fp32")
    for name in ("--exp-avg-dtype", "--exp-avg-sq-dtype"):
        parser.add_argument(name, choices=tuple(STATE_BYTES), default="fp32")
    for flag in ("--sequence-parallel", "--tp-comm-overlap", "--use-distributed-optimizer", "--use-megatron-fsdp",
                 "--use-custom-fsdp", "--use-torch-fsdp2", "--recompute-activations", "--cpu-offloading", "--bf16",
                 "--fp16", "--moe-enable-deepep", "--overlap-moe-expert-parallel-comm", "--moe-layer-recompute",
                 "--overlap-grad-reduce", "--overlap-param-gather", "--grad-reduce-in-bf16",
                 "--accumulate-allreduce-grads-in-fp32", "--use-precision-aware-optimizer", "--fp8-param-gather",
                 "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                 "--moe-grouped-gemm", "--multi-latent-attention", "--moe-shared-expert-overlap"):
        parser.add_argument(flag, action="store_true")
    return parser


def from_megatron(text: str, *, world_size: int) -> ImportedConfig:
    """Read a Megatron-LM command line (``pretrain_gpt.py --tensor-model-parallel-size 8 ...``; the words after
    the last ``*.py``, else all of them) for a run on ``world_size`` devices. A bad value raises one
    ``ConfigError`` naming the flag; what Megatron-LM runs that the cost model has no term for, ``NotModelledError``."""
    parser = megatron_parser()
    words = _argument_words(text)
    args, rest = parser.parse_known_args(words)
    unread = _unread(rest, parser)
    tp, pp, cp, ep = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size,
                      args.expert_model_parallel_size)
    dp = data_parallel(world_size, inner=tp * pp * cp, framework="megatron",
                       inner_names="--tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size")
    _check_experts(args, dp=dp, tp=tp)
    if args.micro_batch_size is None:
        raise ConfigError("Megatron-LM arguments: --micro-batch-size is required (Megatron-LM asserts it); add it")
    chunks, virtual = _chunks(args, pp=pp)
    mtp = _mtp_layers(args)
    if mtp and chunks:
        chunks = [*chunks[:-1], chunks[-1] + mtp]  # the modules run after the last block, in the last chunk
    recompute, block_recompute, notes = _recompute(args, chunks=chunks)
    modules = _priced_modules(args)
    _check_pieces(args, modules)
    block_recompute = _offloaded(args, block_recompute, chunks=chunks, pp=pp) if args.cpu_offloading else block_recompute
    strategy = Strategy(
        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=_zero(args), micro_batch=args.micro_batch_size, recompute=recompute,
        block_recompute=block_recompute, sp=args.sequence_parallel and tp > 1, sp_regather=args.sequence_parallel and tp > 1,
        tp_overlap=args.tp_comm_overlap and tp > 1, schedule="interleaved" if virtual > 1 else "1f1b",
        virtual_stages=virtual, chunk_blocks=tuple(chunks) if len(set(chunks)) > 1 else (),
        etp=args.expert_tensor_parallel_size, recompute_modules=modules,
    )
    return ImportedConfig(
        framework="megatron", strategy=canonical(strategy), global_batch=args.global_batch_size or args.micro_batch_size * dp,
        seq_len=args.seq_length, precision=_precision(args),
        fp8_scaling={recipe: scaling for scaling, recipe in FP8_RECIPES.items()}[args.fp8_recipe] if args.fp8_format else None,
        variant=_variant(_expert_exchange(args, ep=ep, notes=notes), _configured(args, zero=strategy.zero, notes=notes)),
        unread=tuple(unread), notes=tuple(notes), layers=args.num_layers, mtp_layers=mtp,
    )


def _mtp_layers(args: argparse.Namespace) -> int:
    """``--mtp-num-layers``, and the ``m`` a pipeline layout places, which must agree (as Megatron-LM checks)."""
    given = args.mtp_num_layers or 0
    if args.pipeline_model_parallel_layout is None:
        return given
    placed = layout_mtp_layers(args.pipeline_model_parallel_layout)
    if placed != given:
        raise ConfigError(f"--pipeline-model-parallel-layout places {placed} multi-token-prediction layers (m) but "
                          f"--mtp-num-layers is {given}; make them agree")
    return given


def _expert_exchange(args: argparse.Namespace, *, ep: int, notes: list[str]) -> str | None:
    """The profile variant that runs the expert all-to-alls as the arguments say (``cost_models.profiles``): DeepEP
    under the ``flex`` dispatcher, overlapped with another micro-batch's compute under
    ``--overlap-moe-expert-parallel-comm``; None for Megatron-LM's own profile. ``allgather`` (Megatron-LM's default
    dispatcher) is priced as ``alltoall``, and said so."""
    if ep == 1:
        return None
    dispatcher = args.moe_token_dispatcher_type
    if dispatcher == "flex" and not args.moe_enable_deepep:
        raise ConfigError("Megatron-LM arguments: --moe-token-dispatcher-type flex needs --moe-enable-deepep in "
                          f"{MEGATRON_VERSION} (DeepEP is its only backend); add it, or use alltoall")
    if dispatcher == "allgather":
        notes.append("--moe-token-dispatcher-type allgather (Megatron-LM's default): priced as the alltoall "
                     "dispatcher's all-to-alls, which Megatron-LM recommends under expert parallelism")
    deepep, overlap = dispatcher == "flex", args.overlap_moe_expert_parallel_comm
    names = {(True, True): MEGATRON_DEEPEP_EP_OVERLAP.name, (True, False): MEGATRON_DEEPEP.name,
             (False, True): MEGATRON_EP_OVERLAP.name}
    return names.get((deepep, overlap))


def _variant(exchange: str | None, configured: dict[str, object]) -> str | None:
    """The profile the arguments run: the expert exchange's variant (or Megatron-Core's own), adjusted by what the
    arguments configure (``profiles.profile``'s ``name:field=value`` form); None for Megatron-Core's own as it is."""
    base = exchange or MEGATRON.name
    adjusted = adjusted_name(base, {k: v for k, v in configured.items() if getattr(MEGATRON, k) != v})
    return None if adjusted == MEGATRON.name else adjusted


def _configured(args: argparse.Namespace, *, zero: int, notes: list[str]) -> dict[str, object]:
    """The behaviours of ``profiles.ADJUSTABLE`` the arguments set, as Megatron-LM derives them (each checked as it
    checks it): data-parallel overlap (``--overlap-grad-reduce``, and ``--overlap-param-gather`` where the weights are
    gathered after the step); the gradient buffer's dtype; the precision-aware optimizer's master weights and moments;
    FP8 weights gathered in FP8 (``--fp8-param-gather``)."""
    _check_optimizer_flags(args, zero=zero)
    gathers_params = 1 <= zero <= 2  # the distributed optimizer's (and optim_grads') gather of updated weights
    if args.overlap_grad_reduce and gathers_params and not args.overlap_param_gather:
        notes.append("--overlap-grad-reduce without --overlap-param-gather: the weights' all-gather runs after the "
                     "optimizer step; priced with no data-parallel overlap (Tessera overlaps both or neither)")
    moments = max(STATE_BYTES[args.exp_avg_dtype], STATE_BYTES[args.exp_avg_sq_dtype])
    if args.exp_avg_dtype != args.exp_avg_sq_dtype or moments < 2:
        notes.append(f"--exp-avg-dtype {args.exp_avg_dtype} --exp-avg-sq-dtype {args.exp_avg_sq_dtype}: Tessera prices "
                     "Adam's two moments in one dtype of 2 or 4 bytes; both are priced at "
                     f"{max(moments, 2)} bytes")
    configured: dict[str, object] = {"gradient_bytes": _gradient_bytes(args), "master_bytes": _master_bytes(args),
                                     "moment_bytes": max(moments, 2)}
    if zero < 3:  # ZeRO-3's gathers and reduce-scatters are priced overlapped, as every FSDP prefetches them
        configured["dp_overlap"] = args.overlap_grad_reduce and (args.overlap_param_gather or not gathers_params)
    if args.fp8_param_gather and args.use_torch_fsdp2:
        notes.append("--fp8-param-gather under --use-torch-fsdp2: Megatron-LM turns it off (Transformer Engine 2.0 "
                     "and later) and gathers bf16 weights; left out")
    elif args.fp8_param_gather and args.fp8_format:
        configured.update(fp8_params=True, fp8_all_gather=True)
    elif args.fp8_param_gather:
        notes.append("--fp8-param-gather without --fp8-format: no FP8 weights to gather; left out")
    return configured


def _check_optimizer_flags(args: argparse.Namespace, *, zero: int) -> None:
    """What Megatron-LM (``validate_args``, ``OptimizerConfig``, ``MegatronFSDP``) asserts of the flags
    :func:`_configured` reads, one ``ConfigError`` each."""
    aware = ("--main-grads-dtype", args.main_grads_dtype), ("--main-params-dtype", args.main_params_dtype), \
        ("--exp-avg-dtype", args.exp_avg_dtype), ("--exp-avg-sq-dtype", args.exp_avg_sq_dtype)
    lowered = [f"{flag} {value}" for flag, value in aware if value != "fp32"]
    rules = [
        (bool(lowered) and not args.use_precision_aware_optimizer,
         f"{lowered[0] if lowered else ''} needs --use-precision-aware-optimizer"),
        (args.use_precision_aware_optimizer and not args.use_distributed_optimizer,
         "--use-precision-aware-optimizer needs --use-distributed-optimizer"),
        (args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype != "fp32",
         "--accumulate-allreduce-grads-in-fp32 needs --main-grads-dtype fp32"),
        (args.overlap_param_gather and not args.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce"),
        (args.fp8_param_gather and zero == 0, "--fp8-param-gather needs --use-distributed-optimizer or an FSDP"),
        ((args.use_megatron_fsdp or args.use_custom_fsdp) and args.data_parallel_sharding_strategy == "optim_grads"
         and not args.overlap_grad_reduce, "Megatron-FSDP's optim_grads sharding needs --overlap-grad-reduce"),
    ]
    for broken, message in rules:
        if broken:
            raise ConfigError(f"{message} (Megatron-LM asserts it); fix the arguments")


def _gradient_bytes(args: argparse.Namespace) -> int:
    """Bytes of a gradient in Megatron-Core's buffer (``grad_reduce_in_fp32`` is ``accumulate_allreduce_grads_in_fp32``):
    fp16's own unless ``--accumulate-allreduce-grads-in-fp32``; for bf16, fp32 (``validate_args`` turns it on) unless
    ``--grad-reduce-in-bf16`` or bf16 main gradients; fp32 parameters' otherwise."""
    if args.fp16:
        return 4 if args.accumulate_allreduce_grads_in_fp32 else 2
    if args.bf16:
        return 2 if args.grad_reduce_in_bf16 or args.main_grads_dtype == "bf16" else 4
    return 4


def _master_bytes(args: argparse.Namespace) -> int:
    """Bytes of a master weight: fp32, except where the precision-aware optimizer keeps them itself (its
    ``use_precision_aware_optimizer_no_fp8_or_ds_fp8``: no FP8, delayed scaling, or lower main params): then 16-bit
    remainders beside bf16 weights (``store_param_remainders``, on by default from Transformer Engine 2.1;
    ``distrib_optimizer.py``), else ``--main-params-dtype``."""
    recipe = args.fp8_recipe if args.fp8_format else None
    keeps_them = args.use_precision_aware_optimizer and (
        args.main_params_dtype != "fp32" or recipe in (None, "delayed"))
    if not keeps_them:
        return 4
    return 2 if args.bf16 or args.main_params_dtype == "fp16" else 4


def _precision(args: argparse.Namespace) -> str:
    if args.fp8_format:
        return "fp8"
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def _argument_words(text: str) -> list[str]:
    try:
        words = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise ConfigError(f"bad Megatron-LM arguments: {exc} (check the quotes)") from None
    scripts = [i for i, word in enumerate(words) if word.endswith(".py")]
    return words[scripts[-1] + 1:] if scripts else words


def _unread(rest: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The leftover words grouped by flag (``--lr 1e-4``); a flag one typo away from one Tessera reads is refused."""
    known = [option for action in parser._actions for option in action.option_strings]  # argparse keeps no public list
    groups: list[str] = []
    for word in rest:
        flag = word.partition("=")[0]
        if word.startswith("--"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.9)
            if close:
                raise ConfigError(f"bad Megatron-LM argument {quoted(flag)}: did you mean {close[0]}?")
            groups.append(word)
        elif groups:
            groups[-1] += f" {word}"
        else:
            groups.append(word)
    return groups


def _check_experts(args: argparse.Namespace, *, dp: int, tp: int) -> None:
    """Expert parallelism inside dp (and, with a smaller expert tensor-parallel degree, the folded tp ranks)."""
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    if tp % etp:
        raise NotModelledError(f"--expert-tensor-parallel-size {etp} does not divide --tensor-model-parallel-size "
                               f"{tp}: Tessera folds the experts' tensor-parallel group inside the dense one; pick a "
                               "divisor of tp")
    ranks = f"the data-parallel size {dp}" if etp == tp else f"dp x tp / expert tp = {dp}x{tp}/{etp}"
    if (dp * tp // etp) % ep:
        raise NotModelledError(f"--expert-model-parallel-size {ep} does not divide {ranks}: Megatron-LM may span "
                               "context-parallel ranks with experts, Tessera's cost model carves expert parallelism "
                               "out of those only; pick an ep that divides them")


def _zero(args: argparse.Namespace) -> int:
    if args.use_torch_fsdp2:
        return 3
    if args.use_megatron_fsdp or args.use_custom_fsdp:
        return max(SHARDING[args.data_parallel_sharding_strategy], int(args.use_distributed_optimizer))
    return int(args.use_distributed_optimizer)


def _chunks(args: argparse.Namespace, *, pp: int) -> tuple[list[int], int]:
    """(blocks per pipeline chunk, chunks per rank); an empty list when the layer count is not given."""
    chosen = [name for name in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                                "pipeline_model_parallel_layout") if getattr(args, name) is not None]
    if len(chosen) > 1:
        raise ConfigError("Megatron-LM arguments: give one of --num-layers-per-virtual-pipeline-stage, "
                          "--num-virtual-stages-per-pipeline-rank, --pipeline-model-parallel-layout (Megatron-LM asserts it)")
    layers = args.num_layers
    counted = _counted_in_split(args)
    if any(counted) and (args.pipeline_model_parallel_layout is not None or args.decoder_first_pipeline_num_layers is not None
                    or args.decoder_last_pipeline_num_layers is not None):
        raise ConfigError("--account-for-embedding/loss-in-pipeline-split with a layout or "
                          "--decoder-first/last-pipeline-num-layers (Megatron-LM refuses both); keep one")
    if args.pipeline_model_parallel_layout is not None:
        chunks = parse_layout(args.pipeline_model_parallel_layout, pp=pp)
        if layers is not None and sum(chunks) != layers:
            raise ConfigError(f"--pipeline-model-parallel-layout places {sum(chunks)} layers but --num-layers is "
                              f"{layers}; make them agree")
        return chunks, len(chunks) // pp
    virtual = args.num_virtual_stages_per_pipeline_rank or 1
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = (_need_layers(layers, "--num-layers-per-virtual-pipeline-stage") + sum(counted)) / pp
        virtual = per_stage / args.num_layers_per_virtual_pipeline_stage
        if not virtual.is_integer():
            raise ConfigError(f"--num-layers {layers} over --pipeline-model-parallel-size {pp} is not a multiple of "
                              f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}")
        virtual = int(virtual)
    if pp == 1:
        return ([layers] if layers else []), 1
    return _even_chunks(args, layers=layers, pp=pp, virtual=virtual), virtual


def _counted_in_split(args: argparse.Namespace) -> tuple[int, int]:
    """Whether the embedding and the loss each count as a layer of the pipeline split
    (``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split``: ``TransformerBlock``'s
    ``get_num_layers_to_build`` takes one block off the first chunk, and one off the last)."""
    return int(args.account_for_embedding_in_pipeline_split), int(args.account_for_loss_in_pipeline_split)


def _even_chunks(args: argparse.Namespace, *, layers: int | None, pp: int, virtual: int) -> list[int]:
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if layers is None:
        if first is not None or last is not None:
            _need_layers(None, "--decoder-first/last-pipeline-num-layers")
        return []
    if first is None and last is None:
        embedding, loss = _counted_in_split(args)
        chunks = even_split(layers, pp * virtual, embedding=embedding, loss=loss)
        if chunks is None:
            counted = " with the embedding and the loss counted" if embedding or loss else ""
            problem = ("leaves the first or last chunk without a block (Tessera's chunks hold one or more)"
                       if (layers + embedding + loss) % (pp * virtual) == 0 else "is not divisible")
            raise ConfigError(f"--num-layers {layers}{counted} over pp x virtual stages = {pp * virtual} {problem}; give "
                              "a --pipeline-model-parallel-layout for an uneven split")
        return chunks
    if virtual > 1:
        raise NotModelledError("--decoder-first/last-pipeline-num-layers with virtual stages: Tessera reads uneven "
                               "interleaved stages from --pipeline-model-parallel-layout; write the layout instead")
    middle_stages = pp - (first is not None) - (last is not None)
    middle = layers - (first or 0) - (last or 0)
    if middle < 0 or (middle_stages and middle % middle_stages) or (not middle_stages and middle):
        raise ConfigError(f"--decoder-first/last-pipeline-num-layers leave {middle} of --num-layers {layers} for "
                          f"{middle_stages} middle stage(s), not an even split; fix the layer counts")
    even = middle // middle_stages if middle_stages else 0
    return [first if first is not None else even] + [even] * (pp - 2) + [last if last is not None else even]


def _need_layers(layers: int | None, flag: str) -> int:
    if layers is None:
        raise ConfigError(f"{flag} needs --num-layers to place the layers; add --num-layers N")
    return layers


def _offloaded(args: argparse.Namespace, block_recompute: tuple[str, ...], *, chunks: list[int],
               pp: int) -> tuple[str, ...]:
    """``--cpu-offloading``: the first ``--cpu-offloading-num-layers`` blocks offload (checked as Megatron-LM does)."""
    count, layers = args.cpu_offloading_num_layers, _need_layers(args.num_layers, "--cpu-offloading")
    if count >= layers:
        raise ConfigError(f"--cpu-offloading-num-layers {count} must be below --num-layers {layers} (Megatron-LM "
                          "refuses it); offload fewer layers")
    if pp > 1 or args.recompute_granularity or args.recompute_activations or block_recompute:
        raise ConfigError("--cpu-offloading together with pipelining or recomputation: Megatron-LM refuses both "
                          "(TransformerConfig); drop one")
    return ("offload",) * count + ("none",) * (sum(chunks) - count)


def _recompute(args: argparse.Namespace, *, chunks: list[int]) -> tuple[str, tuple[str, ...], list[str]]:
    """(recompute, block_recompute, notes) of the recomputation arguments."""
    if args.moe_layer_recompute and args.recompute_granularity == "full":
        raise ConfigError("--moe-layer-recompute with --recompute-granularity full (Megatron-LM refuses it); use "
                          "--recompute-granularity selective --recompute-modules moe")
    granularity = _granularity(args)
    if granularity == "selective":
        return _selective_modules(args)
    recompute, block_recompute, notes = _whole_blocks(args, granularity, chunks=chunks)
    if args.recompute_modules is not None:  # Megatron-LM reads them under selective granularity only
        notes.append("--recompute-modules has no effect without --recompute-granularity selective; left out")
    return recompute, block_recompute, notes


def _whole_blocks(args: argparse.Namespace, granularity: str | None, *, chunks: list[int]
                  ) -> tuple[str, tuple[str, ...], list[str]]:
    """Full recomputation of whole blocks (``--recompute-method`` uniform or block), or none."""
    if granularity is None:
        return "none", (), []
    if args.recompute_method is None or args.recompute_num_layers is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                          "--recompute-num-layers N (Megatron-LM asserts them)")
    if args.recompute_method == "uniform":
        notes = [] if args.recompute_num_layers == 1 else [
            f"--recompute-method uniform --recompute-num-layers {args.recompute_num_layers}: recomputes every layer "
            "from checkpoints every few layers; evaluated as full recomputation of every block"]
        return "full", (), notes
    if not chunks:
        _need_layers(None, "--recompute-method block")
    return "none", expand_recompute(chunks, args.recompute_num_layers), []


def _selective_modules(args: argparse.Namespace) -> tuple[str, tuple[str, ...], list[str]]:
    """Selective recomputation of ``--recompute-modules`` (Megatron-Core's default: the attention core alone, which
    is Tessera's ``selective``; ``--moe-layer-recompute`` adds ``moe``): the attention core as ``selective``, the
    other modules as ``Strategy.recompute_modules`` (:func:`_priced_modules`)."""
    modules = _named_modules(args)
    if not modules:
        return "none", (), ["--recompute-modules with no modules: Megatron-LM recomputes nothing"]
    return "selective" if "core_attn" in modules else "none", (), []


PIECE_RULES = (
    ("moe_act", lambda a: not a.moe_grouped_gemm, "needs --moe-grouped-gemm"),
    ("mla_up_proj", lambda a: not a.multi_latent_attention, "needs --multi-latent-attention"),
    ("shared_experts", lambda a: a.moe_shared_expert_overlap, "cannot run with --moe-shared-expert-overlap"),
    ("moe_act", lambda a: a.fp8_format and a.fp8_recipe == "delayed", "cannot run under FP8 delayed scaling"),
    ("layernorm", lambda a: a.fp8_format and a.fp8_recipe == "delayed", "cannot run under FP8 delayed scaling"),
)
"""What ``TransformerConfig.__post_init__`` refuses of ``--recompute-modules`` at ``MEGATRON_VERSION``."""


def _check_pieces(args: argparse.Namespace, modules: tuple[str, ...]) -> None:
    """Refuse, in one line, the named pieces Megatron-LM itself refuses with the other flags (``PIECE_RULES``)."""
    for piece, refused, why in PIECE_RULES:
        if piece in modules and refused(args):
            raise ConfigError(f"--recompute-modules {piece} {why} (Megatron-LM's TransformerConfig refuses it "
                              f"otherwise); change that flag or drop {piece}")


def _named_modules(args: argparse.Namespace) -> list[str]:
    """The modules selective recomputation names, each once (``--moe-layer-recompute`` adds ``moe``)."""
    modules = list(dict.fromkeys(["core_attn"] if args.recompute_modules is None else args.recompute_modules))
    if args.moe_layer_recompute and "moe" not in modules:
        modules.append("moe")
    return modules


def _priced_modules(args: argparse.Namespace) -> tuple[str, ...]:
    """The pieces besides the attention core that Tessera prices recomputing (``Strategy.recompute_modules``), under
    selective granularity (Megatron-LM reads ``--recompute-modules`` under it only)."""
    if _granularity(args) != "selective":
        return ()
    return tuple(m for m in _named_modules(args) if m in PRICED_MODULES)


def _granularity(args: argparse.Namespace) -> str | None:
    """``--recompute-granularity``, or ``selective`` where ``--recompute-activations`` or ``--moe-layer-recompute``
    imply it (Megatron-LM's arguments.py and TransformerConfig)."""
    return args.recompute_granularity or (
        "selective" if args.recompute_activations or args.moe_layer_recompute else None)
