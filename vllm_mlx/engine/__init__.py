"""The engine loop (``EngineCore``: schedule, execute, update), its async front, input and
output processing, detokenizing and stop strings."""
