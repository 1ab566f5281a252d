"""The 2017 encoder-decoder against torch.nn.Transformer with the same weights, called with
torch's mask arguments (and the chapter's example as the chapter writes it).

Tolerance (tests/_tolerance.py): fp32, max |ours - torch| <= 1e-5 x the largest value
compared (FP32), on logits and gradients alike.
"""
import math

import pytest
import torch
from torch import nn

from attnlab.models import Transformer
from attnlab.nn import causal_mask, generate_square_subsequent_mask, padding_mask

from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

CFG = dict(src_vocab_size=23, tgt_vocab_size=19, d_model=32, num_heads=4, num_encoder_layers=2,
           num_decoder_layers=2, d_ff=64, max_seq_len=64, dropout=0.0)


def _copy_attn(ours, ref_attn):
    with torch.no_grad():
        ref_attn.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref_attn.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref_attn.out_proj.load_state_dict(ours.out_proj.state_dict())


def to_torch(model: Transformer) -> nn.Transformer:
    """nn.Transformer with attnlab's weights (and without its final norms if the model has none)."""
    c = model.config
    ref = nn.Transformer(c.d_model, c.num_heads, c.num_encoder_layers, c.num_decoder_layers, c.d_ff, 0.0,
                         activation=c.activation, batch_first=True, norm_first=c.norm_first)
    for ours, theirs in zip(model.encoder_layers, ref.encoder.layers):
        _copy_attn(ours.self_attn, theirs.self_attn)
        for a, b in ((ours.ff.linear1, theirs.linear1), (ours.ff.linear2, theirs.linear2),
                     (ours.self_attn_norm, theirs.norm1), (ours.ff_norm, theirs.norm2)):
            b.load_state_dict(a.state_dict())
    for ours, theirs in zip(model.decoder_layers, ref.decoder.layers):
        _copy_attn(ours.self_attn, theirs.self_attn)
        _copy_attn(ours.cross_attn, theirs.multihead_attn)
        for a, b in ((ours.ff.linear1, theirs.linear1), (ours.ff.linear2, theirs.linear2),
                     (ours.self_attn_norm, theirs.norm1), (ours.cross_attn_norm, theirs.norm2),
                     (ours.ff_norm, theirs.norm3)):
            b.load_state_dict(a.state_dict())
    if c.final_norm:
        ref.encoder.norm.load_state_dict(model.encoder_norm.state_dict())
        ref.decoder.norm.load_state_dict(model.decoder_norm.state_dict())
    else:
        ref.encoder.norm = ref.decoder.norm = None        # torch's stacks skip a norm that is None
    return ref


def torch_logits(model: Transformer, ref: nn.Transformer, src, tgt, **masks):
    """attnlab's embeddings + positions, torch's stacks, attnlab's output layer."""
    scale = math.sqrt(model.config.d_model)
    src_e = model.pos_encoding(model.src_embedding(src) * scale)
    tgt_e = model.pos_encoding(model.tgt_embedding(tgt) * scale)
    return model.output_projection(ref(src_e, tgt_e, **masks))


def batch(B=3, S=9, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, CFG["src_vocab_size"], (B, S), generator=g)
    tgt = torch.randint(0, CFG["tgt_vocab_size"], (B, T), generator=g)
    src_real = padding_mask(torch.tensor([S, 5, 3][:B]), max_len=S)
    tgt_real = padding_mask(torch.tensor([T, 6, 2][:B]), max_len=T)
    return src, tgt, src_real, tgt_real


