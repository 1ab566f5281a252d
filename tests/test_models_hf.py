"""GPT-2, LLaMA and Mixtral against tiny random transformers models, through the same
converter users call (attnlab.from_pretrained / save_pretrained): logits, padding, caching,
greedy generation, checkpoint formats and the strict key report."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig as HFLlamaConfig  # noqa: E402
from transformers import MixtralConfig as HFMixtralConfig  # noqa: E402

import attnlab  # noqa: E402
from attnlab.hub import from_hf_state_dict, permute_rope, to_hf_state_dict, unpermute_rope  # noqa: E402
from attnlab.models import GPT, GPTConfig, GPTModel, Llama, LlamaConfig, Mixtral  # noqa: E402
from attnlab.models.mixtral import MIXTRAL_FUSED_WEIGHT_MAP  # noqa: E402
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

V, CTX = 96, 64
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=CTX, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)


def _hf_config(family: str):
    if family.startswith("gpt2"):
        return GPT2Config(vocab_size=V, n_positions=CTX, n_embd=32, n_layer=2, n_head=4, bos_token_id=None,
                          eos_token_id=None)
    if family == "llama":
        return HFLlamaConfig(**SMALL)
    if family == "llama-linear":
        return HFLlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "factor": 2.5, "rope_theta": 500.0})
    return HFMixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)


def _randomize(model: torch.nn.Module) -> None:
    """Weights of order 0.2 (norm scales around 1) so logits are O(1) and mapping errors show."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean = 1.0 if p.dim() == 1 and name.endswith("weight") else 0.0
            p.copy_(mean + 0.2 * torch.randn(p.shape, generator=g))


def _make_hf(family: str):
    attn = "eager" if family in ("gpt2-eager", "mixtral") else "sdpa"
    model = AutoModelForCausalLM.from_config(_hf_config(family), attn_implementation=attn)
    _randomize(model)
    return model.eval()


FAMILIES = ["gpt2-eager", "gpt2-sdpa", "llama", "llama-linear", "mixtral"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (HF model, directory written by HF save_pretrained), built once."""
    cache = {}

    def get(family):
        if family not in cache:
            hf = _make_hf(family)
            path = tmp_path_factory.mktemp(family)
            hf.save_pretrained(path)
            cache[family] = (hf, path)
        return cache[family]
    return get


def _ids(B=2, T=12, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _close(a, b, what, rtol=FP32):
    assert_close_scaled(a, b, rtol, f"{what}: attnlab vs transformers")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(saved, family):
    hf, path = saved(family)
    ours = attnlab.from_pretrained(path)
    assert not ours.training
    ids = _ids()
    with torch.no_grad():
        _close(ours(ids), hf(ids).logits, f"{family} logits")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_logits_equal_transformers(saved, family, side):
    hf, path = saved(family)
    ours = attnlab.from_pretrained(path)
    ids = _ids(3, 10, seed=2)
    mask = torch.ones(3, 10, dtype=torch.long)
    if side == "right":
        mask[1, 6:], mask[2, 3:] = 0, 0
    else:
        mask[1, :4], mask[2, :7] = 0, 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)       # what HF generate derives from the mask
    with torch.no_grad():
        got = ours(ids, attention_mask=mask)
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    _close(got[real], want[real], f"{family} {side}-padded logits (real tokens)")
    assert torch.isfinite(got).all(), "padded positions must not produce NaN/inf"


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_in_transformers(saved, family, tmp_path):
    hf, path = saved(family)
    ours = attnlab.from_pretrained(path)
    ours.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type and config["architectures"] == [type(hf).__name__]
    keys = set(load_file(tmp_path / "model.safetensors"))
    if family.startswith("gpt2"):
        assert "lm_head.weight" not in keys, "tied lm_head must be stored once (omitted), as HF does"
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(seed=3)
    with torch.no_grad():
        _close(back(ids).logits, hf(ids).logits, f"{family} after attnlab save -> transformers load")
    assert keys == set(load_file(path / "model.safetensors")), "attnlab writes the keys transformers writes"


@pytest.mark.parametrize("family", ["gpt2-sdpa", "mixtral"])
def test_sharded_and_bin_checkpoints_load(saved, family, tmp_path):
    hf, _ = saved(family)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    binary = tmp_path / "bin"
    hf.config.save_pretrained(binary)
    torch.save(hf.state_dict(), binary / "pytorch_model.bin")
    ids = _ids(seed=4)
    with torch.no_grad():
        want = hf(ids).logits
        _close(attnlab.from_pretrained(sharded)(ids), want, f"{family} sharded safetensors")
        _close(attnlab.from_pretrained(binary)(ids), want, f"{family} pytorch_model.bin")


def test_mixtral_fused_layout_both_ways(saved, tmp_path):
    """transformers 5.x's in-memory MixtralExperts (gate_up_proj (X, 2F, E), down_proj (X, E, F))."""
    hf, _ = saved("mixtral")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 96, 32)
    hf.config.save_pretrained(tmp_path)
    save_file(state, tmp_path / "model.safetensors")
    ours = attnlab.from_pretrained(tmp_path)
    ids = _ids(seed=5)
    with torch.no_grad():
        _close(ours(ids), hf(ids).logits, "mixtral from the fused layout")
    back = to_hf_state_dict(ours, MIXTRAL_FUSED_WEIGHT_MAP)
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), f"fused layout round trip changed {k}"


