"""The embedding (semantic) cache: embedder, vector cache, per-scope index and the hit guard."""
