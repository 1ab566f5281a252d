"""Tests and benchmarks lean on transformers' public API only (issue 30).

A name imported from a ``transformers.*`` submodule, or reached as an attribute of the
``transformers`` package, must be one that transformers exports at its top level
(``transformers.__all__``, less its submodules): the private modules (``transformers.models.*``,
the ``modeling_<x>`` files) move between versions, and transformers 5.25 removed a class that
test_mamba2 imported. A parity test that needs a private piece reads it through a public class
(``LlamaModel(cfg).rotary_emb``) or re-expresses it from the paper's equations.

The scan is syntactic (``ast``): ``import transformers.x``, ``from transformers.x import y``,
``from transformers import y``, attribute chains on a name bound to the package (``import
transformers as t``, ``t = pytest.importorskip("transformers")``) and module names handed to
``importorskip`` / ``import_module`` / ``__import__``. A failure names file, line and the name.
"""
import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("tests", "benchmarks")
IMPORTERS = {"importorskip", "import_module", "__import__"}

# Public utilities that live only in a submodule: each is documented by transformers for users.
ALLOWED = (
    # the registry of RoPE initialisers, the documented way to add or inspect a RoPE type (also
    # exported at the top level from 5.x; the 4.x range pyproject.toml admits has it only here)
    "transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS",
    # the logging controls of the "Logging" page of transformers' documentation
    "transformers.utils.logging",
)


def public_names(package=transformers) -> set[str]:
    """What ``from transformers import X`` offers, less the submodules (``models``, ``utils``...)."""
    submodules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    return {n for n in package.__all__ if "." not in n and n not in submodules}


def _allowed(dotted: str) -> bool:
    return any(dotted == a or dotted.startswith(a + ".") for a in ALLOWED)


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _module_argument(node: ast.AST) -> str | None:
    """The module name of ``pytest.importorskip("m")``, ``importlib.import_module("m")`` or
    ``__import__("m")`` (a constant first argument), else None."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return node.args[0].value if name in IMPORTERS else None


def _package_aliases(tree: ast.AST) -> set[str]:
    """The local names bound to the transformers package itself."""
    aliases = {"transformers"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "transformers" and a.asname}
        elif isinstance(node, ast.Assign) and _module_argument(node.value) == "transformers":
            aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return aliases


def private_uses(source: str, public: set[str]) -> list[tuple[int, str]]:
    """(line, dotted name) of every use of a transformers name that is not public, in line order."""
    tree = ast.parse(source)
    aliases = _package_aliases(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, a.name) for a in node.names
                      if a.name.startswith("transformers.") and not _allowed(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == "transformers" or node.module.startswith("transformers.")):
            found |= {(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if a.name not in public and not _allowed(f"{node.module}.{a.name}")}
        elif (module := _module_argument(node)) and module.startswith("transformers.") and not _allowed(module):
            found.add((node.lineno, module))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in aliases and node.attr not in public:
            top = node                                   # the whole chain: transformers.utils.logging.x
            while isinstance(parents.get(top), ast.Attribute):
                top = parents[top]
            dotted = "transformers" + _dotted(top)[len(node.value.id):]
            if not _allowed(dotted):
                found.add((node.lineno, dotted))
    return sorted(found)


# ----------------------------------------------------------------------------- the checker can fail

BAD = '''\
import transformers.models.llama.modeling_llama
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, _compute_default_rope_parameters
from transformers import models, LlamaModel
import transformers as hf
t = pytest.importorskip("transformers")
emb = t.models.vit.modeling_vit.ViTEmbeddings(config)
block = hf.models.deit
mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
transformers.utils.import_utils.is_torch_available()
'''

GOOD = '''\
import transformers
from transformers import LlamaConfig, LlamaModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.generation import GenerationConfig        # exported at top level too
t = pytest.importorskip("transformers")
norm = t.LlamaModel(LlamaConfig()).norm
transformers.utils.logging.disable_progress_bar()
transformers.logging.set_verbosity_error()
import transformers.utils.logging
other.models.llama                                          # not the transformers package
'''


def test_the_check_names_each_private_use_with_its_line():
    public = public_names()
    assert {"LlamaModel", "LlamaConfig", "GenerationConfig", "logging"} <= public
    assert not {"models", "utils", "LlamaMLP", "ViTEmbeddings", "build_alibi_tensor"} & public
    assert private_uses(BAD, public) == [
        (1, "transformers.models.llama.modeling_llama"),
        (2, "transformers.models.llama.modeling_llama.LlamaMLP"),
        (3, "transformers.modeling_rope_utils._compute_default_rope_parameters"),
        (4, "transformers.models"),
        (7, "transformers.models.vit.modeling_vit.ViTEmbeddings"),
        (8, "transformers.models.deit"),
        (9, "transformers.models.mixtral.modeling_mixtral"),
        (10, "transformers.utils.import_utils.is_torch_available"),
    ]
    assert private_uses(GOOD, public) == []


def test_every_allowed_name_exists():
    """The allow-list names what the pinned transformers has: a stale entry fails here."""
    for dotted in ALLOWED:
        module, _, name = dotted.rpartition(".")
        try:
            importlib.import_module(dotted)
        except ImportError:
            assert hasattr(importlib.import_module(module), name), f"{dotted} is gone from transformers"


# ----------------------------------------------------------------------------- the tree

def test_tests_and_benchmarks_use_only_public_transformers_names():
    public = public_names()
    bad = [f"{path.relative_to(ROOT)}:{line}: {name}"
           for folder in SCANNED for path in sorted((ROOT / folder).rglob("*.py"))
           for line, name in private_uses(path.read_text(encoding="utf-8"), public)]
    assert not bad, ("not exported by transformers at top level (read it through a public class or "
                     "re-express it from the paper; see tests/test_public_api.py):\n" + "\n".join(bad))