def test_mixtral_router_logits_and_aux_loss(saved):
    hf, path = saved("mixtral")
    ours = attnlab.from_pretrained(path)
    ids = _ids(seed=6)
    with torch.no_grad():
        logits = ours(ids)
        out = hf(ids, output_router_logits=True)
    assert isinstance(logits, torch.Tensor), "forward returns logits only"
    routers, mask = ours.routing()
    assert len(routers) == 2 and routers[0].shape == (2 * 12, 4) and mask is None
    for i, (a, b) in enumerate(zip(routers, out.router_logits)):
        _close(a, b, f"router logits of layer {i}")
    # HF's load_balancing_loss_func does not divide the token fractions by k: its value is k * ours
    _close(2 * ours.aux_loss(), out.aux_loss, "load-balancing loss x top_k", FP32)


@pytest.mark.parametrize("family", ["gpt2-eager", "llama-linear", "mixtral"])
@pytest.mark.parametrize("padded", [False, True])
def test_cached_decoding_equals_full_forward(saved, family, padded):
    ours = attnlab.from_pretrained(saved(family)[1])
    ids = _ids(2, 14, seed=7)
    mask = torch.ones(2, 14, dtype=torch.bool)
    if padded:
        mask[1, :3] = False                               # a left-padded row (pitfall 11)
    given = mask if padded else None
    with torch.no_grad():
        full = ours(ids, attention_mask=given)
        cache = ours.new_cache()
        steps = [ours(ids[:, :5], attention_mask=None if given is None else mask[:, :5], cache=cache)]
        for t in range(5, 14):
            steps.append(ours(ids[:, t:t + 1], attention_mask=None if given is None else mask[:, :t + 1], cache=cache))
    assert cache.length == 14
    _close(torch.cat(steps, 1)[mask], full[mask], f"{family} cached vs full forward (padded={padded})")


@pytest.mark.parametrize("family", ["gpt2-sdpa", "llama", "mixtral"])
def test_greedy_generation_equals_transformers(saved, family):
    hf, path = saved(family)
    ours = attnlab.from_pretrained(path)
    prompt = _ids(2, 6, seed=8)
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, min_new_tokens=32,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    got = ours.generate(prompt, 32)
    assert got.shape == (2, 38)
    assert torch.equal(got, want), f"{family}: greedy tokens differ\nattnlab {got.tolist()}\nHF      {want.tolist()}"


