"""``python -m vllm_mlx.config [--markdown] [--write PAGE ...]``: the docs' generated tables."""

from vllm_mlx.config.tables import main

raise SystemExit(main())
