"""attnlab.viz.record_attention: one record per attention call, naming its layer, role and
positions, checked against independent references (torch.nn.MultiheadAttention for the
translation Transformer, transformers' eager attention for GPT-2, LLaMA, Mixtral and ALBERT,
whose one shared layer must give one record per pass), with padding, through a KV cache and
under gradient checkpointing; outputs unchanged; nothing left behind."""
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.models import Transformer  # noqa: E402
from attnlab.nn import MultiHeadAttention, causal_mask, padding_mask  # noqa: E402
from attnlab.viz import AttentionCall, record_attention  # noqa: E402
from _encoders import hf_pair, padded_batch  # noqa: E402
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

V = 48


def close(got, want, what):
    assert_close_scaled(got, want, FP32, what)


# ----------------------------------------------------------------------------- translation Transformer
def _translation():
    torch.manual_seed(0)
    model = Transformer(23, 19, d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=64,
                        dropout=0.0).eval()
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(0, 23, (3, 9), generator=g), torch.randint(0, 19, (3, 7), generator=g)
    return model, src, tgt, padding_mask(torch.tensor([9, 5, 3]), max_len=9), padding_mask(torch.tensor([7, 6, 2]),
                                                                                         max_len=7)


def _torch_weights(ours: MultiHeadAttention, query, key, value, allowed=None, real_keys=None):
    """(B, H, T, S) weights of torch.nn.MultiheadAttention with ours' projection weights."""
    ref = nn.MultiheadAttention(ours.d_model, ours.num_heads, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        _, w = ref(query, key, value, key_padding_mask=None if real_keys is None else ~real_keys,
                   attn_mask=None if allowed is None else ~allowed, need_weights=True, average_attn_weights=False)
    return w


def _inputs(model):
    """Record each attention module's (query, key, value, key_padding_mask) with hooks (test-only)."""
    seen, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, MultiHeadAttention):
            def hook(module, args, kwargs, out, name=name):
                q = args[0]
                k = args[1] if len(args) > 1 and args[1] is not None else q
                seen[name] = (q, k, args[2] if len(args) > 2 and args[2] is not None else k,
                              kwargs.get("key_padding_mask"))
            handles.append(m.register_forward_hook(hook, with_kwargs=True))
    return seen, handles


def test_translation_self_and_cross_weights_equal_torch_with_padding():
    model, src, tgt, src_real, tgt_real = _translation()
    pads = dict(src_key_padding_mask=src_real, tgt_key_padding_mask=tgt_real)     # True = real token
    seen, handles = _inputs(model)
    with torch.no_grad(), record_attention(model) as record:
        model(src, tgt, **pads)
    for h in handles:
        h.remove()
    assert len(record) == 2 + 2 * 2 and all(len(record.select(module=name)) == 1 for name in record.modules)
    for name, (q, k, v, real) in seen.items():
        attn = model.get_submodule(name)
        allowed = causal_mask(q.size(1)) if attn.causal else None
        want = _torch_weights(attn, q, k, v, allowed, real)
        (call,) = record.select(module=name)
        close(call.weights, want, f"{name}: recorded vs torch.nn.MultiheadAttention weights")
        expected = torch.ones(3, 1, q.size(1), k.size(1), dtype=torch.bool) & real[:, None, None, :]
        assert torch.equal(call.mask.expand_as(expected), expected & (True if allowed is None else allowed)), name
    assert record.stack("cross").shape == (2, 3, 4, 7, 9)
    assert record.stack("cross")[:, 2, :, :, 3:].abs().max() == 0, "padded source keys get no weight"
    assert record.stack("self", part="decoder_layers").shape == (2, 3, 4, 7, 7)
    assert record.stack("self", part="encoder_layers").shape == (2, 3, 4, 9, 9)


def test_every_call_names_its_module_part_layer_role_and_positions():
    model, src, tgt, src_real, tgt_real = _translation()
    with torch.no_grad(), record_attention(model) as record:
        model(src, tgt, src_key_padding_mask=src_real, tgt_key_padding_mask=tgt_real)
    assert all(isinstance(c, AttentionCall) for c in record)
    assert [(c.module, c.part, c.layer, c.role, c.step) for c in record] == [
        ("encoder_layers.0.self_attn", "encoder_layers", 0, "self", 0),
        ("encoder_layers.1.self_attn", "encoder_layers", 1, "self", 0),
        ("decoder_layers.0.self_attn", "decoder_layers", 0, "self", 0),
        ("decoder_layers.0.cross_attn", "decoder_layers", 0, "cross", 0),
        ("decoder_layers.1.self_attn", "decoder_layers", 1, "self", 0),
        ("decoder_layers.1.cross_attn", "decoder_layers", 1, "cross", 0)]
    for c in record:
        T, S = (9, 9) if c.part == "encoder_layers" else (7, 9) if c.role == "cross" else (7, 7)
        assert c.weights.shape == (3, 4, T, S), c.module
        assert c.query_positions.tolist() == list(range(T)) and c.key_positions.tolist() == list(range(S))
    assert record.parts("self") == ["encoder_layers", "decoder_layers"] and record.parts("cross") == ["decoder_layers"]
    assert record.layers("cross") == [0, 1] and [c.layer for c in record.select(role="cross")] == [0, 1]


