"""The machine and the ground floor: the CPU backend (BLAS), MLX's threads, the errors
shared by all layers, and the checks where untrusted input enters (``validation.py``)."""
