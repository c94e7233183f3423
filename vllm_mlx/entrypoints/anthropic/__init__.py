"""Anthropic's Messages API (``/v1/messages``) on the same engine, translated to chat completions."""
