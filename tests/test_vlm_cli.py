"""A trained vision-language run from the command line: ``attnlab ask RUN IMAGE QUESTION`` answers
held-out digits exactly as the task's own evaluation does (the same greedy tokens, from the image
file instead of the stored bytes), streams its answer, and says in one line what is wrong with a run
of another kind, an unreadable image or a question too long for the context."""
import pytest
import torch

from attnlab.tasks import get_task, open_run
from attnlab.tasks.vlm import MAX_ANSWER, answer
from _multimodal import TINY, VLM_TINY, cli, digit_files, train

N_IMAGES = 12


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    # wider than the other tests' runs and at a higher rate, so that 150 steps learn the answers' form
    return train("vlm", tmp_path_factory.mktemp("vlm") / "run", 150, *VLM_TINY, "--d-model", "32", "--d-ff", "64",
                 "--batch-size", "32", "--lr", "3e-3")


@pytest.fixture(scope="module")
def held_out(vlm_run, tmp_path_factory):
    """(image files, labels) of the first held-out test digits, and the task's own answers to them:
    what its report computes, from the bytes the run's processor made of the embedded digits."""
    files, labels = digit_files(tmp_path_factory.mktemp("digits"), N_IMAGES)
    task = get_task("vlm")
    vlm = task.load(open_run(vlm_run))
    s = task.settings()
    task.check(s)
    x, y = task._data(s, vlm.processor)["test"]
    assert y[:N_IMAGES].tolist() == labels
    answers = {q: answer(vlm.model, vlm.tokenizer, vlm.processor.finish(x[:N_IMAGES]), q) for q in vlm.questions}
    return files, labels, answers


def test_ask_answers_held_out_digits_as_the_task_s_evaluation(vlm_run, held_out, capsys):
    files, labels, answers = held_out
    vlm = get_task("vlm").load(open_run(vlm_run))
    for question in vlm.questions[:2]:
        got = []
        for f in files:
            code, out, err = cli(capsys, "ask", vlm_run, f, question)
            assert code == 0 and err == "", err
            got.append(out.removesuffix("\n"))
        assert got == answers[question]
    code, out, _ = cli(capsys, "ask", vlm_run, files[0])          # no question: the run's first
    assert code == 0 and out == answers[vlm.questions[0]][0] + "\n"
    # the run has learnt what an answer is: one digit's name (which one, a short run guesses at)
    assert all(a in [str(d) for d in range(10)] for a in answers[vlm.questions[0]]), answers


def test_the_answer_streams_token_by_token_and_cached_decoding_equals_recomputing(vlm_run, held_out):
    files, _, _ = held_out
    vlm = get_task("vlm").load(open_run(vlm_run))
    pieces = []
    # a temperature that makes every token about as likely as any other: an answer of several tokens
    text = vlm.ask(files[1], "what digit is this?", temperature=100.0, seed=0, max_new_tokens=MAX_ANSWER,
                   on_text=pieces.append)
    assert "".join(pieces) == text and len(pieces) >= 2 and all(pieces), pieces      # each token's text as decoded
    # the greedy answer with the KV cache equals the argmax of the whole sequence recomputed each step
    from attnlab.tasks.vlm import _prompt
    pixels = vlm.processor(files[:4])
    ids = torch.tensor(_prompt(vlm.tokenizer, "what digit is this?", vlm.model.config.image_tokens)).expand(4, -1)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.cat([ids, vlm.model(ids, pixels)[:, -1].argmax(-1, keepdim=True)], 1)
    recomputed = ids[:, -3:].tolist()
    cached = vlm.answer(files[:4], "what digit is this?")
    assert cached == [vlm.tokenizer.decode(r[:r.index(2)] if 2 in r else r) for r in recomputed]


def test_bad_input_is_one_line(vlm_run, held_out, tmp_path, capsys):
    files, _, _ = held_out
    broken = tmp_path / "broken.png"
    broken.write_text("not an image")
    code, out, err = cli(capsys, "ask", vlm_run, broken, "what digit is this?")
    assert code == 2 and out == "" and err.count("\n") == 1 and "broken.png: not an image file" in err
    code, _, err = cli(capsys, "ask", vlm_run, tmp_path / "gone.png")
    assert code == 2 and err.count("\n") == 1 and "gone.png: no such image file" in err
    clip = train("clip", tmp_path / "clip", 1, *TINY, "--layers", "1")
    capsys.readouterr()
    code, _, err = cli(capsys, "ask", clip, files[0])
    assert code == 2 and err.count("\n") == 1 and "which 'attnlab ask' does not take; use 'attnlab classify'" in err
    code, _, err = cli(capsys, "generate", vlm_run, "--prompt", "x")
    assert code == 2 and "use 'attnlab ask'" in err
    code, _, err = cli(capsys, "ask", vlm_run, files[0], " ".join(["what"] * 40))
    assert code == 2 and err.count("\n") == 1 and "the question has 40 words; this model's context" in err
    code, out, err = cli(capsys, "ask", vlm_run, files[0], "what colour is this?")
    assert code == 0 and err == "attnlab ask: note: 'colour' not in the run's vocabulary (read as <unk>)\n"
    code, _, err = cli(capsys, "ask", vlm_run, files[0], "--temperature", "-1")
    assert code == 2 and "--temperature: must be a number >= 0" in err


