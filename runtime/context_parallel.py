"""Context parallelism: the ``cp`` ranks of a group share each sequence; keys and values travel in a ring.

**Why Tessera's own ring attention.** PyTorch's ``torch.distributed.tensor.experimental.context_parallel``
replaces the CUDA attention kernels only (``aten._scaled_dot_product_{flash,efficient,cudnn}_attention`` and
their backwards, in the dispatch table of its ``_context_parallel/_attention.py``); on CPU, SDPA dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu``, which it does not handle (tried with torch 2.13 on 2 gloo
ranks: "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered"). So the runtime brings a ring attention of its own (Liu et al. 2023, "Ring Attention with
Blockwise Transformers", arXiv:2310.01889), with an explicit forward and backward (:class:`RingAttention`),
over point-to-point ``isend``/``irecv`` (gloo supports them; NCCL on CUDA). Each block runs the device's fused
flash kernel, the one SDPA itself calls (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward on
CPU, ``aten._scaled_dot_product_flash_attention`` on CUDA): no ``(tq, tk)`` score block is materialised, as the cost
model assumes (``cost_models.sparse``: attention at the flash kernel's rate, no score memory); grouped-query K/V
go to it as they are (both kernels take key/value heads that divide the query heads). The CUDA kernels are checked
by ``tests/gpu/test_ring_attention_cuda.py`` where a GPU is lent; no GPU has run them yet.

**Sequence layout: zig-zag.** A sequence of ``T`` tokens is cut into ``2 * cp`` chunks; cp rank ``i`` holds
chunks ``i`` and ``2cp - 1 - i`` (:func:`zigzag_positions`), as Megatron-LM / Transformer Engine and Llama 3
(Sec. 3.3.2) do: under a causal mask every rank then has the same attention work (an early chunk paired
with a late one). ``ParallelModel`` hands each rank these columns of its rows of the batch (inputs and
targets alike); the loss is the mean over the local tokens, and since every rank holds the same number of
tokens, the mean over the ``dp * cp`` ranks is the mean over the batch. Weights are replicated over ``cp``;
gradients are averaged over ``dp * cp`` (``runtime.mesh.data_mesh``).

**Positions.** Everything outside attention is per token, except where a model reads positions. Tessera's
models read them in two ways and both are rewritten to this rank's global positions: RoPE tables (Llama,
MoE: the ``rope_cos``/``rope_sin`` buffers become the rows of the local positions, so the model's own
``narrow(0, 0, T_local)`` reads the right angles) and a learned position embedding (GPT's ``pos_emb``: a
pre-hook maps the model's ``arange(T_local)`` to the global positions). Other models are refused.

**Attention.** Each attention module (a module with an integer ``head_dim``, the rule tensor parallelism
uses) runs its forward under :class:`RingAttentionMode`, which turns the model's own
``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` into :func:`ring_attention`. Wrapping the module
(not the whole model) keeps it right under activation checkpointing, whose recomputation re-enters the
module. Local query heads under tensor parallelism are fine: the ring runs per local head.

**The ring** (per attention call, ``cp`` steps). Forward: at step ``s`` a rank holds the keys/values of rank
``i - s`` and, while it computes against them, already sends them on to ``i + 1`` and receives the next ones
(communication overlaps compute). Each (query chunk, key chunk) pair is skipped when the mask hides it,
computed without mask when it is fully visible, and under the causal mask on the diagonal (the chunks are equal,
so a pair is one or the other). Block outputs are merged in fp32 with their log-sum-exp, as flash attention
merges its tiles. Backward: the key/value blocks travel the same ring again with their fp32 gradient accumulators;
each block's flash backward takes the whole attention's output and log-sum-exp; after ``cp`` shifts every
accumulator is back at its owner. Memory: one block of keys/values in flight, never the whole sequence's.

Expert parallelism composes (``runtime.expert_parallel``). Not implemented (``NotModelledError`` from
:func:`check_context_parallel`): pipeline parallelism, sequence parallelism and ``torch.compile`` with ``cp > 1``;
attention with an explicit mask, dropout or no causal mask.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from tessera.cost_models.cp_rules import POSITION_EMBEDDING, ROPE_BUFFERS, attention_modules, context_parallel_problem
from tessera.cost_models.types import Strategy
from tessera.errors import ConfigError, NotModelledError
from tessera.runtime.mesh import CP



def zigzag_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of cp rank ``rank``'s tokens, ``(seq_len / cp,)``: chunks ``rank`` and ``2cp - 1 - rank``."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])  # (T/cp,)


def shard_sequence(tensor: torch.Tensor, *, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's columns of ``tensor`` ``(B, T, ...)``: ``(B, T / cp, ...)`` in zig-zag order."""
    if tensor.shape[1] % (2 * cp):
        raise ConfigError(f"context parallelism cuts sequences into 2*cp = {2 * cp} chunks; this batch has "
                          f"{tensor.shape[1]} tokens per sequence; pass sequences of the planned length")
    return tensor[:, zigzag_positions(tensor.shape[1], cp, rank, device=tensor.device)]


