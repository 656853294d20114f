"""Capture: turn an ``nn.Module`` into a LayerGraph of measured per-layer statistics, never touching real weights.

Steps (one function each):

1. ``find_layers`` (``tessera.planner.layer_flow``, as is step 2): the planning units. Every child of the root is a layer, except that the elements of a
   ``ModuleList`` / ``ModuleDict`` / ``Sequential`` are layers themselves (``blocks.0``, ``blocks.1``...), and a
   parameter-less wrapper holding such a container somewhere below it is looked through (Hugging Face's
   ``model.layers.0``, ``bert.encoder.layer.0``). Known limit: a root-level MoE layer (router + ``experts``
   list) would be looked through too; inside a block, where MoE layers live, it is not.
2. ``trace_layers``: the first front end that traces the model (``tessera.planner.front_ends``: torch.fx, then
   torch.export non-strict, then make_fx under FakeTensorMode) gives the execution order of layers and the data-flow
   edges between them. Graph nodes are grouped by the layer that owns them; nodes in the root's own forward
   ("glue", e.g. the position add) pass their producers through, so ``tok_emb -> add -> blocks.0`` becomes
   ``tok_emb -> blocks.0``. The same graph gives the tensor-parallel linear pairs (``tessera.planner.layer_info``).
3. ``measure_layers`` (``tessera.planner.measure``): FLOPs, saved bytes under each recompute policy, input and
   output bytes of every layer and the loss, from one fake forward + loss + backward -- at three sequence lengths,
   so ``LayerGraph.at_seq_len`` can rescale without re-tracing (see ``tessera.planner.layer_graph``); for a
   bf16/fp16 capture, again with fp32 weights under ``torch.autocast`` (what the runtime's DDP and its TP or PP
   without data parallelism save).
4. ``LayerStats`` per layer: the measurements, the parameters it owns, the facts of ``layer_info``, the block's
   kind (``tessera.planner.block_kinds``: attention, local attention, MoE, SSM, encoder), and a signature shared by
   identical blocks (blocks that differ in kind, shapes or any measured number never share one).
5. ``unavailable_axes`` (``tessera.planner.capabilities``): the parallel axes the runtime cannot apply to this
   model, and why, one line each.

Mixture-of-experts layers are measured at their expected load (``tessera.planner.experts``). Glue (ops and
parameters in the root module's own forward, outside every layer) is charged to the first layer. Layers the
forward never calls are left out. The loss is its own layer ``loss``, after the model.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from tessera.cost_models.layer_stats import LayerStats
from tessera.errors import CaptureError, ModelSpecError
from tessera.models import is_builtin_spec, model_config, with_override
from tessera.planner import layer_info
from tessera.planner.block_kinds import block_kinds
from tessera.planner.capabilities import unavailable_axes
from tessera.planner.experts import expected_expert_load, measured_capacity_factor
from tessera.planner.front_ends import LeafModules, meta_autocast_off
from tessera.planner.layer_flow import LayerFlow, find_layers, revisited, trace_layers, traced_flow_and_pairs
from tessera.planner.layer_graph import (
    SCALED_FIELDS, LayerGraph, SeqScaling, fit_polynomial, repeat_last_block, signed,
)
from tessera.planner.measure import LOSS, ExampleInputs, Tally, measure_at_lengths, measure_layers
from tessera.planner.recompute_regions import REGIONS, WITH_MATMUL_INPUTS, WITH_MATMULS
from tessera.planner.model_source import max_positions, resolve_model, resolve_model_and_inputs

log = logging.getLogger(__name__)

__all__ = ["LayerFlow", "capture", "capture_preset", "find_layers", "measure_layers", "trace_layers"]

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def capture(
    model: nn.Module,
    *,
    seq_len: int,
    dtype: torch.dtype = torch.bfloat16,
    name: str | None = None,
    example_inputs: ExampleInputs | None = None,
    front_ends: Sequence[str] | None = None,
    leaf_modules: LeafModules = (),
    expert_capacity_factor: float | None = None,
    fit_seq_scaling: bool = False,
    tp_plan: Mapping[str, str] | None = None,
) -> LayerGraph:
    """Trace and measure ``model`` for one sequence of ``seq_len`` tokens, on meta (or fake meta) tensors.

    Works on a model on meta or with real weights (weights are never copied or used). Inputs are token ids
    ``(1, seq_len)`` (plus ``use_cache=False`` for a forward that takes it, as Hugging Face's do) unless
    ``example_inputs`` gives the model's positional args (a tuple or one tensor), keyword
    args (a dict) or a function of ``seq_len`` returning them (only then can ``at_seq_len`` rescale; with fixed
    inputs ``seq_len`` is just recorded). ``front_ends`` restricts and orders the tracers (``"fx"``,
    ``"export"``, ``"make_fx"``); ``leaf_modules`` (classes or FQNs) are recorded by torch.fx as one call.
    ``expert_capacity_factor`` sets the expected expert load (``tessera.planner.experts``). ``name`` defaults to
    ``model.name`` or the class name. ``fit_seq_scaling`` also measures at ``seq_len / 2`` and ``/ 4`` and fits
    each statistic's polynomial in the sequence length, so ``LayerGraph.at_seq_len`` can rescale (three
    measurements instead of one; planning one length does not need it). ``tp_plan`` is the user's tensor-parallel
    plan the runtime will be given (``unavailable_axes`` judges tp by it). Raises CaptureError naming the
    module and the op that failed.
    """
    if seq_len <= 0:
        raise CaptureError(f"seq_len must be positive, got {seq_len}")
    _check_learned_positions(model, seq_len)
    token_inputs = example_inputs is None
    example_inputs = example_inputs if example_inputs is not None else _default_inputs(model)
    layers = find_layers(model)
    config = getattr(model, "config", None)
    windowed = layer_info.windowed_kernel(config) or layer_info.windowed_kernel(getattr(config, "text_config", None))
    with (meta_autocast_off(), expected_expert_load(model, expert_capacity_factor),
          layer_info.measured_with_sdpa(config),
          _naming_example_inputs(token_inputs, seq_len, encoder_decoder=getattr(config, "is_encoder_decoder", False))):
        flow, pairs = traced_flow_and_pairs(model, layers, example_inputs, seq_len, front_ends, leaf_modules)
        rescalable = fit_seq_scaling and (example_inputs is None or callable(example_inputs))
        lengths = fit_lengths(seq_len) if rescalable else (seq_len,)
        tallies = measure_at_lengths(model, flow.order, dtype=dtype, lengths=lengths, inputs=example_inputs)
        _linear_inputs_at_every_length_or_none(tallies)
        if dtype in AUTOCAST_DTYPES:
            _add_autocast(tallies, model, flow.order, dtype=dtype, inputs=example_inputs)
    stats, keys = _records(model, layers, flow, pairs, tallies[seq_len], capacity_factor=expert_capacity_factor,
                           seq_len=seq_len, windowed=windowed)
    with meta_autocast_off(), layer_info.measured_with_sdpa(config):  # the tensor-parallel trial runs the blocks
        unavailable = unavailable_axes(model, layers, stats, front_end=flow.front_end,
                                       fallback_reasons=flow.fallback_reasons, token_inputs=token_inputs,
                                       tp_plan=tp_plan, revisited=revisited(flow), trial_inputs=(example_inputs, seq_len))
    return LayerGraph(
        model_name=name or getattr(model, "name", None) or type(model).__name__,
        seq_len=seq_len,
        dtype=_DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch.")),
        front_end=flow.front_end,
        layers=tuple(stats),
        edges=flow.edges,
        fallback_reasons=flow.fallback_reasons,
        seq_scaling=_scaling(stats, keys, tallies) if len(lengths) == 3 else (),
        windowed_attention=windowed,
        unavailable_axes=unavailable,
        token_inputs=token_inputs,
    )


@contextmanager
def _naming_example_inputs(token_inputs: bool, seq_len: int, *, encoder_decoder: bool = False) -> Iterator[None]:
    """A capture that fed token ids it was not given says, after its own reason, how to feed other inputs (first,
    for an encoder-decoder, whose decoder needs its own: T5 builds none from the encoder's)."""
    try:
        yield
    except CaptureError as error:
        if not token_inputs:
            raise
        if encoder_decoder:
            raise CaptureError(
                f"{error} This is an encoder-decoder (config.is_encoder_decoder): pass the decoder's inputs too, "
                "example_inputs={'input_ids': ids, 'decoder_input_ids': ids} (one sample each), or from the command "
                "line a spec 'file.py:factory' returning (model, example_inputs)") from error
        raise CaptureError(f"{error} If the model does not take token ids of shape (1, {seq_len}), pass "
                           "example_inputs= (one sample's tensor, tuple or dict; or a spec 'file.py:factory' "
                           "returning (model, example_inputs))") from error


def capture_preset(
    spec: str, *, seq_len: int, dtype: torch.dtype = torch.bfloat16, expert_capacity_factor: float | None = None,
    fit_seq_scaling: bool = False, tp_plan: Mapping[str, str] | None = None,
) -> LayerGraph:
    """Build the model a spec names on meta (``tessera.planner.model_source``: presets, ``hf:...``,
    ``file.py:factory``) and capture it (``fit_seq_scaling``: see :func:`capture`).

    A built-in model deeper than its distinct blocks need is captured with ``REPEATED_BLOCKS`` copies of its
    repeated block and the last one repeated to full depth (``layer_graph.repeat_last_block``): Tessera's models
    build every block after the ``dense_layers`` alike from the config, and measurement replays a block after two
    identical ones anyway (``tessera.planner.replay``), so the graph is the one a capture of the whole model gives
    (a test compares them), at the cost of a few blocks (DeepSeek-V3: 6 blocks and ~4,600 modules, not 63,000)."""
    options = {"seq_len": seq_len, "dtype": dtype, "expert_capacity_factor": expert_capacity_factor,
               "fit_seq_scaling": fit_seq_scaling, "tp_plan": tp_plan}
    key = _memo_key(spec, options)
    if key in _CAPTURED:
        return _CAPTURED[key]
    shortened = _shorter_builtin(spec)
    graph = None
    if shortened is not None:
        graph = repeat_last_block(_capture_spec(shortened[0], name=spec, **options), shortened[1])
    if graph is None:
        graph = _capture_spec(spec, name=spec, **options)
    if key is not None:
        if len(_CAPTURED) >= CAPTURE_MEMO:
            _CAPTURED.pop(next(iter(_CAPTURED)))
        _CAPTURED[key] = graph
    return graph


CAPTURE_MEMO = 8
"""Captures of built-in and Hugging Face specs a process keeps: ``tessera plan --format megatron`` prices the plan
and then what the framework runs of it, the same capture twice (1-3 s on the large presets)."""
_CAPTURED: dict[tuple, LayerGraph] = {}


def _memo_key(spec: str, options: dict) -> tuple | None:
    """The memo's key for a capture, or ``None`` for a spec whose model could change between two calls (a factory
    in a file or module the process may edit): built-in specs and Hugging Face configs are fixed by their text."""
    if not (is_builtin_spec(spec) or spec.strip().startswith("hf:")):
        return None
    tp_plan = options["tp_plan"]
    key = (spec, *(options[name] for name in ("seq_len", "dtype", "expert_capacity_factor", "fit_seq_scaling")),
           None if tp_plan is None else tuple(tp_plan.items()))  # in order: a plan's first matching glob wins
    try:
        hash(key)
    except TypeError:  # a malformed plan: captured afresh, where unavailable_axes reports it
        return None
    return key


REPEATED_BLOCKS = 3
"""Copies of a built-in model's repeated block that capture measures before repeating the last."""


def _shorter_builtin(spec: str) -> tuple[str, int] | None:
    """(the spec with fewer blocks, the blocks it has) for a built-in model deeper than it needs, else None."""
    if not is_builtin_spec(spec):
        return None
    config = model_config(spec)
    keep = getattr(config, "dense_layers", 0) + REPEATED_BLOCKS
    return (with_override(spec, "layers", keep), config.layers) if config.layers > keep else None


def _capture_spec(
    spec: str, *, name: str, seq_len: int, dtype: torch.dtype, expert_capacity_factor: float | None,
    fit_seq_scaling: bool, tp_plan: Mapping[str, str] | None,
) -> LayerGraph:
    model, _, example_inputs = resolve_model_and_inputs(spec)
    if (longer := spec_for_seq_len(spec, seq_len, model)) != spec:
        model, _ = resolve_model(longer)
    positions = max_positions(model)
    if positions is not None and seq_len > positions:  # meta would not notice positions past a table
        hint = (
            f"add max_position_embeddings={seq_len} to the spec"
            if spec.startswith("hf:")
            else f"use '{spec.partition(':')[0]}:seq={seq_len}' (with the preset's other overrides)"
        )
        raise ModelSpecError(
            f"{name} covers {positions} positions but seq_len={seq_len} was asked for; {hint} for a longer context"
        )
    return capture(model, seq_len=seq_len, dtype=dtype, name=name, expert_capacity_factor=expert_capacity_factor,
                   fit_seq_scaling=fit_seq_scaling, example_inputs=example_inputs, tp_plan=tp_plan)


def _check_learned_positions(model: nn.Module, seq_len: int) -> None:
    """Refuse a ``seq_len`` past a learned position table (GPT-2's ``wpe``, OPT's ``embed_positions``): meta
    tensors would not notice, and training would fail on its first batch with an index error. Rotary positions
    are computed for any length, so a RoPE model's ``max_position_embeddings`` is not a limit here."""
    positions = max_positions(model)
    if positions is None or seq_len <= positions:
        return
    tables = [name for name, module in model.named_modules()
              if isinstance(module, nn.Embedding) and ("pos" in name.lower() or name.rsplit(".", 1)[-1] == "wpe")]
    if tables:
        raise ModelSpecError(f"the model's learned position table {tables[0]} covers {positions} positions (its config) "
                             f"but seq_len={seq_len} was asked for; plan seq_len <= {positions}, or build the model "
                             "with more positions")


def spec_for_seq_len(spec: str, seq_len: int, model: nn.Module | None = None) -> str:
    """``spec``, with its rotary tables extended to ``seq_len`` where it is a built-in RoPE model whose tables are
    shorter: they are computed for any length (no parameters), as a long-context continuation of pre-training
    extends them (Llama 3 405B goes from 8K to 128K, arXiv:2407.21783 Sec. 3.4.2). What capture measures and what
    ``auto_parallelize`` builds must be this same model."""
    if not is_builtin_spec(spec):
        return spec
    model = model if model is not None else resolve_model(spec)[0]
    positions = max_positions(model)
    if positions is not None and seq_len > positions and _computed_positions(spec, model):
        return with_override(spec, "seq", seq_len)
    return spec


def _computed_positions(spec: str, model: nn.Module) -> bool:
    """A built-in model whose positions are rotary tables (buffers), not a learned embedding."""
    return is_builtin_spec(spec) and hasattr(model, "rope_cos") and not hasattr(model, "pos_emb")


def _default_inputs(model: nn.Module) -> ExampleInputs | None:
    """Token ids (None); for a forward taking ``input_ids`` and ``use_cache`` (Hugging Face), also
    ``use_cache=False``: a training step keeps no KV cache, and a cache in the output does not export."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a Python signature
        return None
    if "use_cache" in parameters and "input_ids" in parameters:
        return lambda s: {"input_ids": torch.zeros((1, s), dtype=torch.int64, device="meta"), "use_cache": False}
    return None


def fit_lengths(seq_len: int) -> tuple[int, int, int]:
    """The three sequence lengths measured for the polynomial fit: ``seq_len`` first."""
    if seq_len >= 4:
        return seq_len, seq_len // 2, seq_len // 4
    return seq_len, seq_len + 1, seq_len + 2


# ----------------------------------------------------------------------------------------------- records


def _records(
    model: nn.Module, layers: dict[str, nn.Module], flow: LayerFlow, pairs: dict[str, tuple], tallies: dict[str, Tally],
    *, capacity_factor: float | None = None, seq_len: int, windowed: bool = False,
) -> tuple[list[LayerStats], list[str]]:
    """LayerStats of every layer and the loss, with their signature keys (``windowed``: the model's attention
    kernel skips the pairs outside sliding windows, so local blocks are priced at their window's share)."""
    owned = _owned_params(model, flow.order, layers)
    elements = layer_info.container_elements(model, layers)
    vocab = tallies[flow.head].output_width if flow.head else 0
    kinds = {fqn: layer_info.layer_kind(layers[fqn], is_head=fqn == flow.head, in_container=fqn in elements)
             for fqn in flow.order}
    facts = {fqn: _facts(model, layers[fqn], kinds[fqn], tallies[fqn], vocab=vocab, pairs=pairs.get(fqn, ()))
             for fqn in flow.order}
    blocks = {fqn: layers[fqn] for fqn in flow.order if kinds[fqn] == "block"}
    block_kind = block_kinds(blocks, order=flow.order, experts={fqn: facts[fqn]["experts"] for fqn in blocks},
                             config=getattr(model, "config", None), seq_len=seq_len)
    stats, keys = [], []
    for fqn in flow.order:
        module, kind = layers[fqn], kinds[fqn]
        if facts[fqn]["experts"]:
            facts[fqn].update(_expert_facts(model, module, capacity_factor))
        facts[fqn]["block_kind"], facts[fqn]["attention_window"] = block_kind.get(fqn, ("", 0))
        keys.append(_signature_key(module, kind, owned[fqn]))
        stats.append(_layer_stats(fqn, kind, tallies[fqn], owned[fqn], facts[fqn], keys[-1],
                                  window_seq_len=seq_len if windowed else 0))
    keys.append(_signature_key(None, "loss", 0))
    stats.append(_layer_stats(LOSS, "loss", tallies[LOSS], 0, {}, keys[-1]))
    return stats, keys


AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
"""Capture dtypes the runtime may also train by ``torch.autocast`` over fp32 weights (``LayerStats``'s
``autocast_saved_bytes_*``)."""


def _add_autocast(
    tallies: dict[int | None, dict[str, Tally]], model: nn.Module, order: tuple[str, ...], *, dtype: torch.dtype,
    inputs: ExampleInputs | None,
) -> None:
    """Measure the same lengths again with fp32 weights under autocast and attach each layer's figures to its
    tally. A model whose ops fake CPU tensors cannot run keeps only the plain figures (the cost model then prices
    autocast's activations as the measured dtype's)."""
    try:
        measured = measure_at_lengths(model, order, dtype=dtype, lengths=tuple(tallies), inputs=inputs, autocast=True)
    except Exception as exc:  # an optional second measurement: the capture stands without it
        log.warning("autocast's activations not measured (priced as %s's): %s: %s", _DTYPE_NAMES[dtype],
                    type(exc).__name__, exc)
        return
    for length, layers in tallies.items():
        for fqn, tally in layers.items():
            tally.under_autocast = measured[length][fqn]


def _facts(model: nn.Module, module: nn.Module, kind: str, tally: Tally, *, vocab: int, pairs: tuple) -> dict:
    """LayerStats fields read off the module and the graph (see ``tessera.planner.layer_info``)."""
    declared_kv = layer_info.kv_heads_declared(module, getattr(model, "config", None)) if tally.heads else 0
    embedding_vocab = layer_info.embedding_vocab(module, vocab) if kind == "embedding" else 0
    return {
        "hidden_size": tally.output_width if kind in ("embedding", "block", "norm", "head") else 0,
        "attention_heads": tally.heads,
        "kv_heads": declared_kv or tally.kv_heads,
        "kv_head_width": tally.kv_head_width,
        "query_head_width": tally.query_head_width,
        "experts": layer_info.expert_count(module),
        "vocab_size": vocab if kind == "head" else embedding_vocab,
        "tp_pairs": pairs,
        **(layer_info.matrix_facts(module) if kind == "block" else {}),
    }


def _expert_facts(model: nn.Module, module: nn.Module, capacity_factor: float | None) -> dict:
    """The MoE fields of a layer with routed experts (see ``tessera.planner.experts``)."""
    return {
        "top_k": layer_info.top_k_declared(module, getattr(model, "config", None)),
        "expert_param_count": layer_info.expert_param_count(module),
        "expert_width": layer_info.expert_width(module),
        "expert_capacity_factor": measured_capacity_factor(module, capacity_factor),
    }


def _owned_params(model: nn.Module, order: tuple[str, ...], layers: dict[str, nn.Module]) -> dict[str, int]:
    """Parameters per layer, each tensor counted once at its first owner in model order; glue to the first."""
    seen: set[int] = set()
    owned = {}
    for fqn in order:
        fresh = [p for p in layers[fqn].parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        owned[fqn] = sum(p.numel() for p in fresh)
    owned[order[0]] += sum(p.numel() for p in model.parameters() if id(p) not in seen)
    return owned


def _numbers(tally: Tally) -> dict[str, int | None]:
    """The sequence-dependent LayerStats fields of a tally (``SCALED_FIELDS``)."""
    return {
        "forward_flops": tally.forward_flops,
        "backward_flops": tally.backward_flops,
        "saved_bytes_no_recompute": tally.saved_bytes,
        "saved_bytes_selective": tally.saved_bytes_selective,
        "saved_bytes_full_recompute": tally.input_bytes,
        "output_bytes": tally.output_bytes,
        "selective_recompute_flops": tally.core_flops,
        "op_selective_recompute_flops": tally.op_selective_recompute_flops,
        "saved_bytes_op_selective": tally.saved_bytes_op_selective,
        "saved_bytes_matmul_selective": tally.saved_bytes_matmul_selective,
        "linear_input_bytes": tally.linear_input_bytes if tally.linears_seen else None,
        "linear_call_input_bytes": tally.linear_call_input_bytes if tally.linears_seen else None,
        "expert_forward_flops": tally.expert_forward_flops,
        "expert_backward_flops": tally.expert_backward_flops,
        "fused_norm_saving_bytes": tally.fused_norm_saving_bytes,
        "declared_norm_saving_bytes": tally.declared_norm_saving_bytes,
        "fused_gate_saving_bytes": tally.fused_gate_saving_bytes,
        **{f"{region}_saved_bytes": tally.region_saved_bytes.get(region, 0) for region in REGIONS},
        **{f"{region}_flops": tally.region_flops.get(region, 0) for region in WITH_MATMULS},
        **{f"{region}_linear_input_bytes": tally.region_linear_input_bytes.get(region, 0) for region in WITH_MATMUL_INPUTS},
        **_autocast_numbers(tally.under_autocast),
    }


def _autocast_numbers(tally: Tally | None) -> dict[str, int | None]:
    """The ``autocast_*`` fields from a layer's tally under autocast (``None`` when not measured)."""
    return {
        "autocast_saved_bytes_no_recompute": tally and tally.saved_bytes,
        "autocast_saved_bytes_full_recompute": tally and tally.input_bytes,
        "autocast_saved_bytes_selective": tally and tally.saved_bytes_selective,
        "autocast_saved_bytes_op_selective": tally and tally.saved_bytes_op_selective,
        "autocast_saved_bytes_matmul_selective": tally and tally.saved_bytes_matmul_selective,
        "autocast_output_bytes": tally and tally.output_bytes,
        "autocast_fused_norm_saving_bytes": tally and tally.fused_norm_saving_bytes,
    }


def _layer_stats(
    fqn: str, kind: str, tally: Tally, params: int, facts: dict, key: str, *, window_seq_len: int = 0,
) -> LayerStats:
    """The layer's record; with ``window_seq_len``, its attention core priced as a windowed kernel runs it."""
    stats = LayerStats(fqn=fqn, kind=kind, signature="", param_count=params, **_numbers(tally), **facts)
    return signed(layer_info.with_windowed_attention(stats, seq_len=window_seq_len) if window_seq_len else stats, key)


def _signature_key(module: nn.Module | None, kind: str, params: int) -> str:
    """Hash of class, kind and parameter shapes: the part of a signature that does not depend on the inputs."""
    shapes = [(n, list(p.shape)) for n, p in module.named_parameters()] if module is not None else []
    key = [type(module).__name__, kind, shapes, params]
    return hashlib.sha1(json.dumps(key).encode()).hexdigest()[:12]


def _linear_inputs_at_every_length_or_none(tallies: dict[int, dict[str, Tally]]) -> None:
    """A layer whose linears do not account for its FLOPs at one measured length (eager attention's matmuls grow
    faster than its linears) reports no linear inputs at any: a polynomial needs all three points, and a figure kept
    from one length would not scale."""
    for fqn in next(iter(tallies.values())):
        if not all(measured[fqn].linears_seen for measured in tallies.values()):
            for measured in tallies.values():
                measured[fqn].linear_flops = 0


def _scaling(stats: list[LayerStats], keys: list[str], tallies: dict[int, dict[str, Tally]]) -> tuple[SeqScaling, ...]:
    """Exact polynomials in the sequence length of every layer's statistics, from the three measurements."""
    scaling = []
    for layer, key in zip(stats, keys):
        numbers = {s: _numbers(measured[layer.fqn]) for s, measured in tallies.items()}
        fits = {f: fit_polynomial({s: numbers[s][f] for s in numbers}) for f in SCALED_FIELDS}
        coefficients = {f: c for f, c in fits.items() if c is not None}
        scaling.append(SeqScaling(fqn=layer.fqn, signature_key=key, coefficients=coefficients))
    return tuple(scaling)
