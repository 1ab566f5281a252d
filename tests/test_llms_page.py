"""docs/llms.md (section 6.3): its table of what each family changes is scripts/llm_table.py's output,
read off models built from the registry's presets, and it names every decoder family of the table."""
from pathlib import Path

from _scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


def _table_script():
    return load_script("scripts/llm_table.py", "attnlab_llm_table")


def test_the_page_holds_the_table_the_registry_gives():
    table = _table_script().table()
    page = (ROOT / "docs" / "llms.md").read_text(encoding="utf-8")
    assert table in page, "docs/llms.md's table is not scripts/llm_table.py's output: paste the script's output"


def test_the_table_reads_the_features_off_the_models():
    """Spot checks against what each family's file builds (a wrong reading would show here)."""
    rows = {r[0].strip("`"): r for r in map(_table_script().features, ["llama", "qwen2", "gemma2", "deepseek_v3"])}
    assert rows["llama"][1:] == ["-", "-", "-", "-", "-", "w", "-", "-", "-", "-"]
    assert rows["qwen2"][1] == "yes" and rows["gemma2"][5] == "yes" and rows["gemma2"][6] == "1 + w"
    assert rows["deepseek_v3"][-1] == "yes" and rows["deepseek_v3"][-2] != "-"
