"""attnlab.models: one file per architecture, assembled from attnlab.nn."""
from .transformer import Transformer, TransformerConfig
from .causal_lm import CausalLM
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .mixtral import Mixtral, MixtralConfig
