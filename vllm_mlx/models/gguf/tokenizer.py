"""Build a Hugging Face ``tokenizer.json`` (with the ``tokenizers`` library) from GGUF metadata.

llama.cpp is the reference: the tokenizer built here gives the ids ``llama_tokenize(text,
add_special=True, parse_special=True)`` gives. Two vocabulary kinds (``tokenizer.ggml.model``):

``gpt2``: byte-level BPE with the file's merges and one of llama.cpp's pre-tokenizers
(``tokenizer.ggml.pre``, see ``pretokenizers.py``).

``llama``: SentencePiece BPE vocabularies (Llama 2, Mistral v0.1-v0.3, Gemma 2/3, Phi-3). llama.cpp
splits the text into characters and repeatedly merges the adjacent pair whose concatenation is a
vocabulary token with the highest score; characters no token covers become their ``<0xNN>`` byte
tokens. A ``tokenizers`` BPE model does the same when its merges are every split of every token
into two tokens, ranked by the token's score (transformers' SentencePiece converters build them so)
with ``byte_fallback``. The one difference is the order of two candidate merges of equal score:
llama.cpp takes the leftmost, BPE the earlier in the list; real vocabularies give their normal
tokens distinct scores (Gemma 3's decrease strictly with the id). Spaces become "▁"; with
``tokenizer.ggml.add_space_prefix`` (llama.cpp's default for this kind; Gemma files set it false)
every piece of text that starts the prompt or follows a special or added token gets a leading
"▁", as llama.cpp does (transformers' "legacy" Llama behaviour, a ``Prepend`` normalizer).

Why not transformers' own GGUF path (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``): it is
slower (~13 s on Gemma 3's 262k vocabulary against ~3 s here), it does not add the BOS token the
file asks for, and for Gemma it renames the all-space added tokens ("  ") to "▁▁" pieces left to
the merges, whereas llama.cpp (and SentencePiece, where they are user-defined pieces) matches the
longest one whole first: 40 spaces are 31 + 9 here and in llama.cpp, 16 + 24 there. The tests use
it as an independent oracle on text without such runs.

Token types (``tokenizer.ggml.token_type``): control (3) and unknown (2) tokens become special
added tokens, user-defined ones (4) plain added tokens, all matched in the raw text before the
rest, as llama.cpp's special-token partition does; normal (1), unused (5) and byte (6) tokens are
the model's vocabulary. ``tokenizer_config.json`` carries the BOS/EOS policy (``add_bos_token``,
``add_eos_token``, defaulting as llama.cpp does), which ``tokenizer.json``'s post-processor applies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vllm_mlx.models.gguf.pretokenizers import PRE_TOKENIZERS, BPEPreTokenizer
from vllm_mlx.platform.errors import ModelSourceError

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

SPACE = "\u2581"  # SentencePiece's "▁"
SUPPORTED_MODELS = ("gpt2", "llama")
# llama.cpp's ids when a SentencePiece file names none.
SPM_DEFAULT_IDS = {"bos": 1, "eos": 2, "unknown": 0}
# Tokens llama.cpp ends generation on by their text (and types as control whatever the file says).
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    }
)


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer a GGUF describes, with llama.cpp's defaults applied."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]
    special_ids: dict[str, int | None]  # bos, eos, unknown, padding
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    rstrip_special: bool  # llama.cpp strips the whitespace after Phi-3's special tokens

    @property
    def pre_tokenizer(self) -> BPEPreTokenizer:
        return PRE_TOKENIZERS[self.pre]

    def token(self, kind: str) -> str | None:
        token_id = self.special_ids.get(kind)
        return self.tokens[token_id] if token_id is not None else None


def _array(metadata: dict, key: str, default: list) -> list:
    value = metadata.get(f"tokenizer.ggml.{key}")
    return list(value) if value is not None else default


def _check_vocabulary(metadata: dict, tokens: list) -> None:
    """The vocabulary's arrays have the types and lengths they must (a malformed one is a clear
    ``ModelSourceError``, not a traceback from deep inside the tokenizer library)."""
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelSourceError("tokenizer.ggml.tokens is not a list of strings")
    per_token = {"token_type": (int,), "scores": (int, float)}
    for key, kinds in per_token.items():
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            continue
        if not isinstance(value, list) or len(value) != len(tokens) or not all(
            isinstance(v, kinds) and not isinstance(v, bool) for v in value
        ):
            raise ModelSourceError(f"tokenizer.ggml.{key} does not hold one number per token ({len(tokens)})")
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)):
        raise ModelSourceError("tokenizer.ggml.merges is not a list of strings")
    for kind in ("bos", "eos", "unknown", "padding", "eot", "eom", "sep"):
        token_id = metadata.get(f"tokenizer.ggml.{kind}_token_id")
        if token_id is not None and (not isinstance(token_id, int) or isinstance(token_id, bool)):
            raise ModelSourceError(f"tokenizer.ggml.{kind}_token_id is not an integer")


def read_vocab(metadata: dict) -> GGUFVocab:
    """The vocabulary and flags from GGUF metadata; unsupported kinds are refused by name."""
    model = metadata.get("tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre") or "default"
    if model not in SUPPORTED_MODELS or (model == "gpt2" and pre not in PRE_TOKENIZERS):
        raise ModelSourceError(
            f"unsupported GGUF tokenizer (model={model!r}, pre={pre!r}); supported: SentencePiece "
            f"(model 'llama') and byte-level BPE (model 'gpt2') with pre-tokenizer "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    if "tokenizer.ggml.tokens" not in metadata:
        raise ModelSourceError("the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    _check_vocabulary(metadata, tokens)
    types = _array(metadata, "token_type", [TOKEN_TYPE_NORMAL] * len(tokens))
    spm = model == "llama"
    special_ids = {}
    for kind in ("bos", "eos", "unknown", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{kind}_token_id")
        if token_id is None and spm:
            token_id = SPM_DEFAULT_IDS.get(kind)
        special_ids[kind] = int(token_id) if token_id is not None and int(token_id) < len(tokens) else None
    name = str(metadata.get("general.name", "")).lower()

    def flag(key: str, default: bool) -> bool:
        return bool(metadata.get(f"tokenizer.ggml.{key}", default))

    return GGUFVocab(
        model=model,
        pre=pre,
        tokens=tokens,
        types=[int(t) for t in types],
        scores=[float(s) for s in _array(metadata, "scores", [0.0] * len(tokens))],
        merges=_array(metadata, "merges", []),
        special_ids=special_ids,
        add_bos=flag("add_bos_token", spm or PRE_TOKENIZERS[pre].add_bos),
        add_eos=flag("add_eos_token", False),
        add_space_prefix=spm and flag("add_space_prefix", True),
        rstrip_special="phi-3" in name or "phi3" in name,
    )


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, best-scored token first.

    Ties go by the merged token's id, then by (left id, right id), as transformers orders them.
    """
    ids = {token: i for i, token in enumerate(tokens)}
    found = []
    for token_id, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id, right_id = ids.get(left), ids.get(right)
            if left_id is not None and right_id is not None:
                found.append((-scores[token_id], token_id, left_id, right_id))
    found.sort()
    return [(tokens[left], tokens[right]) for _, _, left, right in found]


