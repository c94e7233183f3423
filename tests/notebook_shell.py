"""An in-process IPython shell with the extension loaded and a model started: the magics' tests."""

from __future__ import annotations

from contextlib import contextmanager

from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output


@contextmanager
def loaded_shell(model_dir, engine_options: dict, **magics_config):
    """The shell, ``%vllm_mlx load``-ed on ``model_dir`` with ``engine_options``;
    ``magics_config``: ``GenerateMagics`` traits (``max_tokens=16``, ``temperature=0.0``)."""
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "vllm_mlx_jupyter")
    shell.run_line_magic("config", f"GenerateMagics.model = {str(model_dir)!r}")
    shell.run_line_magic("config", f"GenerateMagics.engine_options = {engine_options!r}")
    for name, value in magics_config.items():
        shell.run_line_magic("config", f"GenerateMagics.{name} = {value!r}")
    with capture_output():
        shell.run_line_magic("vllm_mlx", "load")
    try:
        yield shell
    finally:
        shell.run_line_magic("unload_ext", "vllm_mlx_jupyter")


def generate(ip, line: str, cell: str = "Tell me a story."):
    """A ``%%generate`` cell run in ``ip`` (output captured); returns the generation at once."""
    with capture_output():
        return ip.run_cell_magic("generate", line, cell)
