"""attnlab.nn: the building blocks, each usable and testable alone."""
from .attention import (MultiHeadAttention, causal_mask, combine_masks, generate_square_subsequent_mask,
                        padding_mask, scaled_dot_product_attention)
from .cache import KVCache, LayerCaches
from .position import AttentionPosition
from .norm import DyT, JointHeadsRMSNorm, LayerNorm, RMSNorm, make_norm
from .mlp import FeedForward, GatedMLP, SparseMoE, expert_counts, load_balancing_loss, make_activation
from .position import (ALiBi, LearnedPositionalEmbedding, PositionalEncoding, RotaryEmbedding, T5RelativePositionBias,
                       alibi_slopes, relative_position_bucket, sinusoidal_table)
from .block import CausalLayer, DecoderLayer, EncoderLayer
from .linear import InferenceLinear, optimize_for_inference, prepare_for_inference, set_inference_dtype
from .pooling import POOLINGS, Pooling, attention_pool, cls_pool, mean_pool
from .packing import Packing
from . import inplace
