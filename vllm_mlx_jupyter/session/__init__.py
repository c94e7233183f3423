"""A ``%%generate`` cell's life in the kernel: the session (one engine per kernel), its
generations, how a cell becomes a prompt (interpolation, tools, constraints) and how the
output is read (content, reasoning, tool calls, parsed objects)."""
