"""The weights the explorer draws, for every registered architecture built from attnlab's attention
(its family's "tiny" preset, as tests/contract.py builds them):

- recorded while the fused (SDPA) kernel computes the output, they equal the weights the explicit
  path (matmul, scale, mask, softmax) returns when it computes that output itself, call by call;
- they equal transformers' ``output_attentions`` (eager attention) with the same weights, for
  every architecture transformers has;
- recording leaves the outputs bit-identical, and the fused kernel really ran for every call; a
  classifier whose head reads the first position alone is the one exception, bounded below
  (recorded, its last layer computes every query; its outputs equal bit for bit that model's
  run with the shortcut off, and move by at most FIRST_ONLY_EPS epsilons of its largest output);
- a module the explorer was not written for (built in this test from MultiHeadAttention) goes
  end to end into views, figures and a page.
"""
import inspect

import pytest
import torch
from torch import nn

import attnlab
import attnlab.nn.attention as attention_module
from attnlab.models.registry import architectures
from attnlab.nn import MultiHeadAttention
from attnlab.nn.window import WindowAttention
from attnlab.viz import record_attention
from attnlab.viz.explorer import payload, write_page
from attnlab.viz.figures import write_figures
from attnlab.viz.views import record_views
import contract  # noqa: E402  (tests/ is on sys.path under pytest)
from _tolerance import FP32, assert_close_scaled  # noqa: E402

transformers = pytest.importorskip("transformers")


def _has_attention(arch) -> bool:
    return any(isinstance(m, MultiHeadAttention) for m in contract.tiny(arch).modules())


ATTENDING = [a for a in architectures() if _has_attention(a)]
HF = [a for a in ATTENDING if a.family.hf]
FIRST_ONLY = ("classifier", "image-classifier")
IDS = lambda archs: [f"{a.model_type}-{a.name}" for a in archs]  # noqa: E731


def _explicit(model, x):
    """The model's outputs and every attention call's weights, each module forced onto the
    explicit path (``return_weights=True``), which returns the weights it computed the output with."""
    seen = []
    modules = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    windowed = [m for m in model.modules() if isinstance(m, WindowAttention)]
    for m in windowed:                  # a Swin's windows in one call through its attention module
        m.grouped = False

    def forced(m):
        def forward(*args, **kwargs):
            out, w = type(m).forward(m, *args, **{**kwargs, "return_weights": True})
            seen.append(w.detach())
            return out, w
        return forward

    for m in modules:
        m.forward = forced(m)
    try:
        out = model(*x)
    finally:
        for m in modules:
            del m.forward
        for m in windowed:
            del m.grouped
    return out, seen


def test_every_architecture_is_drawn_or_refused_in_one_line():
    """The state-space families hold no attention module: Mamba-2 and Mamba-3 are drawn as their
    implicit attention (one "matrix" view, attnlab.viz.implicit); the others are refused in one line."""
    from attnlab.viz.views import text_views
    # attnlab's own families (a test elsewhere in this process may have registered a toy one)
    without = [a for a in architectures() if a not in ATTENDING and a.model_cls.__module__.startswith("attnlab.")]
    assert len(ATTENDING) >= 25 and {a.model_type for a in without} >= {"mamba", "mamba2", "mamba3"}
    drawn = set()
    for arch in without:
        if arch.family.modality != "text":
            continue
        model = contract.tiny(arch)
        if arch.model_type in ("mamba2", "mamba3"):
            (view,) = text_views(model, [1, 2, 3], ["a", "b", "c"])
            assert view.kind == "matrix" and view.weights.shape[2:] == (3, 3), arch
            drawn.add(arch.model_type)
        else:
            with pytest.raises(ValueError, match="has no attention layers to draw") as e:
                text_views(model, [1, 2, 3], ["a", "b", "c"])
            assert "\n" not in str(e.value)
    assert drawn == {"mamba2", "mamba3"}


SOFTCAPPED = {"gemma2"}      # every layer soft-caps its scores: no call can take the fused kernel