def test_translation_cached_steps_are_appended_and_equal_the_full_forward():
    model, src, tgt, src_real, _ = _translation()
    with torch.no_grad():
        memory = model.encode(src, src_real)
        with record_attention(model) as full:
            model.decode(tgt, memory, src_real)
        cache = model.new_cache()
        with record_attention(model) as steps:
            for t in range(tgt.size(1)):
                model.decode(tgt[:, t:t + 1], memory, src_real, cache=cache)
    for name in ("decoder_layers.0.self_attn", "decoder_layers.1.cross_attn"):
        calls = steps.select(module=name)
        assert len(calls) == tgt.size(1) and calls[0].weights.shape[-2] == 1
        assert [c.step for c in calls] == list(range(tgt.size(1)))
        # a static cross-attention cache cannot count queries: the steps still carry their positions
        assert [c.query_positions.tolist() for c in calls] == [[t] for t in range(tgt.size(1))]
        close(steps.weights(name), full.weights(name), f"{name}: cached steps vs one forward")
    close(steps.stack("cross"), full.stack("cross"), "cached cross-attention, every layer")
    assert steps.select(part="encoder_layers") == [], "the encoder did not run inside the context"
    with torch.no_grad():                                  # the first steps outside the context, the rest inside
        cache = model.new_cache()
        for t in range(3):
            model.decode(tgt[:, t:t + 1], memory, src_real, cache=cache)
        with record_attention(model) as late:
            for t in range(3, tgt.size(1)):
                model.decode(tgt[:, t:t + 1], memory, src_real, cache=cache)
    for role in ("self", "cross"):
        calls = late.select(module=f"decoder_layers.1.{role}_attn")
        assert [c.query_positions.tolist() for c in calls] == [[t] for t in range(3, tgt.size(1))], role


def test_outputs_unchanged_nothing_left_behind_and_errors():
    model, src, tgt, src_real, tgt_real = _translation()
    pads = dict(src_key_padding_mask=src_real, tgt_key_padding_mask=tgt_real)     # True = real token
    with torch.no_grad():
        plain = model(src, tgt, **pads)
        with record_attention(model) as record:
            recorded = model(src, tgt, **pads)
            with pytest.raises(RuntimeError, match="already"):
                with record_attention(model):
                    pass
        after = model(src, tgt, **pads)
    assert torch.equal(plain, recorded) and torch.equal(plain, after)
    assert len(record) == 6, "nothing recorded after the context"
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        if isinstance(m, MultiHeadAttention):
            assert m.attention_record is None
    with pytest.raises(ValueError, match="no attnlab MultiHeadAttention"):
        with record_attention(nn.Linear(2, 2)):
            pass
    with pytest.raises(ValueError, match="role must be one of self, cross"):
        record.stack("cross_attn")
    with pytest.raises(ValueError, match="several parts .encoder_layers, decoder_layers.: choose one with part="):
        record.stack("self")
    with pytest.raises(ValueError, match="no cross-attention ran in part 'encoder_layers'"):
        record.stack("cross", part="encoder_layers")


def test_two_forwards_in_one_context_are_two_steps_that_weights_will_not_join():
    model, src, tgt, src_real, tgt_real = _translation()
    with torch.no_grad(), record_attention(model) as record:
        model(src, tgt)
        model(src[:2], tgt[:2])
    calls = record.select(part="decoder_layers", layer=1, role="cross")
    assert [c.step for c in calls] == [0, 1] and [c.weights.shape[0] for c in calls] == [3, 2]
    with pytest.raises(ValueError, match="ran 2 times on separate sequences"):
        record.weights(1, "cross")


def test_checkpointed_backward_records_once_and_keeps_gradients():
    model, src, tgt, src_real, tgt_real = _translation()
    pads = dict(src_key_padding_mask=src_real, tgt_key_padding_mask=tgt_real)     # True = real token
    model.train()                                          # dropout is 0: train mode changes nothing else
    model(src, tgt, **pads).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.gradient_checkpointing = True
    with record_attention(model) as record:
        logits = model(src, tgt, **pads)
        logits.sum().backward()                            # recomputes every layer inside the context
    assert len(record) == 6, "recomputation in backward recorded again"
    assert not any(c.weights.requires_grad for c in record)
    for a, p in zip(want, model.parameters()):
        close(p.grad, a, "gradients with recording and checkpointing")
    logits = model(src, tgt, **pads)
    with record_attention(model) as late:
        logits.sum().backward()                            # recording switched on between forward and backward
    assert len(late) == 0


