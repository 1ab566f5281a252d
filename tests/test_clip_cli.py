"""`attnlab train clip` end to end on tiny settings: the digits and an image folder with class or
file captions, batches whose images point at their distinct captions, the end token where both pooling rules find it, an
exact resume, zero-shot `classify`, `embed` of texts and images, `export` read by transformers'
CLIPModel and CLIPProcessor (fp32, 1e-5 relative to scale), and bad input in one line."""
import pytest
import torch
from PIL import Image

from attnlab.tasks import get_task, open_run
from _multimodal import TINY, cli as _cli, digit_files, photos as _photos, train
from _tolerance import FP32, assert_close_scaled

_TINY = TINY + ["--layers", "1"]


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    return train("clip", tmp_path_factory.mktemp("clip") / "run", 4, *_TINY)


def test_the_digits_train_with_one_image_per_caption_and_the_end_token_last(digits_run, capsys):
    run = open_run(digits_run)
    assert run.task == "clip" and run.task_options["labels"] == [str(d) for d in range(10)]
    clf = get_task("clip").load(run)
    tok, config = clf.tokenizer, clf.model.config
    ids = tok.encode("a photo of a 3")
    # the end token closes every caption, is the vocabulary's largest id and is not 2: both pooling rules find it
    assert ids[-1] == config.eos_token_id == tok.vocab_size - 1 != 2 and max(ids[:-1]) < ids[-1]
    task = get_task("clip")
    setup = task.prepare(task.settings(out=str(digits_run.parent / "x")), None)
    plan = setup.task.plan(0, 0)
    assert sorted(torch.cat([i for i, _ in plan]).tolist()) == list(range(len(setup.task.train_c)))
    # as many images of each caption in a batch (64 // 10 = 6), but where a class runs out
    counts = [setup.task.train_c[i].bincount() for i, _ in plan]
    balanced = [set(c[c > 0].tolist()) == {6} and len(c[c > 0]) == 10 for c in counts]
    assert sum(balanced) >= 0.9 * len(plan)
    index, seed = plan[0]
    images = setup.task.train_x[index]
    batch = setup.task.inputs(images, setup.task.train_c[index], "cpu")
    # the batch's distinct captions, each image pointing at its own
    texts = batch["input_ids"]
    assert len(texts) == len(setup.task.train_c[index].unique()) < len(index)
    for i, t in enumerate(batch["text_index"].tolist()):
        caption = setup.task.captions[int(setup.task.train_c[index][i])]
        assert tok.decode(texts[t].tolist()) == caption


def test_zero_shot_classify_and_embed_texts_and_images(digits_run, tmp_path, capsys):
    files, _ = digit_files(tmp_path, 3)
    code, out, err = _cli(capsys, "classify", digits_run, *files)
    assert code == 0, err
    rows = [line.split("\t") for line in out.splitlines()]
    assert len(rows) == 3 and all(r[0] in [str(d) for d in range(10)] for r in rows)
    code, out, err = _cli(capsys, "classify", digits_run, "--labels", "3, 7", "--top", "2", files[0])
    assert code == 0, err
    label_a, p_a, label_b, p_b = out.split()
    assert {label_a, label_b} == {"3", "7"} and abs(float(p_a) + float(p_b) - 1) < 1e-3
    code, out, err = _cli(capsys, "embed", digits_run, "a photo of a 3", "a photo of a 7", "--images", *files[:2])
    assert code == 0, err
    vectors = torch.tensor([[float(v) for v in line.split()] for line in out.splitlines()])
    clf = get_task("clip").load(open_run(digits_run))
    assert vectors.shape == (4, clf.model.config.projection_dim)
    want = torch.cat([clf.text_vectors(["a photo of a 3", "a photo of a 7"]), clf.image_vectors(files[:2])])
    torch.testing.assert_close(vectors, want, atol=2e-6, rtol=0)


