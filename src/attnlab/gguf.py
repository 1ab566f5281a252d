"""GGUF files in and out: llama.cpp's single-file format for a model, its tokenizer and chat template.

    model = attnlab.from_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf")     # dequantised, fp32
    tokenizer = attnlab.load_tokenizer("SmolLM2-135M-Instruct.Q4_1.gguf")  # BPE + chat template
    save_gguf(model, "out.gguf", tokenizer, qtype="Q8_0")                   # transformers reads it

A GGUF file holds key/value metadata (``general.architecture``, then ``<arch>.block_count``,
``<arch>.embedding_length``, ..., ``tokenizer.ggml.tokens``, ``tokenizer.chat_template``) and named
tensors, each stored as F32, F16 or in a block-quantised type (Q8_0: blocks of 32 int8 with one fp16
scale; Q4_1: 32 4-bit values with an fp16 scale and minimum). Reading goes through the Hugging Face
layout that the rest of attnlab already speaks: the metadata becomes a config.json dict, the tensors
(dequantised to fp32 by the ``gguf`` package) get transformers' checkpoint names, and the family's
registered config translator and weight rules (:mod:`attnlab.models.registry`) build the model as
for a model directory. What differs by architecture is a table, :data:`LAYOUTS` (config keys and
tensor names), not code; a new architecture is a new entry.

llama.cpp's converter stores the rows of the query and key projections permuted per head for its
interleaved RoPE (channel pairs (2i, 2i+1)), while the Hugging Face layout pairs channel i with
i + D/2. A layout names those tensors and the config field giving their head count; reading puts
the rows back with :func:`attnlab.hub.permute_rope` (the same permutation as Meta's original
checkpoints) and writing applies its inverse. Without it the model loads without complaint and
writes nonsense.

The tokenizer: ``tokenizer.ggml.model`` "gpt2" is byte-level BPE (the vocabulary spelled in
GPT-2's byte alphabet, the merges in rank order); ``tokenizer.ggml.pre`` names how text is split
before the merges (GPT-2's regex unless :data:`PRE_SPLITS` has another); tokens typed CONTROL are
added as special tokens (kept whole in text, skipped when decoding) and USER_DEFINED ones as plain
added tokens, as transformers and llama.cpp do.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from .models.convert import permute_rope, unpermute_rope
from .models.pretrained import from_hf_state_dict, to_hf_state_dict
from .models.registry import architecture_of, family

__all__ = ["GGUFLayout", "LAYOUTS", "PRE_SPLITS", "is_gguf", "read_metadata", "gguf_architecture", "read_gguf", "from_gguf",
           "gguf_tokenizer", "save_gguf", "QTYPES", "encode_blocks", "decode_blocks", "BLOCK_BYTES"]


@dataclass(frozen=True)
class GGUFLayout:
    """How one GGUF architecture maps onto a Hugging Face one.

    ``config``: (GGUF key after "<arch>.", config.json field, "int" | "float"); ``tensors``: (GGUF
    name, checkpoint name) templates where ``{i}`` is a layer index and ``{p}`` "weight" or "bias";
    ``rope_rows``: the GGUF templates whose rows llama.cpp permuted, with the config field giving
    that projection's head count."""
    model_type: str
    architecture: str
    config: tuple[tuple[str, str, str], ...]
    tensors: tuple[tuple[str, str], ...]
    rope_rows: dict[str, str]
    tied_head: tuple[str, str] = ("output.weight", "tie_word_embeddings")   # absent tensor -> the field is True


_LLAMA_CONFIG = (
    ("context_length", "max_position_embeddings", "int"), ("block_count", "num_hidden_layers", "int"),
    ("embedding_length", "hidden_size", "int"), ("feed_forward_length", "intermediate_size", "int"),
    ("attention.head_count", "num_attention_heads", "int"),
    ("attention.head_count_kv", "num_key_value_heads", "int"), ("rope.dimension_count", "head_dim", "int"),
    ("rope.freq_base", "rope_theta", "float"), ("attention.layer_norm_rms_epsilon", "rms_norm_eps", "float"),
    ("vocab_size", "vocab_size", "int"))
