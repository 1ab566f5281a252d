"""The Swin Transformer and its window blocks against independent references: the shift mask
against the paper's own construction (slices of the rolled map), and SwinModel /
SwinForImageClassification against transformers with the same weights, on inputs that need
padding (an image that is not whole patches, stage maps that are not whole windows) with shifted
windows active, through save_pretrained both ways, and their attention per block."""
import json

import numpy as np
import pytest
import torch

import attnlab
import attnlab.models  # noqa: F401  (registers every family)
import contract
from _tolerance import FP32, assert_close_scaled
from attnlab.models.swin import SwinConfig, SwinForImageClassification, SwinModel, swin_config_to_hf
from attnlab.nn.window import (DropPath, WindowAttention, permute_tokens, relative_position_index, shifted_window_mask,
                               window_and_shift, window_groups, window_order, window_partition, window_reverse)
from attnlab.train import split_decay
from attnlab.viz import record_attention

transformers = pytest.importorskip("transformers")

# 30 px at patch 4: the image is padded to 32 (an 8 x 8 grid); window 3: stage 0's 8 x 8 map is
# padded to 9 x 9 and stage 1's 4 x 4 to 6 x 6, and both stages shift their odd blocks by 1
SIZES = dict(image_size=30, patch_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4), window_size=3,
             drop_path_rate=0.0, num_labels=5)


