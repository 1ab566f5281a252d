"""The 2017 encoder-decoder against torch.nn.Transformer with the same weights.

Tolerance: fp32 max abs difference <= 1e-5 on logits and gradients.
"""
import math

import pytest
import torch
from torch import nn

from attnlab.models import Transformer
from attnlab.nn import padding_mask

ATOL = 1e-5
CFG = dict(src_vocab_size=23, tgt_vocab_size=19, d_model=32, num_heads=4, num_encoder_layers=2,
           num_decoder_layers=2, d_ff=64, max_seq_len=64, dropout=0.0)


def _copy_attn(ours, ref_attn):
    with torch.no_grad():
        ref_attn.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref_attn.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref_attn.out_proj.load_state_dict(ours.out_proj.state_dict())


def to_torch(model: Transformer) -> nn.Transformer:
    """nn.Transformer with attnlab's weights (always has final norms: pass final_norm=True)."""
    c = model.config
    ref = nn.Transformer(c.d_model, c.num_heads, c.num_encoder_layers, c.num_decoder_layers, c.d_ff, 0.0,
                         batch_first=True, norm_first=c.norm_first)
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
    ref.encoder.norm.load_state_dict(model.encoder_norm.state_dict())
    ref.decoder.norm.load_state_dict(model.decoder_norm.state_dict())
    return ref


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
    logits = model(src, tgt, src_real, tgt_real)

    # the reference path: attnlab's embeddings + positions, torch's stacks, attnlab's output layer
    scale = math.sqrt(CFG["d_model"])
    src_e = model.pos_encoding(model.src_embedding(src) * scale)
    tgt_e = model.pos_encoding(model.tgt_embedding(tgt) * scale)
    causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
    hidden = ref(src_e, tgt_e, tgt_mask=causal, src_key_padding_mask=~src_real,
                 tgt_key_padding_mask=~tgt_real, memory_key_padding_mask=~src_real, tgt_is_causal=True)
    ref_logits = model.output_projection(hidden)
    assert (logits - ref_logits).abs().max() <= ATOL, "logits differ from nn.Transformer (1e-5)"

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
    for mine, theirs in pairs:
        assert (mine - theirs).abs().max() <= ATOL, "gradient differs from nn.Transformer (1e-5)"
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
    full = model(src, tgt, src_real)
    memory = model.encode(src, src_real)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t:t + 1], memory, src_real, cache=cache) for t in range(tgt.size(1))]
    assert (torch.cat(steps, 1) - full).abs().max() <= ATOL, "cached decoding differs (1e-5)"


@pytest.mark.parametrize("train", [False, True])
def test_padded_source_does_not_change_real_outputs(train):
    torch.manual_seed(0)
    model = Transformer(**CFG).train(train)
    src, tgt, _, _ = batch(B=1, S=5)
    padded = torch.cat([src, torch.randint(0, 23, (1, 4))], 1)
    alone = model(src, tgt)
    with_pad = model(padded, tgt, padding_mask(torch.tensor([5]), max_len=9))
    assert (alone - with_pad).abs().max() <= ATOL


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
    assert torch.equal(m(src, tgt), m(src, tgt, src != 0))


def test_gradient_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    m = Transformer(**CFG).train()
    src, tgt, src_real, tgt_real = batch()
    m(src, tgt, src_real, tgt_real).sum().backward()
    g1 = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.gradient_checkpointing = True
    m(src, tgt, src_real, tgt_real).sum().backward()
    for a, p in zip(g1, m.parameters()):
        assert (a - p.grad).abs().max() <= ATOL


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
