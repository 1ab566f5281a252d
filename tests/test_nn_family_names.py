"""attnlab.nn holds the building blocks; what a family changes is plugged in from its model file
(QK-norm, soft-capping, windows, norms, RoPE types), never switched on the family's name. This
fails if a name of the decoder families built on those blocks appears in src/attnlab/nn/."""
import re
from pathlib import Path

import attnlab.nn

NN = Path(attnlab.nn.__file__).parent
# the families whose differences live in nn/'s named places (the older ones predate the rule: T5's
# bias and the Mamba scans are named for the papers that define them)
FAMILIES = r"qwen|mistral|gemma|phi-?[34]|olmo|smollm|deepseek|llama[ -]?4"


def test_no_family_name_in_nn():
    pattern = re.compile(FAMILIES, re.IGNORECASE)
    hits = [f"{path.name}:{n}: {line.strip()}" for path in sorted(NN.glob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "family names in attnlab/nn (plug the difference in from the model file):\n" + "\n".join(hits)


def test_the_check_can_fail(tmp_path):
    assert re.search(FAMILIES, "softcap as Gemma 2 does", re.IGNORECASE)
    assert re.search(FAMILIES, "Llama 4's chunks", re.IGNORECASE)
    assert not re.search(FAMILIES, 'ROPE_TYPES = ("llama3", "yarn")', re.IGNORECASE), \
        "llama3 names a RoPE type (the string configs carry), not a family switch"
