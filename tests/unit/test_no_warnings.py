"""The demo's commands print no warnings from dependencies: transformers deprecated ``past_key_values``
(``FutureWarning`` on every build and answer), and a new user reads such lines as something broken.
Each command runs in its own interpreter with FutureWarning as an error, so no earlier test's
warning filters or already-shown warnings hide one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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
