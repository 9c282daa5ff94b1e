"""Model and template identities: sha256 over canonical JSON of what shapes the KV cache / the tokens."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch

from packstore.format.header import canonical_json, sha256_hex

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (name, dtype, shape, bytes) in name order.

    Tied tensors are hashed once and recorded as aliases, so the digest depends on values, not layout.
    """
    digest = hashlib.sha256()
    seen: dict[tuple[int, int], str] = {}
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach()
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        digest.update(canonical_json([name, str(tensor.dtype), list(tensor.shape)]))
        if identity in seen and tensor.numel() > 0:
            digest.update(b"alias:" + seen[identity].encode())
            continue
        seen[identity] = name
        data = tensor.to("cpu").contiguous().view(torch.uint8).flatten().numpy()
        digest.update(memoryview(data))
    return digest.hexdigest()


def model_identity(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, Any]:
    """The fields that decide what KV cache a model computes for given tokens."""
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
        "weights_sha256": weights_digest(model),
    }


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
