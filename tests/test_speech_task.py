"""`attnlab train speech` and `attnlab transcribe` end to end on a tiny spoken corpus (a few steps,
a resume), the word error rate against hand-worked examples, SpecAugment's masks, and bad input
(a file that is not 16-bit PCM, the wrong rate, a model of another kind, --data) in one line."""
import numpy as np
import pytest
import torch

import attnlab
from attnlab.cli import main
from attnlab.data.speech import speak
from attnlab.models.registry import family
from attnlab.processors import write_wav
from attnlab.tasks import get_task, open_run
from attnlab.tasks.speech import spec_augment, word_error_rate, word_errors

_TINY = ["--sentences", "8", "--eval-size", "2", "--test-size", "2", "--d-model", "16", "--heads", "2", "--layers", "1",
         "--d-ff", "32", "--batch-size", "4", "--no-progress", "--max-words", "5"]


def _cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_word_error_rate_by_hand():
    # ref: the cat sat on the mat (6 words); "sat" -> "sit" substituted, the second "the" deleted: 2 errors
    assert word_errors("the cat sit on mat", "the cat sat on the mat") == 2
    # one word inserted at the front, the rest right: 1 error
    assert word_errors("a the cat sat on the mat", "the cat sat on the mat") == 1
    # nothing heard: every reference word deleted; nothing to hear: every word inserted
    assert word_errors("", "three dogs run") == 3 and word_errors("three dogs run", "") == 3
    # two words swapped: no cheaper path than two substitutions
    assert word_errors("dogs three run", "three dogs run") == 2
    # the corpus rate pools the errors over the reference words: (2 + 1 + 0) / (6 + 6 + 3)
    got = word_error_rate(["the cat sit on mat", "a the cat sat on the mat", "three dogs run"],
                          ["the cat sat on the mat", "the cat sat on the mat", "three dogs run"])
    assert got == pytest.approx(100 * 3 / 15)
    with pytest.raises(ValueError, match="2 hypotheses for 1 references"):
        word_error_rate(["a", "b"], ["a"])


def test_spec_augment_masks_bands_and_spans_with_the_example_mean():
    x = torch.arange(2 * 10 * 40, dtype=torch.float32).reshape(2, 10, 40)
    y = spec_augment(x, torch.Generator().manual_seed(3), max_band=3, max_span=5)
    assert torch.equal(x, torch.arange(800, dtype=torch.float32).reshape(2, 10, 40))        # a copy
    for b in range(2):
        changed = y[b] != x[b]
        assert changed.any() and (y[b][changed] == x[b].mean()).all()
        rows, cols = changed.all(1).sum(), changed.all(0).sum()              # whole bands, whole spans
        assert changed.sum() <= rows * 40 + cols * 10 and rows <= 6 and cols <= 10
    assert torch.equal(y, spec_augment(x, torch.Generator().manual_seed(3), max_band=3, max_span=5))


@pytest.fixture(scope="module")
def speech_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("speech")
    run = root / "run"
    common = [*_TINY, "--audio-cache", root / "audio", "--out", run]
    assert main([str(a) for a in ["train", "speech", "--steps", "2", *common]]) == 0
    assert main([str(a) for a in ["train", "speech", "--steps", "3", "--resume", *common]]) == 0      # resumable
    return run, root


def test_train_resume_and_transcribe(speech_run, capsys, tmp_path):
    run, root = speech_run
    info = open_run(run)
    assert info.task == "speech" and info.processors["audio"] == {"modality": "audio",
                                                                   "file": "preprocessor_config.json"}
    assert (run / "step-0000003").is_dir()
    speech = get_task("speech").load(info)
    wav = tmp_path / "u.wav"
    write_wav(wav, speak("three dogs see a cat", "en-us", 160), 16000)
    code, out, _ = _cli(capsys, "transcribe", run, wav, wav)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2 and lines[0] == lines[1] == speech([wav])[0]
    assert all(w in speech.tokenizer.vocab for w in lines[0].split())
    code, out, _ = _cli(capsys, "transcribe", run, wav, "--beam", "2")
    assert code == 0 and len(out.splitlines()) == 1


def test_export_is_read_by_transformers(speech_run, capsys, tmp_path):
    from transformers import AutoFeatureExtractor, AutoModelForSpeechSeq2Seq
    run, _ = speech_run
    code, _, err = _cli(capsys, "export", run, tmp_path / "hf")
    assert code == 0, err
    fe = AutoFeatureExtractor.from_pretrained(tmp_path / "hf")
    hf = AutoModelForSpeechSeq2Seq.from_pretrained(tmp_path / "hf").eval()
    speech = get_task("speech").load(open_run(run))
    wave = speak("seven cats", "en-us", 160)
    x = speech.extractor([wave])
    theirs = torch.as_tensor(fe(wave.numpy(), sampling_rate=16000, return_tensors="np").input_features)
    assert (x - theirs).abs().max() <= 1e-5 * theirs.abs().max()            # the run's front end, as saved
    ids = torch.tensor([[1, 5, 9]])
    with torch.no_grad():
        want = hf(input_features=x, decoder_input_ids=ids).logits
        got = speech.model(x, ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_bad_input_is_one_line(speech_run, capsys, tmp_path):
    run, root = speech_run
    (tmp_path / "notes.wav").write_text("not a sound")
    code, _, err = _cli(capsys, "transcribe", run, tmp_path / "notes.wav")
    assert code == 2 and err.count("\n") == 1 and "notes.wav: not a 16-bit PCM WAV file" in err
    write_wav(tmp_path / "fast.wav", np.zeros(4410), 44100)
    code, _, err = _cli(capsys, "transcribe", run, tmp_path / "fast.wav")
    assert code == 2 and err.count("\n") == 1 and "sampled at 44100 Hz; the model takes 16000 Hz" in err
    code, _, err = _cli(capsys, "transcribe", run, tmp_path / "missing.wav")
    assert code == 2 and "missing.wav: no such sound file" in err
    gpt = tmp_path / "gpt"                           # a model of another kind
    attnlab.save_pretrained(family("gpt2").default.build(family("gpt2").preset("tiny")), gpt)
    code, _, err = _cli(capsys, "transcribe", gpt, tmp_path / "fast.wav")
    assert code == 2 and err.count("\n") == 1 and "which 'attnlab transcribe' does not take" in err
    code, _, err = _cli(capsys, "train", "speech", "--data", tmp_path / "notes.wav", "--out", tmp_path / "r",
                        "--audio-cache", root / "audio")
    assert code == 2 and "trains on the embedded spoken corpus only" in err
