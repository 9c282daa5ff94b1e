"""The package's import graph (issue 35): no import cycles, and each layer imports only the layers below it.

The graph is read statically with ``ast`` from every module under packstore/ (the generated packstore/v1
excepted), so it needs no import of torch, lmdb or grpc and runs in well under a second. Every import counts
alike: at module level, inside a function (a lazy import still ties the layers together) and under
``if TYPE_CHECKING:`` (an annotation-only import is still a dependency of the design).

Resolution: ``import X`` is an edge to module X; ``from X import Y`` is an edge to module X.Y when that is a
module, else to X (Y is a name defined in X); relative imports are made absolute against the importing
module's package first. One exception, in the cycle check only: an edge from a package's ``__init__`` to a
module inside that package (a re-export, e.g. packstore.store -> packstore.store.lmdb.store) is dropped, so
a loop that only closes through such a re-export is not a cycle.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "packstore"
GENERATED = "packstore.v1"

# The layers: the second component of a module's name (packstore.store.lmdb.store is in "store",
# packstore.errors is "errors"); the root package packstore/__init__.py (only __version__) is "packstore".
# The rules are docs/architecture.md's table "The layers and what each may import", read here (layer_rules): the doc is
# the one place they are written, so it cannot drift from what this test holds. Each layer may import itself, the
# layers its row names (in backquotes, outside parentheses) and BASE, except a row that says "nothing of packstore"
# (no import of packstore at all) or "anything" (the CLI, a shell over everything).
DOC = ROOT / "docs" / "architecture.md"
TABLE_HEADER = "| Layer | Job | May import |"
BASE = {"errors", "extras", "packstore"}


def layer_of_cell(cell: str) -> str:
    """The layer a table row's first cell names: `store/` is "store", `vllm.py` "vllm", the root `__init__.py`
    "packstore"."""
    name = cell.strip().strip("`")
    return "packstore" if name == "__init__.py" else name.removesuffix("/").removesuffix(".py")


def table_rows(text: str) -> list[tuple[int, list[str]]]:
    """The layer table's rows (line number, cells) in a Markdown text."""
    lines = text.split("\n")
    assert TABLE_HEADER in lines, f"{DOC.relative_to(ROOT)} has no table headed {TABLE_HEADER!r}"
    start = lines.index(TABLE_HEADER) + 2  # past the header and the alignment line
    rows = []
    for number, line in enumerate(lines[start:], start + 1):
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"{DOC.relative_to(ROOT)}:{number}: a layer row has 3 cells, not {len(cells)}"
        rows.append((number, cells))
    return rows


def may_import(cell: str) -> set[str]:
    """The layers a row's "May import" cell names: backquoted names outside parentheses (a parenthesis says why, or
    what of the layer), "*" for "anything", nothing for "nothing of packstore"."""
    if cell.startswith("anything"):
        return {"*"}
    if cell.startswith("nothing of packstore"):
        return set()
    while re.search(r"\([^()]*\)", cell):
        cell = re.sub(r"\([^()]*\)", "", cell)
    return set(re.findall(r"`([^`]+)`", cell)) | BASE


def layer_rules(text: str) -> dict[str, set[str]]:
    rules: dict[str, set[str]] = {}
    for number, (name, _job, allowed) in table_rows(text):
        layer = layer_of_cell(name)
        assert layer not in rules, f"{DOC.relative_to(ROOT)}:{number}: layer {layer} has two rows"
        rules[layer] = may_import(allowed)
    return rules


ALLOWED: dict[str, set[str]] = layer_rules(DOC.read_text())

# Inside the store layer: the core (protocols, records, bank records, namespaces, the specifier), one folder per tier,
# and the factory (packstore/store/__init__.py: open_store). The core imports no tier and not the factory; a tier
# imports the core and itself, never another tier or the factory; above the store only the factory opens a tier.
STORE = "packstore.store"
TIERS = ("lmdb", "objects", "remote")

