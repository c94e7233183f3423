"""The vLLM platform plugin: the only code that imports torch and vllm."""