def _spm_model(vocab: GGUFVocab):
    from tokenizers import decoders, models, normalizers

    unk = vocab.token("unknown")
    model = models.BPE(
        vocab={token: i for i, token in enumerate(vocab.tokens)},
        merges=spm_merges(vocab.tokens, vocab.scores),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    replace = normalizers.Replace(" ", SPACE)
    normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if vocab.add_space_prefix else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:  # drop the prefix space (mlx-lm picks its SPM detokenizer by this shape)
        steps.append(decoders.Strip(" ", 1, 0))
    return model, normalizer, decoders.Sequence(steps)


def _bpe_pre_tokenizer(pre: str):
    # The default model's (SmolLM2) layout is kept as it was: the same splits, built in.
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "gpt-2"):
        return byte_level
    return PRE_TOKENIZERS[pre].build()


def _bpe_model(vocab: GGUFVocab):
    from tokenizers import models

    # Split where llama.cpp does, at the first space after the first character; a merge without
    # one is skipped (llama.cpp keeps it as a pair of empty strings, which never matches).
    cuts = ((m, m.find(" ", 1)) for m in vocab.merges)
    merges = [(m[:cut], m[cut + 1 :]) for m, cut in cuts if cut > 0]
    return models.BPE(
        vocab={token: i for i, token in enumerate(vocab.tokens)},
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=vocab.pre_tokenizer.ignore_merges,
    )


def _post_processor(vocab: GGUFVocab, byte_level: bool):
    """BOS/EOS as the file asks (after ByteLevel's offsets step for byte-level vocabularies)."""
    from tokenizers import processors

    steps = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    ends = {kind: vocab.token(kind) for kind, wanted in (("bos", vocab.add_bos), ("eos", vocab.add_eos)) if wanted}
    ends = {kind: token for kind, token in ends.items() if token is not None}
    if ends:

        def template(sequence: str, type_id: int) -> str:
            parts = [ends.get("bos"), f"${sequence}", ends.get("eos")]
            return " ".join(f"{part}:{type_id}" for part in parts if part)

        special = {token: vocab.special_ids[kind] for kind, token in ends.items()}
        steps.append(
            processors.TemplateProcessing(
                single=template("A", 0),
                pair=f"{template('A', 0)} {template('B', 1)}",
                special_tokens=list(special.items()),
            )
        )
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else processors.Sequence(steps)


