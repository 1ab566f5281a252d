"""attnlab.nn.packing: a padded batch's layers run on its real tokens alone, and every real token
gets what the padded computation gives it (fp32, 1e-5 relative to scale), gradients included;
padded positions come back as zeros."""
import pytest
import torch
from torch import nn

from attnlab.models.bert import BertConfig, BertForSequenceClassification, BertModel
from attnlab.nn import EncoderLayer, MultiHeadAttention, Packing
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)


def _mask(lengths, T=None):
    T = T or max(lengths)
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


def test_pack_and_unpack_round_trip_in_row_order():
    mask = _mask([3, 1, 4], T=5)
    p = Packing(mask)
    x = torch.arange(3 * 5 * 2, dtype=torch.float32).view(3, 5, 2)
    packed = p.pack(x)
    assert p.count == 8 and packed.shape == (8, 2) and p.fraction == pytest.approx(8 / 15)
    assert torch.equal(packed, x[mask])                          # row-major: each row's tokens in order
    back = p.unpack(packed)
    assert torch.equal(back[mask], x[mask]) and not back[~mask].any(), "padding must come back as zeros"


@pytest.mark.parametrize("bad, match", [
    (torch.ones(2, 3), "bool tensor"), (torch.ones(6, dtype=torch.bool), "bool tensor")])
def test_a_bad_mask_is_named(bad, match):
    with pytest.raises(ValueError, match=match):
        Packing(bad)


def test_shape_mismatches_are_named():
    p = Packing(_mask([2, 3]))
    with pytest.raises(ValueError, match=r"Packing.pack: expected a \(batch, seq\) = \(2, 3\)"):
        p.pack(torch.zeros(3, 2, 4))
    with pytest.raises(ValueError, match="expected 5 packed rows"):
        p.unpack(torch.zeros(4, 4))


@pytest.mark.parametrize("fused, norm_first", [(True, False), (False, True)])
def test_packed_encoder_layer_equals_padded_on_real_tokens_with_gradients(fused, norm_first):
    torch.manual_seed(0)
    layer = EncoderLayer(32, 4, 64, 0.0, norm_first=norm_first, activation="gelu",
                         self_attn=MultiHeadAttention(32, 4, fused_qkv=fused))
    mask = _mask([7, 3, 5], T=8)
    x = torch.randn(3, 8, 32)
    w = torch.randn(3, 8, 32)                                     # a loss that reads the real tokens only

    x1 = x.clone().requires_grad_()
    padded = layer(x1, key_padding_mask=mask)
    (padded * w)[mask].sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    p = Packing(mask)
    x2 = x.clone().requires_grad_()
    packed = layer(p.pack(x2), packing=p)
    assert packed.shape == (p.count, 32)
    (p.unpack(packed) * w)[mask].sum().backward()

    assert_close_scaled(p.unpack(packed)[mask], padded[mask], FP32, "packed layer output (real tokens)")
    assert_close_scaled(x2.grad, x1.grad, FP32, "input gradient")
    # one scale for all: the key bias's gradient is zero in exact arithmetic (softmax ignores a
    # shift shared by every key), so alone it would compare rounding noise with rounding noise
    names = [n for n, _ in layer.named_parameters()]
    assert_close_scaled(torch.cat([param.grad.flatten() for _, param in layer.named_parameters()]),
                        torch.cat([grads[n].flatten() for n in names]), FP32, "parameter gradients")


def test_packed_attention_projects_only_the_real_tokens():
    torch.manual_seed(1)
    attn = MultiHeadAttention(16, 2, fused_qkv=True)
    rows = []
    attn.qkv_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    attn.out_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    p = Packing(_mask([5, 2, 1], T=6))
    out, _ = attn(torch.randn(p.count, 16), packing=p)
    assert out.shape == (8, 16) and rows == [8, 8], "projections must see the 8 real tokens, not 18 positions"


def test_packed_attention_rejects_what_it_cannot_do():
    attn = MultiHeadAttention(16, 2)
    p = Packing(_mask([2, 1]))
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="packing is for self-attention without a cache"):
        attn(x, x, x, packing=p)
    with pytest.raises(ValueError, match=r"packed query must be \(real tokens, d_model\) = \(3, 16\)"):
        attn(torch.randn(4, 16), packing=p)
    with pytest.raises(ValueError, match="must be an attnlab.nn.Packing"):
        attn(x, packing=_mask([2, 1]))


def _bert(cls=BertModel):
    torch.manual_seed(2)
    return cls(BertConfig(vocab_size=50, d_model=32, num_heads=4, num_layers=2, d_ff=64, dropout=0.0,
                          attention_dropout=0.0, max_position_embeddings=16)).eval()


