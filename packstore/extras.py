"""The optional extras (pyproject's ``[project.optional-dependencies]``) and the modules each adds, and the one way
packstore reports one missing: ``MissingExtra``, a line naming the extra to install instead of an import traceback.

Code that needs an extra imports it through ``require_extra`` where it is used; the console scripts turn any other
``ModuleNotFoundError`` of a module listed here into the same line (``missing_extra``).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from packstore.errors import MissingExtra

# The top-level modules of each extra's own packages (and of what they need, botocore), and the extras an extra
# installs too. tests/unit/test_extras.py checks both against pyproject.toml.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "model": ("torch", "transformers", "safetensors", "accelerate", "gguf", "tqdm", "jinja2"),
    "lexical": ("bm25s", "Stemmer"),
    "bank": ("sentence_transformers", "faiss"),
    "server": ("grpc_health", "grpc_reflection", "prometheus_client", "starlette", "uvicorn", "anyio", "httpx"),
    "s3": ("boto3", "botocore"),
    "route": ("onnxruntime", "tokenizers", "faiss", "safetensors"),
}
INCLUDED: dict[str, tuple[str, ...]] = {"bank": ("model", "lexical", "route"), "server": ("lexical",), "route": ("lexical",)}


def missing(extra: str, module: str) -> MissingExtra:
    """The error for ``module`` not being installed where ``extra`` is needed."""
    return MissingExtra(
        f"{module} is not installed: this needs packstore's {extra!r} extra (pip install 'packstore[{extra}]')", extra=extra, module=module
    )


def require_extra(module: str, extra: str) -> ModuleType:
    """``module``, imported; MissingExtra naming ``extra`` when it, or a module it imports, is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise missing(extra, (exc.name or module).partition(".")[0]) from None


def has_extra(extra: str) -> bool:
    """Whether every module of ``extra`` (and of the extras it includes) is installed; imports nothing."""
    try:
        check_extra(extra)
    except MissingExtra:
        return False
    return True


def check_extra(extra: str) -> None:
    """MissingExtra when a module of ``extra`` (or of an extra it includes) is not installed; imports nothing."""
    for name in (extra, *INCLUDED.get(extra, ())):
        for module in EXTRA_MODULES[name]:
            if importlib.util.find_spec(module) is None:
                raise missing(extra, module)


def missing_extra(error: ModuleNotFoundError) -> MissingExtra | None:
    """The MissingExtra an import failure means, when the module missing belongs to an extra; else None (a bug)."""
    module = (error.name or "").partition(".")[0]
    extra = next((extra for extra, modules in EXTRA_MODULES.items() if module in modules), None)
    return missing(extra, module) if extra is not None else None
