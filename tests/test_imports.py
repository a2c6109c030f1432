"""llmtrain's import graph has no cycle, and every module imports on its own in a fresh interpreter.

The graph comes from the source with ``ast``: every ``import`` and ``from ... import`` statement, at
module level and inside functions (a function-level import is still an edge: it runs as soon as the
function does). ``if TYPE_CHECKING:`` blocks are left out, as they never run. Importing ``a.b.c``
runs ``a/__init__`` and ``a/b/__init__`` first, so an import of it is an edge to those packages too,
except to the packages that hold the importing module (they are already imported when it runs).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmtrain"


def module_names() -> dict[str, Path]:
    """Every module of llmtrain by dotted name (packages by their ``__init__``)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import statement that can run: all of them except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = node.orelse
        stack.extend(children)


def import_edges(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(module, line) for each llmtrain module that importing ``name`` (at ``path``) may import directly, and the
    line of the statement that does."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from a import b` imports the module a.b when there is one, else a's attribute b.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            parts = target.split(".")
            # Importing a.b.c imports a and a.b first, except the packages that hold this module: they
            # are imported (or being imported) already when its code runs.
            for prefix in (".".join(parts[:i]) for i in range(1, len(parts))):
                if prefix in known and prefix not in ancestors and prefix != name:
                    yield prefix, node.lineno
            if target in known and target != name:
                yield target, node.lineno


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The llmtrain modules that importing ``name`` (at ``path``) may import directly."""
    return {target for target, _ in import_edges(name, path, known)}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, sorted(component)) for component in components]


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest import path from the component's first module back to itself."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(graph[node] & members):
            if target == start:
                return paths[node] + [start]
            if target not in paths:
                paths[target] = paths[node] + [target]
                queue.append(target)
    return component


def test_the_cycle_finder_finds_a_cycle_and_resolves_relative_imports(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    known = {"llmtrain", "llmtrain.x", "llmtrain.x.y", "llmtrain.z"}
    module = tmp_path / "y.py"
    module.write_text("from . import z\nfrom ..z import thing\ndef f():\n    import llmtrain.x\n"
                      "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import llmtrain.nope\n")
    assert imported_modules("llmtrain.x.y", module, known) == {"llmtrain.x", "llmtrain.z"}


def test_llmtrain_has_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


# Run in a fresh interpreter: third-party packages are imported once, then each llmtrain module is imported
# in a forked child that has no llmtrain module yet (a fresh interpreter per module would take minutes).
_IMPORT_EACH = """
import os, sys, traceback
# third-party only, shared by the children, so each starts in milliseconds: torch's distributed, compiler and
# checkpoint packages, the CLI's parser, the weights' and tokenizer's libraries (one child importing them took 2 s,
# the whole test 74 s of the suite; 12 s with them here)
import numpy, torch, yaml
import torch.distributed, torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.pipelining
import torch.distributed.tensor, torch._dynamo, torch.utils.checkpoint
import jsonargparse, safetensors.torch, tokenizers
assert not any(name == "llmtrain" or name.startswith("llmtrain.") for name in sys.modules)
failed = []
for name in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__(name)
            os._exit(0)
        except BaseException:
            os.write(write, traceback.format_exc().strip().splitlines()[-1].encode())
            os._exit(1)
    os.close(write)
    with os.fdopen(read) as message:
        reason = message.read()
    if os.waitpid(pid, 0)[1]:
        failed.append(f"{name}: {reason}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_on_its_own():
    """Each module with no other llmtrain module imported first, so none works only by the import order."""
    names = [name for name in module_names() if name != "llmtrain.__main__"]  # __main__ runs the CLI
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, f"modules that fail to import on their own:\n{done.stdout}{done.stderr}"
