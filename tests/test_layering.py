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

# DESIGN's layers, bottom first; a module may import its own layer or lower ones. generate and
# train sit below the models and know none (a model may use generate's loop: CausalLM.generate).
LAYERS = [
    {"attnlab.nn", "attnlab.data", "attnlab.tokenizer", "attnlab.processors",    # processors: tokenizers, images
     "attnlab.chat_template"},
    {"attnlab.generate", "attnlab.train"},
    {"attnlab.models", "attnlab.hub", "attnlab", "attnlab.gguf",   # the package's lazy top-level loaders are hub's
     "attnlab.adapters"},                                         # LoRA adapters on any family
    {"attnlab.viz", "attnlab.quantize", "attnlab.compress"},
    {"attnlab.tasks", "attnlab.recipes"},  # recipes: named YAML settings the commands read
    {"attnlab.serve"},                     # the OpenAI-compatible server over a loaded LM
    {"attnlab.cli", "attnlab.__main__"},   # python -m attnlab: the command
]

# Upward edges the design accepts; each is asserted to still exist, so that an entry goes as soon
# as its edge does. None today.
KNOWN_UPWARD_EDGES: set[tuple[str, str]] = set()


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


# ----------------------------------------------------------------------------- no family above models
# The shared rooms (tasks, viz, generate, train, cli) name no model family in code: a family's
# knowledge lives in its model file and its registration. Prose may name one (docstrings, comments,
# help text and messages: "attnlab train image --model deit"), so the check reads the code's tokens:
# an identifier that is a family's name, a string that is exactly one ("vit"), an import of a
# family's module (one that registers one of them). A task's own name is its, not a family's:
# `attnlab train mae` pre-trains whatever family has a masked-image-model architecture.
import io  # noqa: E402
import re  # noqa: E402
import tokenize  # noqa: E402

FAMILY_WORDS = {"vit", "deit", "swin", "mae", "vit_mae", "mamba", "mamba2", "mamba3", "rwkv", "rwkv7", "bert", "t5",
                "gpt2", "llama", "mixtral", "clip", "llava", "whisper"}
SHARED_ROOMS = ("tasks", "viz", "generate", "train", "cli")


def _family_modules() -> set[str]:
    models = SRC / "attnlab" / "models"
    found = set()
    for f in (f for f in models.glob("*.py") if f.stem != "registry"):    # its docstring shows a call
        registered = re.findall(r"register_family\(\s*[\"']([\w-]+)[\"']", f.read_text(encoding="utf-8"))
        if FAMILY_WORDS & set(registered):
            found.add(f"attnlab.models.{f.stem}")
    return found


def _task_names() -> set[str]:
    from attnlab.tasks import registered_tasks
    return set(registered_tasks())


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def family_names_in_code(module: str, file: Path, family_modules: set[str], modules,
                         allowed: frozenset = frozenset()) -> list[str]:
    """Where ``file``'s code (not its prose) names a model family: "line N: what" (``allowed``: the
    words that are also a task's name)."""
    words = FAMILY_WORDS - allowed
    source = file.read_text(encoding="utf-8")
    tree = ast.parse(source, str(file))
    found = [f"imports {t}" for t in sorted(_imports(module, file, modules) & family_modules)]
    imports = {n for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
               for n in range(node.lineno, node.end_lineno + 1)}
    prose = _docstring_lines(tree)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        line = tok.start[0]
        if tok.type == tokenize.NAME and tok.string.lower() in words and line not in imports:
            found.append(f"line {line}: identifier {tok.string}")
        elif tok.type == tokenize.STRING and line not in prose:
            text = re.sub(r"^[a-zA-Z]*['\"]+|['\"]+$", "", tok.string)
            if text.lower() in words:
                found.append(f"line {line}: string {tok.string}")
    return found


def test_the_scanner_finds_family_names_in_code_and_not_in_prose(tmp_path):
    file = tmp_path / "m.py"
    file.write_text('"""attnlab train image --model deit"""\n# swin too\n'
                    'def f(s):\n    """--model vit."""\n    if s == "vit":\n        return swin\n'
                    '    raise ValueError("a Swin has no class token")\n')
    found = family_names_in_code("attnlab.tasks.m", file, set(), {})
    assert found == ["line 5: string \"vit\"", "line 6: identifier swin"]


def test_the_shared_rooms_name_no_family_in_code():
    modules, family_modules = _modules(), _family_modules()
    assert {"attnlab.models.vit", "attnlab.models.mamba2", "attnlab.models.deit"} <= family_modules
    allowed = frozenset(_task_names())
    assert "mae" in allowed
    found = [f"{module}: {what}" for module, file in modules.items()
             if module.split(".")[1:2] and module.split(".")[1] in SHARED_ROOMS
             for what in family_names_in_code(module, file, family_modules, modules, allowed)]
    assert not found, "family names in the shared rooms' code:\n" + "\n".join(found)


def test_docs_extending_states_the_layers_and_shared_rooms_as_checked_here():
    """docs/extending.md's layering table lists LAYERS, bottom first, row by row, and its paragraph
    on family names lists SHARED_ROOMS: the page states the layering as the code has it."""
    text = (SRC.parent / "docs" / "extending.md").read_text(encoding="utf-8")
    section = text[text.index("## The layering"):]
    section = section[:section.index("\n## ", 3)]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    stated = [{"attnlab" if m == "attnlab" else f"attnlab.{m}" for m in re.findall(r"`(\w+)`", row)} for row in rows]
    assert stated == LAYERS
    rooms = re.search(r"The shared rooms \(([^)]*)\)", section.replace("\n", " ")).group(1)
    assert tuple(re.findall(r"`(\w+)`", rooms)) == SHARED_ROOMS
