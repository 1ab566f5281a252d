"""Model directories in and out: ``from_pretrained``, ``save_pretrained``, ``load_tokenizer`` and
``load_processor`` (a directory's tokenizer.json, or its preprocessor_config.json as an
:class:`attnlab.processors.ImageProcessor`); each also takes a GGUF file (:mod:`attnlab.gguf`:
the model dequantised, the tokenizer with its chat template), and ``save_gguf`` writes one.

The public face of :mod:`attnlab.models.pretrained` (which does the work inside the models
layer, so that ``model.save_pretrained(dir)`` needs nothing above it) plus the tokenizer loader
(:func:`attnlab.tokenizer.load_tokenizer`, which reads a Hugging Face tokenizer.json and attnlab's
own files alike). A directory's config.json names the model family (``model_type``) and the
model class (``architectures``); both are looked up in :mod:`attnlab.models.registry`, where
every model file registers its families, architectures, presets and weight rules; this module
knows no model by name.

Weight maps are declarative and two-way (:mod:`attnlab.models.convert`): key templates name
their variable parts in braces, ``"layers.{i}.self_attn.q_proj.{p}"``; an op turns our tensors
into the checkpoint's and has the exact inverse:

    IDENTITY       same tensor                      TRANSPOSE   w.T (GPT-2's Conv1D is (in, out))
    Fuse(dim, n)   cat along dim / chunk into n     PermuteRope(heads_attr)  q/k rows between
    Split(dim, n)  chunk into n / cat (Fuse's        the interleaved and half-split RoPE layouts
                   inverse: BERT's query/key/value)
    Fuse(dim, sizes=(a, b, ...)) / Split(dim, sizes=...): parts of unequal sizes (ints or config
                   field names: Mamba's x_proj, Mamba-2's in_proj)
"""
from __future__ import annotations

from .models.convert import IDENTITY, TRANSPOSE, Fuse, Op, PermuteRope, Rule, Split, permute_rope, unpermute_rope
from . import processors as _processors
from . import tokenizer as _tokenizer
from .gguf import from_gguf, gguf_tokenizer, is_gguf, save_gguf
from .models import pretrained as _pretrained
from .models.pretrained import from_hf_state_dict, read_weights, save_pretrained, to_hf_state_dict
from .models.registry import architecture_of, families, family
from .processors import ImageProcessor

__all__ = ["Op", "IDENTITY", "TRANSPOSE", "Fuse", "Split", "PermuteRope", "permute_rope", "unpermute_rope", "Rule",
           "to_hf_state_dict", "from_hf_state_dict", "read_weights", "from_pretrained", "save_pretrained",
           "load_tokenizer", "load_processor", "ImageProcessor", "family", "families", "architecture_of",
           "save_gguf"]


def from_pretrained(path, dtype=None):
    """A model directory (:func:`attnlab.models.pretrained.from_pretrained`: config.json + weights)
    or a GGUF file (:func:`attnlab.gguf.from_gguf`: dequantised), as the attnlab model of its
    architecture, in eval mode; ``dtype`` None keeps float32."""
    return from_gguf(path, dtype) if is_gguf(path) else _pretrained.from_pretrained(path, dtype)


def load_tokenizer(path):
    """:func:`attnlab.tokenizer.load_tokenizer`, and a GGUF file's tokenizer with its chat template."""
    return gguf_tokenizer(path) if is_gguf(path) else _tokenizer.load_tokenizer(path)


def load_processor(path, modality: str | None = None):
    """:func:`attnlab.processors.load_processor`; a GGUF file holds a text model's tokenizer."""
    if is_gguf(path):
        if modality not in (None, "text"):
            raise ValueError(f"{path}: a GGUF file holds a tokenizer, not a processor of {modality}")
        return gguf_tokenizer(path)
    return _processors.load_processor(path, modality)
