"""Model and template identities: sha256 over canonical JSON of what shapes the KV cache / the tokens.

A loaded model's identity hashes its ``state_dict``. The same identity is also computed from a Hugging Face
directory alone (``directory_model_identity``), without a second model in memory: the model is built on the
meta device for its names, shapes, dtypes and tied tensors, and the tensors are streamed from the
directory's safetensors one at a time and cast as ``from_pretrained(dtype=...)`` casts them. That is what
an engine serving the directory (vLLM, whose own modules have other names and fused weights) checks packs
against.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from packstore import __version__
from packstore.errors import InvalidInput
from packstore.format.header import canonical_json, sha256_hex
from packstore.kv.model_cache import model_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Files whose change changes a directory's identity: a cached identity is keyed by their names, sizes and times.
IDENTITY_INPUTS = ("config.json", SAFETENSORS_INDEX)

# One tensor of a digest, in name order: its name, the tensor (or, for an alias, one of its dtype and shape), and
# the name of the earlier tensor it is tied to, if any.
DigestEntry = tuple[str, torch.Tensor, str | None]


def tensors_digest(entries: Iterable[DigestEntry]) -> str:
    """sha256 over each tensor's (name, dtype, shape) record, then its bytes or ``alias:NAME`` of the tensor it is tied to.

    The one hashing routine of ``weights_sha256``: a loaded model and a streamed directory feed it the same entries.
    """
    digest = hashlib.sha256()
    for name, tensor, alias in entries:
        digest.update(canonical_json([name, str(tensor.dtype), list(tensor.shape)]))
        if alias is not None:
            digest.update(b"alias:" + alias.encode())
            continue
        data = tensor.detach().to("cpu").contiguous().view(torch.uint8).flatten().numpy()
        digest.update(data.data)
    return digest.hexdigest()


def _model_entries(model: torch.nn.Module) -> Iterator[DigestEntry]:
    """A loaded model's state_dict in name order; a tensor sharing an earlier one's storage is its alias."""
    seen: dict[tuple[int, int], str] = {}
    for name, tensor in sorted(model.state_dict().items()):
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if identity in seen and tensor.numel() > 0:
            yield name, tensor, seen[identity]
            continue
        seen[identity] = name
        yield name, tensor, None


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes) in name order.

    Tied tensors are hashed once and recorded as aliases, so the digest depends on values, not layout.
    """
    return tensors_digest(_model_entries(model))


def _shape_identity(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, Any]:
    """Every field of the model identity but the weights: read from the config and the module tree (meta or loaded)."""
    config = model.config.get_text_config(decoder=True)
    names = [name for name, _ in model.named_modules()]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return {
        "architecture": config.model_type,
        "class": type(model).__name__,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "attention_heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": head_dim,
        "rope": {"parameters": rope, "theta": getattr(config, "rope_theta", None)},
        "attention": {
            "sliding_window": getattr(config, "sliding_window", None),
            "layer_types": getattr(config, "layer_types", None),
            "qk_norm": any(n.endswith("q_norm") for n in names),
            "query_pre_attn_scalar": getattr(config, "query_pre_attn_scalar", None),
            "attn_logit_softcapping": getattr(config, "attn_logit_softcapping", None),
        },
        "dtype": str(dtype).removeprefix("torch."),
    }


def model_identity(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, Any]:
    """The fields that decide what KV cache a model computes for given tokens."""
    return _shape_identity(model, dtype) | {"weights_sha256": weights_digest(model)}


def model_fingerprint(model: PreTrainedModel, dtype: torch.dtype) -> str:
    """``model_fp``: two checkpoints of the same shape but different weights get different values."""
    return sha256_hex(canonical_json(model_identity(model, dtype)))