def test_generate_left_padded_batch_and_eos(saved):
    """Pitfall 11: a left-padded batch generates what each prompt generates alone; after EOS a row
    keeps emitting EOS and the loop stops once every row has finished."""
    ours = attnlab.from_pretrained(saved("llama")[1])
    long, short = _ids(1, 6, seed=13), _ids(1, 4, seed=14)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 2, dtype=torch.long), short], 1)])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    got = ours.generate(batch, 8, attention_mask=mask)
    assert torch.equal(got[0, 6:], ours.generate(long, 8)[0, 6:]), "row 0 differs from its prompt alone"
    assert torch.equal(got[1, 6:], ours.generate(short, 8)[0, 4:]), "left-padded row differs from its prompt alone"
    eos = int(got[0, 8])                                  # row 0's third new token
    stopped = ours.generate(long, 8, eos_token_id=eos)
    first = int((stopped[0, 6:] == eos).nonzero()[0])
    assert stopped.shape[1] == 6 + first + 1, "generation must stop once the only row produced EOS"


def test_no_padding_no_cache_uses_the_fused_causal_kernel(saved, monkeypatch):
    """Pitfall 24: a purely causal mask goes to SDPA as is_causal=True, not as a boolean mask."""
    ours = attnlab.from_pretrained(saved("llama")[1])
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        calls.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        ours(_ids(), attention_mask=torch.ones(2, 12))
    assert calls == [(True, True)] * 2, f"expected fused causal calls, got (mask is None, is_causal) = {calls}"
    calls.clear()
    with torch.no_grad():
        ours(_ids(), attention_mask=torch.ones(2, 12).index_fill_(1, torch.tensor([0]), 0))
    assert calls == [(False, False)] * 2, "padding must combine with the causal mask"


def test_bf16_keeps_rope_in_fp32(saved):
    """Pitfall 8: under bf16 the RoPE angles stay fp32, so errors are no worse than transformers' bf16."""
    hf, path = saved("llama-linear")
    ours32, ours16 = attnlab.from_pretrained(path), attnlab.from_pretrained(path, dtype="bfloat16")
    assert ours16.token_embedding.weight.dtype == torch.bfloat16
    assert ours16.layers[0].self_attn.position.inv_freq.dtype == torch.float32
    ids = _ids(2, 60, seed=12)
    with torch.no_grad():
        want = ours32(ids)
        ours_err = (ours16(ids).float() - want).abs().max().item()
        hf_err = (_make_hf("llama-linear").to(torch.bfloat16)(ids).logits.float() - want).abs().max().item()
    assert ours_err <= 1.5 * hf_err + 0.02, f"bf16 error {ours_err:.3g} vs transformers' bf16 {hf_err:.3g}"


# ----------------------------------------------------------------------------- RoPE layouts
def test_rope_permutation_is_invertible_per_head():
    w = torch.randn(2 * 8, 32)                             # k_proj with 2 kv heads of dim 8
    for t in (w, w[:, 0].clone()):                         # weight and bias
        assert torch.equal(unpermute_rope(permute_rope(t, 2), 2), t)
        assert torch.equal(permute_rope(unpermute_rope(t, 2), 2), t)
    p = permute_rope(w, 2)
    assert torch.equal(p[:4], w[0:8:2]) and torch.equal(p[4:8], w[1:8:2]), "head 0: even rows then odd rows"
    assert not torch.equal(permute_rope(w, 2), permute_rope(w, 4)), "the head count matters (GQA: kv heads for k)"


def test_interleaved_rope_on_permuted_weights_equals_half_split(saved, tmp_path):
    hf, path = saved("llama")
    half = attnlab.from_pretrained(path)
    cfg = LlamaConfig(**{**half.config.__dict__, "rope_interleaved": True})
    inter = Llama(cfg).eval()
    state = half.state_dict()
    for i in range(cfg.num_layers):
        for name, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
            key = f"layers.{i}.self_attn.{name}.weight"
            state[key] = unpermute_rope(state[key], heads)      # half-split rows -> Meta's interleaved rows
    inter.load_state_dict(state)
    ids = _ids(seed=9)
    with torch.no_grad():
        _close(inter(ids), half(ids), "interleaved RoPE on permuted weights vs half-split", FP32)
        inter.save_pretrained(tmp_path)                          # the map permutes back to HF's layout
        _close(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, hf(ids).logits,
               "interleaved model saved for transformers")