# Third-party packages a layer must not import at all (store backends speak bytes: no tensors).
FORBIDDEN_EXTERNAL: dict[str, set[str]] = {
    "format": {"torch", "transformers", "safetensors", "lmdb", "grpc", "boto3", "botocore", "faiss", "sentence_transformers"},
    "store": {"torch", "transformers", "safetensors"},
    "errors": {"torch", "transformers", "safetensors", "lmdb", "grpc", "boto3"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    found = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    return {name: path for name, path in found.items() if name != GENERATED and not name.startswith(GENERATED + ".")}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imported_names(module: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module named, imported name or None, line) for every import statement anywhere in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found += [(source, alias.name, node.lineno) for alias in node.names]
    return found


@cache
def imports() -> tuple[dict[str, set[str]], dict[str, set[str]], list[str]]:
    """Internal edges (module -> modules), external top-level packages per module, unresolved internal imports."""
    known = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    external: dict[str, set[str]] = defaultdict(set)
    unresolved: list[str] = []
    for module, path in known.items():
        for source, name, line in _imported_names(module, path):
            top = source.split(".")[0]
            if top != "packstore":
                external[module].add(top)
                continue
            if source == GENERATED or source.startswith(GENERATED + "."):
                continue
            target = f"{source}.{name}" if name is not None and f"{source}.{name}" in known else source
            if target not in known:
                unresolved.append(f"{path.relative_to(ROOT)}:{line}: {source}" + (f" (name {name})" if name else ""))
            elif target != module:
                edges[module].add(target)
    return dict(edges), dict(external), unresolved


def is_reexport(source: str, target: str) -> bool:
    """An edge from a package's __init__ to a module inside that package."""
    return modules()[source].name == "__init__.py" and target.startswith(source + ".")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Cycle paths covering every strongly connected component of more than one module (Tarjan): for each
    module of such a component a shortest cycle through it, each distinct cycle once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the package's ~100 modules
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    paths: list[list[str]] = []
    for component in sorted(components):
        for start in component:
            path = _cycle_path(start, set(component), edges)
            turn = path.index(min(path[:-1]))
            path = path[turn:-1] + path[: turn + 1]  # the same cycle found from another module reads the same
            if path not in paths:
                paths.append(path)
    return paths


def _cycle_path(start: str, members: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from ``start`` back to it within its component (breadth-first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(edges.get(node, set()) & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(members)}")


def store_part(module: str) -> str | None:
    """Where a module sits in the store layer: "factory", "core", a tier's name, or None outside the store."""
    if module == STORE:
        return "factory"
    if not module.startswith(STORE + "."):
        return None
    part = module.split(".")[2]
    return part if part in TIERS else "core"


def store_breaches(edges: dict[str, set[str]]) -> list[str]:
    """Imports against the store's sub-layers: the core importing a tier or the factory, a tier importing another tier
    or the factory, and anything outside the store importing a tier (the factory alone opens them)."""
    found = []
    for source, targets in sorted(edges.items()):
        mine = store_part(source)
        for target in sorted(targets):
            theirs = store_part(target)
            if theirs is None or theirs == mine or theirs == "core":
                continue
            if (theirs == "factory" and mine is None) or (theirs in TIERS and mine == "factory"):
                continue
            what = "the factory" if theirs == "factory" else f"the {theirs} tier"
            found.append(f"{source} -> {target} ({mine or 'above the store'} imports {what})")
    return found


def layer_edges() -> dict[tuple[str, str], list[str]]:
    """Every import from one layer to another, with the module edges behind it."""
    edges, _, _ = imports()
    crossing: dict[tuple[str, str], list[str]] = defaultdict(list)
    for source, targets in edges.items():
        for target in sorted(targets):
            if layer(source) != layer(target):
                crossing[layer(source), layer(target)].append(f"{source} -> {target}")
    return dict(sorted(crossing.items()))


def test_every_internal_import_resolves() -> None:
    _, _, unresolved = imports()
    assert not unresolved, "imports of packstore modules that do not exist:\n" + "\n".join(unresolved)


def test_no_import_cycles() -> None:
    edges, _, _ = imports()
    kept = {source: {t for t in targets if not is_reexport(source, t)} for source, targets in edges.items()}
    found = cycles(kept)
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(" -> ".join(path) for path in found)


def test_layers_import_only_the_layers_below() -> None:
    crossing = layer_edges()
    print("layer edges today:")
    for (source, target), behind in crossing.items():
        print(f"  {source} -> {target}: {', '.join(behind)}")
    unknown = sorted({layer(m) for m in modules()} - set(ALLOWED))
    assert not unknown, f"layers missing from {DOC.relative_to(ROOT)}'s table (decide what they may import): {unknown}"
    broken = [
        f"{source} -> {target}: {', '.join(behind)}"
        for (source, target), behind in crossing.items()
        if "*" not in ALLOWED[source] and target not in ALLOWED[source]
    ]
    assert not broken, f"imports against the layering ({DOC.relative_to(ROOT)}, the layer table):\n" + "\n".join(broken)


def test_store_tiers_lean_only_on_the_core() -> None:
    edges, _, _ = imports()
    found = store_breaches(edges)
    assert not found, "imports against the store's sub-layers (tests/unit/test_import_graph.py store_breaches):\n" + "\n".join(found)


def test_store_breaches_are_caught() -> None:
    """Planted violations of each sub-layer rule are found; the imports the rules allow are not."""
    planted = {
        "packstore.store.objects.banks": {"packstore.store.lmdb.banks", "packstore.store.bank_records"},
        "packstore.store.lmdb.store": {"packstore.store.objects.cache", "packstore.store.lmdb.banks"},
        "packstore.store.remote.store": {"packstore.store", "packstore.rpc.channel"},
        "packstore.store.namespaces": {"packstore.store.lmdb.store", "packstore.store.protocol"},
        "packstore.store.spec": {"packstore.store"},
        "packstore.bank.bank": {"packstore.store.lmdb.banks", "packstore.store.bank_records"},
        "packstore.service.namespace_stores": {"packstore.store", "packstore.store.objects.store"},
        "packstore.store": {"packstore.store.lmdb.store", "packstore.store.remote.store", "packstore.store.spec"},
    }
    assert store_breaches(planted) == [
        "packstore.bank.bank -> packstore.store.lmdb.banks (above the store imports the lmdb tier)",
        "packstore.service.namespace_stores -> packstore.store.objects.store (above the store imports the objects tier)",
        "packstore.store.lmdb.store -> packstore.store.objects.cache (lmdb imports the objects tier)",
        "packstore.store.namespaces -> packstore.store.lmdb.store (core imports the lmdb tier)",
        "packstore.store.objects.banks -> packstore.store.lmdb.banks (objects imports the lmdb tier)",
        "packstore.store.remote.store -> packstore.store (remote imports the factory)",
        "packstore.store.spec -> packstore.store (core imports the factory)",
    ]


def test_layers_avoid_heavy_dependencies() -> None:
    _, external, _ = imports()
    broken = [
        f"{module} imports {', '.join(sorted(packages & FORBIDDEN_EXTERNAL[layer(module)]))}"
        for module, packages in sorted(external.items())
        if packages & FORBIDDEN_EXTERNAL.get(layer(module), set())
    ]
    assert not broken, "\n".join(broken)


def test_allowed_layers_form_no_cycle() -> None:
    """The table itself is a layering: no two layers may each import the other, directly or round about."""
    table = {source: {t for t in targets if t != "*" and t != source} for source, targets in ALLOWED.items()}
    assert cycles(table) == []


def test_cycle_finder_reports_a_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    two_loops = {"s": {"b", "c"}, "b": {"s"}, "c": {"s"}, "d": {"s"}}
    assert cycles(two_loops) == [["b", "s", "b"], ["c", "s", "c"]]


def test_the_doc_table_names_the_layers_of_the_code() -> None:
    """Every row of docs/architecture.md's table is a layer of the code and every layer has a row; every name a row may
    import is a layer with a row (a misspelt name is not silently no rule)."""
    code = {layer(m) for m in modules()}
    assert set(ALLOWED) == code, f"rows without a layer: {sorted(set(ALLOWED) - code)}; layers without a row: {sorted(code - set(ALLOWED))}"
    named = {target for targets in ALLOWED.values() for target in targets} - {"*"}
    assert named <= set(ALLOWED), f"names in the 'May import' column that are no layer: {sorted(named - set(ALLOWED))}"


def test_the_doc_diagram_draws_every_layer() -> None:
    """The diagram (the doc's first code block) draws each layer of the table, as `name/` (a package) or `name.py`."""
    diagram = DOC.read_text().split("```")[1]
    missing = [
        name
        for name in ALLOWED
        if name != "packstore" and not re.search(rf"(?<![\w.]){re.escape(name)}(/|\.py)", diagram)
    ]
    assert not missing, f"layers the diagram of {DOC.relative_to(ROOT)} leaves out: {missing}"


def test_the_doc_names_files_that_exist() -> None:
    """Each `file.py` the doc names exists: a path with a slash from the repository root or from packstore/, a bare
    name in a layer's row inside that layer, a bare name elsewhere somewhere in packstore/ (a rename that leaves the
    doc behind fails here)."""
    text = DOC.read_text()
    in_rows = {number: layer_of_cell(cells[0]) for number, cells in table_rows(text)}
    missing = []
    for number, line in enumerate(text.split("\n"), 1):
        for name in re.findall(r"`([\w/.]+\.py)`", line):
            if "/" in name:
                found = (ROOT / name).exists() or (PACKAGE / name).exists()
            elif number in in_rows and (PACKAGE / in_rows[number]).is_dir():
                found = any((PACKAGE / in_rows[number]).rglob(name))
            else:
                found = any(PACKAGE.rglob(name))
            if not found:
                missing.append(f"{DOC.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "files the doc names that do not exist:\n" + "\n".join(missing)


def test_a_doc_row_is_read_as_its_rules() -> None:
    """The 'May import' cell's names are the rule: parentheses explain and are skipped; "anything" and "nothing of
    packstore" are the two words with a meaning of their own."""
    assert may_import("`store` (names), `rpc` (the namespace key, `fields.py`), `errors`") == {"store", "rpc"} | BASE
    assert may_import("`answering` (`paged.py`: which pack (engine-free)), `kv`") == {"answering", "kv"} | BASE
    assert may_import("anything; store-only commands import no torch") == {"*"}
    assert may_import("nothing of packstore") == set()
    doc = f"text\n\n{TABLE_HEADER}\n|---|---|---|\n| `format/` | bytes | `errors` |\n| `kv/` | models | `format` |\n\nmore\n"
    assert layer_rules(doc) == {"format": {"errors"} | BASE, "kv": {"format"} | BASE}
    assert layer_rules(doc.replace("| `format` |", "| `format`, `packs` |"))["kv"] == {"format", "packs"} | BASE
