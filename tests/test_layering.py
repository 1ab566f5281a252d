"""The package's import graph: no cycle, layers import only downwards, and importing a lower
layer alone loads nothing above it.

The graph comes from the source, not from what one run happens to import: every import
statement of every module under src/attnlab, including those inside functions (a lazy import is
still a dependency, and a cycle through one breaks as soon as the call order changes).
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# DESIGN's layers, bottom first; a module may import its own layer or lower ones
LAYERS = [
    {"attnlab.nn", "attnlab.data", "attnlab.tokenizer", "attnlab.processors"},   # processors: tokenizers, images
    {"attnlab.models"},
    {"attnlab.hub", "attnlab", "attnlab.adapters"},   # the lazy top-level loaders are hub's; LoRA adapters
    {"attnlab.train"},
    {"attnlab.generate"},
    {"attnlab.viz", "attnlab.quantize"},
    {"attnlab.tasks", "attnlab.recipes"},  # recipes: named YAML settings the commands read
    {"attnlab.serve"},                     # the OpenAI-compatible server over a loaded LM
    {"attnlab.cli", "attnlab.__main__"},   # python -m attnlab: the command
]

# Upward edges the design accepts; each is asserted to still exist, so that an entry goes as soon
# as its edge does.
KNOWN_UPWARD_EDGES = {
    # CausalLM.generate calls attnlab.generate (DESIGN promises both model.generate and decoding
    # outside the model)
    ("attnlab.models.causal_lm", "attnlab.generate"),
}


def _modules() -> dict[str, Path]:
    found = {}
    for file in sorted((SRC / "attnlab").rglob("*.py")):
        parts = list(file.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = file
    return found


def _owner(name: str, modules) -> str | None:
    """The module that ``name`` (a module or an attribute of one) belongs to."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, file: Path, modules) -> set[str]:
    """The attnlab modules ``module`` imports, from every import statement in its source."""
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from pkg import name": the submodule pkg.name when there is one, else pkg itself
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    owners = {_owner(t, modules) for t in targets if t == "attnlab" or t.startswith("attnlab.")}
    return {o for o in owners if o is not None and o != module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, f, modules) for m, f in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}                    # 1: on the current path, 2: finished
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def _layer(module: str) -> int:
    ranks = [i for i, layer in enumerate(LAYERS) for top in layer
             if module == top or (top != "attnlab" and module.startswith(top + "."))]
    assert ranks, f"{module} is in no layer of tests/test_layering.py's LAYERS: place it there"
    return max(ranks)


def test_the_scanner_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "attnlab.hub" in graph["attnlab"], "attnlab/__init__.py imports hub inside __getattr__"
    assert "attnlab.models.registry" in graph["attnlab.models.gpt"]
    assert "attnlab.models.pretrained" in graph["attnlab.models.causal_lm"], "the import inside save_pretrained"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_point_down_the_layers():
    graph = import_graph()
    upward = {(a, b) for a, targets in graph.items() for b in targets if _layer(b) > _layer(a)}
    stale = KNOWN_UPWARD_EDGES - upward
    assert not stale, f"gone, remove from KNOWN_UPWARD_EDGES: {sorted(stale)}"
    new = sorted(upward - KNOWN_UPWARD_EDGES)
    assert not new, "imports pointing up the layers: " + "; ".join(f"{a} -> {b}" for a, b in new)


ABOVE = ("attnlab.models", "attnlab.tasks", "attnlab.train", "attnlab.generate", "attnlab.hub", "attnlab.cli")


@pytest.mark.parametrize("lower", ["attnlab.nn", "attnlab.data"])
def test_importing_a_lower_layer_loads_nothing_above(lower):
    code = (f"import sys, {lower}\n"
            f"print('\\n'.join(m for m in sys.modules if m.startswith({ABOVE!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [], f"import {lower} also loaded: {', '.join(out)}"