# ------------------------------------------------------------------------------------------------ the ring


class _Ring:
    """One rank's place in the cp group: its peers, every rank's positions, and the shift to the next rank."""

    def __init__(self, group: dist.ProcessGroup, seq_len: int) -> None:
        self.group, self.seq_len = group, seq_len
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def positions(self, owner: int, device: torch.device) -> torch.Tensor:
        """Global positions of the tokens cp rank ``owner`` holds."""
        return zigzag_positions(self.seq_len, self.size, owner, device=device)

    def start_shift(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Send ``tensor`` to the next rank and receive the previous rank's into a new buffer (asynchronously)."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor.contiguous(), self.next, self.group),
               dist.P2POp(dist.irecv, received, self.prev, self.group)]
        return received, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _chunk_pairs(pos_q: torch.Tensor, pos_k: torch.Tensor):
    """(query slice, key slice, causal) for each pair of zig-zag chunks the causal mask does not hide entirely: the
    chunks are equal, so a pair is either fully visible (``causal`` False) or one chunk with itself (True)."""
    half_q, half_k = pos_q.numel() // 2, pos_k.numel() // 2
    for q_slice in (slice(0, half_q), slice(half_q, None)):
        for k_slice in (slice(0, half_k), slice(half_k, None)):
            q_pos, k_pos = pos_q[q_slice], pos_k[k_slice]
            if q_pos.max() < k_pos.min():
                continue  # every key lies in the future of every query
            yield q_slice, k_slice, bool(q_pos.min() < k_pos.max())


CPU = torch.device("cpu")
FLASH_DTYPES = (torch.bfloat16, torch.float16)
"""What CUDA's flash kernel takes (CPU's takes fp32 too)."""


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """One block's fused attention: ``(out, lse, aux)``, ``aux`` what its backward needs back (CUDA's flash kernel
    returns it; the CPU kernel needs none)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    out, lse, *aux, _ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, tuple(aux)  # cum_seq_q, cum_seq_k, max_q, max_k, philox seed and offset


def _block_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float, aux: tuple):
    """dQ, dK, dV of one block from the whole attention's output and log-sum-exp (the flash backward)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


class RingAttention(torch.autograd.Function):
    """Causal attention of local queries over the whole sequence's keys/values, circulated over the cp ring."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, scale: float):
        # q (B, nh, t, hd); k, v (B, nkv, t, hd): this rank's zig-zag tokens
        pos_q = ring.positions(ring.rank, CPU)  # only decides which blocks run: no device sync per decision
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, nh, t, hd)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)  # (B, nh, t)
        kv, blocks = torch.stack([k, v]), []  # (2, B, nkv, t, hd)
        for step in range(ring.size):
            following, requests = ring.start_shift(kv) if step < ring.size - 1 else (kv, [])
            pos_k = ring.positions((ring.rank - step) % ring.size, CPU)
            for qs, ks, causal in _chunk_pairs(pos_q, pos_k):
                block_out, block_lse, aux = _block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal, scale)
                _merge_block(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
                blocks.append(aux)
            _wait(requests)
            kv = following
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.blocks = ring, scale, blocks
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, blocks = ctx.ring, ctx.scale, iter(ctx.blocks)
        grad_out = grad_out.contiguous()
        pos_q = ring.positions(ring.rank, CPU)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # (B, nh, t, hd)
        kv, dkv = torch.stack([k, v]), torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        for step in range(ring.size):
            following, requests = ring.start_shift(kv) if step < ring.size - 1 else (kv, [])
            pos_k = ring.positions((ring.rank - step) % ring.size, CPU)
            for qs, ks, causal in _chunk_pairs(pos_q, pos_k):
                grad_q, grad_k, grad_v = _block_backward(
                    grad_out[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs],
                    lse[:, :, qs].contiguous(), causal, scale, next(blocks))
                dq[:, :, qs] += grad_q
                dkv[0][:, :, ks] += grad_k
                dkv[1][:, :, ks] += grad_v
            dkv, grad_requests = ring.start_shift(dkv)  # the accumulator follows its block to the next rank
            _wait(requests + grad_requests)
            kv = following
        # after ring.size shifts every accumulator is back at the rank whose keys/values it belongs to
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's output and log-sum-exp into the running fp32 output and log-sum-exp (views, in place); the
    block sees at least one key in every row, so its log-sum-exp is finite."""
    new_lse = torch.logaddexp(lse, block_lse)  # (B, nh, tq)
    keep, take = torch.exp(lse - new_lse).unsqueeze(-1), torch.exp(block_lse - new_lse).unsqueeze(-1)
    out.copy_(out * keep + block_out.float() * take)
    lse.copy_(new_lse)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ring: _Ring, scale: float | None = None
) -> torch.Tensor:
    """Causal attention ``(B, nh, t, hd)`` of this rank's zig-zag queries over the whole sequence (GQA allowed)."""
    if q.shape[1] % k.shape[1]:
        raise NotModelledError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if q.device.type != "cpu" and q.dtype not in FLASH_DTYPES:
        raise NotModelledError(f"context parallelism on {q.device.type} runs the flash attention kernel, which takes "
                               f"bf16 or fp16; this attention runs in {q.dtype}: train with precision bf16, or cp=1")
    return RingAttention.apply(q, k, v, ring, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))


