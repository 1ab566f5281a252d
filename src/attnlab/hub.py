"""Model directories in and out: ``from_pretrained``, ``save_pretrained``, ``load_tokenizer`` and
``load_processor`` (a directory's tokenizer.json, or its preprocessor_config.json as an
:class:`attnlab.processors.ImageProcessor`).

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
from .models.pretrained import from_hf_state_dict, from_pretrained, read_weights, save_pretrained, to_hf_state_dict
from .models.registry import architecture_of, families, family
from .processors import ImageProcessor, load_processor
from .tokenizer import load_tokenizer

__all__ = ["Op", "IDENTITY", "TRANSPOSE", "Fuse", "Split", "PermuteRope", "permute_rope", "unpermute_rope", "Rule",
           "to_hf_state_dict", "from_hf_state_dict", "read_weights", "from_pretrained", "save_pretrained",
           "load_tokenizer", "load_processor", "ImageProcessor", "family", "families", "architecture_of"]
