"""Checks and reproductions: tenant isolation over many requests, the guard's limits, RSS of the
engine and the embedder alone, the Triton BLS-stream crash and its stress load, and the
dashboard rendered from a real run."""
