"""The lessons' exercises and code excerpts: every exercise on a lesson page has a solution in a
collapsed block whose ```python code asserts its answer, and each solution runs on its own (in a
fresh namespace: a reader may open any one); every excerpt of attnlab's source shown on a page
(a ```py block under `<!-- source: PATH -->`) is in that file verbatim, so the page cannot drift
from the code it teaches."""
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# the lesson pages: each opens with the intuition and ends with exercises
LESSONS = ["attention.md", "masks.md", "multi-head-attention.md", "feed-forward.md", "positions.md", "norms.md",
           "encoder-decoder.md", "causal-lm.md", "bert.md", "t5.md", "classification.md", "trainer.md", "vision.md",
           "state-space.md", "long-context.md", "explorer.md", "summary.md", "llms.md", "compression.md",
           "multimodal.md"]
EXERCISE = re.compile(r"^### Exercise (\d+)[^\n]*\n(.*?)(?=^### |^## |^\[\^|\Z)", re.MULTILINE | re.DOTALL)
SOLUTION = re.compile(r'<details markdown="1">\s*<summary>Solution</summary>(.*?)</details>', re.DOTALL)
PYTHON = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
EXCERPT = re.compile(r"^<!-- source: (\S+) -->\n```py\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def _exercises(page: str) -> list[tuple[str, str]]:
    return EXERCISE.findall((DOCS / page).read_text(encoding="utf-8"))


def _solutions():
    for page in LESSONS:
        for number, body in _exercises(page):
            yield pytest.param(page, number, body, id=f"{page}-{number}")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("page", LESSONS)
def test_lesson_has_two_to_five_exercises(page):
    """Two or three per page, and up to five on a page that teaches several of the chapter's
    sections (positions: 4.2-4.6 and 8.2; vision: 5.1-5.6; decoder-only models: 6.2-6.6)."""
    numbers = [int(n) for n, _ in _exercises(page)]
    assert 2 <= len(numbers) <= 5 and numbers == list(range(1, len(numbers) + 1)), f"{page}: exercises {numbers}"


@pytest.mark.parametrize("page, number, body", list(_solutions()))
def test_solution_asserts_its_answer_and_runs_alone(page, number, body):
    solution = SOLUTION.search(body)
    assert solution, f"{page} exercise {number} has no collapsed solution"
    blocks = PYTHON.findall(solution.group(1))
    assert blocks and any("assert" in b for b in blocks), f"{page} exercise {number}: the solution checks nothing"
    namespace = {"__name__": f"exercise.{page}.{number}"}
    for block in blocks:
        exec(compile(block, f"docs/{page} exercise {number}", "exec"), namespace)


def test_source_excerpts_are_verbatim():
    found = 0
    for page in sorted(DOCS.glob("*.md")):
        for path, excerpt in EXCERPT.findall(page.read_text(encoding="utf-8")):
            found += 1
            source = (ROOT / path).read_text(encoding="utf-8")
            assert excerpt in source, f"{page.name}: the excerpt of {path} is not in it (any more)"
    assert found >= len(LESSONS) - 1


# the chapter's sections (seed 000's headings) and the article's (A1-A7)
CHAPTER_SECTIONS = ([f"1.{i}" for i in range(1, 5)] + [f"2.{i}" for i in range(1, 5)] + [f"3.{i}" for i in range(1, 6)]
                    + [f"4.{i}" for i in range(1, 7)] + [f"5.{i}" for i in range(1, 7)] + [f"6.{i}" for i in range(1, 7)]
                    + ["7.1", "7.2"] + [f"8.{i}" for i in range(1, 5)] + ["9"] + [f"A{i}" for i in range(1, 8)])
EXERCISE_PAGES = {"attention": "attention.md", "masks": "masks.md", "multi-head": "multi-head-attention.md",
                  "feed-forward": "feed-forward.md", "positions": "positions.md", "norms": "norms.md",
                  "encoder-decoder": "encoder-decoder.md", "causal-lm": "causal-lm.md", "bert": "bert.md", "t5": "t5.md", "classification": "classification.md",
                  "trainer": "trainer.md", "vision": "vision.md", "state-space": "state-space.md",
                  "explorer": "explorer.md", "summary": "summary.md", "llms": "llms.md",
                  "long-context": "long-context.md", "compression": "compression.md"}


def test_coverage_table_is_complete_and_true():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    table = index.split("## Coverage of the chapter", 1)[1].split("\n## ", 1)[0]
    rows = [r.split("|")[1:-1] for r in table.splitlines() if r.startswith("| ") and not r.startswith("| section")]
    rows = [[c.strip() for c in r] for r in rows if not set(r[0].strip()) <= {"-", " "}]
    assert [r[0].split()[0] for r in rows] == CHAPTER_SECTIONS
    figures = {p.name for p in (DOCS / "figures").glob("*.png")}
    for section, pages, _code, figure, exercises in rows:
        for name in re.findall(r"`([\w.-]+\.png)`", figure):
            assert name in figures, f"{section}: no figure {name}"
        for ref in filter(None, (e.strip() for e in exercises.split(","))):
            words = ref.split()
            if len(words) == 2:
                page, number = words
            else:
                number = words[0]                      # "masks 2, 3": the page carries over
            listed = {n for n, _ in _exercises(EXERCISE_PAGES[page])}
            assert number in listed, f"{section}: {page}.md has no exercise {number}"
        for link in re.findall(r"\]\(([\w-]+\.md)", pages):
            assert (DOCS / link).is_file(), f"{section}: {link} does not exist"


def test_every_test_a_page_cites_exists():
    """The proofs in the pages' footnotes name tests as `tests/FILE.py::NAME`: each must be defined
    there, so a renamed or removed test cannot leave a page citing nothing."""
    cited = 0
    for page in sorted(DOCS.glob("*.md")):
        for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)", page.read_text(encoding="utf-8")):
            cited += 1
            source = ROOT / path
            assert source.is_file(), f"{page.name} cites {path}, which does not exist"
            assert re.search(rf"^(async )?def {name}\(", source.read_text(encoding="utf-8"), re.MULTILINE), (
                f"{page.name} cites {path}::{name}, which is not defined there")
    assert cited > 20