@pytest.mark.parametrize("arch", ATTENDING, ids=IDS(ATTENDING))
def test_recorded_weights_equal_the_explicit_path_and_outputs_stay_the_same(arch, monkeypatch):
    model = contract.tiny(arch, randomize=True)
    x = contract.inputs(arch, model)
    fused = []
    plain_sdpa = attention_module.F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        fused.append(1)
        return plain_sdpa(*args, **kwargs)

    with torch.no_grad():
        plain = model(*x)
        monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", counting)
        with record_attention(model) as record:
            recorded = model(*x)
        monkeypatch.undo()
        explicit, want = _explicit(model, x)
    if arch.kind in FIRST_ONLY:
        _assert_within_first_only_bound(arch, recorded, plain)    # the test below says why
    else:
        assert contract.same(recorded, plain), f"{arch}: recording changed the outputs"
    # recording keeps the fused kernel wherever the plain call uses it; soft-capped scores
    # (tanh before the softmax) have no fused kernel, so those calls are explicit either way
    modules = dict(model.named_modules())
    fusable = sum(getattr(modules[c.module], "softcap", None) is None for c in record)
    assert len(record) == len(want) > 0 and len(fused) == fusable, \
        f"{arch}: {len(fused)} fused kernel calls for {fusable} recorded calls that have a fused kernel"
    assert fusable > 0 or arch.model_type in SOFTCAPPED
    for got, ref in zip(contract.outputs(explicit), contract.outputs(plain)):
        if got.is_floating_point():
            assert_close_scaled(got, ref, FP32, f"{arch}: explicit vs fused outputs")
    for i, (call, w) in enumerate(zip(record, want)):
        got = call.weights
        if arch.kind in FIRST_ONLY and w.size(-2) == 1:      # unrecorded, that last layer ran its first query
            got = got[..., :1, :]
        assert got.shape == w.shape, f"{arch} call {i} ({call.module})"
        assert_close_scaled(got, w, FP32, f"{arch} call {i} ({call.module}) weights")


# A classifier whose head reads the first position alone runs its last layer for that query only;
# recorded, that layer computes every query (the record wants all rows). The first row of a
# many-row matrix product may round differently from a one-row product (the kernel blocks the
# sum differently), so such outputs may move by a few units in the last place of their scale.
FIRST_ONLY_EPS = 8            # bound in fp32 epsilons (1.19e-7) of the largest |output|; measured: at most 2.3


def _assert_within_first_only_bound(arch, recorded, plain) -> None:
    eps = torch.finfo(torch.float32).eps
    for got, ref in zip(contract.outputs(recorded), contract.outputs(plain)):
        bound = FIRST_ONLY_EPS * eps * ref.abs().max()
        assert (got - ref).abs().max() <= bound, \
            f"{arch}: recording moved the outputs by {float((got - ref).abs().max()):.3g}, over {float(bound):.3g}"


def _all_rows(model):
    """The model with its last layer's first-query shortcut off: ``encode(..., first_only=False)``."""
    model.encode = lambda *a, **k: type(model).encode(model, *a, **{**k, "first_only": False})
    return model


SHORTCUT = [a for a in ATTENDING if a.kind in FIRST_ONLY
            and hasattr(a.model_cls, "encode")
            and "first_only" in inspect.signature(a.model_cls.encode).parameters]


@pytest.mark.parametrize("arch", SHORTCUT, ids=IDS(SHORTCUT))
def test_recording_a_first_token_classifier_differs_only_by_computing_every_query(arch):
    """The whole difference recording makes is the shortcut: recorded outputs equal, bit for bit,
    those of the model run unrecorded with every query of its last layer computed; and they stay
    within FIRST_ONLY_EPS epsilons of the largest output of the shortcut's."""
    model = contract.tiny(arch, randomize=True)
    x = contract.inputs(arch, model)
    with torch.no_grad():
        shortcut = model(*x)
        with record_attention(model):
            recorded = model(*x)
        every_row = _all_rows(model)(*x)
    assert contract.same(recorded, every_row), f"{arch}: recording changed more than the last layer's rows"
    _assert_within_first_only_bound(arch, recorded, shortcut)


