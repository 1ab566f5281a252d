"""A model family defined and registered in this file alone, then held to the same contract as
the built-in ones (tests/contract.py): proof that a new family needs its own module and
nothing else. The toy is a causal LM assembled from attnlab.nn blocks:

    ids -> embedding -> N x [x = x + Attn_RoPE(RMSNorm(x)); x = x + FFN(RMSNorm(x))] -> RMSNorm -> head
"""
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import contract
from attnlab.generate import generate
from attnlab.models.pretrained import SavePretrained
from attnlab.models.registry import families, family, register_family
from attnlab.nn import FeedForward, LayerCaches, MultiHeadAttention, RMSNorm, RotaryEmbedding


@dataclass
class ToyConfig:
    vocab_size: int = 96
    d_model: int = 32
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 64
    max_seq_len: int = 64


class ToyLayer(nn.Module):
    def __init__(self, c: ToyConfig, rope: RotaryEmbedding):
        super().__init__()
        self.attn_norm, self.ff_norm = RMSNorm(c.d_model), RMSNorm(c.d_model)
        self.attn = MultiHeadAttention(c.d_model, c.num_heads, bias=False, position=rope, causal=True)
        self.ff = FeedForward(c.d_model, c.d_ff, activation="gelu")

    def forward(self, x: Tensor, padding: Tensor | None, positions: Tensor, cache) -> Tensor:
        x = x + self.attn(self.attn_norm(x), key_padding_mask=padding, positions=positions, cache=cache)[0]
        return x + self.ff(self.ff_norm(x))


class ToyLM(SavePretrained, nn.Module):
    """forward(input_ids (B, T), attention_mask (B, P + T) or None, cache) -> logits (B, T, V)."""

    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = c = config
        rope = RotaryEmbedding(c.d_model // c.num_heads)
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(ToyLayer(c, rope) for _ in range(c.num_layers))
        self.norm, self.head = RMSNorm(c.d_model), nn.Linear(c.d_model, c.vocab_size, bias=False)

    def new_cache(self) -> LayerCaches:
        return LayerCaches(len(self.layers))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, cache: LayerCaches | None = None):
        T, past = input_ids.size(1), 0 if cache is None else cache.length
        padding = None if attention_mask is None else attention_mask.bool()
        # a left-padded row's first real token is position 0
        positions = (torch.arange(past, past + T, device=input_ids.device) if padding is None
                     else (padding.long().cumsum(-1) - 1).clamp(min=0)[:, -T:])
        x = self.embedding(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, padding, positions, None if cache is None else cache.self_attn[i])
        return self.head(self.norm(x))

    def generate(self, input_ids: Tensor, max_new_tokens: int, **options) -> Tensor:
        return generate(self, input_ids, max_new_tokens, **options)


def build_config(*, vocab_size, context, d_model, num_heads, num_layers, d_ff=None, dropout=0.0) -> ToyConfig:
    if dropout:
        raise ValueError("toy-lm has no dropout")
    return ToyConfig(vocab_size, d_model, num_heads, num_layers, d_ff or 2 * d_model, context)


TOY = register_family("toy-lm", ToyConfig, presets={"tiny": {}}, build_config=build_config,
                      limits=lambda c: {"vocab_size": c.vocab_size, "context": c.max_seq_len})
TOY.register("ToyLM", ToyLM, kind="causal-lm")


# ----------------------------------------------------------------------------- tests
def test_the_toy_family_is_registered_like_the_built_in_ones():
    assert family("toy-lm") is TOY and TOY in families("causal-lm")
    model = TOY.for_kind("causal-lm").build(TOY.build_config(vocab_size=40, context=16, d_model=16, num_heads=2,
                                                             num_layers=1))
    assert model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 40)


def test_the_toy_family_meets_the_contract(tmp_path):
    contract.run_contract(TOY.default, tmp_path)


def test_the_toy_family_trains_through_the_lm_task_and_loads_back(tmp_path, capsys):
    """`attnlab train lm --model toy-lm`: the LM task builds any registered causal-LM family through
    the registry, trains it, records it in run.json, and `generate` / `eval` load it back."""
    from attnlab.cli import main
    from attnlab.tasks.lm import load_lm
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    run = tmp_path / "run"
    assert main(["train", "lm", "--model", "toy-lm", "--data", str(text), "--out", str(run), "--steps", "12",
                 "--d-model", "32", "--heads", "2", "--layers", "1", "--context", "32", "--batch-size", "8",
                 "--lr", "1e-2", "--warmup", "2", "--eval-every", "6", "--sample-tokens", "8", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "model: ToyLM" in out.err and "sample" in out.out
    lm = load_lm(run, "cpu")
    assert isinstance(lm.model, ToyLM) and lm.model.config.max_seq_len == 32 and not lm.model.training
    losses = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "eval"' in line]
    assert len(losses) == 2
    assert main(["generate", str(run), "--prompt", "the quick", "--temperature", "0", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("the quick")
    held = tmp_path / "held.txt"
    held.write_text("the lazy dog jumps over the quick brown fox. " * 3)
    assert main(["eval", str(run), "--data", str(held)]) == 0
    assert "perplexity" in capsys.readouterr().out
