"""Banks: large fact sets stored as text + embedding, clustered by k-means, routed per query."""
