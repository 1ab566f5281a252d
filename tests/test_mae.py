"""The masked auto-encoder against transformers' ViTMAEForPreTraining / ViTMAEModel with the same
weights and the same noise (the same masked patches, logits and loss, with the normalised pixel loss
on and off, at the trained image size and another), its fixed sin-cos tables against the paper's
formula, save_pretrained both ways, reproducible masking, and the pre-training task with the
fine-tuning that starts from it (``attnlab train mae``, then ``attnlab train image --init``)."""
import numpy as np
import pytest
import torch

import attnlab
import attnlab.models  # noqa: F401  (registers every family)
import contract
from _tolerance import FP32, assert_close_scaled
from attnlab.models.mae import (VIT_MAE, ViTMAEConfig, ViTMAEForPreTraining, ViTMAEModel, masking_noise, patchify,
                                sincos_2d_table, unpatchify)

transformers = pytest.importorskip("transformers")

HF_SIZES = dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_attention_heads=4,
                num_hidden_layers=2, intermediate_size=64, decoder_hidden_size=16, decoder_num_attention_heads=2,
                decoder_num_hidden_layers=2, decoder_intermediate_size=32)


def _hf(cls=transformers.ViTMAEForPreTraining, seed=0, **overrides):
    """A random transformers MAE: every tensor, the fixed position tables included, of order 0.2, so
    a table read from the wrong place or a dropped weight shows in the outputs."""
    torch.manual_seed(seed)
    model = cls(transformers.ViTMAEConfig(**{**HF_SIZES, **overrides}))
    contract.randomize_(model, seed)
    return model.eval()


