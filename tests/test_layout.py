"""The repository's shape, as the issue "One house" defines it: no import cycle among the project's modules,
the model files import no project module inside a function, inference_utils.py stays a few helpers, every
script's main() fits on a screen, and the repository has one median."""
import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for p in ROOT.glob("*.py")} | {f"lib.{p.stem}": p for p in (ROOT / "lib").glob("*.py")}


def is_main_guard(node):
    """`if __name__ == "__main__":`: run as a script, a file is the module __main__, not the module that
    others import, so an import there closes no cycle."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def imported(node):
    """The project modules that one import statement names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif node.module == "lib":
        names = [f"lib.{a.name}" for a in node.names]
    else:
        names = [node.module]
    return [n for n in names if n in MODULES]


def module_imports(path):
    """Every project import of a file outside its main guard, each with whether it sits in a function."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if is_main_guard(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((name, in_function) for name in imported(child))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    visit(ast.parse(path.read_text()), False)
    return found


def test_no_import_cycle_among_the_project_modules():
    graph = {name: {m for m, _ in module_imports(path)} for name, path in MODULES.items()}
    done, path = set(), []

    def walk(name):
        if name in path:
            cycle = path[path.index(name):] + [name]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        if name in done:
            return
        path.append(name)
        for other in sorted(graph[name]):
            walk(other)
        path.pop()
        done.add(name)
    for name in sorted(graph):
        walk(name)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("gptlite")))
def test_the_model_files_import_no_project_module_inside_a_function(name):
    inside = [m for m, in_function in module_imports(MODULES[name]) if in_function]
    assert not inside, f"{name} imports {inside} inside a function"


MODEL_FILES = sorted(n for n in MODULES if n.startswith("gptlite"))
MODEL_FILE_MAY_IMPORT = {"lib.errors"}  # the exception classes: a leaf that imports nothing of the project


def outside_imports(path):
    """Every module a file imports outside its main guard, by its full name."""
    names = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if is_main_guard(child):
                continue
            if isinstance(child, ast.Import):
                names.extend(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                names.extend([f"lib.{a.name}" for a in child.names] if child.module == "lib" else [child.module])
            visit(child)
    visit(ast.parse(path.read_text()))
    return names


@pytest.mark.parametrize("name", MODEL_FILES)
def test_the_model_files_import_only_torch_and_the_model_files_below_them(name):
    """The house's rule: a model file imports torch, the standard library, other model files and lib/errors.py;
    what trains, loads, times or serves a model imports it, never the other way."""
    wrong = [m for m in outside_imports(MODULES[name]) if not (
        m.split(".")[0] in sys.stdlib_module_names or m == "torch" or m.startswith("torch.")
        or m in MODEL_FILES or m in MODEL_FILE_MAY_IMPORT)]
    assert not wrong, f"{name} imports {wrong}: move what needs them out of the model file (lib/ or a script)"


def test_the_import_rule_test_sees_an_import_that_breaks_it(tmp_path):
    bad = tmp_path / "gptlite_bad.py"
    bad.write_text("import torch\nimport inference_utils\nfrom lib import files\nif __name__ == '__main__':\n"
                   "    from lib import harness\n")
    assert outside_imports(bad) == ["torch", "inference_utils", "lib.files"]


def test_inference_utils_is_a_few_helpers():
    n_lines = len((ROOT / "inference_utils.py").read_text().splitlines())
    assert n_lines <= 350, f"inference_utils.py has {n_lines} lines"


@pytest.mark.parametrize("path", sorted(ROOT.glob("main_*.py")), ids=lambda p: p.name)
def test_every_main_fits_on_a_screen(path):
    mains = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert len(mains) == 1, f"{path.name} has no main()"
    length = mains[0].end_lineno - mains[0].lineno + 1
    assert length <= 45, f"{path.name}: main() is {length} lines"


def test_one_median_in_the_repository():
    """Timings and figures over repeats all go through inference_utils.median, the one median."""
    other = re.compile(r"statistics\.median|median_low|median_high|np\.median\(|torch\.median\(|"
                       r"sorted\([^)]*\)\[len\([^)]*\) // 2\]")
    sources = [p for p in sorted(ROOT.glob("*.py")) + sorted((ROOT / "lib").glob("*.py")) if p.name != "inference_utils.py"]
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sources for i, line in enumerate(p.read_text().splitlines(), 1)
             if other.search(line)]
    assert not found, f"medians outside inference_utils.median: {found}"
    defined = [f"{p.name}:{n.name}" for p in sources for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.FunctionDef) and n.name == "median"]
    assert not defined, f"another median function: {defined}"


# ----------------------------------------------------------------------------------------------------
# Citations of the post: every "Blog section" names one of the post's section titles, never a guessed one.

SECTIONS = {  # ../shared/post-outline.md's titles (checked against it below where that file is present)
    "Background: how a GPT generates text, and where the time goes", "Prefill and decode",
    "Where the compute goes: MLP versus attention", "Caching", "KV cache", "Prefix caching", "Semantic caching",
    "Choosing a caching strategy", "Batching and scheduling", "Static batching", "Continuous batching",
    "PagedAttention: memory management for the KV cache", "Chunked prefill", "Prefill-decode disaggregation",
    "Scaling out: parallelism and offloading", "Other serving techniques", "Faster attention",
    "Why attention matters", "FlashAttention", "FlashDecoding", "Smaller KV caches: MQA, GQA and MLA",
    "Quantized attention: SageAttention", "Sparse attention", "Linear attention and hybrid models",
    "Sparse plus linear attention: SLA", "Summary of attention methods", "Distillation and pruning",
    "Knowledge distillation", "Implementing offline distillation with soft labels", "Pruning", "What's next"}
OUTLINE = ROOT.parent / "shared" / "post-outline.md"
CITATION = re.compile(r'[Bb]log sections?:? ((?:"[^"]+"(?:,| and| or)? ?)+)')


def outline_titles(text):
    """The outline's section titles: `N. **Title**` and `- Title — listings` / `- Title (summary)`."""
    titles = set(re.findall(r"^\d+\. \*\*(.+?)\*\*", text, re.M))
    for item in re.findall(r"^ {2,}- (.+)$", text, re.M):
        titles.update(t.strip() for t in re.split(r" —| \(", item)[0].split("; "))
    return titles


