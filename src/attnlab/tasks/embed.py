"""Sentence embeddings: the mean of an encoder's last hidden states over a text's real tokens.

    emb = load_embedder("all-MiniLM-L6-v2/")          # a Hugging Face directory or an attnlab run
    vectors = emb.embed(["a cat sits", "a dog runs"])  # (2, E), unit length by default

Any model that has token vectors works: a registered "base" model (BertModel, GPT2Model), a
classify run or classifier directory (its vectors before pooling), or a checkpoint whose family
has a base architecture (a language model, a masked LM: its base, without the head). Mean pooling
over the real tokens is what sentence-transformers checkpoints such as all-MiniLM-L6-v2 were
trained with; their vectors are then normalised to unit length, so that a dot product is the
cosine similarity, and ``normalize=True`` (the default) does the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.pooling import mean_pool
from ..tokenizer import PAD_ID, Tokenizer
from .classify import encode_texts, model_length, pad_batch, text_batches
from .pretrained import load_base
from .run import inspect_path, load_model, load_tokenizers, resolve_device

__all__ = ["Embedder", "load_embedder"]


@dataclass
class Embedder:
    """A model's token vectors, mean-pooled per text. ``model`` is a base model (forward gives
    (B, T, E)) or has ``hidden_states(ids, mask) -> (x, mask)`` (the classifiers)."""
    model: nn.Module
    tokenizer: Tokenizer
    path: Path
    max_len: int

    def _hidden(self, input_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        if hasattr(self.model, "hidden_states"):
            x, m = self.model.hidden_states(input_ids, mask)
            return x, mask if m is None else m
        return self.model(input_ids, attention_mask=mask), mask

    @torch.no_grad()
    def embed(self, texts: Sequence[str], normalize: bool = True, batch_size: int = 64) -> Tensor:
        """(N, E) float32 vectors, row i for texts[i]; unit length with ``normalize``."""
        ids = encode_texts(self.tokenizer, texts, self.max_len)
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else PAD_ID
        device = next(self.model.parameters()).device
        out: Tensor | None = None
        for b in text_batches(ids, batch_size, self.max_len, shuffle=False):
            input_ids, mask = pad_batch([ids[i] for i in b], pad)
            x, m = self._hidden(input_ids.to(device), mask.to(device))
            v = mean_pool(x.float(), m).cpu()
            if out is None:
                out = torch.empty(len(texts), v.size(-1))
            out[b] = v
        if out is None:
            raise ValueError("embed: no texts given")
        return F.normalize(out, dim=-1) if normalize else out


def load_embedder(path: str | Path, device: str | torch.device | None = None) -> Embedder:
    """The encoder at ``path`` (module docstring), in eval mode on ``device``."""
    info = inspect_path(path)
    model = None
    if info.kind == "run":
        run = info.run
        loaded = load_model(run)
        tokenizers = load_tokenizers(run)
        tok = tokenizers.get("text") or tokenizers.get("source") or next(iter(tokenizers.values()))
        if hasattr(loaded, "hidden_states"):
            model = loaded
    else:
        from ..hub import from_pretrained
        from .run import architecture_for
        arch = architecture_for(info.model_type, info.architectures, str(Path(path) / "config.json"))
        if arch.kind == "classifier" and hasattr(arch.model_cls, "hidden_states"):
            from ..tokenizer import load_tokenizer
            model, tok = from_pretrained(path), load_tokenizer(path)
    if model is None:
        model, tok = load_base(str(path), flag="")
    model = model.to(resolve_device(device)).eval()
    return Embedder(model, tok, Path(path), min(512, model_length(model)))