def _pixels(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _noise(batch, patches, seed=1):
    return torch.rand(batch, patches, generator=torch.Generator().manual_seed(seed))


def _same_outputs(ours, theirs, names):
    for name in names:
        got, want = getattr(ours, name), getattr(theirs, name)
        if name in ("mask", "ids_restore"):
            assert torch.equal(got, want.to(got.dtype)), name       # the same patches, exactly
        else:
            assert_close_scaled(got, want, FP32, name)


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_pretraining_equals_transformers_with_the_same_noise(norm_pix_loss, tmp_path):
    hf = _hf(norm_pix_loss=norm_pix_loss)
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert type(ours) is ViTMAEForPreTraining and ours.config.norm_pix_loss is norm_pix_loss
    x, noise = _pixels(3, 3, 16, 16), _noise(3, 16)
    with torch.no_grad():
        got, want = ours(x, noise), hf(pixel_values=x, noise=noise)
    _same_outputs(got, want, ("mask", "ids_restore", "logits", "loss"))
    assert int(got.mask.sum()) == 3 * 12                              # 75 % of 16 patches, per image
    # the two losses differ, so the flag is read: normalised targets are not the raw pixels
    with torch.no_grad():
        other = transformers.ViTMAEForPreTraining.from_pretrained(tmp_path, norm_pix_loss=not norm_pix_loss).eval()
        assert not torch.allclose(other(pixel_values=x, noise=noise).loss, want.loss)


def test_pretraining_equals_transformers_at_another_image_size(tmp_path):
    hf = _hf(norm_pix_loss=True)
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    x, noise = _pixels(2, 3, 24, 24), _noise(2, 36)                    # a 6x6 grid, the tables' is 4x4
    with torch.no_grad():
        got = ours(x, noise, interpolate_pos_encoding=True)
        want = hf(pixel_values=x, noise=noise, interpolate_pos_encoding=True)
    _same_outputs(got, want, ("mask", "ids_restore", "logits", "loss"))
    with pytest.raises(ValueError, match="ViTMAEForPreTraining: a 24x24 image, the model's is 16x16; pass "
                                         "interpolate_pos_encoding=True"):
        ours(x, noise)


def test_the_bare_encoder_equals_transformers_vitmaemodel(tmp_path):
    hf = _hf(transformers.ViTMAEModel, mask_ratio=0.5)
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert type(ours) is ViTMAEModel
    x, noise = _pixels(2, 3, 16, 16), _noise(2, 16)
    with torch.no_grad():
        got, want = ours(x, noise), hf(pixel_values=x, noise=noise)
    assert got.last_hidden_state.shape == (2, 1 + 8, 32)              # the class token and the visible half
    _same_outputs(got, want, ("mask", "ids_restore", "last_hidden_state"))


def _sincos_reference(h, w, dim, column_first=True):
    """MAE's fixed table from its definition (He et al. 2021, the transformer's sin-cos per axis): a
    zero row for the class token, then per patch (row r, column c, row-major) [sin(c f_i), cos(c f_i),
    sin(r f_i), cos(r f_i)], f_i = 10000^(-i / (dim/4)), in float64 and rounded once to fp32. Columns
    come first as in MAE's released code and the checkpoints trained with it (transformers rotates
    its builder's halves to match); ``column_first=False`` is the other order, for the negative check."""
    q = dim // 4
    freq = torch.tensor([10000.0 ** (-i / q) for i in range(q)], dtype=torch.float64)
    rows = []
    for r in range(h):
        for c in range(w):
            first, second = (c * freq, r * freq) if column_first else (r * freq, c * freq)
            rows.append(torch.cat([first.sin(), first.cos(), second.sin(), second.cos()]))
    return torch.cat([torch.zeros(1, dim, dtype=torch.float64), torch.stack(rows)]).float().unsqueeze(0)


def test_the_fixed_position_tables_are_the_papers_sin_cos():
    """Exact (tolerance 0) against the formula; the formula tells rows from columns and the two
    orders of the halves apart. (transformers 5.25 leaves a fresh ViTMAE's encoder table at zero
    and keeps its builder private, so the reference is the definition.)"""
    assert torch.equal(sincos_2d_table((3, 5), 16), _sincos_reference(3, 5, 16))     # rows and columns kept apart
    assert not torch.equal(sincos_2d_table((3, 5), 16), _sincos_reference(5, 3, 16)), "transposed grid must differ"
    assert not torch.equal(sincos_2d_table((4, 4), 16), _sincos_reference(4, 4, 16, column_first=False)), \
        "the halves' order must matter"
    model = ViTMAEForPreTraining(VIT_MAE.preset("tiny"))
    assert torch.equal(model.position.weight, _sincos_reference(4, 4, 32))
    assert torch.equal(model.decoder.position.weight, _sincos_reference(4, 4, 16))
    # fixed: buffers, so no optimizer moves them and no weight decay reaches them
    names = {n for n, _ in model.named_parameters()}
    assert "position.weight" not in names and "decoder.position.weight" not in names


def test_the_class_and_mask_tokens_do_not_decay():
    from attnlab.train import split_decay
    decay, no_decay = ({n for n, _ in group} for group in split_decay(ViTMAEForPreTraining(VIT_MAE.preset("tiny"))))
    assert {"cls_token", "decoder.mask_token"} <= no_decay
    assert {"patch_embed.proj.weight", "decoder.embed.weight", "decoder.pred.weight"} <= decay


def test_saved_for_transformers_gives_the_same_loss(tmp_path):
    torch.manual_seed(0)
    ours = ViTMAEForPreTraining(VIT_MAE.preset("tiny", norm_pix_loss=True, mask_ratio=0.5))
    contract.randomize_(ours, 3)
    ours.eval().save_pretrained(tmp_path)
    hf, info = transformers.ViTMAEForPreTraining.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert hf.config.norm_pix_loss is True and hf.config.mask_ratio == 0.5
    x, noise = _pixels(2, 3, 16, 16), _noise(2, 16)
    with torch.no_grad():
        _same_outputs(ours(x, noise), hf.eval()(pixel_values=x, noise=noise), ("mask", "ids_restore", "logits",
                                                                               "loss"))
    back = attnlab.from_pretrained(tmp_path)
    assert back.config == ours.config


def test_the_presets_have_transformers_sizes():
    fam = attnlab.models.family("vit_mae")
    for preset in ("vit-mae-base", "vit-mae-large"):
        config = fam.preset(preset)
        with torch.device("meta"):
            ours = ViTMAEForPreTraining(config)
            theirs = transformers.ViTMAEForPreTraining(transformers.ViTMAEConfig(**fam.config_to_hf(config)))
        # transformers keeps the fixed tables as parameters without gradient, attnlab as buffers
        count = sum(t.numel() for t in [*ours.parameters(), *ours.buffers()])
        assert count == sum(p.numel() for p in theirs.parameters()), preset


# ----------------------------------------------------------------------------- masking and pixels
def test_noise_or_a_seed_fixes_the_masked_patches():
    model = ViTMAEForPreTraining(VIT_MAE.preset("tiny")).eval()
    x = _pixels(4, 3, 16, 16)
    with torch.no_grad():
        a, b, c = model(x, seed=7), model(x, seed=7), model(x, seed=8)
        d = model(x, masking_noise(4, 16, seed=7))
        free1, free2 = model(x), model(x)
    assert torch.equal(a.mask, b.mask) and torch.equal(a.logits, b.logits) and torch.equal(a.mask, d.mask)
    assert not torch.equal(a.mask, c.mask)
    assert not torch.equal(free1.mask, free2.mask), "without noise or a seed each call masks afresh"
    # the smallest noise is kept: the mask is 0 exactly on each image's 4 smallest noise values
    noise = masking_noise(4, 16, seed=7)
    kept = torch.zeros(4, 16).scatter_(1, noise.argsort(1)[:, :4], 1.0)
    assert torch.equal(a.mask, 1 - kept)


def test_patchify_is_transformers_and_unpatchify_inverts_it():
    hf = _hf()
    x = _pixels(2, 3, 16, 16)
    assert torch.equal(patchify(x, 4), hf.patchify(x))
    assert torch.equal(unpatchify(patchify(x, 4), 4, (16, 16), 3), x)
    assert torch.equal(unpatchify(patchify(x, 4), 4, (16, 16), 3), hf.unpatchify(hf.patchify(x)))


@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_a_perfect_prediction_reconstructs_the_image_unnormalised(norm_pix_loss):
    """With the normalised-pixel loss the decoder predicts each patch's normalised values: shown as
    they are they would not be the image; put back on each patch's mean and spread they are."""
    model = ViTMAEForPreTraining(VIT_MAE.preset("tiny", norm_pix_loss=norm_pix_loss)).eval()
    x = _pixels(2, 3, 16, 16) * 3 + 1
    with torch.no_grad():
        out = model(x, seed=0)
    target = patchify(x, 4)
    if norm_pix_loss:
        mean, var = target.mean(-1, keepdim=True), target.var(-1, keepdim=True)
        target = (target - mean) / (var + 1e-6) ** 0.5
    perfect = out._replace(logits=target)
    assert_close_scaled(model.reconstruction(x, perfect), x, 1e-6, "reconstruction")
    raw = unpatchify(perfect.logits, 4, (16, 16), 3)
    assert torch.allclose(raw, x) is (not norm_pix_loss)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5])
