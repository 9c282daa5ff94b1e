"""model_fp computed from a Hugging Face directory (streamed safetensors, a meta-device skeleton) equals the loaded model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from packstore.errors import InvalidInput
from packstore.kv import identity
from packstore.kv.identity import directory_model_fingerprint, directory_model_identity, directory_template_fingerprint
from packstore.kv.models import load_model
from tests.helpers.hub_cache import COMMIT, hub_cache
from tests.helpers.tiny_model import make_model_dir

ALT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(autouse=True)
def model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch model cache, so identities cached by one test never answer another."""
    monkeypatch.setenv("PACKSTORE_MODEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny-tied"), tied=True)


def loaded_fp(path: Path, dtype: str = "float32") -> str:
    return load_model(str(path), device="cpu", dtype=dtype, progress=False).model_fp


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_directory_fingerprint_equals_the_loaded_models(tiny_model_dir: Path, dtype: str) -> None:
    assert directory_model_fingerprint(tiny_model_dir, dtype, cache=False) == loaded_fp(tiny_model_dir, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tied_embeddings_hash_as_an_alias_of_the_stored_tensor(tied_model_dir: Path, dtype: str) -> None:
    assert "lm_head.weight" not in load_file(tied_model_dir / "model.safetensors")  # save_pretrained drops the tied copy
    assert directory_model_fingerprint(tied_model_dir, dtype, cache=False) == loaded_fp(tied_model_dir, dtype)


def test_a_tie_stored_twice(tied_model_dir: Path, tmp_path: Path) -> None:
    """Both members of a tie in the files: tied when equal, untied (each its own value) when not, as from_pretrained does."""
    tensors = load_file(tied_model_dir / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    for case, lm_head in (("equal", embedding.clone()), ("different", torch.randn_like(embedding))):
        directory = copy_model_dir(tied_model_dir, tmp_path / case)
        save_file(tensors | {"lm_head.weight": lm_head}, directory / "model.safetensors", metadata={"format": "pt"})
        assert directory_model_fingerprint(directory, "float32", cache=False) == loaded_fp(directory), case
    assert loaded_fp(tmp_path / "equal") == loaded_fp(tied_model_dir)
    assert loaded_fp(tmp_path / "different") != loaded_fp(tied_model_dir)


def test_sharded_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sharded = copy_model_dir(tiny_model_dir, tmp_path / "sharded", weights=False)
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 2
    assert directory_model_fingerprint(sharded, "bfloat16", cache=False) == loaded_fp(tiny_model_dir, "bfloat16")


def test_modules_kept_in_float32_are_hashed_in_float32(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that keeps some modules in float32 at bfloat16 (``_keep_in_fp32_modules_strict``) is cast as from_pretrained casts it."""
    monkeypatch.setattr(LlamaForCausalLM, "_keep_in_fp32_modules_strict", ["lm_head"])
    lm = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16", progress=False)
    assert lm.model.lm_head.weight.dtype == torch.float32 and lm.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert directory_model_fingerprint(tiny_model_dir, "bfloat16", cache=False) == lm.model_fp


def test_identity_is_cached_until_a_file_changes(tiny_model_dir: Path, tmp_path: Path, model_cache: Path, monkeypatch) -> None:
    directory = copy_model_dir(tiny_model_dir, tmp_path / "model")
    first = directory_model_identity(directory, "float32")
    assert len(list((model_cache / "identities").glob("*.json"))) == 1

    def no_model(*_args):
        raise AssertionError("the cached identity should have answered")

    with monkeypatch.context() as patched:
        patched.setattr(identity, "_meta_model", no_model)
        assert directory_model_identity(directory, "float32") == first

    other = load_file(make_model_dir(tmp_path / "other", seed=3) / "model.safetensors")
    save_file(other, directory / "model.safetensors", metadata={"format": "pt"})
    changed = directory_model_identity(directory, "float32")
    assert changed != first and changed["weights_sha256"] != first["weights_sha256"]
    assert directory_model_fingerprint(directory, "float32") == loaded_fp(directory)
    assert directory_model_identity(directory, "bfloat16")["dtype"] == "bfloat16"  # the dtype is part of the key


def test_a_damaged_cache_entry_is_recomputed(tiny_model_dir: Path, model_cache: Path) -> None:
    expected = directory_model_fingerprint(tiny_model_dir, "float32")
    for entry in (model_cache / "identities").glob("*.json"):
        entry.write_text('{"key": ')
    assert directory_model_fingerprint(tiny_model_dir, "float32") == expected


def test_refusals(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="unsupported dtype 'int8'"):
        directory_model_fingerprint(tiny_model_dir, "int8")
    with pytest.raises(InvalidInput, match="no config.json"):
        directory_model_fingerprint(tmp_path, "float32")
    no_weights = copy_model_dir(tiny_model_dir, tmp_path / "no-weights", weights=False)
    with pytest.raises(InvalidInput, match="holds no model.safetensors"):
        directory_model_fingerprint(no_weights, "float32")
    missing = copy_model_dir(tiny_model_dir, tmp_path / "missing")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InvalidInput, match="does not store the tensor 'model.norm.weight'"):
        directory_model_fingerprint(missing, "float32", cache=False)


def test_directory_template_fingerprint(tiny_lm, tiny_model_dir: Path) -> None:
    assert directory_template_fingerprint(tiny_model_dir) == tiny_lm.template_fp
    other = load_model(str(tiny_model_dir), device="cpu", progress=False, chat_template=ALT_TEMPLATE)
    assert directory_template_fingerprint(tiny_model_dir, ALT_TEMPLATE) == other.template_fp != tiny_lm.template_fp


def copy_model_dir(source: Path, target: Path, *, weights: bool = True) -> Path:
    """A copy of a model directory, without its weight files unless ``weights``."""
    target.mkdir(parents=True)
    for file in source.iterdir():
        if weights or not file.name.startswith("model.safetensors"):
            (target / file.name).write_bytes(file.read_bytes())
    return target


def test_config_fields_come_from_the_directory(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    found = directory_model_identity(tiny_model_dir, "float32", cache=False)
    assert found["class"] == "LlamaForCausalLM" and found["layers"] == config["num_hidden_layers"]
    assert found["kv_heads"] == config["num_key_value_heads"]


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """vLLM serving a hub id: the identities come from the snapshot it loaded, never from the network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = hub_cache(tiny_model_dir, tmp_path / "hub", "acme/tiny")
    snapshot = identity.local_directory("acme/tiny", cache_dir=hub)
    assert snapshot == hub / "models--acme--tiny" / "snapshots" / COMMIT
    assert identity.local_directory("acme/tiny", revision=COMMIT, cache_dir=hub) == snapshot
    assert identity.local_directory(tiny_model_dir) == tiny_model_dir  # a directory is itself
    assert directory_model_fingerprint(snapshot, "float32", cache=False) == loaded_fp(tiny_model_dir)
    assert directory_template_fingerprint(snapshot) == directory_template_fingerprint(tiny_model_dir)
    for missing in ("acme/absent", "not a hub id!"):
        with pytest.raises(InvalidInput, match=f"model '{missing}' is neither a local directory nor in the local Hugging Face cache"):
            identity.local_directory(missing, cache_dir=hub)