# ----------------------------------------------------------------------------- errors
def test_missing_and_unexpected_keys_are_listed(saved, tmp_path):
    hf, path = saved("llama")
    state = load_file(path / "model.safetensors")
    hf.config.save_pretrained(tmp_path)
    broken = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    broken["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(broken, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing keys \(1\): model\.layers\.1\.mlp\.up_proj\.weight") as err:
        attnlab.from_pretrained(tmp_path)
    assert "unexpected keys (1): model.layers.0.extra.weight" in str(err.value)
    state["model.norm.weight"] = torch.zeros(5)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"shape mismatches: norm\.weight: checkpoint \(5,\)"):
        attnlab.from_pretrained(tmp_path)


def test_unknown_model_type_and_missing_weights(saved, tmp_path):
    hf, _ = saved("gpt2-eager")
    hf.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no weights found"):
        attnlab.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(ValueError, match=r"unsupported model_type 'not-a-model'; supported: .*gpt2.*llama.*mixtral"):
        attnlab.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        attnlab.from_pretrained(tmp_path / "absent")


def test_bin_checkpoint_never_executes_pickle(saved, tmp_path):
    saved("gpt2-eager")[0].config.save_pretrained(tmp_path)
    torch.save({"transformer.wte.weight": torch.zeros(2), "payload": _Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="refusing to execute"):
        attnlab.from_pretrained(tmp_path)


class _Payload:
    pass


def test_gpt2_checkpoint_without_prefix_and_with_attn_bias_buffers(saved, tmp_path):
    """The Hub's original gpt2 weights: keys of the bare GPT2Model plus the causal-mask buffers."""
    hf, path = saved("gpt2-eager")
    state = {k.removeprefix("transformer."): v for k, v in load_file(path / "model.safetensors").items()}
    state["h.0.attn.bias"] = torch.ones(1, 1, CTX, CTX)
    hf.config.save_pretrained(tmp_path)
    save_file(state, tmp_path / "model.safetensors")
    ids = _ids(seed=10)
    with torch.no_grad():
        _close(attnlab.from_pretrained(tmp_path)(ids), hf(ids).logits, "gpt2 without the 'transformer.' prefix")


def test_input_validation(saved):
    gpt = attnlab.from_pretrained(saved("gpt2-eager")[1])
    llama = attnlab.from_pretrained(saved("llama")[1])
    for model in (gpt, llama):
        with pytest.raises(ValueError, match=f"token id {V} is out of range"):
            model(torch.tensor([[1, V]]))
        with pytest.raises(ValueError, match=f"position {CTX} is beyond the model's context of {CTX}"):
            model(torch.zeros(1, CTX + 1, dtype=torch.long))
    cache = gpt.new_cache()
    gpt(torch.zeros(1, CTX, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="beyond the model's context"):
        gpt(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="attention_mask must be"):
        gpt(torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="not divisible"):
        GPTConfig(d_model=30, num_heads=4)


# ----------------------------------------------------------------------------- init, tying, tokenizer
def test_gpt_init_and_tied_head():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=V, n_positions=CTX, d_model=64, num_heads=4, num_layers=4))
    assert model.lm_head.weight is model.token_embedding.weight
    residual = torch.cat([p.flatten() for p in model.residual_projections()])
    other = model.layers[0].ff.linear1.weight
    want = 0.02 / math.sqrt(2 * 4)
    assert abs(residual.std().item() - want) < 0.1 * want, f"residual std {residual.std():.4g}, expected {want:.4g}"
    assert abs(other.std().item() - 0.02) < 0.002, f"matrix std {other.std():.4g}, expected 0.02"
    assert model.layers[0].self_attn.qkv_proj.bias.abs().max() == 0


def test_tied_llama_saves_embedding_once(tmp_path):
    model = Llama(LlamaConfig(vocab_size=V, d_model=32, num_heads=4, num_kv_heads=2, num_layers=1, d_ff=48,
                              max_position_embeddings=CTX, tie_word_embeddings=True))
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    back = attnlab.from_pretrained(tmp_path)
    assert back.lm_head.weight is back.token_embedding.weight
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(seed=11)
    with torch.no_grad():
        _close(back(ids), hf(ids).logits, "tied llama in transformers")
    with pytest.raises(ValueError, match="missing keys"):
        from_hf_state_dict(Llama(LlamaConfig(**{**model.config.__dict__, "tie_word_embeddings": False})),
                           to_hf_state_dict(model))