def template_identity(tokenizer: Any) -> dict[str, Any]:
    """Chat template source, special tokens and ids, BOS/EOS behaviour, and a digest of the vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # tokenizer.json as the tokenizers library serializes it (deterministic)
        vocabulary_digest = sha256_hex(backend.to_str().encode("utf-8"))
    else:
        vocabulary_digest = sha256_hex(canonical_json(sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])))
    return {
        "chat_template": tokenizer.chat_template,
        "special_tokens": {t: tokenizer.convert_tokens_to_ids(t) for t in sorted(tokenizer.all_special_tokens)},
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "add_bos_token": getattr(tokenizer, "add_bos_token", None),
        "add_eos_token": getattr(tokenizer, "add_eos_token", None),
        # What the tokenizer really adds around plain text, whatever its flags claim.
        "plain_text_probe": tokenizer("a b").input_ids,
        "vocabulary_sha256": vocabulary_digest,
    }


def template_fingerprint(tokenizer: Any) -> str:
    """``template_fp``: any change to how a conversation becomes token ids changes it."""
    return sha256_hex(canonical_json(template_identity(tokenizer)))


def local_directory(name: str | Path, *, revision: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """The local directory of a Hugging Face model: ``name`` itself when it is a directory, else the snapshot of hub id
    ``name`` (at ``revision``) in the local Hugging Face cache (``cache_dir``, else the default), never downloaded:
    an engine serving a hub id has it there, and identities are computed from the files it loaded."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        found = snapshot_download(str(name), revision=revision, cache_dir=cache_dir, local_files_only=True)
    except (HFValidationError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        where = f" ({cache_dir})" if cache_dir is not None else ""
        raise InvalidInput(f"model {str(name)!r} is neither a local directory nor in the local Hugging Face cache{where}: {exc}") from exc
    return Path(found)


def directory_template_fingerprint(path: str | Path, chat_template: str | None = None) -> str:
    """``template_fp`` of a Hugging Face directory's tokenizer (with ``chat_template`` in place of its own)."""
    tokenizer = AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return template_fingerprint(tokenizer)


def directory_model_fingerprint(path: str | Path, dtype: str, *, cache: bool = True) -> str:
    """``model_fp`` of a Hugging Face directory computed in ``dtype``: the value ``load_model(path, dtype=dtype)`` has."""
    return sha256_hex(canonical_json(directory_model_identity(path, dtype, cache=cache)))


def directory_model_identity(path: str | Path, dtype: str, *, cache: bool = True) -> dict[str, Any]:
    """``model_identity`` of the model a Hugging Face directory loads as, with no model in memory.

    With ``cache`` the result is kept under the model cache directory, keyed by the directory, its config's and
    weight files' names, sizes and modification times, the dtype and the library versions: hashing an 8B model's
    16 GB takes minutes, and an engine checks it at every start.
    """
    if dtype not in DTYPES:
        raise InvalidInput(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    directory = Path(path).expanduser().resolve()
    if not (directory / "config.json").is_file():
        raise InvalidInput(f"{directory} is not a Hugging Face model directory (no config.json)")
    key = _cache_key(directory, dtype)
    entry = model_cache_dir() / "identities" / f"{sha256_hex(canonical_json(key))}.json"
    if cache and (cached := _read_cached(entry, key)) is not None:
        return cached
    model = _meta_model(directory, DTYPES[dtype])
    identity = _shape_identity(model, DTYPES[dtype]) | {"weights_sha256": _directory_weights_digest(model, directory, DTYPES[dtype])}
    if cache:
        _write_cached(entry, key, identity)
    return identity


def _safetensors_files(directory: Path) -> list[Path]:
    """The weight files ``from_pretrained`` reads: those the sharded index lists, else ``model.safetensors``."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidInput(f"{index} is not a safetensors index (no weight_map): {exc}") from None
        return [directory / name for name in sorted(set(weight_map.values()))]
    if (directory / SAFETENSORS_FILE).is_file():
        return [directory / SAFETENSORS_FILE]
    raise InvalidInput(f"{directory} holds no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}: its identity is computed from safetensors")


def _cache_key(directory: Path, dtype: str) -> dict[str, Any]:
    """What a directory's identity depends on, as cheap to read as a directory listing."""
    files = [directory / name for name in IDENTITY_INPUTS if (directory / name).is_file()] + _safetensors_files(directory)
    stats = []
    for file in files:
        try:
            stat = file.stat()
        except OSError as exc:
            raise InvalidInput(f"cannot read {file}: {exc.strerror}") from None
        stats.append([file.name, stat.st_size, stat.st_mtime_ns])
    return {
        "directory": str(directory),
        "files": stats,
        "dtype": dtype,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "packstore": __version__,
    }


def _read_cached(entry: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The identity cached in ``entry`` for exactly ``key``, or None (absent, unreadable, or another key)."""
    try:
        record = json.loads(entry.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key or not isinstance(record.get("identity"), dict):
        return None
    return record["identity"]


def _write_cached(entry: Path, key: dict[str, Any], identity: dict[str, Any]) -> None:
    """Keep ``identity`` for ``key``, written whole or not at all; a cache that cannot be written is skipped."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = entry.with_name(f".{entry.name}.{os.getpid()}")
        partial.write_text(json.dumps({"key": key, "identity": identity}, sort_keys=True), encoding="utf-8")
        os.replace(partial, entry)
    except OSError:
        pass


def _meta_model(directory: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The model ``from_pretrained(directory, dtype=dtype)`` builds, on the meta device: names, shapes, dtypes, ties."""
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"cannot read the model config in {directory}: {exc}") from None
    if getattr(config, "quantization_config", None):
        raise InvalidInput(f"{directory} holds a quantized checkpoint: its identity can only be computed by loading it")
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as exc:  # transformers' answer to a config of no causal language model it knows
        raise InvalidInput(f"{directory} holds no causal language model transformers can build: {exc}") from None


def _load_dtype(model: PreTrainedModel, dtype: torch.dtype):
    """name, meta tensor -> the dtype ``from_pretrained`` gives that tensor: float32 for what the model keeps in float32
    at this dtype (its ``_keep_in_fp32_modules`` plan), else the dtype it was built in."""
    plan = list(model._get_dtype_plan(dtype).items())
    pattern = re.compile("|".join(f"(?P<g{i}>{glob.replace('*', '.*')})" for i, (glob, _) in enumerate(plan))) if plan else None

    def load_dtype(name: str, meta: torch.Tensor) -> torch.dtype:
        match = pattern.search(name) if pattern is not None else None
        return plan[int(match.lastgroup[1:])][1] if match is not None and match.lastgroup else meta.dtype

    return load_dtype


def _directory_weights_digest(model: PreTrainedModel, directory: Path, dtype: torch.dtype) -> str:
    """``weights_digest`` of the model ``from_pretrained`` would load from ``directory``, one tensor in memory at a time."""
    files = _safetensors_files(directory)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(file), framework="pt")) for file in files]
        stored = {name: handle for handle in handles for name in handle.keys()}
        return tensors_digest(_directory_entries(model, stored, _load_dtype(model, dtype), directory))


def _directory_entries(model: PreTrainedModel, stored: dict[str, Any], load_dtype, directory: Path) -> Iterator[DigestEntry]:
    """The entries ``_model_entries`` gives for the loaded model, each tensor read from the files when it is hashed.

    Tied tensors are one Parameter in the meta model; their value is the one the files hold (a tied lm_head is
    usually absent from them). Where the files hold several members of a tie with different values, from_pretrained
    leaves them untied, and so each is hashed with its own value.
    """
    tensors = model.state_dict(keep_vars=True)
    ties: dict[int, list[str]] = {}
    for name, tensor in sorted(tensors.items()):
        ties.setdefault(id(tensor), []).append(name)
    untied: set[int] = set()

    def read(name: str) -> torch.Tensor:
        meta = tensors[name]
        if name not in stored:
            raise InvalidInput(
                f"{directory} does not store the tensor {name!r} under that name: its identity can only be computed by loading it"
            )
        tensor = stored[name].get_tensor(name)
        if tuple(tensor.shape) != tuple(meta.shape):
            raise InvalidInput(f"{directory}: tensor {name!r} has shape {list(tensor.shape)}, the model expects {list(meta.shape)}")
        return tensor.to(load_dtype(name, meta))

    for name in sorted(tensors):
        meta = tensors[name]
        members = ties[id(meta)]
        if meta.numel() == 0:  # never an alias, as in _model_entries
            yield name, torch.empty(meta.shape, dtype=load_dtype(name, meta)), None
        elif len(members) == 1 or id(meta) in untied:
            yield name, read(name), None
        elif name != members[0]:
            yield name, meta, members[0]
        else:
            value, tied = _tie_value(members, [member for member in members if member in stored], read)
            if not tied:
                untied.add(id(meta))
            yield name, value, None


def _tie_value(members: list[str], present: list[str], read) -> tuple[torch.Tensor, bool]:
    """The value of a tie's first member (in name order), and whether from_pretrained keeps the tie: it does unless the
    files hold members with different values."""
    if not present:
        raise InvalidInput(f"the model files store none of the tied tensors {', '.join(members)}")
    values = [read(member) for member in present]
    if all(torch.equal(values[0], value) for value in values[1:]):
        return values[0], True
    if present != members:
        raise InvalidInput(f"the tied tensors {', '.join(members)} hold different values in the files and some are missing")
    return values[0], False
