"""KV cache bookkeeping: the block pool, block tables, prefix hashing, state slots and
checkpoints, sizing, per-tenant stats, and the manager the scheduler talks to."""
