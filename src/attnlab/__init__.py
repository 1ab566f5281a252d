"""attnlab: the attention mechanism and the Transformer family, from first principles.

The top-level loaders are imported on first use, so that ``import attnlab.nn`` (or any other
lower layer) loads no model, task or command.
"""
__version__ = "0.1.0"

_LAZY = {"from_pretrained": "attnlab.hub", "save_pretrained": "attnlab.hub", "load_tokenizer": "attnlab.hub",
         "load_processor": "attnlab.hub"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        from . import hub
        return getattr(hub, name)
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
