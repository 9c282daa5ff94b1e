"""packstore: a persistent store and delivery service for knowledge packs (pre-computed KV caches)."""

__version__ = "0.1.0"
