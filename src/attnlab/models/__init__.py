"""attnlab.models: one file per architecture, assembled from attnlab.nn.

Every module of this package is imported here, so that each model file registers its families
and architectures (:mod:`attnlab.models.registry`) by being imported: a new model file needs no
line anywhere else. Registry lookups are only reachable through this package, so they always
see every model.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from .transformer import Transformer, TransformerConfig
from .causal_lm import CausalLM
from .gpt import GPT, GPTConfig, GPTModel
from .llama import Llama, LlamaConfig
from .mixtral import Mixtral, MixtralConfig
from .registry import architecture_of, families, family

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
