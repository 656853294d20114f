"""A model built on the meta device (a spec's model, or a user's) is initialised by its own init once sharded
(``runtime.materialize``): ties made before ``to_empty`` are kept, a Hugging Face model takes its own
``_init_weights``, and a parameter no init writes is refused by name instead of training from stale memory."""

import pytest
import torch
from torch import nn

import tessera
from tessera.errors import NotModelledError

HF_LLAMA = ("hf:llama:hidden_size=32,num_attention_heads=4,num_key_value_heads=2,intermediate_size=64,"
            "num_hidden_layers=2,vocab_size=64")


class Norm(nn.Module):
    def __init__(self, dim: int, with_reset: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        if with_reset:
            self.reset_parameters = lambda: nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class TiedLM(nn.Module):
    """A user's LM: embedding tied to the head, its own norms, no root ``reset_parameters()``."""

    def __init__(self, norm_reset: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(nn.Sequential(Norm(16, norm_reset), nn.Linear(16, 16)) for _ in range(2))
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def train_one_step(model, vocab: int = 64) -> tuple[object, float]:
    torch.manual_seed(0)
    pm = tessera.auto_parallelize(model, "cpu:ranks=1", global_batch=4, seq_len=8)
    tokens = torch.randint(vocab, (4, 9))
    return pm, pm.train_step((tokens[:, :-1], tokens[:, 1:]))


def test_a_tied_user_model_on_meta_keeps_its_tie_and_trains():
    with torch.device("meta"):
        model = TiedLM()
    pm, loss = train_one_step(model)
    assert pm.module.head.weight is pm.module.embed.weight  # one weight, as built (to_empty had made two)
    assert torch.isfinite(torch.tensor(loss)) and all(torch.isfinite(p).all() for p in pm.module.parameters())


def test_a_parameter_no_init_writes_is_refused_by_name():
    with torch.device("meta"):
        model = TiedLM(norm_reset=False)
    with pytest.raises(NotModelledError, match=r"first: blocks\.0\.0\.weight, of Norm, which has no reset_parameters"):
        train_one_step(model)


def test_a_hugging_face_spec_built_on_meta_takes_its_own_init():
    pm, loss = train_one_step(HF_LLAMA)
    model = pm.module
    norms = [module.weight for name, module in model.named_modules() if name.endswith("norm")]
    assert norms and all((norm - 1).abs().max() < 0.01 for norm in norms)  # ones, one optimizer step ago:
    # LlamaRMSNorm has no reset_parameters(), its _init_weights sets them (they held stale memory: the loss was NaN)
    assert torch.allclose(model.model.rotary_emb.inv_freq[:2], torch.tensor([1.0, 0.1]))
    assert torch.isfinite(torch.tensor(loss))