def _added_tokens(vocab: GGUFVocab) -> list:
    from tokenizers import AddedToken

    added = []
    for token, kind in zip(vocab.tokens, vocab.types):
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED):
            special = kind != TOKEN_TYPE_USER_DEFINED or token in EOG_TEXTS
            rstrip = vocab.rstrip_special and token not in ("<unk>", "<s>", "<|endoftext|>")
            added.append(AddedToken(token, special=special, normalized=False, rstrip=rstrip))
    return added


def build_tokenizer(metadata: dict):
    """A ``tokenizers.Tokenizer`` equivalent to the GGUF's tokenizer (as llama.cpp runs it)."""
    from tokenizers import Tokenizer, decoders

    vocab = read_vocab(metadata)
    if vocab.model == "llama":
        model, normalizer, decoder = _spm_model(vocab)
        tokenizer = Tokenizer(model)
        tokenizer.normalizer = normalizer
        tokenizer.decoder = decoder
    else:
        tokenizer = Tokenizer(_bpe_model(vocab))
        tokenizer.pre_tokenizer = _bpe_pre_tokenizer(vocab.pre)
        tokenizer.decoder = decoders.ByteLevel()
    post = _post_processor(vocab, byte_level=vocab.model == "gpt2")
    if post is not None:
        tokenizer.post_processor = post
    tokenizer.add_tokens(_added_tokens(vocab))
    return tokenizer


def eog_token_ids(metadata: dict) -> list[int]:
    """The ids llama.cpp ends generation on: EOS, the file's EOT/EOM ids, and tokens by text
    (``EOG_TEXTS``: ``<end_of_turn>``, ``<|im_end|>``, ``<|eot_id|>``, ...), with llama.cpp's two
    exceptions (``<|end|>`` beside ``<|return|>``/``<|call|>`` or ``<|calls|>``/``<|flush|>``;
    ``</s>`` beside ``<|tool_response>``). For ``config.json``'s ``eos_token_id`` list."""
    vocab = read_vocab(metadata)
    by_text = {token: i for i, token in enumerate(vocab.tokens) if token in EOG_TEXTS}
    ids = set(by_text.values())
    for key in ("eos", "eot", "eom"):
        token_id = vocab.special_ids["eos"] if key == "eos" else metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and int(token_id) < len(vocab.tokens):
            ids.add(int(token_id))
    has_call = "<|call|>" in by_text or "<|calls|>" in by_text
    if "<|end|>" in by_text and has_call and ("<|return|>" in by_text or "<|flush|>" in by_text):
        ids.discard(by_text["<|end|>"])  # gpt-oss / solar-open: "<|end|>" ends a message, not the turn
    if "</s>" in by_text and "<|tool_response>" in by_text:
        ids.discard(by_text["</s>"])
    return sorted(ids)


def chat_templates(metadata: dict) -> str | list[dict] | None:
    """``tokenizer.chat_template``, or with named ones (``tokenizer.chat_template.NAME``) the list
    form transformers reads (the unnamed one as "default")."""
    prefix = "tokenizer.chat_template."
    named = [
        {"name": key.removeprefix(prefix), "template": value}
        for key, value in sorted(metadata.items())
        if key.startswith(prefix) and value
    ]
    default = metadata.get("tokenizer.chat_template")
    if not named:
        return default or None
    return ([{"name": "default", "template": default}] if default else []) + named


def context_length(metadata: dict, default: int = 2048) -> int:
    arch = metadata.get("general.architecture", "llama")
    return int(metadata.get(f"{arch}.context_length", default))


def tokenizer_config(metadata: dict) -> dict:
    """``tokenizer_config.json``: special tokens, BOS/EOS policy and the chat template."""
    vocab = read_vocab(metadata)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.token("bos"),
        "eos_token": vocab.token("eos"),
        "pad_token": vocab.token("padding") or vocab.token("eos"),
        "unk_token": vocab.token("unknown"),
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": vocab.model == "gpt2" and vocab.pre_tokenizer.clean_spaces,
        "model_max_length": context_length(metadata),
    }
    template = chat_templates(metadata)
    if template:
        config["chat_template"] = template
    return config


def write_tokenizer_files(metadata: dict, out_dir: Path) -> None:
    build_tokenizer(metadata).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(metadata), indent=2) + "\n")