def test_bad_input_is_one_line(digits_run, tmp_path, capsys):
    not_image = tmp_path / "notes.png"
    not_image.write_text("not an image")
    code, _, err = _cli(capsys, "classify", digits_run, "--labels", "", not_image)
    assert code == 2 and err.strip().count("\n") == 0 and "--labels" in err and "none empty" in err
    code, _, err = _cli(capsys, "classify", digits_run, "--labels", "a,,b", not_image)
    assert code == 2 and "--labels" in err
    code, _, err = _cli(capsys, "classify", digits_run, not_image)
    assert code == 2 and err.strip().count("\n") == 0 and "notes.png: not an image file" in err
    code, _, err = _cli(capsys, "embed", digits_run, "--images", not_image)
    assert code == 2 and err.strip().count("\n") == 0 and "notes.png: not an image file" in err
    captions = tmp_path / "captions.tsv"
    captions.write_text("red/00.png\ta red square\nno tab here\n")
    data = _photos(tmp_path / "photos")
    code, _, err = _cli(capsys, "train", "clip", "--data", data, "--captions", captions, "--out", tmp_path / "r",
                        "--steps", "2", *_TINY)
    assert code == 2 and err.strip().splitlines()[-1].endswith("captions.tsv, line 2: expected IMAGE<TAB>caption")


