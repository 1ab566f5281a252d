"""Encoder transfer by kind (attnlab.models.transfer, ``attnlab train image --init``): a Swin and a
DeiT checkpoint (Hugging Face directories and attnlab runs) start a classifier of their own family
whose encoder holds exactly their tensors (torch.equal) and whose head is new, and fine-tune through
``attnlab train image`` with tiny models and a few steps; what does not fit is refused in one line."""
import numpy as np
import pytest
import torch

import attnlab.models  # noqa: F401  (registers every family)
import contract
from attnlab.models.registry import family
from attnlab.models.transfer import TransferError, encoder_tensors, transfer_encoder, transfer_family


def _image_folder(root, n=6, size=32):
    from PIL import Image
    rng = np.random.default_rng(0)
    for c, label in enumerate(["blue", "red"]):
        (root / label).mkdir(parents=True)
        for i in range(n):
            x = rng.integers(0, 90, (size, size, 3))
            x[..., 2 - 2 * c] += 160
            Image.fromarray(x.astype(np.uint8)).save(root / label / f"{i}.png")
    return root


def _cli(capsys, *args):
    from attnlab.cli import main
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _saved(model_type: str, kind: str, path, seed=1):
    fam = family(model_type)
    torch.manual_seed(0)
    model = fam.for_kind(kind).build(fam.preset("tiny"))
    contract.randomize_(model, seed)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("model_type, kind", [("swin", "image-classifier"), ("swin", "image-base"),
                                              ("deit", "image-classifier"), ("deit", "image-base"),
                                              ("vit", "image-base"), ("vit_mae", "masked-image-model")])
def test_the_encoder_moves_whole_and_the_head_is_new(model_type, kind, tmp_path):
    source = _saved(model_type, kind, tmp_path / "src")
    target = transfer_family(attnlab.models.architecture_of(source), "image-classifier")
    assert target.model_type == ("vit" if model_type == "vit_mae" else model_type)
    model = transfer_encoder(source, target, kind="image-classifier",
                             overrides={"num_labels": 5, "id2label": dict(enumerate("abcde"))}, seed=3)
    want, got = encoder_tensors(source), encoder_tensors(model)
    assert want.keys() == got.keys() and len(want) > 10
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert model.config.num_labels == 5
    torch.manual_seed(3)          # the head as a new model of the same config starts
    fresh = target.for_kind("image-classifier").build(model.config)
    heads = [k for k, v in fresh.state_dict().items() if v.shape[:1] == (5,)]       # the class heads' rows
    assert heads and all(torch.equal(model.state_dict()[k], fresh.state_dict()[k]) for k in heads)


def test_what_does_not_fit_is_refused(tmp_path):
    deit = _saved("deit", "image-classifier", tmp_path / "deit")
    with pytest.raises(TransferError, match=r"^its encoder does not fit a ViTForImageClassification \(no place for "
                                            r"\['embeddings.distillation_token'\]"):
        transfer_encoder(deit, family("vit"), kind="image-classifier", overrides={})
    bert = family("bert")
    with pytest.raises(TransferError, match=r"starts a bert model, which has no image-classifier architecture$"):
        transfer_family(bert.default, "image-classifier")


@pytest.mark.parametrize("model_type", ["swin", "deit"])
def test_init_from_a_checkpoint_fine_tunes_through_train_image(model_type, tmp_path, capsys):
    from attnlab.tasks import open_run
    from attnlab.tasks.run import load_model
    data = _image_folder(tmp_path / "data")
    source = _saved(model_type, "image-classifier", tmp_path / "hf")
    code, _, err = _cli(capsys, "train", "image", "--data", data, "--out", tmp_path / "clf", "--steps", "2",
                        "--init", tmp_path / "hf", "--batch-size", "4", "--no-progress")
    assert code == 0, err
    run = open_run(tmp_path / "clf")
    assert run.model_type == model_type and run.task_options["labels"] == ["blue", "red"]
    tuned = load_model(run)
    assert tuned.config.num_labels == 2 and tuned.config.image_size == source.config.image_size
    before, after = encoder_tensors(source), encoder_tensors(tuned)
    assert before.keys() == after.keys()
    assert any(not torch.equal(after[k], v) for k, v in before.items()), "fine-tuning trained the encoder"
    # and again from that attnlab run, as a run's encoder transfers too
    code, _, err = _cli(capsys, "train", "image", "--data", data, "--out", tmp_path / "again", "--steps", "1",
                        "--init", tmp_path / "clf", "--batch-size", "4", "--no-progress")
    assert code == 0, err
    assert open_run(tmp_path / "again").model_type == model_type


def test_init_with_a_text_checkpoint_says_so_in_one_line(tmp_path, capsys):
    _saved("bert", "base", tmp_path / "bert")
    data = _image_folder(tmp_path / "data", n=2)
    code, _, err = _cli(capsys, "train", "image", "--data", data, "--out", tmp_path / "clf", "--steps", "1",
                        "--init", tmp_path / "bert", "--no-progress")
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        "starts a bert model, which has no image-classifier architecture"), err


@pytest.mark.parametrize("model_type, reference", [("bert", "BertForSequenceClassification"),
                                                   ("electra", "ElectraForSequenceClassification")])
def test_a_text_encoder_starts_its_family_s_classifier_as_transformers_loads_it(model_type, reference, tmp_path):
    """``classify --init DIR --head native`` goes through the same transfer: the classifier that
    transformers builds from the bare encoder's directory (its encoder and BERT's pooler loaded, the
    head new) computes what ours does once the new heads are made equal (fp32, 1e-5 of the scale)."""
    import transformers
    from attnlab.models.pretrained import to_hf_state_dict
    from attnlab.tasks.pretrained import native_classifier
    source = _saved(model_type, "base", tmp_path / "enc")
    model = native_classifier(source, ["neg", "pos"], seed=3).eval()
    assert type(model).__name__ == reference and model.config.id2label == {0: "neg", 1: "pos"}
    want, got = encoder_tensors(source), encoder_tensors(model)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ref = getattr(transformers, reference).from_pretrained(tmp_path / "enc", num_labels=2).eval()
    ours = to_hf_state_dict(model)
    theirs = ref.state_dict()
    new = [k for k in theirs if k.startswith("classifier")]
    assert new and all(not k.startswith("classifier") or k in new for k in ours)
    ref.load_state_dict({**theirs, **{k: ours[k] for k in new}})
    # everything but the new head came from the directory on both sides
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs if k not in new), "encoder or pooler differs"
    ids = torch.randint(5, model.config.vocab_size, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask).logits
        logits = model(ids, attention_mask=mask)
    assert float((logits - expected).abs().max() / expected.abs().max()) < 1e-5