@pytest.mark.parametrize("norm_first", [False, True])
def test_matches_torch_transformer_forward_and_gradients(norm_first):
    torch.manual_seed(0)
    model = Transformer(**CFG, norm_first=norm_first, final_norm=True).eval()
    ref = to_torch(model).eval()
    src, tgt, src_real, tgt_real = batch()
    logits = model(src, tgt, src_key_padding_mask=src_real, tgt_key_padding_mask=tgt_real)

    # the reference path: attnlab's embeddings + positions, torch's stacks, attnlab's output layer
    scale = math.sqrt(CFG["d_model"])
    src_e = model.pos_encoding(model.src_embedding(src) * scale)
    tgt_e = model.pos_encoding(model.tgt_embedding(tgt) * scale)
    causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
    hidden = ref(src_e, tgt_e, tgt_mask=causal, src_key_padding_mask=~src_real,
                 tgt_key_padding_mask=~tgt_real, memory_key_padding_mask=~src_real, tgt_is_causal=True)
    ref_logits = model.output_projection(hidden)
    assert_close_scaled(logits, ref_logits, FP32, "logits vs nn.Transformer")

    g = torch.randn_like(logits)
    (logits * g).sum().backward()
    ours_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (ref_logits * g).sum().backward()
    enc0, ref_enc0 = model.encoder_layers[0], ref.encoder.layers[0]
    dec1, ref_dec1 = model.decoder_layers[1], ref.decoder.layers[1]
    pairs = [
        (torch.cat([ours_grads[f"encoder_layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]),
         ref_enc0.self_attn.in_proj_weight.grad),
        (torch.cat([ours_grads[f"decoder_layers.1.cross_attn.{x}_proj.weight"] for x in "qkv"]),
         ref_dec1.multihead_attn.in_proj_weight.grad),
        (ours_grads["decoder_layers.1.ff.linear1.weight"], ref_dec1.linear1.weight.grad),
        (ours_grads["encoder_layers.0.ff_norm.weight"], ref_enc0.norm2.weight.grad),
        (ours_grads["src_embedding.weight"], model.src_embedding.weight.grad),
        (ours_grads["output_projection.weight"], model.output_projection.weight.grad),
    ]
    for i, (mine, theirs) in enumerate(pairs):
        assert_close_scaled(mine, theirs, FP32, f"gradient {i} vs nn.Transformer")
    del enc0, dec1


def test_post_norm_has_no_final_norm_and_pre_norm_has_one():
    assert isinstance(Transformer(**CFG).encoder_norm, nn.Identity)                  # the paper
    pre = Transformer(**CFG, norm_first=True)                                          # pitfall 17
    assert not isinstance(pre.encoder_norm, nn.Identity) and not isinstance(pre.decoder_norm, nn.Identity)
    x = torch.randn(2, 4, CFG["d_model"]) * 10 + 3
    assert pre.encoder_norm(x).mean(-1).abs().max() < 1e-4            # it is a real normalisation


@pytest.mark.parametrize("norm_first", [False, True])
def test_cached_step_decoding_equals_full_forward(norm_first):
    torch.manual_seed(0)
    model = Transformer(**CFG, norm_first=norm_first).eval()
    src, tgt, src_real, _ = batch()
    full = model(src, tgt, src_key_padding_mask=src_real)
    memory = model.encode(src, src_real)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t:t + 1], memory, src_real, cache=cache) for t in range(tgt.size(1))]
    assert_close_scaled(torch.cat(steps, 1), full, FP32, "cached decoding vs full forward")


@pytest.mark.parametrize("train", [False, True])
def test_padded_source_does_not_change_real_outputs(train):
    torch.manual_seed(0)
    model = Transformer(**CFG).train(train)
    src, tgt, _, _ = batch(B=1, S=5)
    padded = torch.cat([src, torch.randint(0, 23, (1, 4))], 1)
    alone = model(src, tgt)
    with_pad = model(padded, tgt, src_key_padding_mask=padding_mask(torch.tensor([5]), max_len=9))
    assert_close_scaled(with_pad, alone, FP32, "padded vs unpadded source")


def test_weight_tying_and_shared_embeddings():
    m = Transformer(**{**CFG, "src_vocab_size": 19}, tie_output=True, share_embeddings=True)
    assert m.output_projection.weight is m.tgt_embedding.weight is m.src_embedding.weight
    assert m.output_projection.bias is None
    n_unique = sum(p.numel() for p in m.parameters())
    assert n_unique < sum(p.numel() for p in Transformer(**{**CFG, "src_vocab_size": 19}).parameters())


def test_pad_id_derives_masks():
    m = Transformer(**CFG, pad_id=0).eval()
    src = torch.tensor([[3, 4, 5, 0, 0]])
    tgt = torch.tensor([[1, 2, 3]])
    assert torch.equal(m(src, tgt), m(src, tgt, src_key_padding_mask=src != 0))


def test_gradient_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    m = Transformer(**CFG).train()
    src, tgt, src_real, tgt_real = batch()
    m(src, tgt, src_key_padding_mask=src_real, tgt_key_padding_mask=tgt_real).sum().backward()
    g1 = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.gradient_checkpointing = True
    m(src, tgt, src_key_padding_mask=src_real, tgt_key_padding_mask=tgt_real).sum().backward()
    # one vector: the key biases' gradients are exactly zero in theory, round-off in practice
    assert_close_scaled(torch.cat([p.grad.flatten() for p in m.parameters()]), torch.cat([a.flatten() for a in g1]),
                        FP32, "checkpointed gradients")


