"""``attnlab export RUN OUT``: a run's model as a Hugging Face directory that transformers loads.

OUT receives ``config.json`` (the architecture's transformers class in "architectures"; a classify
or image run's label names as ``id2label`` and ``label2id``), ``model.safetensors``, an image run's image processor as
``preprocessor_config.json`` (an image-text run: both it and the tokenizer files, as
transformers' processors of images and texts read them) and, where the run's tokenizer is one
the ``tokenizers`` library reads (a pretrained model's tokenizer.json, or a BPE vocabulary trained
by attnlab), ``tokenizer.json`` with a ``tokenizer_config.json`` naming its special tokens, so
that ``AutoTokenizer.from_pretrained(OUT)`` works too. A word- or character-level vocabulary has
no such form: OUT then holds the model alone, and a line says so.

Only models of a Hugging Face family export: language-model, translation and masked-LM runs of
such a family, and a classifier fine-tuned with ``--head native`` (the family's own classifier).
The tokenizer_config.json names the tokenizer's pad, unk, bos and eos tokens and the special
tokens the model's family states in its registration (``special_tokens``: a [CLS], a [MASK]).
The chapter's Transformer, its TextClassifier and the pooling head of ``--head pooling`` have no
transformers class; the error says which to train instead.

An OUT ending in ``.gguf`` gets one GGUF file instead (llama.cpp's format, which transformers also
reads; :func:`attnlab.gguf.save_gguf`): the weights as ``--qtype`` F32, F16, Q8_0, Q4_0 or Q4_1
(round-to-nearest, every matrix at that type; ``attnlab quantize`` chooses per layer), the tokenizer
and its chat template. RUN may itself be a GGUF file: re-written at another ``--qtype``, or
dequantised into a Hugging Face directory; a Hugging Face directory may be written as a GGUF file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "write a run's model (and tokenizer) as a Hugging Face directory that transformers loads"
EXAMPLE = ("attnlab train classify --init all-MiniLM-L6-v2/ --head native --data train.tsv --out runs/sst2\n"
           "  attnlab export runs/sst2 sst2-minilm/    # transformers.pipeline('text-classification', 'sst2-minilm')\n"
           "  attnlab export runs/image digits-vit/    # transformers.pipeline('image-classification', 'digits-vit')\n"
           "  attnlab export runs/lm lm-q8.gguf --qtype Q8_0     # llama.cpp and transformers read it\n"
           "  attnlab export SmolLM2-135M-Instruct.Q4_1.gguf smollm2/   # a dequantised Hugging Face directory")

# token names transformers' tokenizer classes read from tokenizer_config.json, by attnlab's role
_ROLE_KEYS = {"pad": "pad_token", "unk": "unk_token", "bos": "bos_token", "eos": "eos_token"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="an attnlab run directory (its best checkpoint), a checkpoint directory or a GGUF file")
    p.add_argument("out", help="the directory to write (new, or empty), or a FILE.gguf")
    p.add_argument("--qtype", choices=["F32", "F16", "Q8_0", "Q4_0", "Q4_1"], default="F32",
                   help="how a .gguf OUT stores the weight matrices (default F32; vectors stay F32)")
    p.add_argument("--merge", action="store_true", help="a LoRA run: fold the adapters into the weights and write "
                   "the whole merged model (default: write the adapter alone, in PEFT's layout; a .gguf OUT always "
                   "gets the merged model)")


def _tokenizer_files(tok, out: Path, context: int | None, family_tokens: dict[str, str]) -> str | None:
    """Write tokenizer.json and tokenizer_config.json for ``tok``, naming its special tokens by role
    and the ``family_tokens`` (tokenizer_config key -> token) its vocabulary has; the reason it
    cannot, or None."""
    hf = getattr(tok, "hf", None)
    if hf is None:
        return f"its {tok.kind} tokenizer has no Hugging Face form"
    (out / "tokenizer.json").write_text(hf.to_str(pretty=True), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    special = getattr(tok, "special", None) or {
        role: hf.id_to_token(i) for role in _ROLE_KEYS if (i := getattr(tok, f"{role}_id", None)) is not None}
    config.update({_ROLE_KEYS[r]: t for r, t in special.items() if t is not None and r in _ROLE_KEYS})
    config.update({key: token for key, token in family_tokens.items() if hf.token_to_id(token) is not None})
    if context:
        config["model_max_length"] = context
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return None


def run(args: argparse.Namespace) -> int:
    from . import UserError
    from ..models.pretrained import save_pretrained
    from ..models.registry import architecture_of
    from ..processors import save_processor
    from ..tasks.run import inspect_path, load_model, load_processors, model_context
    info = inspect_path(args.run)
    if info.kind not in ("run", "gguf") and not args.out.lower().endswith(".gguf"):
        raise UserError(f"{args.run}: {info.describe()}; 'attnlab export' writes an attnlab run as a Hugging Face "
                        "directory")
    if info.kind == "gguf" or args.out.lower().endswith(".gguf"):
        return _gguf(args, info)
    model = load_model(info.run)
    arch = architecture_of(model)
    if arch.family.base_rules is None:
        hint = (" (fine-tune with --head native for the family's own classifier)" if arch.name == "EncoderClassifier"
                else "")
        raise UserError(f"{args.run}: its model is a {arch.name}, which has no Hugging Face counterpart{hint}")
    unsupported = arch.family.hf_unsupported(model.config) if arch.family.hf_unsupported else None
    if unsupported:
        raise UserError(f"{args.run}: its {arch.name}'s {unsupported}; train it without those settings to export it")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: exists and is not an empty directory; give a new one")
    if _lora_export(model, out, args, info.run.path):
        return 0
    save_pretrained(model, out)
    processors = load_processors(info.run)
    why = note = None
    if "image" in processors:                  # preprocessor_config.json, which transformers' image processors read
        save_processor(processors["image"], out)
        if processors["image"].channels == 1:
            note = (f"{out}: a grey (1-channel) model: transformers' image-classification pipeline makes every image "
                    "RGB and cannot run it; call the model on 1-channel pixel_values, or train with --channels 3")
    if "audio" in processors:                  # preprocessor_config.json, which WhisperFeatureExtractor-style readers take
        save_processor(processors["audio"], out)
    if "image" not in processors or "text" in processors:       # a model of images and texts has both
        tok = processors.get("text") or processors.get("source") or next(iter(processors.values()))
        why = _tokenizer_files(tok, out, model_context(model), arch.family.special_tokens)
        template = info.run.task_options.get("chat_template")
        if template and not why:               # a fine-tuned chat model: transformers' apply_chat_template reads it
            config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
            (out / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=template), indent=2,
                                                                  sort_keys=True) + "\n", encoding="utf-8")
    written = sorted(p.name for p in out.iterdir())
    print(f"{out}: {arch.name} ({arch.model_type}) from {info.run.path}: {', '.join(written)}", file=sys.stderr)
    if note:
        print(note, file=sys.stderr)
    if why:
        print(f"{out}: no tokenizer files: {why}; tokenize as the run does (attnlab.tokenizer)", file=sys.stderr)
    return 0


def _gguf(args: argparse.Namespace, info) -> int:
    """A run, GGUF file or Hugging Face directory written as a GGUF file, or a GGUF file as a Hugging
    Face directory."""
    from . import UserError
    from ..hub import from_pretrained, load_tokenizer, save_gguf, save_pretrained
    from ..tasks.run import load_model, load_tokenizers, model_context
    from ..gguf import read_metadata
    if info.kind != "run":                               # a GGUF file or a Hugging Face directory
        has_tokenizer = ("tokenizer.ggml.model" in read_metadata(info.path) if info.kind == "gguf"
                         else (info.path / "tokenizer.json").is_file())
        model, tok = from_pretrained(info.path), load_tokenizer(info.path) if has_tokenizer else None
    else:
        from ..adapters import lora_layers, merge_lora
        model, tok = load_model(info.run).eval(), load_tokenizers(info.run).get("text")
        if lora_layers(model):                           # GGUF has no adapters: the merged weights
            merge_lora(model)
    out = Path(args.out)
    if out.suffix.lower() == ".gguf":
        if out.exists():
            raise UserError(f"{out}: exists; give a new file name")
        save_gguf(model, out, tok if getattr(tok, "hf", None) is not None else None, qtype=args.qtype)
        print(f"{out}: {type(model).__name__} as GGUF ({args.qtype}), {out.stat().st_size / 2**20:.1f} MiB",
              file=sys.stderr)
        return 0
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: exists and is not an empty directory; give a new one")
    save_pretrained(model, out)
    if tok is not None:
        _tokenizer_files(tok, out, model_context(model), {})
    if getattr(tok, "chat_template", None):           # where transformers' tokenizers look for it
        (out / "chat_template.jinja").write_text(tok.chat_template, encoding="utf-8")
    print(f"{out}: {type(model).__name__} from {info.path}: {', '.join(sorted(p.name for p in out.iterdir()))}",
          file=sys.stderr)
    return 0


def _lora_export(model, out: Path, args: argparse.Namespace, source: Path) -> bool:
    """A LoRA run without --merge: write its adapter (PEFT's layout) and say so; True when done.
    With --merge the adapters are folded into the weights (W + alpha/r B A) before the model is written."""
    from . import UserError
    from ..adapters import lora_layers, merge_lora, save_adapter
    if not lora_layers(model):
        if args.merge:
            raise UserError(f"--merge: {source} has no LoRA adapters to merge")
        return False
    if args.merge:
        merge_lora(model)
        return False
    save_adapter(model, out)
    print(f"{out}: the LoRA adapter of {source} (adapter_config.json, adapter_model.safetensors); "
          "--merge writes the whole merged model", file=sys.stderr)
    return True