def test_a_mask_ratio_outside_zero_to_one_is_refused(ratio):
    with pytest.raises(ValueError, match=rf"^ViTMAEConfig: mask_ratio must be in \[0, 1\), got {ratio}$"):
        ViTMAEConfig(**{**VIT_MAE.presets["tiny"], "mask_ratio": ratio})
    with pytest.raises(ValueError, match=r"mask_ratio must be in \[0, 1\)"):
        VIT_MAE.config_from_hf({**HF_SIZES, "model_type": "vit_mae", "mask_ratio": ratio})


def test_noise_of_the_wrong_shape_is_refused_in_one_line():
    model = ViTMAEForPreTraining(VIT_MAE.preset("tiny"))
    x = _pixels(2, 3, 16, 16)
    with pytest.raises(ValueError, match=r"^ViTMAEForPreTraining: noise must be a \(batch, patches\) = \(2, 16\) "
                                         r"tensor, got \(2, 15\)$"):
        model(x, torch.rand(2, 15))
    with pytest.raises(ValueError, match=r"^ViTMAEModel: noise must be a \(batch, patches\) = \(2, 16\) tensor, "
                                         r"got \(16,\)$"):
        ViTMAEModel(VIT_MAE.preset("tiny"))(x, torch.rand(16))
    with pytest.raises(ValueError, match="^ViTMAEForPreTraining: give noise or seed, not both$"):
        model(x, torch.rand(2, 16), seed=1)


