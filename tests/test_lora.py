"""LoRA (attnlab.nn.lora, attnlab.adapters) against PEFT on a tiny random transformers LLaMA.

From the same base weights and the same initial adapter (PEFT's, moved through PEFT's own saved
files), fp32 AdamW steps give the same losses (FP32 = 1e-5 relative to the losses' scale); PEFT's
adapter loads into attnlab with equal logits and ours into PEFT; merged weights give the adapted
layer's outputs (FP32); only the adapters receive gradients.
"""
import pytest
import torch
import torch.nn.functional as F

from _tolerance import FP32, assert_close_scaled

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from attnlab.adapters import (add_lora, adaptable_layers, load_adapter, lora_layers, lora_state_dict,  # noqa: E402
                              merge_lora, resolve_targets, save_adapter)
from attnlab.hub import from_pretrained  # noqa: E402
from attnlab.nn.lora import LoRALinear  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _hf_llama(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    hf.save_pretrained(tmp_path / "base")
    return hf


def _peft(hf, dropout=0.0):
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=TARGETS, lora_dropout=dropout, task_type="CAUSAL_LM")
    return peft.get_peft_model(hf, config)


def _batch():
    return torch.randint(0, SMALL["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(2))


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def test_adapters_train_alone_and_match_peft_losses(tmp_path):
    hf = _hf_llama(tmp_path)
    ours = from_pretrained(tmp_path / "base")
    pm = _peft(hf)
    pm.save_pretrained(tmp_path / "start")               # PEFT's random A, zero B: our starting point too
    load_adapter(ours, tmp_path / "start")
    assert sorted(n for n, p in ours.named_parameters() if p.requires_grad) == sorted(
        f"{n}.lora_{x}.weight" for n in lora_layers(ours) for x in "AB")
    assert len(lora_layers(ours)) == 3 * SMALL["num_hidden_layers"]
    ids = _batch()
    losses = {}
    for name, model in (("peft", pm), ("ours", ours)):
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        out = []
        for _ in range(6):
            logits = model(input_ids=ids).logits if name == "peft" else model(ids)
            loss = _loss(logits, ids)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        losses[name] = torch.stack(out)
    assert losses["ours"][-1] < losses["ours"][0] - 1e-3           # the adapters learned something
    assert_close_scaled(losses["ours"], losses["peft"], FP32)
    # frozen: the base weights did not move
    base = from_pretrained(tmp_path / "base")
    for (n, p), q in zip(base.named_parameters(), [dict(ours.named_parameters())[n] for n, _ in
                                                    base.named_parameters()]):
        assert torch.equal(p, q), n


def test_peft_adapter_loads_with_equal_logits_and_ours_loads_into_peft(tmp_path):
    hf = _hf_llama(tmp_path)
    pm = _peft(hf).eval()
    with torch.no_grad():                                 # a non-zero B, so the adapter changes the logits
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.2)
    pm.save_pretrained(tmp_path / "peft")
    ours = load_adapter(from_pretrained(tmp_path / "base"), tmp_path / "peft").eval()
    ids = _batch()
    with torch.no_grad():
        want = pm(input_ids=ids).logits
        plain = hf.get_base_model()(input_ids=ids).logits if hasattr(hf, "get_base_model") else None
        assert_close_scaled(ours(ids), want, FP32)
    # ours back into PEFT: change our adapters, save, load into a fresh PEFT model
    with torch.no_grad():
        for m in lora_layers(ours).values():
            m.lora_A.weight.mul_(1.5)
    save_adapter(ours, tmp_path / "ours")
    torch.manual_seed(0)
    fresh = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    back = peft.PeftModel.from_pretrained(fresh, tmp_path / "ours").eval()
    with torch.no_grad():
        got, mine = back(input_ids=ids).logits, ours(ids)
    assert_close_scaled(got, mine, FP32)
    assert (got - want).abs().max() > 1e-3                # the change travelled: not PEFT's old adapter
    assert plain is None or (plain - want).abs().max() > 1e-3


def test_merge_equals_the_adapted_outputs(tmp_path):
    _hf_llama(tmp_path)
    model = from_pretrained(tmp_path / "base")
    torch.manual_seed(3)
    add_lora(model, ["q", "k", "v", "o", "gate", "up", "down"], rank=3, alpha=5.0)
    with torch.no_grad():
        for m in lora_layers(model).values():
            m.lora_B.weight.normal_(0.0, 0.3)
    model.eval()
    ids = _batch()
    with torch.no_grad():
        adapted = model(ids)
        merge_lora(model)
        merged = model(ids)
    assert not lora_layers(model) and all(type(m) is not LoRALinear for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    assert (adapted - from_pretrained(tmp_path / "base")(ids).detach()).abs().max() > 1e-2
    assert_close_scaled(merged, adapted, FP32)


def test_layer_math_and_init():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5)
    layer = LoRALinear.wrap(base, rank=2, alpha=4.0)
    assert layer.weight is base.weight and torch.count_nonzero(layer.lora_B.weight) == 0
    x = torch.randn(4, 6)
    assert torch.equal(layer(x), base(x))                 # B = 0: the frozen layer exactly
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    want = x @ base.weight.T + base.bias + 2.0 * (x @ layer.lora_A.weight.T @ layer.lora_B.weight.T)
    assert_close_scaled(layer(x), want, 1e-6)
    with pytest.raises(ValueError, match="rank"):
        LoRALinear.wrap(torch.nn.Linear(2, 2), rank=0, alpha=1.0)


def test_targets_are_named_as_the_checkpoint_names_them():
    from attnlab.models.registry import family
    llama = family("llama").for_kind("causal-lm").build(family("llama").preset("tiny"))
    names = {a.name for a in adaptable_layers(llama)}
    assert "model.layers.0.self_attn.q_proj" in names and "model.layers.1.mlp.down_proj" in names
    chosen, targets = resolve_targets(llama, ["q", "v"])
    assert targets == ["q_proj", "v_proj"] and [a.ours for a in chosen][:2] == [
        "layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj"]
    gpt = family("gpt2").for_kind("causal-lm").build(family("gpt2").preset("tiny"))
    chosen, _ = resolve_targets(gpt, ["c_attn"])            # GPT-2's fused projection, named as HF does
    assert [a.ours for a in chosen] == ["layers.0.self_attn.qkv_proj", "layers.1.self_attn.qkv_proj"]
    assert "lm_head" not in {a.ours for a in adaptable_layers(gpt)}     # tied to the embedding: no adapter
    with pytest.raises(ValueError, match="'q' matches no Linear layer of GPT; its layers: c_attn"):
        resolve_targets(gpt, ["q"])


def test_bad_adapter_files_name_the_problem(tmp_path):
    _hf_llama(tmp_path)
    model = from_pretrained(tmp_path / "base")
    add_lora(model, ["q"], rank=2, alpha=2.0)
    save_adapter(model, tmp_path / "a")
    from safetensors.torch import save_file
    tensors = lora_state_dict(model)
    tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = torch.zeros(2, 32)
    save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="k_proj.lora_A.weight belongs to no adapted layer"):
        load_adapter(from_pretrained(tmp_path / "base"), tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text('{"peft_type": "LORA", "use_dora": true}')
    with pytest.raises(ValueError, match="use_dora not supported"):
        load_adapter(from_pretrained(tmp_path / "base"), tmp_path / "a")


def _causal_families():
    from attnlab.models.registry import families
    return [f.model_type for f in families("causal-lm") if "tiny" in f.presets]


@pytest.mark.parametrize("model_type", _causal_families())
def test_every_causal_family_takes_adapters_saves_them_and_merges(model_type, tmp_path):
    """Any registered causal-LM family: adapters on all its adaptable layers, PEFT's files written and
    read back (equal logits), merged = adapted (FP32)."""
    from attnlab.models.registry import family
    fam = family(model_type)
    arch = fam.for_kind("causal-lm")
    torch.manual_seed(0)
    model = arch.build(fam.preset("tiny")).eval()
    layers = adaptable_layers(model)
    assert layers, f"{model_type}: no Linear layer can take an adapter"
    targets = sorted({a.name.rsplit(".", 1)[-1] for a in layers})
    add_lora(model, targets, rank=2, alpha=3.0)
    with torch.no_grad():
        for m in lora_layers(model).values():
            m.lora_B.weight.normal_(0.0, 0.2)
    save_adapter(model, tmp_path / "a")
    fresh = arch.build(fam.preset("tiny")).eval()
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if ".lora_" not in k})
    load_adapter(fresh, tmp_path / "a")
    vocab = getattr(model.config, "vocab_size")
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = model(ids)
        assert_close_scaled(fresh(ids), adapted, FP32)
        merge_lora(model)
        assert_close_scaled(model(ids), adapted, FP32)
