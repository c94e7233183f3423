"""A tiny SentencePiece BPE model, and a GGUF holding its vocabulary the way llama.cpp's converter
writes one (``convert_hf_to_gguf.py``, ``_create_vocab_sentencepiece``).

Independent of ``vllm_mlx``: the model is trained with the ``sentencepiece`` library, whose own
processor is the oracle; the file is written with gguf-py's ``GGUFWriter`` and read back with its
``GGUFReader`` into the plain ``{key: value}`` dict the converter passes to the tokenizer builder.
"""

from __future__ import annotations

import io
from pathlib import Path

import sentencepiece as spm
from gguf import GGUFReader, GGUFWriter, TokenType

USER_DEFINED = ["<tag>"]
CONTROL = ["<ctl>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Then it sleeps under the old oak tree.",
    "def main():\n    print('hello world')\n    return {'answer': 42}\n",
    "for i in range(10):\n\tif i % 2 == 0:\n\t\tcontinue\n",
    "Numbers 1234567890 and 3.14159, 2,000,000 or 0.001; dates 2024-01-31.",
    "naïve café déjà vu — Ελληνικά, русский текст, Ünïcödé",
    "  indented  text with   several    spaces\n\nand blank lines\n",
    "Don't stop: we're here, they've gone, I'll wait. What's up?!",
]


def train_spm(add_dummy_prefix: bool, vocab_size: int = 500) -> bytes:
    """A BPE model with byte fallback and identity normalization, like Llama 2's."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 30),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        user_defined_symbols=USER_DEFINED,
        control_symbols=CONTROL,
        minloglevel=2,
    )
    return model.getvalue()


def token_type(sp: spm.SentencePieceProcessor, i: int) -> int:
    """llama.cpp's converter's types; user-defined pieces as when ``added_tokens_decoder`` lists them."""
    if sp.IsUnknown(i):
        return int(TokenType.UNKNOWN)
    if sp.IsControl(i):
        return int(TokenType.CONTROL)
    if sp.IsUnused(i):
        return int(TokenType.UNUSED)
    if sp.IsByte(i):
        return int(TokenType.BYTE)
    if sp.IdToPiece(i) in USER_DEFINED:
        return int(TokenType.USER_DEFINED)
    return int(TokenType.NORMAL)


def write_spm_gguf(path: Path, sp: spm.SentencePieceProcessor, add_space_prefix: bool, **extra) -> None:
    """A tokenizer-only GGUF; ``extra`` adds ``tokenizer.ggml.*`` keys (e.g. add_bos_token=False)."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(extra.pop("name", "tiny-spm-test"))
    writer.add_context_length(512)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([sp.IdToPiece(i) for i in range(sp.GetPieceSize())])
    writer.add_token_scores([sp.GetScore(i) for i in range(sp.GetPieceSize())])
    writer.add_token_types([token_type(sp, i) for i in range(sp.GetPieceSize())])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_space_prefix(add_space_prefix)
    for key, value in extra.items():
        writer.add_bool(f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def read_metadata(path: Path) -> dict:
    """``{key: plain Python value}`` as the converter passes it (strings as str, arrays as lists)."""
    reader = GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
