"""attnlab.viz: attention plots. Reads models; nothing in the core imports it."""
from .attention import plot_attention, plot_attention_grid
