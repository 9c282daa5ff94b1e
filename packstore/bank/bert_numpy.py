"""A sentence-transformers BERT embedder (all-MiniLM-L6-v2: BERT, mean pooling, unit length) computed in NumPy, so a
bank embedded by it routes by meaning where torch is not installed (``packstore[route]``: tokenizers, safetensors).

The forward is BERT's own (embeddings, then per layer self-attention and a GELU feed-forward, each with a residual
and LayerNorm), one text at a time and unpadded, in float32 from the same ``model.safetensors``. It is not torch's
arithmetic: its vectors differ from sentence-transformers' in the last bits (tests/unit/test_bert_numpy.py bounds the
difference), which moves no route in practice; a bank records the model's files, and both read the same files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from packstore.extras import require_extra

_SQRT_HALF = np.float32(1 / math.sqrt(2))


def _erf(x: np.ndarray) -> np.ndarray:
    """erf, vectorized, to within 1.2e-7 (Numerical Recipes' Chebyshev fit of erfc): BERT's GELU is
    x * (1 + erf(x / sqrt 2)) / 2, and NumPy has no erf."""
    sign = np.sign(x)
    a = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = -a * a - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    found: np.ndarray = (sign * (1.0 - t * np.exp(poly))).astype(np.float32)
    return found


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    normed: np.ndarray = ((x - mean) / np.sqrt(var + eps)) * weight + bias
    return normed


def is_numpy_bert(directory: Path) -> bool:
    """Whether ``directory`` is a sentence-transformers model this module computes: a BERT with absolute positions,
    mean pooling and normalization (all-MiniLM-L6-v2 is)."""
    try:
        config = json.loads((directory / "config.json").read_text())
        modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((directory / "modules.json").read_text())]
        pooling = json.loads((directory / "1_Pooling" / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return False
    plain = config.get("model_type") == "bert" and config.get("position_embedding_type", "absolute") == "absolute"
    plain = plain and config.get("hidden_act") == "gelu" and (directory / "model.safetensors").is_file()
    return plain and modules == ["Transformer", "Pooling", "Normalize"] and pooling.get("pooling_mode_mean_tokens") is True


@dataclass
class NumpyBert:
    """The model in ``directory`` (``is_numpy_bert``), its weights read once."""

    directory: Path

    @cached_property
    def config(self) -> dict[str, Any]:
        found: dict[str, Any] = json.loads((self.directory / "config.json").read_text())
        return found

    @cached_property
    def weights(self) -> dict[str, np.ndarray]:
        safetensors_numpy = require_extra("safetensors.numpy", "route")
        found: dict[str, np.ndarray] = safetensors_numpy.load_file(str(self.directory / "model.safetensors"))
        return {name.removeprefix("bert."): value.astype(np.float32) for name, value in found.items() if value.dtype != np.int64}

    @cached_property
    def tokenizer(self) -> Any:
        tokenizers = require_extra("tokenizers", "route")
        tokenizer = tokenizers.Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        limit = json.loads((self.directory / "sentence_bert_config.json").read_text()).get("max_seq_length", 512)
        tokenizer.no_padding()
        tokenizer.enable_truncation(int(limit))
        return tokenizer

    @property
    def dim(self) -> int:
        return int(self.config["hidden_size"])

    def embed(self, texts: list[str]) -> np.ndarray:
        """``[len(texts), dim]`` float32, unit length, mean-pooled over each text's tokens."""
        rows = [self._pooled(self.tokenizer.encode(text).ids) for text in texts]
        vectors = np.array(rows, dtype=np.float32).reshape(len(texts), self.dim)
        unit: np.ndarray = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return unit

    def _pooled(self, ids: list[int]) -> np.ndarray:
        w, eps = self.weights, float(self.config["layer_norm_eps"])
        heads = int(self.config["num_attention_heads"])
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][: len(ids)]
        x = x + w["embeddings.token_type_embeddings.weight"][0]
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        width = x.shape[1] // heads
        for layer in range(int(self.config["num_hidden_layers"])):
            p = f"encoder.layer.{layer}."

            def dense(h: np.ndarray, name: str, p: str = p) -> np.ndarray:
                out: np.ndarray = h @ w[p + name + ".weight"].T + w[p + name + ".bias"]
                return out

            q, k, v = (dense(x, f"attention.self.{n}").reshape(-1, heads, width).transpose(1, 0, 2) for n in ("query", "key", "value"))
            scores = q @ k.transpose(0, 2, 1) / np.float32(math.sqrt(width))
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            context = ((scores / scores.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(len(ids), -1)
            x = _layer_norm(dense(context, "attention.output.dense") + x, w[p + "attention.output.LayerNorm.weight"],
                            w[p + "attention.output.LayerNorm.bias"], eps)
            inner = dense(x, "intermediate.dense")
            inner = inner * np.float32(0.5) * (np.float32(1) + _erf(inner * _SQRT_HALF))
            x = _layer_norm(dense(inner, "output.dense") + x, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
        pooled: np.ndarray = x.mean(0)
        return pooled
