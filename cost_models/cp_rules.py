"""Which models the runtime's context parallelism can run (``runtime.context_parallel``), as a pure rule on the
module tree, shared by the runtime's check and the planner's capabilities so the two never disagree.

Ring attention replaces the forward of every attention module (a module with an integer ``head_dim``), and each
cp rank must give its tokens their global positions: the runtime knows rotary tables held as root buffers
(``rope_cos``/``rope_sin``: Tessera's Llama and MoE) and a learned root ``pos_emb`` embedding (Tessera's GPT).
"""

from __future__ import annotations

from torch import nn

ROPE_BUFFERS = ("rope_cos", "rope_sin")
POSITION_EMBEDDING = "pos_emb"


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ring attention runs: those declaring an integer ``head_dim``."""
    return [module for module in model.modules() if isinstance(getattr(module, "head_dim", None), int)]


def has_known_positions(model: nn.Module) -> bool:
    buffers = dict(model.named_buffers(recurse=False))
    rope = all(name in buffers for name in ROPE_BUFFERS)
    return rope or isinstance(getattr(model, POSITION_EMBEDDING, None), nn.Embedding)


def context_parallel_problem(model: nn.Module) -> str | None:
    """Why the runtime cannot run ``model`` under cp > 1 at any degree (one line), or None."""
    if not attention_modules(model):
        return ("context parallelism found no attention module (a module with an integer head_dim) to run as ring "
                "attention; plan with cp=1")
    if not has_known_positions(model):
        return ("context parallelism must give each token its global position, and knows Tessera's models only: RoPE "
                f"tables ({', '.join(ROPE_BUFFERS)} buffers: Llama, MoE) or a learned {POSITION_EMBEDDING} embedding (GPT); "
                "plan with cp=1")
    return None
