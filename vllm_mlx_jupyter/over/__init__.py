"""``%%generate --over``: one template over many rows (a list or a DataFrame), fed to the shared
engine with backpressure, and its results table."""
