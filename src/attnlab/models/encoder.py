"""Pieces the bidirectional encoders (ALBERT, DeBERTa) share: the input checks, the
initialisation, the masked-LM head tied to the token embedding and the classifier head.

    masked-LM head:  h (B, T, E) -> Linear E -> E_emb -> activation -> LayerNorm -> x W_tok^T + b -> (B, T, V)

W_tok is the token embedding itself (tied: one tensor, stored once); ``b`` is the head's own
bias, the only output weight a checkpoint holds. Shape letters: see :mod:`attnlab.nn.attention`.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn.norm import LayerNorm
from .convert import Rule

__all__ = ["EMBEDDING_RULES", "ACT_FROM_HF", "ACT_TO_HF", "activation_module", "check_inputs", "init_weights",
           "MaskedLMHead", "labels_from_hf", "labels_to_hf"]

# the input embeddings' weights, named alike in BERT-style checkpoints (relative to the base)
EMBEDDING_RULES = [
    Rule("token_embedding.weight", "embeddings.word_embeddings.weight"),
    Rule("position_embedding.weight", "embeddings.position_embeddings.weight"),
    Rule("token_type_embedding.weight", "embeddings.token_type_embeddings.weight"),
    Rule("embedding_norm.{p}", "embeddings.LayerNorm.{p}"),
]
# Hugging Face's activation names <-> FeedForward's ("gelu_new" is GPT-2's tanh approximation)
ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def activation_module(name: str) -> nn.Module:
    """The module of one of FeedForward's activation names."""
    if name not in ACT_TO_HF:
        raise ValueError(f"unknown activation {name!r}; valid activations are {', '.join(ACT_TO_HF)}")
    return nn.GELU(approximate="tanh") if name == "gelu_tanh" else nn.GELU() if name == "gelu" else nn.ReLU()


def check_inputs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                 token_type_ids: Tensor | None) -> Tensor | None:
    """Validate an encoder's inputs against ``model.config`` (vocab_size, max_position_embeddings,
    type_vocab_size); returns the (B, T) boolean padding mask (True = real token), or None when
    there is no padding. One clear ValueError per problem: ids not a non-empty integer (B, T)
    tensor or out of [0, vocab_size), a sequence longer than the positions, a mask or token
    types of another shape, a type out of range."""
    who, V = type(model).__name__, model.config.vocab_size
    max_len, type_vocab_size = model.config.max_position_embeddings, model.config.type_vocab_size
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0 \
            or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"{who}: input_ids must be a non-empty integer (batch, seq) tensor, got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    B, T = input_ids.shape
    lo, hi = (int(v) for v in input_ids.aminmax())
    if lo < 0 or hi >= V:
        raise ValueError(f"{who}: token id {hi if hi >= V else lo} is out of range [0, vocab_size={V})")
    if T > max_len:
        raise ValueError(f"{who}: a sequence of {T} tokens is longer than the model's {max_len} positions")
    if token_type_ids is not None:
        if token_type_ids.shape != (B, T):
            raise ValueError(f"{who}: token_type_ids must be (batch, seq) = {(B, T)}, "
                             f"got {tuple(token_type_ids.shape)}")
        lo, hi = (int(v) for v in token_type_ids.aminmax())
        if lo < 0 or hi >= type_vocab_size:
            raise ValueError(f"{who}: token type {hi if hi >= type_vocab_size else lo} is out of range "
                             f"[0, type_vocab_size={type_vocab_size})")
    if attention_mask is None:
        return None
    if attention_mask.shape != (B, T):
        raise ValueError(f"{who}: attention_mask must be (batch, seq) = {(B, T)} with True/1 for real tokens, "
                         f"got {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    return None if bool(mask.all()) else mask


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """Matrices and embedding tables ~ N(0, std), biases 0, norm scales 1, as BERT-style
    checkpoints start (PyTorch's N(0, 1) embedding tied to the output head would give huge
    logits and a slow, denormal-filled backward on CPU)."""
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, 0.0, std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


class MaskedLMHead(nn.Module):
    """The masked-LM head (see the module docstring): ``dense`` (E -> E_emb), the activation,
    ``norm``, then the scores against the tied token embedding plus ``bias`` (V,).

    forward(h (B, T, E), embedding (V, E_emb) weight) -> logits (B, T, V).
    """

    def __init__(self, d_model: int, embedding_size: int, vocab_size: int, activation: str, eps: float):
        super().__init__()
        self.dense = nn.Linear(d_model, embedding_size)
        self.act = activation_module(activation)
        self.norm = LayerNorm(embedding_size, eps)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, h: Tensor, embedding: Tensor) -> Tensor:
        return nn.functional.linear(self.norm(self.act(self.dense(h))), embedding, self.bias)


def labels_to_hf(num_labels: int, id2label: dict[int, str] | None) -> dict:
    """config.json's label fields: num_labels, and the names when the config has them."""
    if id2label is None:
        return {"num_labels": num_labels}
    return {"num_labels": num_labels, "id2label": {str(i): n for i, n in id2label.items()},
            "label2id": {n: i for i, n in id2label.items()}}


def labels_from_hf(c: dict) -> dict:
    """(num_labels, id2label) from config.json; transformers' placeholder names LABEL_i read as none."""
    names = {int(i): n for i, n in (c.get("id2label") or {}).items()}
    num_labels = len(names) if names else c.get("num_labels", 2)
    if names and sorted(names) != list(range(num_labels)):
        raise ValueError(f"config.json: id2label keys must be 0 .. {num_labels - 1}, got {sorted(names)}")
    if all(n == f"LABEL_{i}" for i, n in names.items()):
        names = {}
    return {"num_labels": num_labels, "id2label": names or None}