# ----------------------------------------------------------------------------- the text's attention to the image
def _attention(vlm_run, image):
    from attnlab.viz.image_text import image_text_attention
    vlm = get_task("vlm").load(open_run(vlm_run))
    question = "what digit is this?"
    ids = vlm.prompt_ids(question) + vlm.tokenizer.encode(vlm.ask(image, question))
    return vlm, ids, image_text_attention(vlm.model, ids, vlm.processor([image]))


def test_the_recorded_text_to_image_map_is_the_language_model_s_attention(vlm_run, held_out, tmp_path, capsys):
    """Shapes, rows that sum as softmax rows do, causality, and the weights equal to transformers'
    LlavaForConditionalGeneration (eager attention, output_attentions) on the exported run, fp32,
    1e-5 of scale."""
    transformers = pytest.importorskip("transformers")
    from _tolerance import FP32, assert_close_scaled
    files, _, _ = held_out
    vlm, ids, a = _attention(vlm_run, files[0])
    config = vlm.model.config
    P, T = config.image_tokens, len(ids)
    n_text = T - P
    L, H = config.text.num_layers, config.text.num_heads
    assert a.weights.shape == (L, H, T, T) and a.image_map.shape == (L, H, n_text, P)
    assert a.image_positions.tolist() == list(range(P)) and a.text_positions.tolist() == list(range(P, T))
    assert (a.rows, a.cols, a.prefix) == (4, 4, 0) and a.patch_map().shape == (n_text, 4, 4)
    rows = a.weights.sum(-1)
    torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-5, rtol=0)    # softmax rows
    text_part = a.weights[:, :, a.text_positions][..., a.text_positions].sum(-1)
    torch.testing.assert_close(a.image_share + text_part, torch.ones_like(text_part), atol=1e-5, rtol=0)
    assert (a.weights.triu(1) == 0).all()                                         # causal: nothing from later tokens
    assert (a.image_share > 0).all() and (a.image_share < 1).all()
    # the same weights from transformers, reading the run exported as a Hugging Face directory
    assert cli(capsys, "export", vlm_run, tmp_path / "hf")[0] == 0
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), pixel_values=vlm.processor([files[0]]), output_attentions=True)
    want = torch.stack([w[0] for w in out.attentions])                             # (L, H, T, T)
    assert_close_scaled(a.weights, want, FP32, "the language model's attention weights")


def test_viz_draws_the_text_to_image_attention_over_the_image(vlm_run, held_out, tmp_path, capsys):
    from PIL import Image
    files, _, answers = held_out
    code, out, err = cli(capsys, "viz", vlm_run, "what digit is this?", "--image", files[0], "--out", tmp_path / "a.png")
    assert code == 0, err
    assert out.splitlines() == [f"what digit is this? -> {answers['what digit is this?'][0]}", f"wrote {tmp_path / 'a.png'}"]
    with Image.open(tmp_path / "a.png") as im:
        assert im.size[0] > 500 and im.size[1] > 200
    code, out, err = cli(capsys, "viz", vlm_run, "--image", files[0], "--layer", "2", "--out", tmp_path / "b.png")
    assert code == 0 and (tmp_path / "b.png").stat().st_size > 0, err
    code, out, err = cli(capsys, "viz", vlm_run, "--image", files[0], "--html", tmp_path / "page.html")
    assert code == 0, err
    page = (tmp_path / "page.html").read_text()
    assert "text to image attention" in page and "language model self-attention" in page
    from attnlab.viz.image_text import image_text_views
    vlm, ids, a = _attention(vlm_run, files[0])
    picture = vlm.processor.resized(files[0]).permute(1, 2, 0).numpy()
    views = image_text_views(a, picture, [str(i) for i in ids])
    assert views[0].weights.shape == a.image_map.shape and views[0].image.rows * views[0].image.cols == len(views[0].cols)
    code, _, err = cli(capsys, "viz", vlm_run, "what digit is this?")
    assert code == 2 and "give the image to ask about with --image FILE" in err
    code, _, err = cli(capsys, "viz", vlm_run, "--image", files[0], "--layer", "9", "--out", tmp_path / "c.png")
    assert code == 2 and "--layer must be in 1..2, got 9" in err


def test_a_prompt_as_long_as_the_tower_s_sequence_is_still_the_language_model_s():
    """The language model is the stack that ran last: a prompt of 16 image tokens and one word has
    the vision tower's length (16 patches and the class token) and is still told apart."""
    from attnlab.models.llava import LlavaForConditionalGeneration
    from attnlab.models.registry import family
    from attnlab.viz.image_text import image_text_attention
    torch.manual_seed(0)
    vlm = LlavaForConditionalGeneration(family("llava").preset("tiny")).eval()
    c = vlm.config
    ids = [c.image_token_id] * c.image_tokens + [5]
    a = image_text_attention(vlm, ids, torch.randn(1, 3, 16, 16))
    assert len(ids) == c.image_tokens + 1 == (c.vision.image_size // c.vision.patch_size) ** 2 + 1
    assert a.weights.shape == (c.text.num_layers, c.text.num_heads, 17, 17) and (a.weights.triu(1) == 0).all()
    assert c.vision.vision_num_layers != c.text.num_layers                # the tower's stack would have 3 layers
