"""One model surface over the whole registry, as transformers' users expect it: every registered
model has ``save_pretrained`` (the same directory as attnlab.save_pretrained), takes transformers'
keyword names (``input_ids``, ``attention_mask`` with its 1/0 integers, ``token_type_ids``,
``decoder_input_ids``, ``decoder_attention_mask``) besides the chapter's, and loads a checkpoint
without the tensors it declares that no output reads, staying strict about every other one. The
parameters come from the registry, so a family registered later is held to the same surface."""
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import attnlab
import attnlab.models  # noqa: F401  (importing the package registers every model file)
import contract
from attnlab.nn import optimize_for_inference
from attnlab.models.convert import convert, unread_tensors
from attnlab.models.registry import architectures
from attnlab.models.t5 import T5ForConditionalGeneration
from attnlab.models.transformer import Transformer

ARCHS = architectures()
IDS = [f"{a.model_type}/{a.name}" for a in ARCHS]
# where the chapter's names differ from transformers': an encoder-decoder's padding masks
CHAPTER_MASKS = {"attention_mask": "src_key_padding_mask", "decoder_attention_mask": "tgt_key_padding_mask"}


@pytest.mark.parametrize("arch", ARCHS, ids=IDS)
def test_every_model_has_save_pretrained_writing_what_the_library_writes(arch, tmp_path):
    model = contract.tiny(arch, randomize=True)
    assert callable(getattr(model, "save_pretrained", None)), f"{arch}: no save_pretrained"
    assert model.save_pretrained(tmp_path / "method") == tmp_path / "method"
    attnlab.save_pretrained(model, tmp_path / "function")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "method" / name).read_bytes() == (tmp_path / "function" / name).read_bytes(), name
    back = attnlab.from_pretrained(tmp_path / "method")
    optimize_for_inference(model)       # as from_pretrained readies ``back``: the same products, bit for bit
    x = contract.inputs(arch, model)
    with torch.no_grad():
        assert contract.same(back(*x), model(*x)), f"{arch}: outputs changed through model.save_pretrained"


def _masks(x: dict) -> dict:
    """transformers' integer masks (1 = real token) for the token inputs of ``x``: row 0 ends in
    three padding tokens, so a mask that were dropped or read the wrong way round would show."""
    masks = {}
    for ids, name in (("input_ids", "attention_mask"), ("decoder_input_ids", "decoder_attention_mask")):
        if ids in x:
            mask = torch.ones_like(x[ids])
            mask[0, -3:] = 0
            masks[name] = mask
    return masks


@pytest.mark.parametrize("arch", ARCHS, ids=IDS)
def test_every_model_takes_transformers_keyword_names(arch):
    model = contract.tiny(arch, randomize=True)
    x = contract.inputs(arch, model)
    theirs = contract.example(arch, model.config)      # the kind's inputs under transformers' names
    with torch.no_grad():
        assert contract.same(model(**theirs), model(*x)), f"{arch}: transformers' names give other outputs"
        masks = _masks(theirs)
        if not masks:
            return
        padded = model(**theirs, **masks)
        assert not contract.same(padded, model(**theirs)), f"{arch}: the attention mask was ignored"
        ours = {(CHAPTER_MASKS[k] if arch.kind == "seq2seq" else k): v.bool() for k, v in masks.items()}
        assert contract.same(model(*x, **ours), padded), f"{arch}: transformers' masks differ from the chapter's"
        if getattr(model.config, "type_vocab_size", 0) > 1:
            types = torch.zeros_like(theirs["input_ids"])
            types[:, 5:] = 1
            assert not contract.same(model(**theirs, token_type_ids=types), model(**theirs)), \
                f"{arch}: token_type_ids were ignored"


@pytest.mark.parametrize("cls", [Transformer, T5ForConditionalGeneration])
def test_an_encoder_decoder_takes_each_argument_under_one_name(cls):
    arch = next(a for a in ARCHS if a.model_cls is cls)
    model = contract.tiny(arch)
    src, tgt = contract.inputs(arch, model)
    who = cls.__name__.removesuffix("ForConditionalGeneration")
    with pytest.raises(ValueError, match=f"{who}: give src or input_ids \\(transformers' name for it\\), not both"):
        model(src, tgt, input_ids=src)
    with pytest.raises(ValueError, match="give tgt_key_padding_mask or decoder_attention_mask"):
        model(src, tgt, tgt_key_padding_mask=tgt > -1, decoder_attention_mask=torch.ones_like(tgt))
    with pytest.raises(TypeError, match=f"{who}: missing tgt \\(or transformers' name for it, decoder_input_ids\\)"):
        model(input_ids=src)
    additive = torch.zeros(src.shape).masked_fill(src == 0, float("-inf"))      # torch's convention, not 1/0
    with pytest.raises(ValueError, match="attention_mask must hold 1 for real tokens and 0 for padding"):
        model(input_ids=src, decoder_input_ids=tgt, attention_mask=additive - 1)


UNREAD = [a for a in ARCHS if unread_tensors(contract.tiny(a))]


def test_the_bare_encoders_with_a_kept_pooler_declare_it_unread():
    assert {a.name for a in UNREAD} == {"BertModel", "AlbertModel", "ViTModel", "DeiTModel",
                                        "LlavaForConditionalGeneration"}


@pytest.mark.parametrize("arch", UNREAD, ids=[f"{a.model_type}/{a.name}" for a in UNREAD])
def test_a_checkpoint_without_the_unread_tensors_loads_and_nothing_else_may_be_missing(arch, tmp_path):
    model = contract.tiny(arch, randomize=True)
    model.save_pretrained(tmp_path / "full")
    tensors = load_file(tmp_path / "full" / "model.safetensors")
    state = model.state_dict()
    unread, _, _, _ = convert({k: state[k] for k in unread_tensors(model)}, arch.weight_map, model.config, to_hf=True)
    # the pooler's weight and bias; LLaVA's vision layer past its feature layer (16 tensors) and final norm (2)
    assert len(unread) == (18 if arch.model_type == "llava" else 2)
    kept = {k: v for k, v in tensors.items() if k not in unread}
    for name, drop in (("bare", ()), ("gap", (sorted(kept)[0],))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
        save_file({k: v for k, v in kept.items() if k not in drop}, str(tmp_path / name / "model.safetensors"))
    with pytest.warns(UserWarning, match=f"{arch.name}: the checkpoint has no {re.escape(', '.join(sorted(unread)))}; "
                                         f"no output of the model reads them"):
        back = attnlab.from_pretrained(tmp_path / "bare")
    x = contract.inputs(arch, model)
    with torch.no_grad():
        assert contract.same(back(*x), model(*x)), f"{arch}: outputs changed without the unread tensors"
    with pytest.raises(ValueError, match=f"missing keys \\(1\\): {sorted(kept)[0]}"):
        attnlab.from_pretrained(tmp_path / "gap")
