"""attnlab.viz: attention recording and plots. Reads models; nothing in the core imports it."""
from .attention import plot_attention, plot_attention_grid
from .labels import PatchGrid, TokenLabels, readable_piece
from .record import AttentionCall, AttentionRecord, record_attention
