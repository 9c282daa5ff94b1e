"""model_fp / template_fp: stable across processes, sensitive to what changes the KV or the tokens."""

from __future__ import annotations

import subprocess
import sys

import torch

from packstore.kv.identity import model_fingerprint, template_fingerprint
from packstore.kv.models import load_model
from tests.helpers.tiny_model import ALT_TEMPLATE


def test_identities_are_stable_across_processes(tiny_lm, tiny_model_dir) -> None:
    code = (
        "from packstore.kv.models import load_model;"
        f"lm = load_model({str(tiny_model_dir)!r}, device='cpu', progress=False);"
        "print(lm.model_fp, lm.template_fp)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [tiny_lm.model_fp, tiny_lm.template_fp]


def test_same_shape_different_weights_is_a_different_model(tiny_lm, other_tiny_model_dir) -> None:
    other = load_model(str(other_tiny_model_dir), device="cpu", progress=False)
    assert other.model_fp != tiny_lm.model_fp
    assert other.template_fp == tiny_lm.template_fp


def test_compute_dtype_is_part_of_the_model_identity(tiny_lm) -> None:
    assert model_fingerprint(tiny_lm.model, torch.bfloat16) != tiny_lm.model_fp


def test_one_changed_weight_changes_the_model_identity(tiny_model_dir) -> None:
    lm = load_model(str(tiny_model_dir), device="cpu", progress=False)
    before = lm.model_fp
    with torch.no_grad():
        lm.model.model.layers[1].self_attn.v_proj.weight[0, 0] += 1e-3
    assert model_fingerprint(lm.model, lm.dtype) != before


def test_chat_template_is_part_of_the_template_identity(tiny_lm, tiny_model_dir) -> None:
    other = load_model(str(tiny_model_dir), device="cpu", progress=False, chat_template=ALT_TEMPLATE)
    assert other.template_fp != tiny_lm.template_fp
    assert other.model_fp == tiny_lm.model_fp
    assert template_fingerprint(other.tokenizer) == other.template_fp