_LLAMA_TENSORS = (
    ("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("blk.{i}.attn_q.{p}", "model.layers.{i}.self_attn.q_proj.{p}"),
    ("blk.{i}.attn_k.{p}", "model.layers.{i}.self_attn.k_proj.{p}"),
    ("blk.{i}.attn_v.{p}", "model.layers.{i}.self_attn.v_proj.{p}"),
    ("blk.{i}.attn_output.{p}", "model.layers.{i}.self_attn.o_proj.{p}"),
    ("blk.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("blk.{i}.ffn_gate.{p}", "model.layers.{i}.mlp.gate_proj.{p}"),
    ("blk.{i}.ffn_up.{p}", "model.layers.{i}.mlp.up_proj.{p}"),
    ("blk.{i}.ffn_down.{p}", "model.layers.{i}.mlp.down_proj.{p}"))

# general.architecture -> layout. Mistral's files say "llama" too (llama.cpp converts them so).
LAYOUTS: dict[str, GGUFLayout] = {
    "llama": GGUFLayout("llama", "LlamaForCausalLM", _LLAMA_CONFIG, _LLAMA_TENSORS,
                        {"blk.{i}.attn_q.{p}": "num_attention_heads", "blk.{i}.attn_k.{p}": "num_key_value_heads"}),
}

# tokenizer.ggml.pre -> the regex that splits text before the merges (byte-level BPE); a name
# not listed splits as GPT-2 does (ByteLevel's own regex): "smollm", "gpt-2", "starcoder", ...
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS: dict[str, str] = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}

_CONTROL, _USER_DEFINED, _NORMAL = 3, 4, 1                    # tokenizer.ggml.token_type values


def is_gguf(path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix: a directory never is one)."""
    return str(path).lower().endswith(".gguf")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading or writing GGUF files needs the 'gguf' package: pip install gguf") from None
    return gguf


# GGUF value types (the format's numbering) -> struct format; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Sequential little-endian reads over a file's bytes (a memory map: nothing is copied)."""

    def __init__(self, buf, where):
        self.buf, self.pos, self.where = buf, 0, where

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.where}: not a readable GGUF file (truncated at byte {self.pos})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.scalar("<I"), self.scalar("<Q")
            return [self.value(item) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"{self.where}: not a readable GGUF file (unknown value type {kind})")
        return self.scalar(_SCALARS[kind])


@dataclass
class _TensorInfo:
    name: str
    shape: tuple[int, ...]              # GGUF's order: the fastest-varying dimension first
    qtype: int
    offset: int