def _pixels(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _hf(cls, seed=0, attn="sdpa", **overrides):
    config = transformers.SwinConfig(**swin_config_to_hf(SwinConfig(**{**SIZES, **overrides})),
                                     attn_implementation=attn)
    torch.manual_seed(seed)
    model = cls(config)
    contract.randomize_(model, seed)
    return model.eval()


def _ours_from(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    return attnlab.from_pretrained(tmp_path).eval()


# ----------------------------------------------------------------------------- the blocks
def _paper_mask(H, W, M, s):
    """The shift mask as the paper's code builds it: label the slices of the rolled map, then
    compare labels inside each window."""
    img = torch.zeros(1, H, W, 1)
    cnt = 0
    for h in (slice(0, -M), slice(-M, -s), slice(-s, None)):
        for w in (slice(0, -M), slice(-M, -s), slice(-s, None)):
            img[:, h, w, :] = cnt
            cnt += 1
    labels = window_partition(img, M).squeeze(-1)
    return labels[:, None, :] == labels[:, :, None]


@pytest.mark.parametrize("H, W, M, s", [(8, 8, 4, 2), (9, 6, 3, 1), (14, 21, 7, 3)])
def test_the_shift_mask_is_the_papers(H, W, M, s):
    mask = shifted_window_mask(H, W, M, s)
    assert mask.shape == ((H // M) * (W // M), M * M, M * M)
    assert torch.equal(mask, _paper_mask(H, W, M, s))
    assert mask[0].all() and not mask[-1].all()          # the top-left window is one piece, the last is not


def test_windows_partition_and_reverse():
    x = _pixels(2, 6, 9, 5)
    windows = window_partition(x, 3)
    assert windows.shape == (2 * 2 * 3, 9, 5)
    assert torch.equal(windows[1].view(3, 3, 5), x[0, 0:3, 3:6])        # the second window of image 0
    assert torch.equal(window_reverse(windows, 3, 6, 9), x)


def test_one_gather_rolls_and_partitions_and_its_gradient_is_the_inverse():
    x = _pixels(2, 6, 9, 5).requires_grad_()
    order = window_order(6, 9, 3, shift=1)
    got = permute_tokens(x.reshape(2, 54, 5), order, torch.argsort(order)).view(-1, 9, 5)
    want = window_partition(torch.roll(x, (-1, -1), (1, 2)), 3)
    assert torch.equal(got, want)
    g = _pixels(*got.shape, seed=1)
    (grad_got,) = torch.autograd.grad(got, x, g)
    (grad_want,) = torch.autograd.grad(want, x, g)
    assert torch.equal(grad_got, grad_want)


@pytest.mark.parametrize("H, W, M, s", [(8, 8, 4, 2), (9, 6, 3, 1), (14, 21, 7, 3)])
def test_the_windows_that_share_a_shift_mask_are_grouped(H, W, M, s):
    mask = shifted_window_mask(H, W, M, s)
    groups = window_groups(H, W, M, s)
    assert len(groups) == 4                                     # interior, last column, last row, corner
    assert sorted(torch.cat([ids for ids, _ in groups]).tolist()) == list(range(mask.size(0)))
    assert groups[0][1] is None and mask[groups[0][0]].all()   # the interior needs no mask
    for ids, shared in groups[1:]:
        assert torch.equal(mask[ids], shared.expand(len(ids), -1, -1)) and not shared.all()
    assert window_groups(H, W, M, 0)[0][1] is None and len(window_groups(H, W, M, 0)) == 1


def test_grouped_window_attention_equals_one_call_with_a_mask_per_window():
    """The grouped path (the default) against MultiHeadAttention called once over every window in
    image order with the (B * nW, 1, T, T) shift mask: outputs and the gradients of the input and
    of the relative position table, in training mode (the learned bias takes the explicit path)."""
    B, H, W, C, M, s = 2, 9, 6, 8, 3, 1
    wa = WindowAttention(C, 2, M, s)
    with torch.no_grad():
        wa.attn.position.table.normal_()
    x = _pixels(B, H, W, C).requires_grad_()
    out = wa(x)
    windows = window_partition(torch.roll(x, (-s, -s), (1, 2)), M)
    mask = shifted_window_mask(H, W, M, s).repeat(B, 1, 1).unsqueeze(1)
    want = wa.attn(windows, mask=mask)[0]
    want = torch.roll(window_reverse(want, M, H, W), (s, s), (1, 2))
    assert_close_scaled(out, want, FP32)
    g = _pixels(*out.shape, seed=1)
    got = torch.autograd.grad(out, (x, wa.attn.position.table), g)
    wanted = torch.autograd.grad(want, (x, wa.attn.position.table), g)
    for a, b in zip(got, wanted):
        assert_close_scaled(a, b, FP32)
    wa.grouped = False                                  # one call through wa.attn, windows in image order
    calls = []
    wa.attn.register_forward_hook(lambda m, args, kwargs, out: calls.append(args[0].shape), with_kwargs=True)
    assert_close_scaled(wa(x), want, FP32)
    assert calls == [windows.shape]
    del wa.grouped
    with torch.no_grad():                               # the layouts of a few batch sizes are kept, not all
        for batch in range(1, 8):
            assert_close_scaled(wa(x.detach()[:1].expand(batch, -1, -1, -1))[-1], out.detach()[0], FP32)
    assert len(wa._cache) <= 4


def test_the_relative_index_and_the_window_of_a_small_map():
    index = relative_position_index(2)                  # offsets (dy, dx) in {-1, 0, 1}^2 -> rows 0 .. 8
    assert index[0].tolist() == [4, 3, 1, 0] and index.diag().eq(4).all()
    # a 2 x 2 window reads the middle of a 3 x 3 window's 5 x 5 table: offset (0, 0) is row 12
    assert relative_position_index(2, 3).diag().eq(12).all()
    assert window_and_shift(4, 6, 7, 3) == (4, 0) and window_and_shift(8, 8, 4, 2) == (4, 2)
    with pytest.raises(ValueError, match="shift must be in \\[0, window\\)"):
        WindowAttention(8, 2, window=4, shift=4)


# ----------------------------------------------------------------------------- against transformers
@pytest.mark.parametrize("size", [(30, 30), (40, 27)])
def test_the_classifier_equals_transformers_on_inputs_that_need_padding(size, tmp_path):
    hf = _hf(transformers.SwinForImageClassification)
    ours = _ours_from(hf, tmp_path)
    assert type(ours) is SwinForImageClassification
    assert [b.attn.shift for b in ours.stack()] == [0, 1, 0, 1]
    x = _pixels(2, 3, *size)
    with torch.no_grad():
        want = hf(pixel_values=x).logits
        assert_close_scaled(ours(x), want, FP32)
        # the shifted blocks matter: without their shift the logits differ
        for block in ours.stack():
            block.attn.shift = 0
        assert not torch.allclose(ours(x), want, atol=1e-3)


def test_the_bare_model_equals_transformers_hidden_state_and_pooler(tmp_path):
    hf = _hf(transformers.SwinModel)
    ours = _ours_from(hf, tmp_path)
    assert type(ours) is SwinModel
    x = _pixels(3, 3, 30, 30)
    with torch.no_grad():
        want = hf(pixel_values=x)
        hidden = ours(x)
        assert hidden.shape == (3, 4 * 4, 32) == want.last_hidden_state.shape
        assert_close_scaled(hidden, want.last_hidden_state, FP32)
        assert_close_scaled(ours.pool(hidden), want.pooler_output, FP32)


def test_save_pretrained_loads_in_transformers(tmp_path):
    torch.manual_seed(0)
    ours = SwinForImageClassification(SwinConfig(**SIZES))
    contract.randomize_(ours, 3)
    ours.eval().save_pretrained(tmp_path)
    hf, info = transformers.SwinForImageClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    x = _pixels(2, 3, 30, 30, seed=1)
    with torch.no_grad():
        assert_close_scaled(ours(x), hf.eval()(pixel_values=x).logits, FP32)
    back = attnlab.from_pretrained(tmp_path)
    assert back.config == ours.config
    with torch.no_grad():
        assert torch.equal(back(x), ours(x))


def test_recorded_attention_equals_transformers_per_block(tmp_path):
    hf = _hf(transformers.SwinForImageClassification, attn="eager")
    ours = _ours_from(hf, tmp_path)
    captured = []
    hooks = [m.register_forward_hook(lambda m, i, o: captured.append(o[1]))
             for m in hf.modules() if type(m).__name__ == "SwinAttention"]
    x = _pixels(2, 3, 30, 30)
    with torch.no_grad():
        want = hf(pixel_values=x, output_attentions=True)
        with record_attention(ours) as rec:
            logits = ours(x)
        assert torch.equal(logits, ours(x))                             # recording leaves the output alone
    for h in hooks:
        h.remove()
    assert rec.layers() == [0, 1, 2, 3] and len(captured) == 4
    for layer, theirs in enumerate(captured):
        got = rec.weights(layer)
        assert got.shape == theirs.shape                                # (B * windows, heads, 9, 9)
        assert_close_scaled(got, theirs, FP32)
    # transformers' output_attentions holds each stage's last block
    for stage, theirs in enumerate(want.attentions):
        assert_close_scaled(rec.weights(2 * stage + 1), theirs, FP32)
    assert not rec[1].mask.all()                                        # a shifted block masks across pieces


def test_a_map_smaller_than_the_window_uses_the_middle_of_the_table(tmp_path):
    """A 4 x 4 map with window 5 is one 4 x 4 window, unshifted, whose bias is the middle of the
    5 x 5 window's table: transformers' Swin built with window 4 and that sub-table agrees."""
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    ours = SwinModel(SwinConfig(image_size=16, patch_size=4, embed_dim=16, depths=(2,), num_heads=(2,),
                                window_size=5, drop_path_rate=0.0))
    contract.randomize_(ours, 1)
    ours.eval().save_pretrained(tmp_path)
    # the rows of the 9 x 9 table (offsets -4 .. 4) for the offsets -3 .. 3 of a 4 x 4 window
    middle = torch.tensor([(dy + 4) * 9 + dx + 4 for dy in range(-3, 4) for dx in range(-3, 4)])
    tensors = load_file(tmp_path / "model.safetensors")
    tensors = {k: v[middle] if k.endswith("relative_position_bias_table") else v for k, v in tensors.items()}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "window_size": 4}))
    hf, info = transformers.SwinModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    x = _pixels(2, 3, 16, 16)
    with torch.no_grad():
        assert_close_scaled(ours(x), hf.eval()(pixel_values=x).last_hidden_state, FP32)


def test_the_presets_have_transformers_sizes():
    fam = attnlab.models.family("swin")
    for preset in ("swin-t", "swin-s"):
        config = fam.preset(preset)
        with torch.device("meta"):
            ours = SwinForImageClassification(config)
            theirs = transformers.SwinForImageClassification(transformers.SwinConfig(**fam.config_to_hf(config)))
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert sum(p.numel() for p in fam.default.build(fam.preset("swin-t")).parameters()) == 28_288_354


def test_the_position_tables_do_not_decay():
    decay, no_decay = ({n for n, _ in group} for group in split_decay(SwinForImageClassification(SwinConfig(**SIZES))))
    assert "stages.0.blocks.0.attn.attn.position.table" in no_decay
    assert "stages.0.blocks.0.attn.attn.qkv_proj.weight" in decay


@pytest.mark.parametrize("shape, problem", [((2, 1, 30, 30), r"\(2, 1, 30, 30\)"), ((3, 30, 30), r"\(3, 30, 30\)")])
def test_bad_pixels_are_named_in_one_line(shape, problem):
    model = SwinForImageClassification(SwinConfig(**SIZES))
    with pytest.raises(ValueError, match=r"^SwinForImageClassification: pixel_values must be a \(batch, 3, height, "
                                         rf"width\) tensor, got {problem}$"):
        model(torch.zeros(shape))


def test_unsupported_transformers_configs_are_named(tmp_path):
    config = swin_config_to_hf(SwinConfig(**SIZES))
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "swin", "use_absolute_embeddings": True}))
    with pytest.raises(ValueError, match=r"^SwinConfig: use_absolute_embeddings=true \(an absolute position table\) "
                                         r"is not supported$"):
        attnlab.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^SwinConfig: hidden_act 'swish' is not supported \(gelu, gelu_new, "
                                         r"gelu_pytorch_tanh, relu\)$"):
        attnlab.models.family("swin").config_from_hf({**config, "hidden_act": "swish"})