@pytest.mark.parametrize("arch", HF, ids=IDS(HF))
def test_recorded_weights_equal_transformers_output_attentions(arch, tmp_path):
    model = contract.tiny(arch, randomize=True)
    directory = attnlab.save_pretrained(model, tmp_path)
    cls = getattr(transformers, arch.name)
    hf = cls.from_pretrained(directory, attn_implementation="eager").eval()
    example = contract.example(arch, model.config)
    with torch.no_grad():
        with record_attention(model) as record:
            model(*example.values())
        out = hf(**example, output_attentions=True)
    if arch.kind == "vision-language":         # transformers returns the language model's attentions
        calls = [c for c in record if c.module.startswith("language_model.")]
        assert len(calls) == len(out.attentions) > 0, f"{arch}: {len(calls)} calls recorded"
        for i, (call, w) in enumerate(zip(calls, out.attentions)):
            assert_close_scaled(call.weights, w, FP32, f"{arch} call {i} ({call.module})")
        return
    if arch.kind in ("seq2seq", "speech-to-text"):     # encoder self, decoder self, cross: one stack each
        order = list(dict.fromkeys((c.part, c.role) for c in record))
        wanted = (out.encoder_attentions, out.decoder_attentions, out.cross_attentions)
        assert [role for _, role in order] == ["self", "self", "cross"], order
        for (part, role), want in zip(order, wanted, strict=True):
            got = record.stack(role, part=part)
            assert got.size(0) == len(want), f"{arch} {part}: {got.size(0)} layers recorded, transformers {len(want)}"
            for layer, w in enumerate(want):
                assert_close_scaled(got[layer], w, FP32, f"{arch} {part} {role} layer {layer}")
        return
    if arch.kind == "contrastive":             # two towers (CLIP): each output holds its tower's attentions
        towers = {name[:-len("_output")]: getattr(out, name).attentions for name in out.keys()
                  if name.endswith("_model_output")}
        assert towers, f"{arch}: transformers returned no tower outputs"
        for tower, want in towers.items():
            calls = [c for c in record if c.module.startswith(tower + ".")]
            assert len(calls) == len(want) > 0, f"{arch} {tower}: {len(calls)} calls recorded, transformers {len(want)}"
            for i, (call, w) in enumerate(zip(calls, want)):
                assert_close_scaled(call.weights, w, FP32, f"{arch} {tower} call {i} ({call.module})")
        return
    # one entry per attention call, in call order (Swin's windows: (B * windows, H, N, N) per
    # block); a masked-image model's decoder runs after the encoder, whose calls transformers returns
    want = out.attentions
    calls = list(record)
    if arch.kind == "masked-image-model":
        calls = calls[:len(want)]
    if arch.model_type == "swin":
        # transformers' SwinStage returns the attentions of its last block alone: one per stage
        last = {c.module.split(".blocks.")[0]: c for c in calls}
        calls = list(last.values())
    assert len(calls) == len(want) > 0, f"{arch}: {len(record)} calls recorded, transformers {len(want)}"
    for i, (call, w) in enumerate(zip(calls, want)):
        assert call.weights.shape == w.shape, f"{arch} call {i} ({call.module})"
        assert_close_scaled(call.weights, w, FP32, f"{arch} call {i} ({call.module})")


class _Unforeseen(nn.Module):
    """A model no file of attnlab knows: two attention modules of its own arrangement (a
    self-attention and an attention over a fixed memory), no registry entry, no labels."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.memory = nn.Parameter(torch.randn(5, 16))
        self.blocks = nn.ModuleList([MultiHeadAttention(16, 4, 0.0) for _ in range(2)])
        self.cross_reader = MultiHeadAttention(16, 2, 0.0)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x, is_causal=True)[0]
        memory = self.memory.expand(ids.size(0), -1, -1)
        return x + self.cross_reader(x, memory, memory)[0]


def test_a_model_the_explorer_was_not_written_for_goes_into_a_page(tmp_path):
    torch.manual_seed(0)
    model = _Unforeseen().eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    labels = [f"w{i}" for i in range(7)]
    with torch.no_grad(), record_attention(model) as record:
        model(ids)
    views = record_views(record, labels, labels, [f"m{j}" for j in range(5)])
    assert [(v.name, tuple(v.weights.shape)) for v in views] == [("blocks/self", (2, 4, 7, 7)),
                                                                 ("layer/cross", (1, 2, 7, 5))]
    causal = views[0].weights
    assert torch.all(causal.triu(1) == 0) and torch.allclose(causal.sum(-1), torch.ones(2, 4, 7))
    paths = write_figures(views, tmp_path / "png")
    assert [p.name for p in paths] == ["blocks-self-layer1.png", "blocks-self-layer2.png", "layer-cross-layer1.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    page = write_page(views, tmp_path / "page.html", title="unforeseen")
    data = payload(views, "unforeseen")
    assert [v["heads"] for v in data["views"]] == [4, 2] and data["views"][1]["cols"] == [f"m{j}" for j in range(5)]
    assert "attnlab-data" in page.read_text() and page.stat().st_size < 100_000
