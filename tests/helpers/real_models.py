"""The real wheel models and the real questions the model tests answer (tools/data/ckc_dev.jsonl)."""

from __future__ import annotations

import json

import pytest

from tools.lib.evallib import data_path

MODELS = ["smollm2-135m", "gemma3-270m"]
# What the model tests start ``packstore worker`` with: a device LRU of ready packs (on a CPU, the host memory the
# worker reserves and touches as it starts) of 512 MiB, ample for their packs of tens of MB, instead of the 2 GiB
# default, whose touch keeps a core busy for seconds after every start.
WORKER_FLAGS = ("--cache-bytes", str(512 << 20))
MIN_PACK_TOKENS = 500
MIN_QUESTIONS = 20
DATA = data_path()


def eval_rows() -> list[dict]:
    if not DATA.exists():
        pytest.fail(f"evaluation data not found at {DATA} (set PACKSTORE_EVAL_DATA)")
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def fact_sets(tokenizer, rows: list[dict]) -> list[tuple[list[str], list[dict]]]:
    """Consecutive rows grouped until their contexts reach MIN_PACK_TOKENS; enough groups for MIN_QUESTIONS."""
    groups, current, covered = [], [], 0
    for row in rows:
        current.append(row)
        if len(tokenizer("\n".join(r["context"] for r in current)).input_ids) >= MIN_PACK_TOKENS:
            groups.append(([r["context"] for r in current], current))
            covered += len(current)
            current = []
            if covered >= MIN_QUESTIONS:
                break
    return groups
