"""Aggregate throughput and TTFT vs mlx-lm (same as ``vllm-mlx bench``); see --help."""

import sys

from vllm_mlx.entrypoints.bench import main

if __name__ == "__main__":
    sys.exit(main())
