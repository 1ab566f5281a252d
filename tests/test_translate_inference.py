"""The translation task's own inference encodes sources as it trains them: without a source EOS
(generate.translate defaults to src_eos=True, the convention of models trained with one), and
an empty source gives an empty translation without running the model."""
import torch

import attnlab.generate as generate
from attnlab.models import Transformer
from attnlab.tasks.translate import TranslationTask, Translator
from attnlab.tokenizer import train_tokenizers


def _setup():
    pairs = [("one cat", "cat one"), ("two dog", "dog two")] * 4
    src_tok, tgt_tok = train_tokenizers("word", [a for a, _ in pairs], [b for _, b in pairs], shared=True)
    torch.manual_seed(0)
    model = Transformer(src_tok.vocab_size, tgt_tok.vocab_size, d_model=16, num_heads=2, num_encoder_layers=1,
                        num_decoder_layers=1, d_ff=32, max_seq_len=32, dropout=0.0)
    encoded = [(src_tok.encode(a), tgt_tok.encode(b)) for a, b in pairs]
    return model, src_tok, tgt_tok, encoded, pairs


def test_every_task_caller_passes_no_source_eos(monkeypatch):
    model, src_tok, tgt_tok, encoded, pairs = _setup()
    calls = []
    real = generate.translate

    def spy(*args, **kwargs):
        calls.append(kwargs.get("src_eos", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(generate, "translate", spy)
    Translator(model, src_tok, tgt_tok, None)(["one cat"])
    TranslationTask(model, src_tok, tgt_tok, encoded, pairs[:2], eval_size=2).evaluate(model)
    assert calls == [False, False]


def test_an_empty_source_translates_to_an_empty_line_in_place():
    model, src_tok, tgt_tok, _, _ = _setup()
    out = generate.translate(model, src_tok, tgt_tok, ["one cat", "", "  ", "two dog"], src_eos=False)
    assert len(out) == 4 and out[1] == "" and out[2] == ""
    alone = generate.translate(model, src_tok, tgt_tok, ["one cat", "two dog"], src_eos=False)
    assert [out[0], out[3]] == alone
