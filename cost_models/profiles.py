"""Implementation profiles: what a training framework does differently with the same strategy.

A strategy says how a run is split; the framework that runs it decides how well its data-parallel collectives
overlap and what FP8 keeps in memory. A published run is evaluated as the framework that ran it, a Tessera
plan as Tessera's runtime (``TESSERA``, the default of ``cost_models.estimate``). Behaviours that are Strategy
knobs today because a framework chooses them per run (``Strategy.tp_overlap``, ``Strategy.sp_regather``) stay
there.

- **Sharded data parallelism** (ZeRO-3 / FSDP). PyTorch FSDP (FSDP1 with ``BACKWARD_PRE`` prefetch, FSDP2 always)
  gathers each block's parameters in one flat all-gather issued a block ahead and reduce-scatters each block's
  gradients as soon as its backward ends, on their own streams: the collectives move at the fabric's rate and
  hide behind compute (``communication.exposed_dp_comm_s``). DeepSpeed ZeRO-3 as measured in 2021 (Narayanan
  et al. SC'21 Table 2: 174.6B and 529.6B on 384-2240 A100s) gathered parameter by parameter, its collectives
  ``zero3_comm_slowdown`` times slower than the ideal ring: fitted on those rows (``benchmarks/published.py``).
  How far ahead the backward gathers are issued is the framework's (``backward_prefetch``). FSDP1's
  ``BackwardPrefetch.BACKWARD_PRE`` (and FSDP2, always) issues the next block's all-gather before the current
  block's gradient computation, so it hides behind it; ``BACKWARD_POST`` issues it only after that computation
  (torch ``BackwardPrefetch`` docstring: it overlaps the current reduce-scatter with the next gradient
  computation, not the next all-gather), so every block's backward waits for its own gather. MosaicML Composer
  defaults to ``BACKWARD_POST`` (``composer.utils.parallelism.FSDPConfig.backward_prefetch``) and llm-foundry's
  benchmark sweep (``scripts/train/benchmarking/submit_benchmarks.py`` at 061f2c7ce64e) does not override it.
- **Tensor-parallel overlap** (``Strategy.tp_overlap``). Megatron-Core's userbuffers overlap (Transformer
  Engine ``ub_tp_comm_overlap``) splits the collectives of the forward and of the backward behind their GEMMs.
  torchtitan's async TP (inductor's micro-pipeline pass, late 2024) overlaps the forward's only
  (``tp_overlap_backward`` False): its announcement (PyTorch dev-discuss, "[Distributed w/ TorchTitan]
  Introducing Async Tensor Parallelism in PyTorch", 2024) reports ~20% forward speedup but ~8% end to end on
  Llama 3 70B, about what a forward-only overlap saves of a step that also runs the backward.
- **FP8 memory**. Transformer Engine keeps an FP8 copy of each linear's weight and of its transpose across
  micro-batches (``weight_fp8_bytes`` = 2) and saves FP8 inputs for the backward (``fp8_saves_inputs``); torchao
  float8 casts on the fly from the bf16 weight and saves what autograd saves (bf16). FSDP2 with torchao may
  all-gather FP8 weights (``fp8_all_gather``: 1 byte per parameter on the wire and in the gathered buffer).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import ConfigError


@dataclass(frozen=True)
class ImplementationProfile:
    """The behaviours of one framework the cost model distinguishes (see the module docstring)."""

    name: str
    zero3_comm_slowdown: float = 1.0
    """Factor on ZeRO-3's parameter all-gathers and gradient reduce-scatters over the ideal ring time."""
    fp8_saves_inputs: bool = False
    """Under FP8, the linears save their inputs for the backward in FP8 (1 byte) instead of bf16."""
    weight_fp8_bytes: float = 0.0
    """Under FP8, bytes per block-linear parameter of FP8 weight copies kept across micro-batches."""
    fp8_all_gather: bool = False
    """Under FP8 with ZeRO-3, block parameters are all-gathered in FP8 (1 byte each)."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """The ZeRO stages the framework runs (Megatron-Core: DDP or its distributed optimizer, ZeRO-1)."""
    tp_overlap_backward: bool = True
    """Under ``Strategy.tp_overlap``, the backward's tensor-parallel collectives are overlapped too (not only the
    forward's and the recomputation's)."""
    backward_prefetch: str = "pre"
    """When ZeRO-3 issues a block's backward all-gather: ``pre`` (before the later block's gradient computation,
    hidden behind it) or ``post`` (after it: exposed), as FSDP1's ``BackwardPrefetch``."""


DEEPSPEED_ZERO3_SLOWDOWN = 6.0
"""Fitted on SC'21 Table 2's DeepSpeed ZeRO-3 rows (``benchmarks/published.py`` prints the fit); re-fit there."""

TESSERA = ImplementationProfile(name="tessera")
"""Tessera's runtime: FSDP2 for ZeRO-1 to 3 (``runtime.data_parallel``); it runs no FP8 (the planner plans it
as torchao float8 on FSDP2 would run it)."""
TORCHTITAN = ImplementationProfile(name="torchtitan", tp_overlap_backward=False)
"""torchtitan: FSDP2, torchao float8 (``enable_fsdp_float8_all_gather`` off by default), async TP on the
forward only."""
PYTORCH_FSDP_TE = ImplementationProfile(name="fsdp-te", fp8_saves_inputs=True, weight_fp8_bytes=2.0,
                                        backward_prefetch="post")
"""PyTorch FSDP1 under MosaicML Composer (llm-foundry): ``BACKWARD_POST`` prefetch, Transformer Engine linears
under ``amp_fp8``."""
MEGATRON = ImplementationProfile(name="megatron", fp8_saves_inputs=True, weight_fp8_bytes=2.0, zero_stages=(0, 1))
"""Megatron-LM / Megatron-Core / NeMo, Transformer Engine for FP8."""
DEEPSPEED = ImplementationProfile(name="deepspeed", zero3_comm_slowdown=DEEPSPEED_ZERO3_SLOWDOWN)
"""DeepSpeed ZeRO-3 as SC'21 measured it."""

PROFILES = {p.name: p for p in (TESSERA, TORCHTITAN, PYTORCH_FSDP_TE, MEGATRON, DEEPSPEED)}
"""Every profile by name."""


def profile(name: str) -> ImplementationProfile:
    """The profile called ``name``; an unknown name lists the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(f"unknown implementation profile {name!r}; known: {', '.join(PROFILES)}") from None
