"""A base-encoder family registered by the tests alone (kind "base", like BertModel), and a
pretrained-model directory of it with a Hugging Face tokenizer.json that adds [CLS] and [SEP]:
what `attnlab train classify --init` and `attnlab embed` take from any registered family."""
from dataclasses import dataclass

import torch
from torch import nn

import attnlab
from attnlab.models.pretrained import SavePretrained
from attnlab.models.registry import register_family
from attnlab.nn import EncoderLayer

REVIEWS = [("a great film", "pos"), ("a dull film", "neg"), ("great acting", "pos"), ("dull acting", "neg"),
           ("truly great", "pos"), ("so dull", "neg")]
@dataclass
class ToyEncoderConfig:
    vocab_size: int = 16
    d_model: int = 16
    num_heads: int = 2
    num_layers: int = 1
    max_seq_len: int = 32


class ToyEncoder(SavePretrained, nn.Module):
    """A bidirectional encoder whose forward gives the last hidden state, like BertModel."""

    def __init__(self, config: ToyEncoderConfig):
        super().__init__()
        self.config = c = config
        self.embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.position = nn.Embedding(c.max_seq_len, c.d_model)
        self.layers = nn.ModuleList(EncoderLayer(c.d_model, c.num_heads, 2 * c.d_model, 0.0, norm_first=True)
                                    for _ in range(c.num_layers))

    def forward(self, input_ids, attention_mask=None):
        x = self.embedding(input_ids) + self.position(torch.arange(input_ids.size(1)))
        for layer in self.layers:
            x = layer(x, key_padding_mask=None if attention_mask is None else attention_mask.bool())
        return x


def _toy_sizes(*, vocab_size, context, d_model, num_heads, num_layers, d_ff=None, dropout=0.0):
    return ToyEncoderConfig(vocab_size, d_model, num_heads, num_layers, context)


TOY = register_family("toy-encoder", ToyEncoderConfig, presets={"tiny": {}}, build_config=_toy_sizes,
                      limits=lambda c: {"vocab_size": c.vocab_size, "context": c.max_seq_len})
TOY.register("ToyEncoder", ToyEncoder, kind="base")


def toy_encoder_dir(path):
    """A pretrained-model directory: config.json + model.safetensors + a WordPiece-like tokenizer.json
    that adds [CLS] and [SEP], as a BERT directory holds."""
    words = sorted({w for t, _ in REVIEWS for w in t.split()})
    torch.manual_seed(0)
    attnlab.save_pretrained(ToyEncoder(ToyEncoderConfig(vocab_size=4 + len(words))), path)
    word_tokenizer_json(path, words)
    return path


def word_tokenizer_json(path, words) -> None:
    """A Hugging Face tokenizer.json: [PAD] [UNK] [CLS] [SEP] then ``words``, adding [CLS] ... [SEP]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + list(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(path / "tokenizer.json"))


def pretrained_dir(path, model_type: str, architecture: str):
    """A Hugging Face directory of a registered family's architecture (its "tiny" preset, random
    weights of order 0.2), with a word tokenizer.json; for a masked LM, a checkpoint whose base
    sits under a prefix beside a head that fine-tuning and embedding must leave out."""
    import contract
    from attnlab.models.registry import family
    fam = family(model_type)
    torch.manual_seed(0)
    model = fam.architecture(architecture).build(fam.preset("tiny"))
    contract.randomize_(model)
    attnlab.save_pretrained(model, path)
    word_tokenizer_json(path, sorted({w for t, _ in REVIEWS for w in t.split()}))
    return path