def _open(path) -> tuple[dict, list[_TensorInfo], np.ndarray, int]:
    """(metadata, tensor infos, the file's bytes as a memory map, start of the tensor data).

    The format (version 2 and 3): magic "GGUF", version, tensor and key counts, the key/value pairs,
    the tensor infos (name, dimensions, type, offset), then the data, aligned to general.alignment
    (32 bytes unless stated)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    if len(buf) < 24 or bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a readable GGUF file (no GGUF magic number)")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2, 3)")
    n_tensors, n_keys = cur.scalar("<Q"), cur.scalar("<Q")
    meta = {}
    for _ in range(n_keys):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name, dims = cur.string(), cur.scalar("<I")
        shape = tuple(cur.scalar("<Q") for _ in range(dims))
        infos.append(_TensorInfo(name, shape, cur.scalar("<I"), cur.scalar("<Q")))
    align = int(meta.get("general.alignment", 32))
    return meta, infos, buf, -(-cur.pos // align) * align


def read_metadata(path) -> dict:
    """All key/value metadata of a GGUF file as Python values (strings, numbers, lists)."""
    return _open(path)[0]


def _layout(meta: dict, where) -> GGUFLayout:
    arch = meta.get("general.architecture")
    if arch not in LAYOUTS:
        raise ValueError(f"{where}: GGUF architecture {arch!r} is not supported (supported: {', '.join(LAYOUTS)})")
    return LAYOUTS[arch]


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
                      + "$")


def gguf_architecture(path) -> tuple[str, str]:
    """(model_type, architecture class name) of a GGUF file, from its metadata alone."""
    layout = _layout(read_metadata(path), path)
    return layout.model_type, layout.architecture


def hf_config(meta: dict, tensor_names, where="GGUF") -> dict:
    """The config.json dict (transformers' field names) that a GGUF file's metadata describes."""
    layout = _layout(meta, where)
    arch = meta["general.architecture"]
    config = {"model_type": layout.model_type, "architectures": [layout.architecture]}
    for key, hf, kind in layout.config:
        if f"{arch}.{key}" in meta:
            config[hf] = (int if kind == "int" else float)(meta[f"{arch}.{key}"])
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:    # older files state it only here
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    elif meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{where}: RoPE scaling {meta[f'{arch}.rope.scaling.type']!r} is not supported")
    head, field = layout.tied_head
    config[field] = head not in tensor_names
    for role in ("bos", "eos", "pad"):
        if f"tokenizer.ggml.{role}_token_id" in meta:
            config[f"{role}_token_id"] = int(meta[f"tokenizer.ggml.{role}_token_id"])
    return config


def _tensor(info: _TensorInfo, buf: np.ndarray, start: int, where) -> Tensor:
    """One GGUF tensor dequantised to fp32 (by the ``gguf`` package), in a checkpoint's (out, in) order."""
    gguf = _gguf()
    try:
        qtype = gguf.GGMLQuantizationType(info.qtype)
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ValueError(f"{where}: tensor {info.name} has GGML type {info.qtype}, which gguf does not know") from None
    # GGUF lists dimensions fastest first; the bytes are those of a C-order array of the reversed shape
    shape = tuple(reversed(info.shape))
    row = shape[-1] // block * nbytes
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    at = start + info.offset
    if shape[-1] % block or at + rows * row > len(buf):
        raise ValueError(f"{where}: tensor {info.name} does not fit the file (truncated or damaged)")
    data = np.asarray(buf[at:at + rows * row]).reshape(rows, row)
    if qtype == gguf.GGMLQuantizationType.F32:
        values = data.view(np.float32)
    elif qtype == gguf.GGMLQuantizationType.F16:
        values = data.view(np.float16).astype(np.float32)
    else:
        values = gguf.quants.dequantize(data, qtype)
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def _rename(layout: GGUFLayout, name: str, config: dict, tensor: Tensor, to_hf: bool) -> tuple[str, Tensor] | None:
    for ggml, hf in layout.tensors:
        m = _pattern(ggml if to_hf else hf).match(name)
        if m is None:
            continue
        parts = m.groupdict()
        target = (hf if to_hf else ggml).format(**parts)
        if ggml in layout.rope_rows:
            heads = config[layout.rope_rows[ggml]]
            tensor = permute_rope(tensor, heads) if to_hf else unpermute_rope(tensor, heads)
        return target, tensor
    return None


def read_gguf(path) -> tuple[dict, dict[str, Tensor], dict]:
    """(config.json dict, checkpoint tensors under transformers' names in fp32, raw metadata) of a
    GGUF file; ValueError naming the file for an unsupported architecture or an unknown tensor."""
    meta, infos, buf, start = _open(path)
    config = hf_config(meta, [t.name for t in infos], path)
    layout = _layout(meta, path)
    config.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    tensors, unknown = {}, []
    for info in infos:
        renamed = _rename(layout, info.name, config, _tensor(info, buf, start, path), to_hf=True)
        if renamed is None:
            unknown.append(info.name)
        else:
            tensors[renamed[0]] = renamed[1]
    if unknown:
        raise ValueError(f"{path}: tensors the {layout.architecture} layout does not know: {', '.join(unknown)}")
    return config, tensors, meta


def from_gguf(path, dtype: torch.dtype | str | None = None) -> nn.Module:
    """The attnlab model of a GGUF file (see the module docstring), in eval mode and ready for fast
    inference as :func:`attnlab.hub.from_pretrained` returns it; ``dtype`` None keeps fp32."""
    from .nn.linear import optimize_for_inference
    raw, tensors, _ = read_gguf(path)
    fam = family(raw["model_type"], str(path))
    arch = fam.architecture(raw["architectures"][0], str(path))
    model = arch.build(fam.config_from_json(raw, str(path)))
    model.load_state_dict(from_hf_state_dict(model, tensors), strict=False)     # strict: checked by the rules
    if dtype is not None:
        model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    return optimize_for_inference(model).eval()


# ----------------------------------------------------------------------------- tokenizer
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes: printable Latin-1 bytes stand for themselves,
    the others (controls, space, ...) are shifted to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(shifted)) for b in range(256)}


def _byte_level(meta: dict):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    tokens = meta["tokenizer.ggml.tokens"]
    # a token written in plain text rather than the byte alphabet (a few converters do) is re-spelled
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    split = PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else
                         pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


