"""The demo's commands print no warnings from dependencies: transformers deprecated ``past_key_values``
(``FutureWarning`` on every build and answer), and a new user reads such lines as something broken.
Each command runs in its own interpreter with FutureWarning as an error, so no earlier test's
warning filters or already-shown warnings hide one. Releases before transformers renamed the cache
argument still get the old name."""

from __future__ import annotations

import inspect
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from packstore.kv.models import LoadedModel


def test_demo_commands_print_no_dependency_warnings(tmp_path: Path, tiny_model_dir: Path) -> None:
    facts = tmp_path / "facts.txt"
    facts.write_text("Wexley is a town on the river Dane.\nWexley is famous for its bells.\n")
    model = ["--model", str(tiny_model_dir)]
    for argv in (
        ["build", str(facts), *model, "--name", "wexley"],
        ["ask", "wexley", "Which river?", *model, "--compare-rag", "--max-new-tokens", "6"],
        ["amend", "wexley", "--erratum", "Wexley is famous for its cheese.", "--name", "wexley-v2"],
        ["ask", "wexley-v2", "What is Wexley famous for?", *model, "--compare-rag", "--max-new-tokens", "6"],
        ["ls"],
    ):
        run = [sys.executable, "-W", "error::FutureWarning", "-m", "packstore.cli.packctl", "--store", str(tmp_path / "store"), *argv]
        result = subprocess.run(run, capture_output=True, text=True)
        assert result.returncode == 0, f"{argv[0]}: {result.stderr}"
        assert "Warning" not in result.stderr, f"{argv[0]}: {result.stderr}"


class _ForwardBeforeTheRename(torch.nn.Module):
    """A model as transformers 5.17 (still allowed by the pin) builds them: its forward knows only ``past_key_values``."""

    def forward(self, input_ids: torch.Tensor, past_key_values: object = None) -> None:
        """Never run: only its signature is read."""


def test_the_cache_goes_under_the_name_the_installed_transformers_takes(tiny_lm: LoadedModel) -> None:
    assert tiny_lm.cache_argument in inspect.signature(tiny_lm.model.forward).parameters
    old = replace(tiny_lm, model=_ForwardBeforeTheRename())
    assert old.cache_argument == "past_key_values"
