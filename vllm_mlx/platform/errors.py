"""Errors that reach users as one clear line (the CLI prints them without a traceback)."""


class VllmMlxError(Exception):
    """Base class for the errors this package raises on purpose, with a message fit for users."""


class ModelSourceError(VllmMlxError):
    """A model source cannot be resolved: a missing path, a bad GGUF, a failed download."""


class ModelMemoryError(VllmMlxError):
    """A model cannot fit the memory the engine may use, in the weight format asked for (or in
    any, for "auto"): refused before its weights are loaded, with the figures."""


class ImageInputError(VllmMlxError):
    """An image input cannot be used: missing, unreadable, too large, or a failed fetch."""


def internal_error_message(exc: BaseException) -> str:
    """What a caller sees when its request failed unexpectedly: the kind, not the details
    (they can name local paths or other requests; the log has them). The engine goes on."""
    return f"internal error while running this request ({type(exc).__name__})"