class RingAttentionMode(TorchFunctionMode):
    """Turns ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` into :func:`ring_attention`."""

    def __init__(self, ring: _Ring) -> None:
        super().__init__()
        self.ring = ring

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        if torch.is_autocast_enabled(q.device.type):  # SDPA runs in autocast's dtype; so does the ring
            dtype = torch.get_autocast_dtype(q.device.type)
            q, k, v = (tensor.to(dtype) for tensor in (q, k, v))
        options = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:]), **kwargs)
        if options.get("attn_mask") is not None or options.get("dropout_p", 0.0) or not options.get("is_causal"):
            raise NotModelledError(
                "context parallelism runs causal attention without an explicit mask or dropout; this attention "
                f"passes {sorted(name for name, value in options.items() if value)}; plan it with cp=1"
            )
        return ring_attention(q, k, v, ring=self.ring, scale=options.get("scale"))


class _RingAttentionForward:
    """An attention module's own forward, run under :class:`RingAttentionMode`."""

    def __init__(self, forward, ring: _Ring) -> None:
        self.forward, self.ring = forward, ring

    def __call__(self, *args, **kwargs):
        with RingAttentionMode(self.ring):
            return self.forward(*args, **kwargs)


# --------------------------------------------------------------------------------------------- applying it


def check_context_parallel(model: nn.Module, strategy: Strategy, *, seq_len: int, compile_blocks: bool) -> None:
    """Raise ``NotModelledError``/``ConfigError`` naming what the runtime cannot do for ``cp > 1`` on ``model``."""
    unsupported = {"pp": strategy.pp > 1, "sp": strategy.sp, "torch.compile": compile_blocks}
    for name, used in unsupported.items():
        if used:
            raise NotModelledError(f"strategy {strategy.to_string()!r}: context parallelism together with {name} "
                                   f"is not implemented by the runtime; plan with cp=1 or without {name}")
    if seq_len % (2 * strategy.cp):
        raise ConfigError(f"context parallelism cuts each sequence into 2*cp = {2 * strategy.cp} chunks; seq_len "
                          f"{seq_len} does not divide; pick a seq_len that is a multiple of {2 * strategy.cp}")
    problem = context_parallel_problem(model)
    if problem is not None:
        raise NotModelledError(f"{problem}; plan this model with cp=1")


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, *, seq_len: int) -> None:
    """Run ``model``'s attention as ring attention over the mesh's cp axis and give it this rank's positions.

    Call after materialisation (which recomputes the RoPE tables) and after tensor parallelism.
    """
    ring = _Ring(mesh.get_group(CP), seq_len)
    for module in attention_modules(model):
        module.forward = _RingAttentionForward(module.forward, ring)
    _localise_positions(model, ring.positions(ring.rank, _device(model)))


def _localise_positions(model: nn.Module, positions: torch.Tensor) -> None:
    """RoPE tables -> their rows at ``positions``; a learned position embedding looks up ``positions[i]`` for ``i``."""
    buffers = dict(model.named_buffers(recurse=False))
    for name in ROPE_BUFFERS:
        if name in buffers:
            setattr(model, name, buffers[name][positions].clone())  # (T/cp, hd)
    embedding = getattr(model, POSITION_EMBEDDING, None)
    if isinstance(embedding, nn.Embedding):
        # prepend: run before tensor parallelism's input hook turns the indices into a DTensor
        embedding.register_forward_pre_hook(lambda module, args: (positions[args[0]], *args[1:]), prepend=True)


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
