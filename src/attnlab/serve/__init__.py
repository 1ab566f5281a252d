"""``attnlab serve``: an OpenAI-compatible HTTP server over a causal LM (docs/serving.md).

:mod:`attnlab.serve.engine` batches the requests through one decoding loop (no web dependency);
:mod:`attnlab.serve.app` is the FastAPI application in front of it (``pip install attnlab[serve]``).
"""
from .engine import Delta, Engine, Failed, Finished, Handle, QueueFull, Request

__all__ = ["Engine", "Request", "Handle", "Delta", "Finished", "Failed", "QueueFull"]
