"""The shape of the repository: no import cycles, short files, links that resolve."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

SRC = ROOT / "src"


def module_names() -> dict[str, Path]:
    modules = {}
    for path in (SRC / "marinlm").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """module -> the marinlm modules it imports, anywhere in it (a function's own import too). The
    implicit import of a package's __init__ on the way to its submodule is not an edge."""
    modules = module_names()

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                ]
            else:
                continue
            graph[module] |= {t for n in names if n.startswith("marinlm") and (t := resolve(n)) and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_there_is_no_import_cycle_in_marinlm():
    graph = import_graph()
    assert len(graph) > 50
    found = cycles(graph)
    detail = [f"{c}: " + "; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert not found, "\n".join(detail)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# The packages of marinlm (a top-level module counts as one), lowest first, as docs/architecture.md
# draws them. A package imports only from layers below its own, at module level or in a function.
LAYERS = [
    {"utils", "presets"},
    {"marinlm"},  # the package's own __init__
    {"config"},
    {"model", "tokenizer"},
    {"kernels", "optim", "parallel"},
    {"data"},
    {"dataset"},
    {"train"},
    {"finetune"},
    {"loading", "plan"},
    {"eval"},
    {"hf", "jobs"},
    {"quickstart", "commands"},
    {"cli"},
    {"__main__"},
]


def package_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def upward_imports(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Each import from one package into another that is not in a lower layer, as
    "importer -> imported", and each package no layer names."""
    level = {package: i for i, layer in enumerate(layers) for package in layer}
    unplaced = {package_of(m) for m in graph} - set(level)
    found = [f"{p}: in no layer" for p in sorted(unplaced)]
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = package_of(module), package_of(target)
            if a != b and a in level and b in level and level[b] >= level[a]:
                found.append(f"{module} -> {target}")
    return found


def test_packages_only_point_down():
    """train -> eval, train -> finetune, finetune -> hf, parallel -> train and utils -> config each
    ran back up through an import inside a function; the module-level cycle test passed them."""
    graph = import_graph()
    assert not upward_imports(graph, LAYERS), "\n".join(upward_imports(graph, LAYERS))


def test_an_upward_import_inside_a_function_is_found(tmp_path, monkeypatch):
    """A planted loop: a function in train/ that imports eval/, as train/run.py did."""
    planted = tmp_path / "src"
    (planted / "marinlm").mkdir(parents=True)
    for path in (SRC / "marinlm").rglob("*.py"):
        target = planted / path.relative_to(SRC)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    step = planted / "marinlm" / "train" / "step.py"
    step.write_text(step.read_text() + "\n\ndef _planted():\n    from marinlm.eval.hook import make_eval_hook\n")
    monkeypatch.setattr(__import__(__name__), "SRC", planted)
    assert upward_imports(import_graph(), LAYERS) == ["marinlm.train.step -> marinlm.eval.hook"]


def test_no_source_file_is_over_500_lines():
    lengths = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in (SRC / "marinlm").rglob("*.py")}
    assert not {p: n for p, n in lengths.items() if n > 500}


# A past measurement in a comment or docstring: a rate, a timing, a date, a named host. Such
# numbers belong in docs/performance.md and commit messages, where they can be dated and replaced.
MEASUREMENT = re.compile(
    r"GFLOP/s|TFLOP/s|seen on|(?<!runs/)\b20\d\d-\d\d-\d\d\b|\d ?(ms|us|µs)\b|\d s/step|2-core|EPYC|Xeon"
    r"|\bH[12]00\b|clean[- ]clone|dev VM|\d(\.\d+)?x (faster|slower)"
)


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and every line of every docstring in a Python file."""
    import io
    import tokenize

    text = path.read_text()
    found = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found += [(node.body[0].lineno + i, line) for i, line in enumerate(doc.splitlines())]
    return found


def test_the_performance_page_holds_current_numbers_only():
    """docs/performance.md was 774 lines, half of it kernel history; each benchmark's latest
    reading stays, the history lives in the commit messages."""
    page = (ROOT / "docs" / "performance.md").read_text()
    assert len(page.splitlines()) <= 250
    assert "history" not in page.lower().replace("the history of each change", "")
    assert "cpu_bf16.py`:" not in page  # headings named files that no longer exist


def test_no_code_comment_records_a_past_measurement():
    """About 60 comments held readings ("seen on an H200", "2-core dev VM ... 112 GFLOP/s", dated
    runs); code comments say why, and the readings live in docs/performance.md."""
    found = [
        f"{path.relative_to(SRC)}:{line}: {text.strip()}"
        for path in sorted((SRC / "marinlm").rglob("*.py"))
        for line, text in comments_and_docstrings(path)
        if MEASUREMENT.search(text)
    ]
    assert not found, "\n".join(found)
    assert MEASUREMENT.search("# on the 2-core EPYC: 0.06 against 0.37 ms (2026-12-03)")


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve()
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and resolved.suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#+\s+(.*)$", resolved.read_text(), re.M)}
                if anchor not in headings:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_is_short_and_opens_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120, len(lines)
    head = "\n".join(lines[:25])
    assert "make quickstart" in head and "make test" in head
