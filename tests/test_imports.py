"""The import graph of qkv (docs/ARCHITECTURE.md, "Layers"): no module imports, directly or through others, a
module that imports it back, and imports sit at the top of their module except the few listed below, each
with its reason.

An import counts wherever it stands (module level or inside a function; only `if TYPE_CHECKING:` imports are
left out, as they never run), and importing `qkv.a.b` counts as importing the package `qkv.a` too, because
Python runs `qkv/a/__init__.py` first.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# docs/ARCHITECTURE.md's layers: a module imports its own package and lower layers only (layer 0 among itself)
LAYERS = {"errors": 0, "registry": 0, "hardware": 0, "heap": 0, "config_values": 0, "config_rules": 0, "rope_scaling": 0,
          "config": 0, "plan": 0, "files": 0, "schedules": 0, "presets": 0,
          "nn": 1, "ref": 1, "models": 2, "data": 2, "formats": 3, "analysis": 3, "generate": 4, "parallel": 4,
          "evaluate": 5, "explain": 5, "interp": 2, "serve": 5, "train": 6, "claims": 7, "cli": 8, "hf": 8, "__main__": 9}

# (importing module, imported module) that may stand inside a function ("*" ends a pattern), and why
LOCAL_IMPORTS = {
    ("qkv.cli.*", "qkv.*"): "start-up time: a command imports what it runs when it runs, so `qkv --help` and "
                            "`qkv calc` load no training, serving or model-file code",
    ("qkv.parallel.layout", "qkv.parallel.tensor"): "torch.distributed.tensor takes about a second to import: "
                                                    "only a tensor-parallel run loads it",
    ("qkv.train.steps", "qkv.parallel.tensor"): "the same: only a tensor-parallel pipeline loads it",
}


def listed(importer: str, imported: str) -> tuple[str, str] | None:
    """The LOCAL_IMPORTS rule that allows this function-local import, if any."""
    def matches(pattern: str, name: str) -> bool:
        return name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1]))

    return next((rule for rule in LOCAL_IMPORTS if matches(rule[0], importer) and matches(rule[1], imported)), None)


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    local: bool  # inside a function


def module_names() -> dict[str, Path]:
    names = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def qkv_module(name: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted name lives in (`qkv.nn.kernels.KERNELS` -> `qkv.nn.kernels`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        return [f"{base}.{alias.name}" for alias in node.names]

    def visit(node, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    module = qkv_module(target, modules) if target.startswith("qkv") else None
                    if module and module != name:
                        found.append(Import(name, module, child.lineno, inner))
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return found


def graph() -> tuple[dict[str, set[str]], list[Import]]:
    modules = module_names()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    found = [imp for name, path in modules.items() for imp in imports_of(name, path, modules)]
    for imp in found:
        target = imp.imported
        while target:  # qkv.a.b runs qkv/a/__init__.py first
            if target in modules and target != imp.importer and not imp.importer.startswith(target + "."):
                edges[imp.importer].add(target)
            target = target.rpartition(".")[0]
    return edges, found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def connect(root: str) -> None:
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for name in sorted(edges):
        if name not in index:
            connect(name)
    return found


def test_the_graph_sees_the_package():
    edges, found = graph()
    assert len(edges) > 150 and "qkv.models.build" in edges["qkv.formats.run_dir"]
    assert any(imp.local for imp in found)  # the listed lazy imports are seen


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(graph()[0])
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def package(module: str) -> str:
    return module.split(".")[1]


def test_every_package_has_a_layer_and_imports_only_downwards():
    edges = graph()[0]
    packages = {package(name) for name in edges if name != "qkv"}
    assert packages == set(LAYERS), f"give these a layer: {sorted(packages - set(LAYERS))}"
    upward = sorted(f"{a} imports {b}" for a, targets in edges.items() if a != "qkv" for b in targets
                    if b != "qkv" and package(a) != package(b) and LAYERS[package(b)] >= LAYERS[package(a)]
                    and not LAYERS[package(a)] == LAYERS[package(b)] == 0)
    assert not upward, "imports against the layers of docs/ARCHITECTURE.md:\n" + "\n".join(upward)


# (package, package it never reaches, directly or through others), and why: a layer rule allows these imports
NEVER_REACHES = {
    ("train", "serve"): "training needs a model's chat template (qkv.formats.chat), never the HTTP server",
    ("formats", "generate"): "reading and writing files needs no decoding loop",
}


def reached(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in edges[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_the_packages_that_never_reach_each_other():
    edges = graph()[0]
    found = sorted(f"{name} reaches {target} ({why})" for (low, high), why in NEVER_REACHES.items()
                   for name in edges if name != "qkv" and package(name) == low
                   for target in reached(edges, name) if target != "qkv" and package(target) == high)
    assert not found, "\n".join(found)


def test_reached_follows_imports_through_others():
    assert reached({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}, "a") == {"b", "c"}


def test_function_local_imports_are_the_listed_ones():
    local = [imp for imp in graph()[1] if imp.local]
    unlisted = sorted(f"{imp.importer}:{imp.line} imports {imp.imported}" for imp in local
                      if listed(imp.importer, imp.imported) is None)
    assert not unlisted, "move these imports to the top of their module (or list them with a reason):\n" + \
        "\n".join(unlisted)
    used = {listed(imp.importer, imp.imported) for imp in local}
    assert not set(LOCAL_IMPORTS) - used, "listed but gone: " + str(sorted(set(LOCAL_IMPORTS) - used))


def test_the_rules_match_as_written():
    assert listed("qkv.cli.train", "qkv.train.job") == ("qkv.cli.*", "qkv.*")
    assert listed("qkv.train.steps", "qkv.parallel.tensor") is not None
    assert listed("qkv.train.steps", "qkv.parallel.pipeline") is None and listed("qkv.client", "qkv.x") is None


@pytest.mark.parametrize("module", ["qkv.formats", "qkv.generate", "qkv.evaluate", "qkv.analysis.calc",
                                    "qkv.serve.server", "qkv.explain"])
def test_readers_never_import_training(module):
    """Loading files, generating, evaluating, calculating and serving never need the training loop: no path
    of imports leads from them to qkv.train or qkv.parallel."""
    assert not {name for name in reached(graph()[0], module) if name.startswith(("qkv.train", "qkv.parallel"))}
