"""The contract every registered architecture meets, as plain functions of an
:class:`attnlab.models.registry.Architecture`, so that any test (tests/test_contract.py over the
whole registry, tests/test_toy_family.py on a family it registers itself) runs the same checks.

Each check builds the family's "tiny" preset. What a model takes and returns depends on its
``kind``, and the registry declares each kind once (attnlab.models.registry.KINDS: its example
inputs, output shapes and the transformers output fields that match ours). Comparisons are
relative to the values' scale (different CPU kernels round differently).
"""
from __future__ import annotations

from dataclasses import asdict

import torch
from safetensors.torch import load_model, save_model

import attnlab
from attnlab.generate import greedy_decode
from attnlab.models.registry import KINDS, Architecture, Kind, family
from attnlab.nn import optimize_for_inference
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

B, T = 4, 16                   # 64 tokens: every expert of a tiny mixture gets some


def close(got, want, what: str, rtol: float = FP32) -> None:
    assert_close_scaled(got, want, rtol, what)


def _ids(high: int, shape, seed: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def example(arch: Architecture, config, seed: int = 1) -> dict:
    """The kind's example inputs for a model of ``config``, by transformers' keyword names."""
    return kind_of(arch).example(config, arch.family.input_limits(config), B, T, seed)


def outputs(out) -> tuple[torch.Tensor, ...]:
    """A forward's output as a tuple of tensors (kinds with two outputs return a tuple)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def hf_outputs(arch: Architecture, hf_out) -> tuple[torch.Tensor, ...]:
    """The transformers output's fields that match ours; a field given as a tuple of names is
    whichever of them the output has (families name the same output differently)."""
    names = [n if isinstance(n, str) else next(a for a in n if hasattr(hf_out, a)) for n in kind_of(arch).outputs]
    return tuple(getattr(hf_out, n) for n in names)


def same(a, b) -> bool:
    a, b = outputs(a), outputs(b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def kind_of(arch: Architecture) -> Kind:
    return KINDS[arch.kind]


def tiny(arch: Architecture, seed: int = 0, randomize: bool = False) -> torch.nn.Module:
    """The architecture built from its family's "tiny" preset, in eval mode. ``randomize``:
    weights of order 0.2 (norm scales around 1), so outputs are O(1) and every mapping error shows."""
    assert "tiny" in arch.family.presets, f"{arch.model_type}: every family has a 'tiny' preset for tests"
    torch.manual_seed(seed)
    model = arch.build(arch.family.preset("tiny"))
    if randomize:
        randomize_(model, seed)
    return model.eval()


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean = 1.0 if p.dim() == 1 and name.endswith("weight") else 0.0
            p.copy_(mean + 0.2 * torch.randn(p.shape, generator=g))


def inputs(arch: Architecture, model, seed: int = 1) -> tuple:
    """The example inputs as forward's positional arguments (the kind lists them in forward's order)."""
    return tuple(example(arch, model.config, seed).values())


# ----------------------------------------------------------------------------- checks
def check_forward_and_gradients(arch: Architecture) -> None:
    """Output shape, no NaN/inf, and a gradient (finite) for every parameter."""
    model = tiny(arch).train()
    outs = outputs(model(*inputs(arch, model)))
    shapes = kind_of(arch).shapes(model.config, example(arch, model.config))
    shapes = shapes if isinstance(shapes[0], tuple) else (shapes,)
    got = tuple(tuple(o.shape) for o in outs)
    assert got == tuple(shapes), f"{arch}: output shape(s) {got}, want {tuple(shapes)}"
    assert all(torch.isfinite(o).all() for o in outs), f"{arch}: non-finite outputs"
    g = torch.Generator().manual_seed(2)
    sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
    # weights a checkpoint holds but the forward does not use (the bare encoders' pooler) are
    # buffers, not parameters: every parameter must get a gradient
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"{arch}: no gradient reaches {missing}"
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not bad, f"{arch}: non-finite gradients in {bad}"


def check_state_dict_round_trip(arch: Architecture, tmp_path) -> None:
    """safetensors state dict out and into a differently initialised model: identical outputs;
    the config survives asdict -> config class."""
    model, other = tiny(arch, seed=0), tiny(arch, seed=1)
    x = inputs(arch, model)
    tmp_path.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        want = model(*x)
        assert not same(other(*x), want), f"{arch}: two seeds give the same model; the check could not fail"
        save_model(model, str(tmp_path / "model.safetensors"))
        load_model(other, str(tmp_path / "model.safetensors"))
        assert same(other(*x), want), f"{arch}: outputs changed through a safetensors state-dict round trip"
    assert arch.config_cls(**asdict(model.config)) == model.config, f"{arch}: config changed through asdict"


def check_directory_round_trip(arch: Architecture, tmp_path) -> None:
    """attnlab.save_pretrained -> attnlab.from_pretrained: same class, config and outputs."""
    model = tiny(arch, randomize=True)
    attnlab.save_pretrained(model, tmp_path)
    back = attnlab.from_pretrained(tmp_path)
    assert type(back) is type(model), f"{arch}: saved {type(model).__name__}, loaded {type(back).__name__}"
    assert back.config == model.config, f"{arch}: config changed through save_pretrained / from_pretrained"
    # from_pretrained readies a model for inference (layers reading one input stacked into one
    # product, whose sums run in another order): the saved model, readied the same way, must
    # then give the very same numbers
    optimize_for_inference(model)
    x = inputs(arch, model)
    with torch.no_grad():
        assert same(back(*x), model(*x)), f"{arch}: outputs changed through save_pretrained / from_pretrained"


def _hf_class(arch: Architecture):
    import transformers
    cls = getattr(transformers, arch.name, None)
    assert cls is not None, f"{arch}: transformers has no class {arch.name}"
    return cls


def in_transformers(model: torch.nn.Module, hf_cls, tmp_path, what: str = ""):
    """``model`` saved with attnlab's save_pretrained and loaded by transformers' ``hf_cls``, in eval
    mode; AssertionError naming ``what`` if transformers reports a missing, unexpected or mismatched key."""
    model_dir = attnlab.save_pretrained(model, tmp_path)
    hf, info = hf_cls.from_pretrained(model_dir, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{what or type(model).__name__}: transformers reports {problems}"
    return hf.eval()


def tiny_in_transformers(model_type: str, model_cls, hf_cls, tmp_path, seed: int = 1, randomize=randomize_):
    """(the family's "tiny" config, attnlab's ``model_cls`` built from it with weights set by
    ``randomize(model, seed)``, that model loaded by transformers' ``hf_cls`` through
    :func:`in_transformers`), the models in eval mode."""
    config = family(model_type).preset("tiny")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, seed)
    return config, model, in_transformers(model, hf_cls, tmp_path, model_type)


def check_to_transformers(arch: Architecture, tmp_path) -> None:
    """attnlab -> save_pretrained -> transformers' class of that architecture: no missing or
    unexpected key, same outputs."""
    model = tiny(arch, randomize=True)
    hf = in_transformers(model, _hf_class(arch), tmp_path, str(arch))
    x = inputs(arch, model)
    with torch.no_grad():
        got_hf = hf_outputs(arch, hf(**example(arch, model.config)))
        for got, want in zip(got_hf, outputs(model(*x)), strict=True):
            close(got, want, f"{arch} in transformers")


def check_from_transformers(arch: Architecture, tmp_path) -> None:
    """A transformers model of that architecture -> save_pretrained -> attnlab: same outputs."""
    import transformers
    config = arch.family.preset("tiny")
    hf_config = transformers.AutoConfig.for_model(arch.model_type, **arch.family.config_to_hf(config))
    torch.manual_seed(0)
    hf = _hf_class(arch)(hf_config)
    randomize_(hf)
    hf.eval().save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert type(ours) is arch.model_cls, f"{arch}: a {arch.name} directory loaded as {type(ours).__name__}"
    x = inputs(arch, ours)
    with torch.no_grad():
        for got, want in zip(outputs(ours(*x)), hf_outputs(arch, hf(**example(arch, ours.config))), strict=True):
            close(got, want, f"{arch} from transformers")


def check_generation(arch: Architecture) -> None:
    """Greedy decoding equals the teacher-forced argmax (and, for a causal LM, cached equals uncached)."""
    model = tiny(arch, randomize=True)
    if arch.kind == "causal-lm":
        prompt = _ids(model.config.vocab_size, (2, 5), seed=3)
        cached = model.generate(prompt, 10)
        assert torch.equal(model.generate(prompt, 10, use_cache=False), cached), f"{arch}: cached != uncached"
        with torch.no_grad():
            forced = model(cached[:, :-1]).argmax(-1)[:, prompt.size(1) - 1:]
        assert torch.equal(forced, cached[:, prompt.size(1):]), f"{arch}: greedy tokens != teacher-forced argmax"
    elif arch.kind in ("seq2seq", "speech-to-text"):     # the source: token ids, or an encoder's features
        bos, eos = 1, 2
        src = _ids(model.config.src_vocab_size, (3, 7), seed=3) if arch.kind == "seq2seq" else \
            example(arch, model.config, seed=3)[kind_of(arch).main_input][:3]
        out = greedy_decode(model, src, max_len=10, bos_id=bos, eos_id=eos)
        tgt = torch.cat([torch.full((3, 1), bos), out[:, :-1]], 1)
        with torch.no_grad():
            forced = model(src, tgt).argmax(-1)
        ended = (out == eos).long().cumsum(1) - (out == eos).long()     # tokens after a row's EOS
        real = ended == 0
        assert torch.equal(forced[real], out[real]), f"{arch}: greedy tokens != teacher-forced argmax"
    else:
        raise AssertionError(f"{arch}: kind {arch.kind!r} does not generate")


def generates(arch: Architecture) -> bool:
    return arch.kind in ("causal-lm", "seq2seq", "speech-to-text")


def run_contract(arch: Architecture, tmp_path) -> None:
    """Every check that applies to ``arch``, one after the other (for a test of a single family)."""
    check_forward_and_gradients(arch)
    check_state_dict_round_trip(arch, tmp_path / "state")
    check_directory_round_trip(arch, tmp_path / "dir")
    if arch.family.hf:
        check_to_transformers(arch, tmp_path / "to_hf")
        check_from_transformers(arch, tmp_path / "from_hf")
    if generates(arch):
        check_generation(arch)
