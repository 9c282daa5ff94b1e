"""Shared fixtures: offline mode, a scratch store, and the tiny test model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["VLLM_NO_USAGE_STATS"] = "1"  # vLLM engines the tests start send no usage report (no network here)
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "unit"))
sys.path.insert(0, str(Path(__file__).parent / "integration"))

import pytest  # noqa: E402

from tiny_model import make_model_dir  # noqa: E402


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


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


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