def test_an_image_folder_with_captions_from_a_file_trains_and_resumes_bit_identically(tmp_path, capsys):
    data = _photos(tmp_path / "photos")
    lines = [f"{c}/{i:02d}.png\tsomething {c} number {i}" for c in ("blue", "red", "green") for i in range(6)]
    (tmp_path / "captions.tsv").write_text("\n".join(lines) + "\n")
    flags = ["--data", data, "--captions", tmp_path / "captions.tsv", "--image-size", "8", "--patch-size", "4",
             "--batch-size", "4", "--schedule", "constant", "--warmup", "0", *_TINY]
    assert _cli(capsys, "train", "clip", "--out", tmp_path / "whole", "--steps", "6", *flags)[0] == 0
    assert _cli(capsys, "train", "clip", "--out", tmp_path / "part", "--steps", "3", *flags)[0] == 0
    code, _, err = _cli(capsys, "train", "clip", "--out", tmp_path / "part", "--resume", "--steps", "6",
                        "--no-progress")
    assert code == 0, err
    from safetensors.torch import load_file
    a, b = (load_file(str(tmp_path / r / "step-0000006" / "model.safetensors")) for r in ("whole", "part"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    run = open_run(tmp_path / "whole")
    assert run.task_options["labels"] == []          # no class names: zero-shot needs --labels
    code, _, err = _cli(capsys, "classify", tmp_path / "whole", data / "red" / "00.png")
    assert code == 2 and "--labels" in err


def test_an_exported_folder_run_is_transformers_clip_with_its_processor(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    data = _photos(tmp_path / "photos")
    run = tmp_path / "run"
    code, out, err = _cli(capsys, "train", "clip", "--data", data, "--image-size", "8", "--patch-size", "4",
                          "--out", run, "--steps", "3", *_TINY)
    assert code == 0, err
    assert _cli(capsys, "export", run, tmp_path / "hf")[0] == 0
    hf = transformers.CLIPModel.from_pretrained(tmp_path / "hf").eval()
    processor = transformers.CLIPProcessor.from_pretrained(tmp_path / "hf")
    clf = get_task("clip").load(open_run(run))
    images = [data / c / "01.png" for c in ("blue", "green", "red")]
    labels = ["blue", "green", "red", "purple"]
    inputs = processor(text=[f"a photo of a {label}" for label in labels], images=[Image.open(p) for p in images],
                       return_tensors="pt", padding=True)
    assert inputs["input_ids"][0, inputs["attention_mask"][0].sum() - 1] == hf.config.text_config.eos_token_id
    with torch.no_grad():
        want = hf(**inputs).logits_per_image.softmax(-1)
    assert_close_scaled(clf.zero_shot(labels).probabilities(images), want, FP32, "zero-shot probabilities")


def _clip_tokenizer(transformers):
    """A CLIP tokenizer of letters and digits (each alone and ending a word), no merges."""
    import string
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase + string.digits:
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    return transformers.CLIPTokenizer(vocab=vocab, merges=[])


def test_embed_a_hugging_face_clip_directory_as_get_text_and_image_features(tmp_path, capsys):
    """A transformers CLIPModel saved with its CLIPProcessor (image processor and tokenizer):
    `attnlab embed DIR TEXTS --images FILES` gives transformers' get_text_features of the tokenizer's
    padded ids, then get_image_features of the processor's pixels (fp32, 1e-5 of scale), unit length
    by default; without a tokenizer.json images only, texts refused in one line."""
    transformers = pytest.importorskip("transformers")
    import numpy as np
    import attnlab
    from attnlab.models.registry import family
    config = family("clip").preset("tiny")
    tokenizer = _clip_tokenizer(transformers)
    hf_config = attnlab.models.clip.clip_config_to_hf(config)
    hf_config["text_config"].update(vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    hf = transformers.CLIPModel(transformers.CLIPConfig(**hf_config)).eval()
    size = config.image_size
    processor = transformers.CLIPProcessor(tokenizer=tokenizer, image_processor=transformers.CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}))
    hf.save_pretrained(tmp_path / "hf")
    processor.save_pretrained(tmp_path / "hf")
    data = _photos(tmp_path / "photos")
    files = [data / "red" / "00.png", data / "green" / "03.png", data / "blue" / "05.png"]
    texts = ["a photo of a 3", "red", "a green cat 12"]                    # different lengths: padded
    with torch.no_grad():
        inputs = processor(text=texts, images=[Image.open(f) for f in files], return_tensors="pt", padding=True)
        text = hf.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        image = hf.get_image_features(pixel_values=inputs["pixel_values"])
    want = torch.cat([getattr(text, "pooler_output", text), getattr(image, "pooler_output", image)])
    code, out, err = _cli(capsys, "embed", tmp_path / "hf", *texts, "--no-normalize", "--out", tmp_path / "v.npy",
                          "--images", *files)
    assert code == 0, err
    got = torch.from_numpy(np.load(tmp_path / "v.npy"))
    assert_close_scaled(got[:3], want[:3], FP32, "text features")
    assert_close_scaled(got[3:], want[3:], FP32, "image features")
    # the image processor as its own preprocessor_config.json (the Hub's CLIP directories), unit-length rows
    (tmp_path / "hf" / "processor_config.json").unlink()
    processor.image_processor.save_pretrained(tmp_path / "hf")
    code, out, err = _cli(capsys, "embed", tmp_path / "hf", "--images", *files)
    assert code == 0, err
    got = torch.tensor([[float(v) for v in line.split()] for line in out.splitlines()])
    torch.testing.assert_close(got, torch.nn.functional.normalize(want[3:], dim=-1), atol=2e-6, rtol=0)   # 6 places
    (tmp_path / "hf" / "tokenizer.json").unlink()
    code, _, err = _cli(capsys, "embed", tmp_path / "hf", "--images", files[0])
    assert code == 0, err
    code, _, err = _cli(capsys, "embed", tmp_path / "hf", "a photo", "--images", files[0])
    assert code == 2 and err.count("\n") == 1 and "no tokenizer.json, so no texts to embed" in err
    for name in ("preprocessor_config.json", "processor_config.json"):     # transformers 5 writes the second
        (tmp_path / "hf" / name).unlink(missing_ok=True)
    code, _, err = _cli(capsys, "embed", tmp_path / "hf", "--images", files[0])
    assert code == 2 and err.count("\n") == 1 and "no preprocessor_config.json (nor an image processor" in err
