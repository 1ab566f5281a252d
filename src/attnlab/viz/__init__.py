"""attnlab.viz: attention recording, views, PNG plots and the HTML explorer. Reads models; nothing
in the core imports it."""
from .attention import plot_attention, plot_attention_grid
from .explorer import write_page
from .figures import write_figures
from .labels import PatchGrid, TokenLabels, readable_piece
from .record import AttentionCall, AttentionRecord, record_attention
from .views import View, record_views, text_views
