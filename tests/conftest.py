"""The test kinds, and the fixtures tests share: offline mode, a scratch store, the tiny test model, the real wheel
models, one SeaweedFS for the session, and the run's fidelity and robustness reports.

Kinds. Every test has at least one kind marker (declared in pyproject.toml, ``--strict-markers``); the lanes of the
Makefile are marker expressions over them (README, "Tests"). A test's kind is the name of the directory it sits in
(``tests/unit/`` -> ``unit``, ``tests/s3/`` -> ``s3``, ...) unless the test names its kinds itself (a module's
``pytestmark``, a parameter's ``marks``): a real-model evaluation in ``tests/eval/`` says ``eval`` and ``model``, the
SeaweedFS parameter of a unit suite says ``s3``. A test outside the kind directories is a collection error.

Helpers are a package (``tests.helpers``, importable from the repository root, which pytest's ``pythonpath`` puts on
``sys.path``); test modules never import each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.helpers.tiny_model import make_model_dir

if TYPE_CHECKING:  # the s3 extra (boto3) is imported by the SeaweedFS fixtures only: a GPU host runs the rest without it
    from tools.lib.seaweed import Seaweed

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["VLLM_NO_USAGE_STATS"] = "1"  # vLLM engines the tests start send no usage report (no network here)

TESTS = Path(__file__).resolve().parent
KINDS = ("unit", "service", "s3", "stress", "eval", "model", "vllm", "install")


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by -m
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each test its directory's kind unless it names its own; refuse a test that has neither."""
    homeless = []
    for item in items:
        if any(item.get_closest_marker(kind) for kind in KINDS):
            continue
        directory = Path(item.path).resolve().relative_to(TESTS).parts[0]
        if directory not in KINDS:
            homeless.append(item.nodeid)
            continue
        item.add_marker(directory)
    if homeless:
        raise pytest.UsageError(f"tests outside the kind directories {KINDS} name no kind: {homeless[:5]}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def other_tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer as ``tiny_model_dir``, different weights."""
    return make_model_dir(tmp_path_factory.mktemp("tiny-model-b"), seed=1)


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir: Path):
    from packstore.kv.models import load_model

    return load_model(str(tiny_model_dir), device="cpu", progress=False)


@pytest.fixture(scope="session")
def real_model() -> Callable[..., object]:
    """Load a wheel model by alias (``smollm2-135m``, ``gemma3-270m``) once per run and device (None: packstore's
    default, CUDA where present; "cpu" on a host without one is that same device and model): the model tests share
    it. A test that changes a model loads its own."""
    import torch

    from packstore.kv.models import default_device, load_model

    loaded: dict[tuple[str, torch.device], object] = {}

    def load(name: str, device: str | None = None):
        target = torch.device(device) if device else default_device()
        if (name, target) not in loaded:
            loaded[name, target] = load_model(name, device=target, progress=False)
        return loaded[name, target]

    return load


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    """One SeaweedFS (``weed mini``) for the run; each test works under a prefix of its own (``url``)."""
    from tools.lib.seaweed import running_seaweed

    with running_seaweed(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture(scope="module")
def seaweed(seaweed_server: Seaweed) -> Iterator[Seaweed]:
    """The session's SeaweedFS, with its endpoint and credentials in the environment for the module's tests."""
    with pytest.MonkeyPatch.context() as env:
        for variable, value in seaweed_server.env().items():
            env.setenv(variable, value)
        yield seaweed_server


_FIDELITY_LINES: list[str] = []
_ROBUSTNESS_LINES: list[str] = []


@pytest.fixture(scope="session")
def fidelity_report() -> list[str]:
    """Lines appended here are printed in the run's terminal summary (max |dK|, |dV|, divergences)."""
    return _FIDELITY_LINES


@pytest.fixture(scope="session")
def robustness_report() -> list[str]:
    """Lines appended here are printed in the run's terminal summary (trials, cases, clients, errors, peak RSS)."""
    return _ROBUSTNESS_LINES


def pytest_terminal_summary(terminalreporter) -> None:
    for title, lines in (("fidelity report", _FIDELITY_LINES), ("robustness report", _ROBUSTNESS_LINES)):
        if lines:
            terminalreporter.section(title)
            for line in lines:
                terminalreporter.write_line(line)
