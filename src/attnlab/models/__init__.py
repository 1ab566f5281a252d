"""attnlab.models: one file per architecture, assembled from attnlab.nn."""
from .transformer import Transformer, TransformerConfig
