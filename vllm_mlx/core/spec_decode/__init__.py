"""Speculative decoding's bookkeeping (no MLX): proposers that guess the next tokens cheaply, for
the target model to verify several positions in one forward (issue #28)."""