# ----------------------------------------------------------------------------- the task and fine-tuning
def _image_folder(root, n=10, size=16):
    from PIL import Image
    rng = np.random.default_rng(0)
    for c, label in enumerate(["blue", "red"]):
        (root / label).mkdir(parents=True)
        for i in range(n):
            x = rng.integers(0, 90, (size, size, 3))
            x[..., 2 - 2 * c] += 160
            Image.fromarray(x.astype(np.uint8)).save(root / label / f"{i}.png")
    return root


TINY_MAE = ["--image-size", "16", "--patch-size", "4", "--d-model", "32", "--heads", "2", "--layers", "1",
            "--decoder-d-model", "16", "--decoder-heads", "2", "--decoder-layers", "1", "--batch-size", "8",
            "--no-progress"]


def _cli(capsys, *args):
    from attnlab.cli import main
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _image_settings(**given):
    """The image task's settings, checked as the train command checks them (the data is not read)."""
    from attnlab.tasks import get_task
    image = get_task("image")
    s = image.settings(**{"data": "unread", **given})
    image.check(s)
    return image, s


def _encoder(model) -> dict:
    """The encoder's tensors under their checkpoint names (both models keep them under "vit.")."""
    from attnlab.models.pretrained import to_hf_state_dict
    return {k: v for k, v in to_hf_state_dict(model).items() if k.startswith("vit.")}


def test_the_fine_tuned_classifier_starts_from_the_encoder_with_a_new_head(tmp_path):
    from attnlab.tasks.mae import fine_tuning_start
    torch.manual_seed(0)
    mae = ViTMAEForPreTraining(VIT_MAE.preset("tiny", layer_norm_eps=1e-6))
    contract.randomize_(mae, 5)
    mae.save_pretrained(tmp_path / "hf")
    image, s = _image_settings(init=str(tmp_path / "hf"), seed=3)
    model, processor = fine_tuning_start(s, ["a", "b", "c"], image._model)
    assert (s["image_size"], s["patch_size"], s["d_model"], s["layers"], s["heads"], s["d_ff"]) == (16, 4, 32, 2, 4, 64)
    assert model.config.layer_norm_eps == 1e-6 and model.config.num_labels == 3
    want, got = _encoder(mae), _encoder(model)
    assert want.keys() == got.keys() and len(want) > 10
    assert all(torch.equal(got[k], want[k]) for k in want)
    fresh = image._model(s.copy(), ["a", "b", "c"])                   # the same seed: the head as a new one starts
    assert torch.equal(model.head.weight, fresh.head.weight) and not torch.equal(model.cls_token, fresh.cls_token)
    assert processor.channels == 3 and processor.output_size == (16, 16)


@pytest.mark.parametrize("name", ["ViTForImageClassification", "ViTModel"])
def test_init_also_takes_a_vit_directory_its_head_and_pooler_left_behind(name, tmp_path):
    from attnlab.models.pretrained import to_hf_state_dict
    from attnlab.tasks.mae import fine_tuning_start
    vit = attnlab.models.family("vit")
    source = vit.architecture(name).build(vit.preset("tiny"))
    contract.randomize_(source, 2)
    source.save_pretrained(tmp_path / "vit")
    image, s = _image_settings(init=str(tmp_path / "vit"))
    model, _ = fine_tuning_start(s, ["a", "b"], image._model)
    theirs = to_hf_state_dict(source)
    want = {k if k.startswith("vit.") else "vit." + k: v for k, v in theirs.items()
            if not k.startswith(("classifier.", "pooler."))}
    got = _encoder(model)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert model.head.weight.shape == (2, 32)


