"""A bank's full-text index: BM25 over every fact (bm25s), English stopwords removed, Snowball stems.

Dense sentence embeddings blur rare strings a question shares verbatim with its fact (an invented
name, a product code); BM25 over the whole bank finds them whichever cluster holds the fact.
The index is rebuilt from the bank's texts when facts are added: BM25's document frequencies and
mean length change with every document, and a rebuild costs seconds at 100,000 facts.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from packstore.extras import require_extra
from packstore.format.bank import Cluster, encode_lexical

if TYPE_CHECKING:
    import bm25s
    import Stemmer

LEXICAL_KIND = "bm25s/en/snowball"  # recorded in BankMeta.lexical
# Lucene StandardAnalyzer's habits: a number with inner dots or commas is one token ("14.19",
# "81,080"), and one-character words count ("3-propyl..." keeps its "3"; English stopwords go).
TOKEN_PATTERN = r"(?u)\d+(?:[.,]\d+)+|\w+"
_STEMMERS = threading.local()  # PyStemmer objects are not safe to share between threads
_IMPORTING = threading.Lock()


@contextmanager
def _jax_hidden() -> Iterator[None]:
    """While it lasts, ``import jax`` fails (unless the program imported JAX already, which is left alone)."""
    hide = "jax" not in sys.modules
    if hide:
        sys.modules["jax"] = None  # type: ignore[assignment]  # None in sys.modules makes ``import jax`` fail
    try:
        yield
    finally:
        if hide:
            del sys.modules["jax"]


def _bm25s() -> ModuleType:
    """bm25s, imported on first use and without JAX: where JAX is installed, importing bm25s runs a JAX op that starts
    JAX's GPU client, which reserves most of a GPU's memory (a worker next to its model would lose it). packstore scores
    with bm25s's NumPy code alone, so JAX is hidden while bm25s is imported, once, here."""
    with _IMPORTING:
        loaded = sys.modules.get("bm25s")  # None also where an import of it was refused
        if loaded is not None:
            return loaded
        with _jax_hidden():
            return require_extra("bm25s", "lexical")


def _stemmer() -> Stemmer.Stemmer:
    if not hasattr(_STEMMERS, "english"):
        _STEMMERS.english = require_extra("Stemmer", "lexical").Stemmer("english")
    return _STEMMERS.english


def _tokens(texts: list[str], *, return_ids: bool) -> bm25s.tokenization.Tokenized | list[list[str]]:
    """bm25s's tokens of ``texts``: with ``return_ids`` as its ``Tokenized`` (ids and vocabulary), else as words."""
    return _bm25s().tokenize(
        texts, token_pattern=TOKEN_PATTERN, stopwords="en", stemmer=_stemmer(), return_ids=return_ids, show_progress=False
    )


@dataclass
class LexicalIndex:
    """BM25 over a bank's facts; document ``cluster_starts[c] + row`` is fact ``row`` of cluster ``c``."""

    retriever: bm25s.BM25
    cluster_starts: np.ndarray  # uint32 [clusters + 1]

    @classmethod
    def build(cls, clusters: Mapping[int, Cluster | None], cluster_count: int) -> LexicalIndex:
        """Index every fact of clusters ``0 .. cluster_count - 1`` in cluster order (missing clusters are empty)."""
        sizes = [len(c.texts) if (c := clusters.get(i)) is not None else 0 for i in range(cluster_count)]
        texts = [text for i in range(cluster_count) if (c := clusters.get(i)) is not None for text in c.texts]
        retriever = _bm25s().BM25()
        retriever.index(_tokens(texts, return_ids=True), show_progress=False)
        return cls(retriever, np.concatenate([[0], np.cumsum(sizes)]).astype(np.uint32))

    def query_terms(self, query: str) -> list[str]:
        """The query's stemmed terms that some document holds, in the query's order (a repeated word repeats: BM25
        counts it again)."""
        return [t for t in _tokens([query], return_ids=False)[0] if t in self.retriever.vocab_dict]

    def scores(self, query: str) -> np.ndarray:
        """BM25 of ``query`` against every document (0 where no query term occurs)."""
        terms = self.query_terms(query)
        if not terms:
            return np.zeros(int(self.cluster_starts[-1]), dtype=np.float32)
        return np.asarray(self.retriever.get_scores(terms), dtype=np.float32)

    def rare_term_documents(self, query: str, scores: np.ndarray, bound: int) -> np.ndarray:
        """Up to ``bound`` documents holding the query's rarest indexed terms: every document of the rarest term, then
        of the next rarest, while they fit; the term that does not fit wholly gives its best by ``scores`` (the query's
        BM25). A question that describes a fact shares its rare words (a place, a code) with it but few others, so
        these documents find facts that neither the query's vector nor its overall BM25 ranks near the top."""
        terms = list(dict.fromkeys(self.query_terms(query)))
        if bound < 1 or not terms:
            return np.zeros(0, dtype=np.int64)
        indptr, indices = self.retriever.scores["indptr"], self.retriever.scores["indices"]
        ids = np.asarray(self.retriever.get_tokens_ids(terms), dtype=np.int64)
        found = np.zeros(0, dtype=np.int64)
        for term in ids[np.argsort(indptr[ids + 1] - indptr[ids], kind="stable")]:
            documents = np.setdiff1d(np.asarray(indices[indptr[term] : indptr[term + 1]], dtype=np.int64), found)
            room = bound - len(found)
            if len(documents) >= room:
                return np.concatenate([found, documents[np.argpartition(-scores[documents], room - 1)[:room]]])
            found = np.concatenate([found, documents])
        return found

    def locate(self, documents: np.ndarray) -> list[tuple[int, int]]:
        """``(cluster, row)`` of each document index."""
        clusters = np.searchsorted(self.cluster_starts, documents, side="right") - 1
        return [(int(c), int(d - self.cluster_starts[c])) for c, d in zip(clusters, documents)]

    def to_bytes(self) -> bytes:
        """The sealed index record: the cluster starts and bm25s's own saved files."""
        with tempfile.TemporaryDirectory(prefix="packstore-bm25-") as folder:
            self.retriever.save(folder)
            members = {path.name: path.read_bytes() for path in sorted(Path(folder).iterdir())}
        return encode_lexical(self.cluster_starts, members)

    @classmethod
    def from_record(cls, record: tuple[np.ndarray, dict[str, bytes]]) -> LexicalIndex:
        """The index from a decoded record (``LmdbStore.bank_lexical``)."""
        starts, members = record
        with tempfile.TemporaryDirectory(prefix="packstore-bm25-") as folder:
            for name, data in members.items():
                (Path(folder) / Path(name).name).write_bytes(data)
            retriever = _bm25s().BM25.load(folder, show_progress=False)
        return cls(retriever, starts.copy())
