"""Build a Hugging Face ``tokenizer.json`` (with the ``tokenizers`` library) from GGUF metadata.

Supported: byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) with the
pre-tokenizers below. Control tokens (GGUF token type 3) become special added tokens and
user-defined ones (type 4) plain added tokens, as llama.cpp treats them.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_mlx.platform.errors import ModelSourceError

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def _byte_level(**kwargs):
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True, **kwargs)


def _smollm_pre_tokenizer():
    # SmolLM splits every digit on its own, then applies GPT-2's byte-level regex.
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


PRE_TOKENIZERS = {"smollm": _smollm_pre_tokenizer, "gpt2": _byte_level, "default": _byte_level}


def build_tokenizer(metadata: dict):
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF's tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = metadata.get("tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ModelSourceError(
            f"unsupported GGUF tokenizer (model={kind!r}, pre={pre!r}); "
            f"supported: byte-level BPE with pre-tokenizer {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = metadata["tokenizer.ggml.token_type"]
    added = [
        AddedToken(tokens[i], special=t == TOKEN_TYPE_CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    return tokenizer


def tokenizer_config(metadata: dict) -> dict:
    """``tokenizer_config.json``: special tokens, BOS policy and the chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(key: str):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(token_id)] if token_id is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding") or token("eos"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get("llama.context_length", 2048)),
    }
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def write_tokenizer_files(metadata: dict, out_dir: Path) -> None:
    build_tokenizer(metadata).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(metadata), indent=2) + "\n")