# tokenizer.ggml.model -> builder of a ``tokenizers.Tokenizer`` (and the characters a special token may use)
TOKENIZER_BUILDERS = {"gpt2": _byte_level}


def gguf_tokenizer(path, meta: dict | None = None):
    """The tokenizer a GGUF file describes, as an :class:`attnlab.tokenizer.HFTokenizer` with its
    special-token roles (bos/eos/unk/pad from the file's ids) and its chat template."""
    from tokenizers import AddedToken, processors
    from .tokenizer import HFTokenizer
    meta = meta if meta is not None else read_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise ValueError(f"{path}: this GGUF file holds no tokenizer (no tokenizer.ggml.model)")
    if kind not in TOKENIZER_BUILDERS:
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: "
                         f"{', '.join(TOKENIZER_BUILDERS)})")
    tok, alphabet = TOKENIZER_BUILDERS[kind](meta)
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    # a CONTROL token outside the byte alphabet is a converter's mislabel that no text can produce
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                            if k == _CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    special = {role: tokens[meta[f"tokenizer.ggml.{key}_token_id"]] if f"tokenizer.ggml.{key}_token_id" in meta
               else None for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    if meta.get("tokenizer.ggml.add_bos_token") and special["bos"] is not None:
        bos = special["bos"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tokens.index(bos))])
    return HFTokenizer(tok, special, chat_template=meta.get("tokenizer.chat_template"))


# ----------------------------------------------------------------------------- writing
QTYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")
_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}   # general.file_type (llama.cpp's LlamaFileType)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}                  # bytes of one block of 32 values


def encode_blocks(codes: Tensor, scales: Tensor, offsets: Tensor, qtype: str) -> np.ndarray:
    """GGUF's block bytes of a matrix quantised in groups of 32 along its rows: ``codes`` (out, in)
    unsigned (0..15 for Q4_0 / Q4_1, 0..255 for Q8_0, where the stored int8 is code - 128),
    ``scales`` d and ``offsets`` m (out, in/32) fp16, with w = d * code + m. Q4_0 and Q8_0 store d
    alone (their m is -8 d and -128 d), Q4_1 d then m; a 4-bit block holds value j in the low
    nibble of byte j and value j + 16 in the high one. Returns (out, in/32 * block bytes) uint8."""
    n, k = codes.shape
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"encode_blocks: qtype must be one of {', '.join(BLOCK_BYTES)}, got {qtype!r}")
    if k % 32 or tuple(scales.shape) != (n, k // 32):
        raise ValueError(f"GGUF blocks hold 32 values: a {n} x {k} matrix with scales of shape "
                         f"{tuple(scales.shape)} is not quantised in groups of 32")
    q = codes.to(torch.uint8).reshape(n, k // 32, 32)
    parts = [scales.to(torch.float16).reshape(n, -1, 1).contiguous().view(torch.uint8)]
    if qtype == "Q4_1":
        parts.append(offsets.to(torch.float16).reshape(n, -1, 1).contiguous().view(torch.uint8))
    if qtype == "Q8_0":
        parts.append((q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8))
    else:
        parts.append(q[..., :16] | (q[..., 16:] << 4))
    return np.ascontiguousarray(torch.cat(parts, dim=-1).reshape(n, -1).numpy())


def decode_blocks(raw, qtype: str, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`encode_blocks`: (out, bytes) uint8 -> (codes (out, k) uint8, d, m (out, k/32) fp16)."""
    t = torch.from_numpy(np.array(raw, dtype=np.uint8)) if not isinstance(raw, Tensor) else raw
    n = t.size(0)
    b = t.reshape(n, k // 32, BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).reshape(n, -1)
    if qtype == "Q4_1":
        m, body = b[..., 2:4].contiguous().view(torch.float16).reshape(n, -1), b[..., 4:]
    else:
        m, body = (-(8.0 if qtype == "Q4_0" else 128.0) * d.float()).half(), b[..., 2:]
    if qtype == "Q8_0":
        q = (body.contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    else:
        q = torch.cat([body & 15, body >> 4], dim=-1)
    return q.reshape(n, k), d, m


def _layout_for(model: nn.Module) -> tuple[str, GGUFLayout]:
    arch = architecture_of(model)
    for name, layout in LAYOUTS.items():
        if layout.architecture == arch.name:
            return name, layout
    raise ValueError(f"save_gguf: no GGUF layout for {arch.name} (supported: "
                     f"{', '.join(x.architecture for x in LAYOUTS.values())})")


def _stored(gguf, tensor: Tensor, qtype: str):
    """(array, raw dtype) of one tensor in ``qtype``: vectors (norms, biases) and rows that do not
    fill whole 32-value blocks stay F32, as llama.cpp's converter keeps them (its round-to-nearest
    block quantisers are the ``gguf`` package's)."""
    data = tensor.detach().to("cpu", torch.float32).numpy()
    if qtype == "F32" or data.ndim < 2:
        return data, None
    if qtype == "F16":
        return data.astype(np.float16), None
    if data.shape[-1] % 32:
        return data, None
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    return gguf.quants.quantize(data, kind), kind


def _write_tokenizer(writer, tokenizer) -> None:
    import json
    state = json.loads(tokenizer.hf.to_str())
    model = state["model"]
    if model.get("type") != "BPE" or not isinstance(state.get("decoder"), dict) \
            or state["decoder"].get("type") != "ByteLevel":
        raise ValueError("save_gguf: only a byte-level BPE tokenizer can be written to GGUF")
    vocab = tokenizer.vocabulary()
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["content"] for a in state.get("added_tokens", []) if a.get("special")}
    added = {a["content"] for a in state.get("added_tokens", []) if not a.get("special")}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(next((k for k, v in PRE_SPLITS.items() if v in tokenizer.hf.to_str()), "gpt-2"))
    writer.add_token_list(tokens)
    writer.add_token_types([_CONTROL if t in special else _USER_DEFINED if t in added else _NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])])
    for role, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if getattr(tokenizer, f"{role}_id", None) is not None:
            add(getattr(tokenizer, f"{role}_id"))
    writer.add_add_bos_token(bool(state.get("post_processor") and "$A" in json.dumps(state["post_processor"])
                                  and tokenizer.special.get("bos") in json.dumps(state["post_processor"])))
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)