def test_init_refuses_an_encoder_that_starts_another_family(tmp_path):
    """--init's encoder chooses the family (attnlab.models.transfer): a DeiT directory starts a DeiT
    classifier (tests/test_transfer.py), so --model vit with it is refused, as --model deit with an
    MAE (whose encoder is a ViT) and a family option the encoder does not have."""
    from attnlab.tasks.mae import fine_tuning_start
    from attnlab.tasks.run import RunError
    deit = attnlab.models.family("deit")
    deit.default.build(deit.preset("tiny")).save_pretrained(tmp_path / "deit")
    image, s = _image_settings(init=str(tmp_path / "deit"), model="vit")
    with pytest.raises(RunError, match=r"deit: its encoder starts a deit classifier, not --model vit$"):
        fine_tuning_start(s, ["a", "b"], image._model)
    ViTMAEForPreTraining(VIT_MAE.preset("tiny")).save_pretrained(tmp_path / "mae")
    image, s = _image_settings(init=str(tmp_path / "mae"), model="deit")
    with pytest.raises(RunError, match=r"mae: its encoder starts a vit classifier, not --model deit$"):
        fine_tuning_start(s, ["a", "b"], image._model)
    image, s = _image_settings(init=str(tmp_path / "mae"), norm="dyt")
    with pytest.raises(RunError, match=r"mae: the encoder uses layernorm, not --norm dyt$"):
        fine_tuning_start(s, ["a", "b"], image._model)


def test_train_mae_then_fine_tune_from_it_then_classify(tmp_path, capsys):
    from attnlab.tasks import open_run
    from attnlab.tasks.run import load_model
    data = _image_folder(tmp_path / "data")
    code, _, err = _cli(capsys, "train", "mae", "--data", data, "--out", tmp_path / "mae", "--steps", "3",
                        "--norm-pix-loss", "--mask-ratio", "0.5", *TINY_MAE)
    assert code == 0, err
    assert "16 patches of 4, 8 masked (ratio 0.5), normalised pixel targets" in err
    run = open_run(tmp_path / "mae")
    assert run.task == "mae" and run.config["norm_pix_loss"] is True
    assert (run.path / "preprocessor_config.json").is_file()
    evals = [line for line in (tmp_path / "mae" / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert evals and "val_loss" in evals[-1]
    # the classifier's encoder, before any step, is the MAE run's
    from attnlab.tasks.mae import fine_tuning_start
    image, s = _image_settings(init=str(tmp_path / "mae"), data=str(data))
    start, _ = fine_tuning_start(s, ["blue", "red"], image._model)
    pretrained = _encoder(load_model(run))
    assert all(torch.equal(_encoder(start)[k], v) for k, v in pretrained.items())
    code, _, err = _cli(capsys, "train", "image", "--data", data, "--out", tmp_path / "clf", "--steps", "3",
                        "--init", tmp_path / "mae", "--batch-size", "8", "--no-progress")
    assert code == 0, err
    clf = open_run(tmp_path / "clf")
    assert clf.config["d_model"] == 32 and clf.config["num_layers"] == 1 and clf.config["image_size"] == 16
    moved = _encoder(load_model(clf))
    assert any(not torch.equal(moved[k], v) for k, v in pretrained.items()), "fine-tuning trained the encoder"
    code, out, err = _cli(capsys, "classify", tmp_path / "clf", data / "red" / "0.png")
    assert code == 0, err
    label, p = out.split()
    assert label in ("blue", "red") and 0.5 <= float(p) <= 1.0


def test_train_mae_says_what_is_wrong_in_one_line(tmp_path, capsys):
    data = _image_folder(tmp_path / "data", n=2)
    code, _, err = _cli(capsys, "train", "mae", "--data", data, "--out", tmp_path / "r", "--mask-ratio", "1", *TINY_MAE)
    assert code == 2 and err.strip().splitlines()[-1].endswith("--mask-ratio: must be in [0, 1), got 1.0"), err
