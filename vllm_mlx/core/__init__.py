"""The engine's plain data and bookkeeping: requests, outputs, scheduling, the KV cache's
blocks. No MLX: everything here runs (and is tested) without a model."""