# ----------------------------------------------------------------------------- causal LMs vs transformers
def _hf(family):
    small = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32, bos_token_id=None, eos_token_id=None,
                 pad_token_id=None)
    config = {"gpt2": lambda: transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                                      bos_token_id=None, eos_token_id=None),
              "llama": lambda: transformers.LlamaConfig(**small),
              "mixtral": lambda: transformers.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2)}
    model = transformers.AutoModelForCausalLM.from_config(config[family](), attn_implementation="eager")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():                                  # O(1) scores, so that mapping errors show
        for name, p in model.named_parameters():
            mean = 1.0 if p.dim() == 1 and name.endswith("weight") else 0.0      # norm scales near 1
            p.copy_(mean + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral"])
def test_causal_lm_weights_equal_transformers_eager_attentions(family, tmp_path):
    hf = _hf(family)
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    ids = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4], mask[2, :7] = 0, 0                        # left padding
    for given in (None, mask):
        positions = None if given is None else (given.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            plain = ours(ids, attention_mask=given)
            with record_attention(ours) as record:
                logits = ours(ids, attention_mask=given)
            want = hf(ids, attention_mask=given, position_ids=positions, output_attentions=True).attentions
        assert torch.equal(logits, plain), "recording must not change the logits"
        got = record.stack("self")                         # (L, B, H, T, S)
        assert [(c.module, c.layer) for c in record] == [("layers.0.self_attn", 0), ("layers.1.self_attn", 1)]
        assert got.shape == (2, 3, 4, 10, 10) and len(want) == 2
        real = torch.ones(3, 10, dtype=torch.bool) if given is None else given.bool()
        for layer in range(2):                             # real query rows (HF fills padded rows its own way)
            close(got[layer].transpose(1, 2)[real], want[layer].transpose(1, 2)[real],
                  f"{family} layer {layer} weights (padding: {given is not None})")


def test_causal_lm_cached_decoding_records_every_step(tmp_path):
    hf = _hf("gpt2")
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        with record_attention(ours) as full:
            ours(ids)
        cache = ours.new_cache()
        with record_attention(ours) as steps:
            ours(ids[:, :5], cache=cache)
            for t in range(5, 9):
                ours(ids[:, t:t + 1], cache=cache)
    calls = steps.select(module="layers.1.self_attn")
    assert [c.weights.shape[-2:] for c in calls] == [(5, 5), (1, 6), (1, 7), (1, 8), (1, 9)]
    assert [c.query_positions.tolist() for c in calls] == [[0, 1, 2, 3, 4], [5], [6], [7], [8]]
    assert [c.key_positions.tolist() for c in calls][-1] == list(range(9))
    close(steps.stack("self"), full.stack("self"), "prefill + steps vs one forward")


# ----------------------------------------------------------------------------- ALBERT: one shared layer, N passes
_ALBERT = dict(vocab_size=V, embedding_size=16, hidden_size=32, num_attention_heads=4, intermediate_size=40,
               num_hidden_layers=3, max_position_embeddings=48, type_vocab_size=2)


@pytest.mark.parametrize("extra", [{}, {"num_hidden_groups": 2, "inner_group_num": 2, "num_hidden_layers": 4}],
                         ids=["one-shared-layer", "two-groups-of-two"])
def test_albert_records_one_call_per_layer_as_transformers_output_attentions(extra, tmp_path):
    config = transformers.AlbertConfig(**{**_ALBERT, **extra}, attn_implementation="eager")
    hf, ours = hf_pair(transformers.AlbertModel, config, tmp_path)
    ids, mask, types = padded_batch(V, [11, 4, 8, 1], types=2)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types, output_attentions=True).attentions
        plain = ours(ids, mask, types)
        with record_attention(ours) as record:
            hidden = ours(ids, mask, types)
    assert torch.equal(hidden, plain), "recording must not change the output"
    assert len(record) == len(want) == config.num_hidden_layers * config.inner_group_num
    got = record.stack("self")
    assert got.shape == (len(want), 4, 4, 11, 11) and all(w.shape == (4, 4, 11, 11) for w in want)
    for layer, (call, w) in enumerate(zip(record, want)):
        assert (call.layer, call.role, call.part, call.step) == (layer, "self", "groups", 0)
        assert call.query_positions.tolist() == list(range(11)) and call.key_positions.tolist() == list(range(11))
        assert torch.equal(call.mask.expand(4, 4, 11, 11), mask[:, None, None, :].expand(4, 4, 11, 11))
        # real query rows (transformers fills padded rows its own way; their keys are masked alike)
        close(call.weights.transpose(1, 2)[mask], w.transpose(1, 2)[mask], f"ALBERT {extra} layer {layer}")
        assert torch.equal(got[layer], call.weights)
    shared = record.select(module="groups.0.0.self_attn")
    assert [c.layer for c in shared] == ([0, 1, 2] if not extra else [0, 2])
    with pytest.raises(ValueError, match="ran as layers .* \\(shared weights\\)"):
        record.weights("groups.0.0.self_attn")