@pytest.mark.skipif(not OUTLINE.is_file(), reason="the post's outline is not beside this checkout")
def test_the_section_list_is_the_outlines():
    assert SECTIONS <= outline_titles(OUTLINE.read_text())


def cited_sections():
    files = [*ROOT.glob("*.py"), *(ROOT / "lib").glob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    for path in files:
        for match in CITATION.finditer(path.read_text()):
            for title in re.findall(r'"([^"]+)"', match.group(1)):
                yield path.relative_to(ROOT).as_posix(), title
    readme = (ROOT / "README.md").read_text()  # the techniques table's "blog section" column
    for line in readme.split("## Techniques", 1)[1].split("\n\n", 2)[1].splitlines()[2:]:
        for title in line.split(" | ")[2].split("; "):
            if not title.startswith("part 2"):
                yield "README.md", title


def test_every_cited_section_is_one_of_the_posts():
    cited = list(cited_sections())
    assert len(cited) > 40  # the pattern finds the citations
    assert [(path, title) for path, title in cited if title not in SECTIONS] == []


def test_lib_init_names_every_module_in_a_line():
    doc = ast.get_docstring(ast.parse((ROOT / "lib" / "__init__.py").read_text()))
    named = {name for line in doc.splitlines() if line.startswith("- ")
             for name in re.findall(r"\b([a-z_]+)\b", line.split(":")[0])}
    modules = {p.stem for p in (ROOT / "lib").glob("*.py") if p.stem != "__init__"}
    assert modules <= named, f"lib/__init__.py does not name {sorted(modules - named)}"
