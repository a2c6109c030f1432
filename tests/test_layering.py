"""No upward imports: each unit of llmtrain imports only units of lower layers in ARCHITECTURE.md's "Layers" block.

A unit is a subpackage (``llmtrain.checkpoint`` and every module under it) or a top-level module
(``llmtrain.model``); ``__init__`` is ``llmtrain/__init__.py``. The import graph is test_imports.py's: every
import statement that can run, function-level ones included, each named here by its file and line.
"""

from __future__ import annotations

import re
from typing import Iterable

from test_imports import ROOT, import_edges, module_names

ARCHITECTURE = ROOT / "ARCHITECTURE.md"

Edge = tuple[str, str, int, str]
"""(importing module, its file relative to the repository, line, imported module)."""


def read_layers(text: str) -> list[list[str]]:
    """The units of each layer: a line of the first fenced block under the "## Layers" heading, bottom line first
    (a ``#`` starts a comment)."""
    section = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, f"{ARCHITECTURE.name} has no '## Layers' section"
    block = re.search(r"^```[^\n]*\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, f"the Layers section of {ARCHITECTURE.name} has no fenced block"
    layers = [line.split("#", 1)[0].split() for line in block.group(1).splitlines()]
    return [units for units in layers if units]


def unit_of(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def unit_problems(layers: list[list[str]], units: Iterable[str]) -> list[str]:
    """Units of the code that the block leaves out, and names in the block twice or of no unit."""
    listed = [unit for layer in layers for unit in layer]
    problems = [f"{unit} is in no layer" for unit in sorted(set(units) - set(listed))]
    problems += [f"{unit} is listed {listed.count(unit)} times" for unit in sorted(set(listed))
                 if listed.count(unit) > 1]
    problems += [f"{unit} is listed but llmtrain has no such unit" for unit in sorted(set(listed) - set(units))]
    return problems


def upward_imports(layers: list[list[str]], edges: Iterable[Edge]) -> list[str]:
    """Each import of a unit in the importer's own layer or above, as ``file:line: ...`` (layers counted from 1 at
    the bottom)."""
    level = {unit: index for index, layer in enumerate(layers) for unit in layer}
    found = []
    for module, file, line, target in edges:
        source, destination = unit_of(module), unit_of(target)
        if source == destination or source not in level or destination not in level:
            continue  # within a unit; a unit in no layer is unit_problems' to report
        if level[destination] >= level[source]:
            where = "in its own layer" if level[destination] == level[source] else "above it"
            found.append(f"{file}:{line}: {module} imports {target}: {destination} (layer {level[destination] + 1}) "
                         f"is {where}, and {source} (layer {level[source] + 1}) may import only lower layers")
    return found


def llmtrain_edges() -> list[Edge]:
    modules = module_names()
    known = set(modules)
    return [(name, str(path.relative_to(ROOT)), line, target)
            for name, path in modules.items() for target, line in import_edges(name, path, known)]


def test_the_check_reports_an_upward_import_a_sideways_one_and_a_missing_unit():
    layers = read_layers("# A\n\n## Layers\n\ntext\n\n```\nlow other  # a comment\n\nhigh\n```\n\n## Next\n")
    assert layers == [["low", "other"], ["high"]]
    edges = [("llmtrain.high.a", "llmtrain/high/a.py", 3, "llmtrain.low"),  # down: allowed
             ("llmtrain.high.a", "llmtrain/high/a.py", 4, "llmtrain.high.b"),  # within a unit: allowed
             ("llmtrain.low", "llmtrain/low.py", 7, "llmtrain.high.a"),  # up
             ("llmtrain.low", "llmtrain/low.py", 9, "llmtrain.other")]  # sideways, between units
    found = upward_imports(layers, edges)
    assert len(found) == 2
    assert found[0].startswith("llmtrain/low.py:7: llmtrain.low imports llmtrain.high.a: high (layer 2) is above it")
    assert found[1].startswith("llmtrain/low.py:9: llmtrain.low imports llmtrain.other: other (layer 1) is in its own")
    assert unit_problems(layers, ["low", "high", "other", "new"]) == ["new is in no layer"]
    assert unit_problems(layers + [["low", "gone"]], ["low", "high", "other"]) == [
        "low is listed 2 times", "gone is listed but llmtrain has no such unit"]
    assert unit_of("llmtrain") == "__init__" and unit_of("llmtrain.data.base") == "data"


def test_every_unit_is_in_one_layer():
    problems = unit_problems(read_layers(ARCHITECTURE.read_text()), {unit_of(name) for name in module_names()})
    assert not problems, f"{ARCHITECTURE.name}'s Layers block and llmtrain's units disagree:\n" + "\n".join(problems)


def test_no_unit_imports_from_its_own_layer_or_above():
    found = upward_imports(read_layers(ARCHITECTURE.read_text()), llmtrain_edges())
    assert not found, (f"imports against the layers of {ARCHITECTURE.name} (move the module that is filed in the "
                       "wrong unit, or the unit to the layer where it belongs):\n" + "\n".join(found))


def test_the_package_is_on_top_so_no_unit_may_import_it_for_a_name():
    """llmtrain/__init__.py hands out llmtrain.api's names (``from llmtrain import LLM``), so it sits above every unit:
    a unit that imported the package itself (``from llmtrain import __version__``) would import the whole API."""
    layers = read_layers(ARCHITECTURE.read_text())
    assert layers[-1] == ["__init__"]
    assert not upward_imports(layers, [("llmtrain", "llmtrain/__init__.py", 20, "llmtrain.api")])
    found = upward_imports(layers, [("llmtrain.model", "llmtrain/model.py", 3, "llmtrain")])
    assert len(found) == 1 and "llmtrain.model imports llmtrain: __init__" in found[0]