def _row_pages(pages_cell: str) -> list[str]:
    return [link for link in re.findall(r"\]\(([\w-]+\.md)", pages_cell)] + (
        ["index.md"] if "](#" in pages_cell else [])


def _named_code(code_cell: str) -> list[str]:
    """The names a coverage row's code cell gives in backticks: `MultiHeadAttention(num_kv_heads=)`
    names MultiHeadAttention and num_kv_heads; `ViTModel.encode` names ViTModel and encode."""
    names = []
    for span in re.findall(r"`([^`]+)`", code_cell):
        names += [w for w in re.findall(r"[A-Za-z_][\w]*", span) if len(w) > 2]
    return names


def test_coverage_rows_name_code_that_runs_on_their_pages():
    """Every row of the coverage table has code, a figure and an exercise (45 of 45), and every
    name its code cell gives in backticks appears in a ```python block of one of the row's pages
    (code that tests/test_docs.py runs there), or in an excerpt of attnlab's source that page
    shows and runs: not only a file that exists. Fails, for example, on a name only prose mentions."""
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    table = index.split("## Coverage of the chapter", 1)[1].split("\n## ", 1)[0]
    rows = [r.split("|")[1:-1] for r in table.splitlines() if r.startswith("| ") and not r.startswith("| section")]
    rows = [[c.strip() for c in r] for r in rows if not set(r[0].strip()) <= {"-", " "}]
    assert len(rows) == 45
    missing = [f"{r[0]}: no {what}" for r in rows for what, cell in (("code", r[2]), ("figure", r[3]), ("exercise", r[4]))
               if not cell]
    unrun = []
    for section, pages, code, _figure, _exercises in rows:
        # the page's python blocks, and the excerpts of attnlab's source it shows (verbatim, by
        # test_source_excerpts_are_verbatim), which those blocks call
        texts = [(DOCS / page).read_text(encoding="utf-8") for page in _row_pages(pages)]
        run = "\n".join(b for t in texts for b in PYTHON.findall(t) + [e for _, e in EXCERPT.findall(t)])
        for name in _named_code(code):
            if not re.search(rf"\b{re.escape(name)}\b", run):
                unrun.append(f"{section}: `{name}` is not in a python block of {', '.join(_row_pages(pages))}")
    assert not missing + unrun, "\n".join(missing + unrun)
