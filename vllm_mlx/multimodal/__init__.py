"""Images in: fetching and policy, decoding, the vision-language model families, and
the cache of their features (``cache.py``, the public ``vllm_mlx.multimodal.cache``)."""
