"""Importing packstore does no work (issue 55 item 5): no environment writes, no ``sys.modules`` entries, no threads or
executors started. Read statically (module-level code, class bodies, and the module's own functions that code calls)
and checked at run time in a fresh interpreter. Hugging Face loads stay offline call by call instead of through an
environment written at import: every ``from_pretrained`` and ``SentenceTransformer`` call passes ``local_files_only``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "packstore" / "v1"
MAPPING_WRITES = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}  # os.environ, sys.modules
STARTS = {"Thread", "Timer", "ThreadPoolExecutor", "ProcessPoolExecutor", "Pool", "putenv", "unsetenv"}  # threads, env


def modules() -> dict[str, Path]:
    """Every packstore module by dotted name (the generated packstore.v1 excepted)."""
    found = {}
    for path in sorted((ROOT / "packstore").rglob("*.py")):
        if GENERATED not in path.parents:
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def external_packages(path: Path) -> set[str]:
    """The top-level third-party packages a module imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.partition(".")[0])
    return found - {"packstore", "__future__"} - set(sys.stdlib_module_names)


def _dotted(node: ast.AST) -> str:
    """``os.environ`` for the expression os.environ, "" for anything that is not a dotted name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _run_at_import(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node that runs when the module is imported: its statements and class bodies (not function bodies, but
    their decorators and defaults, nor an ``if __name__ == "__main__":`` block, which runs only as ``python -m``), and
    the bodies of the module's own functions that this code calls by name."""
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    pending: list[ast.AST] = list(tree.body)
    called: set[str] = set()
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("__name__ == '__main__'", "'__main__' == __name__"):
            continue
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            arguments = node.args
            pending += [*arguments.defaults, *(d for d in arguments.kw_defaults if d is not None)]
            if not isinstance(node, ast.Lambda):
                pending += node.decorator_list
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions and node.func.id not in called:
            called.add(node.func.id)
            pending += functions[node.func.id].body
        pending += list(ast.iter_child_nodes(node))


def import_effects(source: str) -> list[str]:
    """What importing a module of this ``source`` would do to the process, in line order."""
    found: set[tuple[int, str]] = set()
    for node in _run_at_import(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target] if isinstance(node, ast.AugAssign) else []
        for target in targets:
            if isinstance(target, ast.Subscript) and _dotted(target.value) in ("os.environ", "environ", "sys.modules"):
                found.add((line, f"writes {_dotted(target.value)}"))
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            owner, _, method = name.rpartition(".")
            if owner in ("os.environ", "environ", "sys.modules") and method in MAPPING_WRITES:
                found.add((line, f"writes {owner} ({method})"))
            if method in STARTS or name in STARTS:
                found.add((line, f"calls {name}"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_no_module_does_work_at_import() -> None:
    broken = [
        f"{path.relative_to(ROOT)}:{effect}" for name, path in modules().items() for effect in import_effects(path.read_text())
    ]
    assert not broken, "module-level code that changes the process when imported:\n" + "\n".join(broken)


def test_the_scan_finds_each_kind_of_work() -> None:
    planted = """
import os, sys, threading
from concurrent.futures import ThreadPoolExecutor
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["A"] = "1"

def _hide():
    sys.modules["jax"] = None

_hide()
POOL = ThreadPoolExecutor(2)

class Holder:
    thread = threading.Thread(target=print)
"""
    assert [effect.split(": ", 1)[1] for effect in import_effects(planted)] == [
        "writes os.environ (setdefault)", "writes os.environ", "writes sys.modules", "calls ThreadPoolExecutor", "calls threading.Thread"
    ]
    assert import_effects("import os\ndef later():\n    os.environ['B'] = '2'\n") == []
    assert import_effects("import os\ndef main():\n    os.environ['B'] = '2'\nif __name__ == '__main__':\n    main()\n") == []


PROBE = """
import importlib, json, os, sys, threading
externals, internals = json.loads(sys.argv[1])
for name in externals:  # their own import-time work is theirs: import them first
    try:
        importlib.import_module(name)
    except Exception:
        pass
environ, threads = dict(os.environ), {t.ident for t in threading.enumerate()}
hidden = {name for name, module in sys.modules.items() if module is None}
for name in internals:
    importlib.import_module(name)
print(json.dumps({
    "environ": sorted(k for k in os.environ.keys() | environ.keys() if os.environ.get(k) != environ.get(k)),
    "threads": sorted(t.name for t in threading.enumerate() if t.ident not in threads),
    "hidden": sorted(name for name, module in sys.modules.items() if module is None and name not in hidden),
}))
"""


def test_importing_every_module_leaves_the_process_as_it_was() -> None:
    """In a fresh interpreter: the third-party packages packstore imports first, then every packstore module (the
    vLLM connector, whose vllm import is the slowest part, excepted); nothing of the environment, the threads or
    ``sys.modules``' hidden entries changed. Hugging Face's settings are left out of its environment, so that a default
    written at import shows."""
    internals = sorted(name for name in modules() if name != "packstore.vllm")
    externals = sorted({package for name in internals for package in external_packages(modules()[name])} - {"vllm"})
    environ = {name: value for name, value in os.environ.items() if not name.startswith(("HF_", "TRANSFORMERS_"))}
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([externals, internals])], capture_output=True, text=True, timeout=600, cwd=ROOT, env=environ
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"environ": [], "threads": [], "hidden": []}


def _hub_loads(tree: ast.Module) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _dotted(node.func).rpartition(".")[2] in ("from_pretrained", "SentenceTransformer"):
            yield node


def test_every_hugging_face_load_is_local_only() -> None:
    """Without an environment written at import, each load says itself that it never reaches the Hub."""
    broken = [
        f"{path.relative_to(ROOT)}:{call.lineno}"
        for path in modules().values()
        for call in _hub_loads(ast.parse(path.read_text()))
        if not any(k.arg == "local_files_only" and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)
    ]
    assert not broken, "Hugging Face loads without local_files_only=True:\n" + "\n".join(broken)