def test_load_tokenizer_reads_both_formats(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from attnlab.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer
    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    import attnlab.hub
    # one loader: attnlab's is the hub's, which reads a GGUF file's tokenizer and hands every other
    # path to attnlab.tokenizer.load_tokenizer
    assert attnlab.load_tokenizer is attnlab.hub.load_tokenizer
    assert load_tokenizer(tmp_path).encode("hello there world") == [0, 2, 1]
    hf = attnlab.load_tokenizer(tmp_path)
    assert isinstance(hf, HFTokenizer) and hf.encode("hello there world") == [0, 2, 1] and hf.unk_id == 2
    with pytest.raises(FileNotFoundError, match="nothing"):
        attnlab.load_tokenizer(tmp_path / "nothing")
    CharTokenizer.train(["ab"]).save(tmp_path / "char.json")
    assert isinstance(attnlab.load_tokenizer(tmp_path / "char.json"), CharTokenizer)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json: not a tokenizer JSON file"):
        attnlab.load_tokenizer(tmp_path / "broken.json")


def test_registry_lists_the_causal_lm_families():
    from attnlab.models.registry import families
    assert {"gpt2", "llama", "mixtral"} <= {f.model_type for f in families("causal-lm")}
    assert issubclass(Mixtral, Llama)


def test_architecture_comes_from_config_json(saved, tmp_path):
    """config.json's "architectures" picks the model class; absent, the family's default; unknown,
    an error naming the supported ones. Never a guess from the checkpoint's keys; the bare model
    takes a checkpoint saved with a head, as transformers does."""
    hf, path = saved("gpt2-eager")
    config = json.loads((path / "config.json").read_text())
    save_file(load_file(path / "model.safetensors"), tmp_path / "model.safetensors")

    def load_with(**changes):
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
        return attnlab.from_pretrained(tmp_path)
    assert type(load_with(architectures=None)) is GPT
    with pytest.raises(ValueError, match=r"architecture 'GPT2ForSequenceClassification' of model_type 'gpt2' is "
                                         r"not supported; supported: GPT2LMHeadModel, GPT2Model"):
        load_with(architectures=["GPT2ForSequenceClassification"])
    # the bare model from an LM checkpoint: its keys under "transformer.", as transformers' GPT2Model loads them
    base = load_with(architectures=["GPT2Model"])
    assert type(base) is GPTModel
    with torch.no_grad():
        _close(base(_ids(seed=3)), hf.transformer(_ids(seed=3)).last_hidden_state, "GPT2Model from an LM checkpoint")


def test_gpt2_base_model_both_ways(saved, tmp_path):
    """GPT2Model: a bare checkpoint gives a model whose forward returns the last hidden state."""
    from transformers import GPT2Model
    hf_lm, _ = saved("gpt2-sdpa")
    hf = GPT2Model(hf_lm.config).eval()
    hf.load_state_dict(hf_lm.transformer.state_dict())
    hf.save_pretrained(tmp_path / "hf")
    ours = attnlab.from_pretrained(tmp_path / "hf")
    assert type(ours) is GPTModel
    ids = _ids(seed=15)
    with torch.no_grad():
        want = hf(ids).last_hidden_state
        _close(ours(ids), want, "GPT2Model last hidden state")
        attnlab.save_pretrained(ours, tmp_path / "ours")
        assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == ["GPT2Model"]
        written = set(load_file(tmp_path / "ours" / "model.safetensors"))
        assert written == set(load_file(tmp_path / "hf" / "model.safetensors"))
        _close(GPT2Model.from_pretrained(tmp_path / "ours").eval()(ids).last_hidden_state, want, "GPT2Model round trip")
    with pytest.raises(TypeError, match="does not generate"):
        ours.generate(ids, 2)