def test_bad_input():
    with pytest.raises(ValueError, match="divisible"):
        Transformer(**{**CFG, "num_heads": 5})
    with pytest.raises(ValueError, match="share_embeddings"):
        Transformer(**CFG, share_embeddings=True)
    m = Transformer(**{**CFG, "max_seq_len": 8})
    with pytest.raises(ValueError, match="8"):
        m(torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="out of range"):
        m(torch.full((1, 3), 23), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="padding mask"):
        m(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        m(torch.zeros(3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))


# ------------------------------------------------------------------ the chapter's call and torch's masks

def test_chapter_example_as_written():
    """Section 7.1's test block, as the chapter writes it: its constructor arguments, its sizes,
    its float mask, ``model(src, tgt, tgt_mask=tgt_mask)``; then the same weights in
    torch.nn.Transformer called with the same mask give the same logits."""
    torch.manual_seed(0)
    src_vocab_size = 10000
    tgt_vocab_size = 10000
    batch_size = 2
    src_seq_len = 20
    tgt_seq_len = 15
    model = Transformer(
        src_vocab_size=src_vocab_size,
        tgt_vocab_size=tgt_vocab_size,
        d_model=512,
        num_heads=8,
        num_encoder_layers=6,
        num_decoder_layers=6,
        d_ff=2048,
        dropout=0.1
    )
    src = torch.randint(0, src_vocab_size, (batch_size, src_seq_len))
    tgt = torch.randint(0, tgt_vocab_size, (batch_size, tgt_seq_len))
    tgt_mask = generate_square_subsequent_mask(tgt_seq_len)
    output = model(src, tgt, tgt_mask=tgt_mask)                       # training mode, as written
    assert output.shape == (batch_size, tgt_seq_len, tgt_vocab_size)
    assert torch.isfinite(output).all()

    model.eval()
    with torch.no_grad():
        ours = model(src, tgt, tgt_mask=tgt_mask)
        theirs = torch_logits(model, to_torch(model).eval(), src, tgt, tgt_mask=tgt_mask)
        assert_close_scaled(ours, theirs, FP32, "the chapter's call vs nn.Transformer")
        # the mask only repeats the decoder's causal self-attention: the same logits without it
        assert torch.equal(model(src, tgt), ours)


def _masks(S, T, B, seed=1):
    """Boolean "may attend" masks and padding masks (True = real token). Key 0 is real and open
    to every query, so no row is empty (torch gives NaN there, attnlab zeros)."""
    g = torch.Generator().manual_seed(seed)

    def one(rows, cols, causal=False):
        allowed = torch.rand(rows, cols, generator=g) > 0.3
        allowed[:, 0] = True
        if causal:
            allowed &= causal_mask(rows, cols)
        return allowed

    allowed = dict(src_mask=one(S, S), tgt_mask=one(T, T, causal=True), memory_mask=one(T, S))
    src_real = padding_mask(torch.tensor([S, S - 2, S - 4][:B]), max_len=S)
    tgt_real = padding_mask(torch.tensor([T, T - 1, T - 3][:B]), max_len=T)
    return allowed, src_real, tgt_real


@pytest.mark.parametrize("norm_first", [False, True])
def test_every_mask_matches_torch_float_and_bool(norm_first):
    """All six masks at once, by keyword as torch takes them: attnlab's float masks equal
    torch's float masks, attnlab's booleans (True = may attend) equal torch's booleans
    (True = blocked), and a float mask's bias is added, not thresholded."""
    torch.manual_seed(0)
    model = Transformer(**CFG, norm_first=norm_first, final_norm=True).eval()
    # torch's eval-mode fast path (the fused encoder layer, torch 2.x) turns a float mask holding
    # both a bias and -inf into NaN; train mode with dropout 0 runs torch's plain path, same math
    ref = to_torch(model).train()
    B, S, T = 3, 9, 7
    src, tgt, _, _ = batch(B, S, T)
    allowed, src_real, tgt_real = _masks(S, T, B)
    g = torch.Generator().manual_seed(2)
    floats = {k: torch.zeros(a.shape).masked_fill(~a, float("-inf")) - torch.rand(a.shape, generator=g)
              for k, a in allowed.items()}
    pads = dict(src_key_padding_mask=src_real, tgt_key_padding_mask=tgt_real, memory_key_padding_mask=src_real)
    torch_pads = {k: ~v for k, v in pads.items()}                    # torch: True = ignore
    with torch.no_grad():
        want = torch_logits(model, ref, src, tgt, **floats, **torch_pads)
        got = model(src, tgt, **floats, **pads)
        assert_close_scaled(got, want, FP32, "float masks vs nn.Transformer")
        # positionally, in torch's order
        positional = model(src, tgt, floats["src_mask"], floats["tgt_mask"], floats["memory_mask"],
                           src_real, tgt_real, src_real)
        assert torch.equal(positional, got)

        want = torch_logits(model, ref, src, tgt, **{k: ~a for k, a in allowed.items()}, **torch_pads)
        got = model(src, tgt, **allowed, **pads)
        assert_close_scaled(got, want, FP32, "bool masks vs nn.Transformer")
        zero_one = {k: torch.zeros(a.shape).masked_fill(~a, float("-inf")) for k, a in allowed.items()}
        assert_close_scaled(model(src, tgt, **zero_one, **pads), got, FP32, "bool mask vs its 0/-inf form")


def test_memory_padding_defaults_to_the_source_padding():
    torch.manual_seed(0)
    model = Transformer(**CFG).eval()
    src, tgt, src_real, _ = batch()
    with torch.no_grad():
        implicit = model(src, tgt, src_key_padding_mask=src_real)
        explicit = model(src, tgt, src_key_padding_mask=src_real, memory_key_padding_mask=src_real)
        unmasked_memory = model(src, tgt, src_key_padding_mask=src_real,
                                memory_key_padding_mask=torch.ones_like(src_real))
    assert torch.equal(implicit, explicit)
    assert not torch.allclose(implicit[1:], unmasked_memory[1:])     # rows 1, 2 have source padding
    # a (B, 1, 1, S) boolean attention mask (True = may attend) says the same as padding masks
    keys = src_real[:, None, None, :]
    with torch.no_grad():
        as_masks = model(src, tgt, src_mask=keys, memory_mask=keys)
    assert_close_scaled(as_masks, implicit, FP32, "(B, 1, 1, S) attention masks vs padding masks")


def test_tgt_mask_adds_to_the_causal_triangle_never_replaces_it():
    """The decoder's self-attention stays causal whatever tgt_mask allows: an all-zero float mask
    (everything allowed) changes nothing, and a mask that blocks more blocks more."""
    torch.manual_seed(0)
    model = Transformer(**CFG).eval()
    src, tgt, _, _ = batch()
    T = tgt.size(1)
    with torch.no_grad():
        plain = model(src, tgt)
        assert_close_scaled(model(src, tgt, tgt_mask=torch.zeros(T, T)), plain, FP32, "all-allowed tgt_mask")
        assert_close_scaled(model(src, tgt, tgt_mask=torch.ones(T, T, dtype=torch.bool)), plain, FP32,
                            "all-True tgt_mask")
        diagonal = torch.eye(T, dtype=torch.bool)                     # each position sees only itself
        assert not torch.allclose(model(src, tgt, tgt_mask=diagonal)[:, 1:], plain[:, 1:])


def test_masks_that_would_be_misread_are_refused():
    """A (B, S) padding mask passed where the old signature took it (third, now src_mask), a
    0/1 keep-mask in the chapter's ``mask == 0`` convention, an integer or 3-D mask: each one a
    clear error instead of a silently different model."""
    model = Transformer(**CFG).eval()
    src, tgt, src_real, _ = batch()
    with pytest.raises(ValueError, match="src_key_padding_mask"):
        model(src, tgt, src_real)
    with pytest.raises(ValueError, match="mask.bool"):
        model(src, tgt, tgt_mask=causal_mask(tgt.size(1)).float())
    with pytest.raises(ValueError, match="bool .True = may attend. or float"):
        model(src, tgt, tgt_mask=causal_mask(tgt.size(1)).long())
    with pytest.raises(ValueError, match="memory_mask"):
        model(src, tgt, memory_mask=src_real[:, None, :])
    with pytest.raises(ValueError, match="True = real token"):
        model(src, tgt, src_key_padding_mask=(~src_real).float())
    with pytest.raises(TypeError):
        model.decoder_layers[0](torch.randn(3, 7, 32), torch.randn(3, 9, 32), causal_mask(7))


def test_layers_take_torch_layer_masks():
    """EncoderLayer(x, mask, key_padding_mask) in torch.nn.TransformerEncoderLayer's order (the
    chapter's EncoderLayer(x, mask) too); DecoderLayer's masks by torch's names. Same weights,
    same results as torch's layers given the converted masks."""
    torch.manual_seed(0)
    model = Transformer(**CFG).eval()
    ref = to_torch(model).eval()
    B, S, T = 3, 9, 7
    allowed, src_real, tgt_real = _masks(S, T, B)
    x, memory = torch.randn(B, S, 32), torch.randn(B, S, 32)
    y = torch.randn(B, T, 32)
    with torch.no_grad():
        got = model.encoder_layers[0](x, allowed["src_mask"], src_real)
        want = ref.encoder.layers[0](x, ~allowed["src_mask"], ~src_real)
        assert_close_scaled(got[src_real], want[src_real], FP32, "EncoderLayer vs nn.TransformerEncoderLayer")
        got = model.decoder_layers[0](y, memory, tgt_mask=allowed["tgt_mask"], memory_mask=allowed["memory_mask"],
                                      tgt_key_padding_mask=tgt_real, memory_key_padding_mask=src_real)
        want = ref.decoder.layers[0](y, memory, ~allowed["tgt_mask"], ~allowed["memory_mask"], ~tgt_real, ~src_real)
        assert_close_scaled(got, want, FP32, "DecoderLayer vs nn.TransformerDecoderLayer")
