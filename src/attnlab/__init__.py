"""attnlab: the attention mechanism and the Transformer family, from first principles."""
__version__ = "0.1.0"
