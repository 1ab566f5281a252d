"""attnlab.nn: the building blocks, each usable and testable alone."""
from .attention import (MultiHeadAttention, causal_mask, combine_masks, generate_square_subsequent_mask,
                        padding_mask, scaled_dot_product_attention)
from .cache import KVCache, LayerCaches
from .position import AttentionPosition
