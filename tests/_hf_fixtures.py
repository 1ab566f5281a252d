"""A tiny Hugging Face GPT-2 directory (config, safetensors, tokenizer.json) for CLI tests."""
from pathlib import Path

import torch


def tiny_gpt2_dir(path: Path, n_embd: int):
    """Write a 2-layer GPT-2 with a 11-word vocabulary to ``path``; returns (hf model, tokenizer)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<|endoftext|>"] + "the quick brown fox jumps over lazy dog a cat".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()                     # joins words with spaces
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(words), n_positions=16, n_embd=n_embd, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():                                  # O(1) logits: a clear greedy choice at every step
        for p in hf.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(path)
    tok.save(str(Path(path) / "tokenizer.json"))
    return hf, tok