def test_drop_path_drops_whole_samples_and_rescales_the_rest():
    drop, x = DropPath(0.5), torch.ones(64, 3, 4)
    assert drop.eval()(x) is x
    y = drop.train()(x)
    kept = y.flatten(1).amax(1)
    assert set(kept.tolist()) == {0.0, 2.0} and torch.equal(y, kept[:, None, None].expand_as(y))


def test_checkpointed_blocks_give_the_same_gradients():
    torch.manual_seed(0)
    model = SwinForImageClassification(SwinConfig(**SIZES)).train()
    contract.randomize_(model, 2)
    x = _pixels(2, 3, 30, 30)

    def grads():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    plain = grads()
    model.gradient_checkpointing = True
    assert_close_scaled(grads(), plain, FP32)


# ----------------------------------------------------------------------------- the command line
def test_the_image_task_trains_swin_then_classifies(tmp_path, capsys):
    from PIL import Image
    from attnlab.cli import main
    from attnlab.tasks import open_run
    rng = np.random.default_rng(0)
    for c, label in enumerate(["blue", "red"]):
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(10):
            x = rng.integers(0, 90, (20, 24, 3))
            x[..., 2 - 2 * c] += 160
            Image.fromarray(x.astype(np.uint8)).save(tmp_path / "data" / label / f"{i}.png")
    run = tmp_path / "run"
    assert main(["train", "image", "--model", "swin", "--data", str(tmp_path / "data"), "--out", str(run),
                 "--steps", "4", "--image-size", "16", "--patch-size", "2", "--d-model", "16", "--heads", "2",
                 "--layers", "2", "--window-size", "4", "--batch-size", "8", "--no-progress"]) == 0
    capsys.readouterr()
    config = open_run(run).config
    assert (config["window_size"], list(config["depths"])) == (4, [2])
    probe = tmp_path / "probe.png"
    Image.fromarray(np.full((20, 20, 3), (230, 20, 20), dtype=np.uint8)).save(probe)
    assert main(["classify", str(run), str(probe), "--top", "2"]) == 0
    line = capsys.readouterr().out.strip().split("\t")
    assert set(line[0::2]) == {"blue", "red"} and abs(sum(map(float, line[1::2])) - 1) < 1e-3
    # exported, the run loads in transformers with the same logits
    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    hf = transformers.SwinForImageClassification.from_pretrained(tmp_path / "hf").eval()
    ours = attnlab.from_pretrained(tmp_path / "hf").eval()
    x = _pixels(2, 3, 16, 16)
    with torch.no_grad():
        assert_close_scaled(ours(x), hf(pixel_values=x).logits, FP32)


def test_the_benchmark_runs_quick():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "swin.py"), "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "same weights: logits agree" in proc.stdout
    for cell in ("inference  fp32", "inference  bf16", "training   fp32", "training   bf16"):
        assert proc.stdout.count(cell) == 2, proc.stdout
