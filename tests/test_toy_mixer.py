"""A token mixer defined and registered in this file alone is recorded and drawn by the viewers:
proof that a new mixer reports what it computed through attnlab.nn.record and that nothing in
attnlab.viz needs to know it. No file outside this one names it.

The toy mixer blends each token's values with those before it by a learned decay per head:

    M[h, t, s] = exp(-softplus(d_h) (t - s)) / Σ_{s'<=t} exp(-softplus(d_h) (t - s'))   for s <= t
    y[t] = W_o concat_h Σ_s M[h, t, s] v_h[s]

and reports M (B, H, T, T) as its map. The tests check the map is what the mixer computed (M v
equals its output, fp32, FP32 = 1e-5 of the scale), that recording leaves the logits bit for bit,
that text_views draws one "matrix" view per layer with the mixer's own title, and that ``attnlab
viz`` of a saved directory writes the PNGs and the explorer page.
"""
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from _tolerance import FP32, assert_close_scaled
from attnlab.models.pretrained import SavePretrained
from attnlab.models.registry import family, register_family
from attnlab.nn.record import MixerCall, ReportsMixing

TITLE = "toy decay map"


@dataclass
class ToyMixConfig:
    vocab_size: int = 32
    d_model: int = 16
    num_heads: int = 2
    num_layers: int = 2
    context: int = 16


def decay_map(decay: Tensor, T: int) -> Tensor:
    """(H, T, T): the module docstring's M."""
    t = torch.arange(T)
    gap = (t[:, None] - t[None, :]).float()
    scores = -F.softplus(decay)[:, None, None] * gap
    return torch.softmax(scores.masked_fill(gap < 0, float("-inf")), -1)


class ToyMixer(ReportsMixing, nn.Module):
    def __init__(self, c: ToyMixConfig):
        super().__init__()
        self.heads = c.num_heads
        self.decay = nn.Parameter(torch.linspace(-1.0, 1.0, c.num_heads))
        self.value, self.out = nn.Linear(c.d_model, c.d_model), nn.Linear(c.d_model, c.d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, E = x.shape
        v = self.value(x).view(B, T, self.heads, -1).transpose(1, 2)             # (B, H, T, E/H)
        M = decay_map(self.decay, T)
        y = (M @ v).transpose(1, 2).reshape(B, T, E)
        self.report(lambda: MixerCall("toy decay", (v,), y, title=TITLE,
                                      matrix=lambda: M.detach()[None].expand(B, -1, -1, -1)))
        return self.out(y)


class ToyMixLM(SavePretrained, nn.Module):
    def __init__(self, config: ToyMixConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.mixers = nn.ModuleList(ToyMixer(config) for _ in range(config.num_layers))
        self.head = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        for mixer in self.mixers:
            x = x + mixer(x)
        return self.head(x)


def _family():
    try:
        return family("toymix")
    except ValueError:
        fam = register_family("toymix", ToyMixConfig, presets={"tiny": {}},
                              limits=lambda c: {"vocab_size": c.vocab_size, "context": c.context})
        fam.register("ToyMixLM", ToyMixLM, kind="causal-lm")
        return fam


def _model() -> ToyMixLM:
    torch.manual_seed(0)
    model = _family().default.build(ToyMixConfig())
    with torch.no_grad():
        model.mixers[1].decay.copy_(torch.tensor([0.5, -2.0]))
    return model.eval()


IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])


def test_the_toy_mixer_reports_the_map_it_computed_and_its_outputs_stay_the_same():
    from attnlab.viz.implicit import call_matrix, implicit_matrices, record_scans
    model = _model()
    with torch.no_grad():
        plain = model(IDS)
        with record_scans(model) as calls:
            recorded = model(IDS)
    assert torch.equal(plain, recorded) and [c.family for c in calls] == ["toy decay"] * 2
    for call in calls:
        (v,) = call.inputs
        M = call_matrix(call)
        assert M.shape == (1, 2, 8, 8) and (M.triu(1) == 0).all()
        y = (M @ v).transpose(1, 2).reshape(1, 8, 16)
        assert_close_scaled(y, call.output, FP32, "M v against the mixer's output")
    assert implicit_matrices(model, IDS).shape == (2, 1, 2, 8, 8)


def test_text_views_draw_the_toy_mixer_as_its_own_matrix_view():
    from attnlab.viz.views import text_views
    model = _model()
    labels = [f"t{i}" for i in range(8)]
    (view,) = text_views(model, IDS[0].tolist(), labels)
    assert view.kind == "matrix" and view.title == TITLE and view.weights.shape == (2, 2, 8, 8)
    assert_close_scaled(view.weights[1, 1], decay_map(torch.tensor([0.5, -2.0]), 8)[1], FP32, "layer 2, head 2")


def test_attnlab_viz_draws_a_saved_toy_model_and_its_explorer_page(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from attnlab.cli import main
    model = _model()
    model.save_pretrained(tmp_path / "toy")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "a", "cat", "sat"])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "toy" / "tokenizer.json"))
    assert main(["viz", str(tmp_path / "toy"), "a cat sat", "--out", str(tmp_path / "figs")]) == 0
    written = [line[len("wrote "):] for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert [p.rsplit("/", 1)[-1] for p in written] == ["layers-implicit-layer1.png", "layers-implicit-layer2.png"]
    assert all(open(p, "rb").read(4) == b"\x89PNG" for p in written)
    page = tmp_path / "page.html"
    assert main(["viz", str(tmp_path / "toy"), "a cat sat", "--html", str(page)]) == 0
    text = page.read_text()
    assert '"kind":"matrix"' in text and TITLE in text


def test_a_mixer_without_a_map_says_why_in_one_line():
    from attnlab.viz.implicit import implicit_matrices

    class Blind(ToyMixer):
        map_per_head = False
        no_map_reason = "the blind toy keeps its map to itself"

    model = _model()
    model.mixers = nn.ModuleList(Blind(model.config) for _ in range(2))
    with pytest.raises(ValueError, match=r"has no mixer that reports a \(T, T\) map per head \(the blind toy keeps "
                                         r"its map to itself\)$"):
        implicit_matrices(model, IDS)


def test_record_mixers_sees_every_mixer_through_one_interface():
    """Attention reports through the same record as the toy mixer: a model with both."""
    from attnlab.nn import MultiHeadAttention
    from attnlab.viz.record import record_attention, record_mixers
    model = _model()
    model.attn = MultiHeadAttention(16, 2)
    forward = model.forward

    def with_attention(ids):
        x = model.embed(ids)
        return forward(ids) + model.head(model.attn(x, is_causal=True)[0])
    model.forward = with_attention
    with torch.no_grad(), record_mixers(model) as entries:
        model(IDS)
    assert [(e.module, e.part, e.layer, e.call.family, e.call.kind) for e in entries] == [
        ("mixers.0", "mixers", 0, "toy decay", "matrix"), ("mixers.1", "mixers", 1, "toy decay", "matrix"),
        ("attn", "", 0, "attention", "attention")]
    with torch.no_grad(), record_attention(model) as record:
        model(IDS)
    assert torch.equal(entries[2].call.matrix(), record[0].weights)