def test_encoder_packs_a_padded_batch_and_zeroes_padding():
    model = _bert()
    mask = _mask([9, 4, 6], T=10)
    ids = torch.randint(1, 50, (3, 10)) * mask
    rows = []
    model.layers[0].ff.linear1.register_forward_hook(lambda m, args, out: rows.append(tuple(args[0].shape)))
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        alone = [model(ids[b:b + 1, :n]) for b, n in enumerate([9, 4, 6])]
    assert rows[0] == (19, 32), "the feed-forward must run on the 19 real tokens only"
    assert not out[~mask].any(), "a packed encoder returns zeros at padded positions"
    for b, n in enumerate([9, 4, 6]):
        assert_close_scaled(out[b, :n], alone[b][0], FP32, f"row {b} batched vs alone")


def test_packing_with_gradient_checkpointing_gives_the_same_gradients():
    model = _bert(BertForSequenceClassification).train()
    mask = _mask([9, 4, 6], T=10)
    ids = torch.randint(1, 50, (3, 10)) * mask
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = ckpt
        model(ids, attention_mask=mask).logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    assert_close_scaled(torch.cat([g.flatten() for g in grads[1]]), torch.cat([g.flatten() for g in grads[0]]),
                        FP32, "checkpointed packed gradients")


# ----------------------------------------------------------------------------- first position only
def _deberta():
    from attnlab.models.deberta import DebertaV2Config, DebertaV2Model
    torch.manual_seed(3)
    return DebertaV2Model(DebertaV2Config(vocab_size=50, d_model=32, num_heads=4, num_layers=2, d_ff=48, dropout=0.0,
                                          max_position_embeddings=16, relative_attention=True, position_buckets=8,
                                          pos_att_type=("p2c", "c2p"))).eval()


@pytest.mark.parametrize("make", [_bert, _deberta], ids=["bert", "deberta-relative"])
@pytest.mark.parametrize("padded", [False, True])
def test_first_only_equals_the_first_row_of_the_full_encoding(make, padded):
    """encode(first_only=True) is encode()[:, :1]: the last layer's [CLS] row, its keys and values
    from every token (DeBERTa: at its true relative distances), gradients included."""
    model = make()
    mask = _mask([9, 4, 6], T=10) if padded else None
    ids = torch.randint(1, 50, (3, 10)) * (mask if padded else 1)
    full = model.encode(ids, mask)
    first = model.encode(ids, mask, first_only=True)
    assert first.shape == (3, 1, 32)
    assert_close_scaled(first, full[:, :1], FP32, "first-only vs full encoding")
    g_full = torch.autograd.grad(full[:, 0].square().sum(), list(model.parameters()), allow_unused=True)
    g_first = torch.autograd.grad(first[:, 0].square().sum(), list(model.parameters()), allow_unused=True)
    pairs = [(a, b) for a, b in zip(g_first, g_full) if b is not None]
    assert_close_scaled(torch.cat([a.flatten() for a, _ in pairs]), torch.cat([b.flatten() for _, b in pairs]),
                        FP32, "first-only gradients")


def test_a_classifier_runs_its_last_layer_on_the_first_rows_only():
    model = _bert(BertForSequenceClassification)
    rows = {}
    for i, layer in enumerate(model.layers):
        layer.ff.linear1.register_forward_hook(lambda m, args, out, i=i: rows.__setitem__(i, args[0].shape[:-1]))
    mask = _mask([9, 4, 6], T=10)
    with torch.no_grad():
        model(torch.randint(1, 50, (3, 10)) * mask, attention_mask=mask)
    assert rows == {0: (19,), 1: (3, 1)}, "layer 0 packed (19 real tokens), the last one the 3 [CLS] rows alone"
    from attnlab.viz import record_attention
    with torch.no_grad(), record_attention(model) as record:   # recording wants every query: the full layer
        model(torch.randint(1, 50, (3, 10)) * mask, attention_mask=mask)
    assert rows[1] == (19,) and record.stack().shape == (2, 3, 4, 10, 10), rows


def test_first_only_refuses_what_it_cannot_combine():
    layer = EncoderLayer(16, 2, 32, 0.0)
    p = Packing(_mask([2, 1]))
    with pytest.raises(ValueError, match="first_only takes the padded"):
        layer(torch.randn(3, 16), packing=p, first_only=True)
    with pytest.raises(ValueError, match="not an attention mask"):
        layer(torch.randn(2, 2, 16), torch.ones(2, 2, dtype=torch.bool), first_only=True)