def save_gguf(model: nn.Module, path, tokenizer=None, qtype: str = "F32", name: str | None = None,
              quantized: dict[str, tuple[Tensor, Tensor, Tensor, str]] | None = None) -> Path:
    """Write ``model`` (and ``tokenizer``, an :class:`attnlab.tokenizer.HFTokenizer` of byte-level
    BPE, with its chat template) as a GGUF file that llama.cpp and transformers read. ``qtype``:
    "F32", "F16", "Q8_0", "Q4_0" or "Q4_1" for the weight matrices (vectors stay F32).

    ``quantized``: checkpoint name -> (codes, d, m, GGUF qtype) for matrices already quantised in
    groups of 32 (:mod:`attnlab.compress`), each an (out, in) tensor in the checkpoint's layout (d
    and m repeated over their group), written as those very blocks (:func:`encode_blocks`) after
    the same row permutation as the weights."""
    if qtype not in QTYPES:
        raise ValueError(f"save_gguf: qtype must be one of {', '.join(QTYPES)}, got {qtype!r}")
    gguf = _gguf()
    arch_name, layout = _layout_for(model)
    arch = architecture_of(model)
    config = dict(arch.family.config_to_json(model.config))
    config.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch_name)
    writer.add_name(name or path.stem)
    writer.add_file_type(_FILE_TYPE[qtype])
    for key, hf, kind in layout.config:
        if config.get(hf) is not None:
            (writer.add_uint32 if kind == "int" else writer.add_float32)(f"{arch_name}.{key}", config[hf])
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if tokenizer is not None:
        _write_tokenizer(writer, tokenizer)
    for hf_name, tensor in to_hf_state_dict(model).items():
        renamed = _rename(layout, hf_name, config, tensor.detach().float(), to_hf=False)
        if renamed is None:
            raise ValueError(f"save_gguf: the {layout.architecture} layout has no GGUF name for {hf_name}")
        if quantized and hf_name in quantized:
            *parts, kind = quantized[hf_name]
            codes, d, m = (_rename(layout, hf_name, config, t, to_hf=False)[1] for t in parts)
            data = encode_blocks(codes, d[:, ::32], m[:, ::32], kind)
            raw = getattr(gguf.GGMLQuantizationType, kind)
        else:
            data, raw = _stored(gguf, renamed[1], qtype)
        writer.add_tensor(renamed[0], data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
