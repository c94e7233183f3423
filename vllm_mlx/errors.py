"""Errors that reach users as one clear line (the CLI prints them without a traceback)."""


class VllmMlxError(Exception):
    """Base class for the errors this package raises on purpose, with a message fit for users."""


class ModelSourceError(VllmMlxError):
    """A model source cannot be resolved: a missing path, a bad GGUF, a failed download."""


class ImageInputError(VllmMlxError):
    """An image input cannot be used: missing, unreadable, too large, or a failed fetch."""
