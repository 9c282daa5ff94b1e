"""Fact banks: embeddings, k-means clusters and a full-text index over a store's bank tables, routed per query (``bank.bank``)."""
