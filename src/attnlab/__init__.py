"""attnlab: the attention mechanism and the Transformer family, from first principles."""
__version__ = "0.1.0"
from .hub import from_pretrained, load_tokenizer, save_pretrained
