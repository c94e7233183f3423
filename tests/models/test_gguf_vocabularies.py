"""GGUF tokenizers of every supported kind against independent oracles.

SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``): a model trained here with the
``sentencepiece`` library, written into a GGUF as llama.cpp's converter does; the ids must equal
the ``sentencepiece`` processor's own. The real Gemma 3 file, when present, against transformers'
GGUF tokenizer. Byte-level BPE pre-tokenizers: against ``tests/bpe_reference.py`` with llama.cpp's
regexes, spelled as llama.cpp spells them, on text that tells the regexes apart.
"""

from __future__ import annotations

import json

import pytest
import sentencepiece as spm
from bpe_reference import ReferenceBPE, byte_symbols
from spm_reference import read_metadata, train_spm, write_spm_gguf

from vllm_mlx.models.gguf.header import open_gguf
from vllm_mlx.models.gguf.tokenizer import (
    build_tokenizer,
    tokenizer_config,
    write_tokenizer_files,
)
from vllm_mlx.platform.errors import ModelSourceError

SPM_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    " leading space, trailing space ",
    "  two leading spaces and   three inside",
    "line one\nline two\n\n\tindented\r\nwindows",
    "Numbers 1234567890, 3.14159 and 2,000,000",
    "naïve café — Ελληνικά русский Ünïcödé",
    "byte fallback: 🚀🎉 日本語 ﬁ \u00ad \U0001F9D1\u200D\U0001F680",
    "def main():\n    print('hello world')\n    return {'answer': 42}\n",
    "Don't stop: we're here, they've gone. What's up?!",
    "x",
    "",
]


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-space-prefix"])
def spm_case(request, tmp_path_factory):
    """(sentencepiece processor, GGUF metadata) for a model with/without SentencePiece's dummy prefix."""
    prefix = request.param
    sp = spm.SentencePieceProcessor(model_proto=train_spm(add_dummy_prefix=prefix))
    path = tmp_path_factory.mktemp("spm") / "tiny-spm.gguf"
    write_spm_gguf(path, sp, add_space_prefix=prefix)
    return sp, read_metadata(path)


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_spm_ids_match_sentencepiece(text, spm_case):
    sp, metadata = spm_case
    tokenizer = build_tokenizer(metadata)
    assert tokenizer.encode(text, add_special_tokens=False).ids == sp.encode(text)


def test_spm_texts_exercise_byte_fallback_and_merges(spm_case):
    sp, _ = spm_case
    pieces = sp.encode(" ".join(SPM_TEXTS), out_type=str)
    assert any(p.startswith("<0x") for p in pieces)  # characters outside the vocabulary
    assert any(len(p) > 3 and not p.startswith("<") for p in pieces)  # multi-merge tokens


def test_spm_merge_order_matters(spm_case):
    # Negative control: ranking merges by the opposite of the scores must change some ids.
    sp, metadata = spm_case
    flipped = dict(metadata, **{"tokenizer.ggml.scores": [-s for s in metadata["tokenizer.ggml.scores"]]})
    tokenizer = build_tokenizer(flipped)
    assert any(tokenizer.encode(t, add_special_tokens=False).ids != sp.encode(t) for t in SPM_TEXTS)


def test_spm_special_and_user_defined_tokens(spm_case):
    """Control and user-defined tokens are matched whole in the raw text; with a space prefix
    llama.cpp prefixes "▁" to every piece of text after one (SentencePiece would not)."""
    sp, metadata = spm_case
    tokenizer = build_tokenizer(metadata)
    for token in ("<ctl>", "<tag>"):
        text = f"before {token}after it"
        expected = sp.encode("before ") + [sp.PieceToId(token)] + sp.encode("after it")
        assert tokenizer.encode(text, add_special_tokens=False).ids == expected


def test_spm_bos_eos_policy(spm_case, tmp_path):
    sp, metadata = spm_case
    assert build_tokenizer(metadata).encode("hi").ids == [sp.bos_id(), *sp.encode("hi")]  # llama.cpp's default
    both = dict(metadata, **{"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True})
    assert build_tokenizer(both).encode("hi").ids == [*sp.encode("hi"), sp.eos_id()]
    config = tokenizer_config(both)
    assert (config["add_bos_token"], config["add_eos_token"]) == (False, True)
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")


def test_spm_directory_loads_in_mlx_lm(spm_case, tmp_path):
    import mlx_lm

    sp, metadata = spm_case
    write_tokenizer_files(metadata, tmp_path)
    tok = mlx_lm.tokenizer_utils.load(tmp_path)
    text = "Hello  world, naïve 🚀\n\tdone"
    assert tok.encode(text) == [sp.bos_id(), *sp.encode(text)]  # BOS once, as the file asks
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    detok = tok.detokenizer
    detok.reset()
    for token in sp.encode(text):
        detok.add_token(token)
    detok.finalize()
    assert detok.text == text  # mlx-lm picked its SentencePiece streaming detokenizer for this shape
    assert type(detok).__name__ == "SPMStreamingDetokenizer"


def test_phi3_special_tokens_strip_following_whitespace(tmp_path):
    # llama.cpp sets RSTRIP on Phi-3's special tokens (by model name), HF's Phi-3 tokenizer.json too.
    sp = spm.SentencePieceProcessor(model_proto=train_spm(add_dummy_prefix=True))
    path = tmp_path / "phi3.gguf"
    write_spm_gguf(path, sp, add_space_prefix=True, name="Phi-3-mini-4k-instruct")
    tokenizer = build_tokenizer(read_metadata(path))
    ids = tokenizer.encode("<ctl>\n  hello", add_special_tokens=False).ids
    assert ids == [sp.PieceToId("<ctl>"), *sp.encode("hello")]


# ---------------------------------------------------------------------------
# The real Gemma 3 file against transformers' GGUF tokenizer

GEMMA_TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "ünïcödé — naïve café, 日本語のテキスト, emoji 🚀🎉, Ελληνικά, русский",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\n\tif x != 0: pass",
    " leading space and trailing space ",
    "a\nb\r\nc\n\n\nd",
    "12345 3.14159 2,000,000",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<b>bold</b> <table><tr><td>x</td></tr></table>",
    "\u0000\u0001 control chars \u00ad soft hyphen \U0001F9D1\u200D\U0001F680 zwj \uE000",
]


@pytest.fixture(scope="module")
def gemma3_tokenizers(gemma3_gguf_path, tmp_path_factory):
    """(ours as mlx-lm loads the converted directory, transformers' GGUF tokenizer)."""
    # transformers reads GGUF files through its PyTorch utilities. torch is no dependency of ours:
    # CI runs these tests in the vLLM plugin's environment, which has it (.ci/run).
    pytest.importorskip("torch", reason="transformers' GGUF tokenizer (the oracle) needs torch")
    import mlx_lm
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("gemma3-tokenizer")
    write_tokenizer_files(open_gguf(gemma3_gguf_path).metadata, out)  # the converter's reader
    ours = mlx_lm.tokenizer_utils.load(out)
    theirs = AutoTokenizer.from_pretrained(str(gemma3_gguf_path.parent), gguf_file=gemma3_gguf_path.name)
    return ours, theirs


@pytest.mark.e2e
@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma3_ids_match_transformers(text, gemma3_tokenizers):
    ours, theirs = gemma3_tokenizers
    # transformers leaves out the BOS the file asks for (add_bos_token true); llama.cpp adds it.
    assert ours.encode(text) == [ours.bos_token_id, *theirs.encode(text, add_special_tokens=False)]
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


@pytest.mark.e2e
def test_gemma3_special_tokens(gemma3_tokenizers):
    ours, _ = gemma3_tokenizers
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert ours.encode("<start_of_turn>", add_special_tokens=False) == [105]
    assert ours.encode("a  b", add_special_tokens=False)[1] == 138  # "  " is a user-defined token
    assert ours.model_max_length == 32768  # gemma3.context_length
    # A run of spaces longer than the longest all-space token: longest match first, as llama.cpp's
    # special-token partition (and SentencePiece's user-defined pieces) do; transformers differs.
    vocab = ours.get_vocab()
    assert ours.encode("x" + " " * 40 + "y", add_special_tokens=False) == [
        vocab["x"], vocab[" " * 31], vocab[" " * 9], vocab["y"]
    ]


# ---------------------------------------------------------------------------
# Byte-level BPE pre-tokenizers

GPT2_CPP = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
CONTRACTIONS_CPP = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
REST_CPP = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# llama.cpp's lists (src/llama-vocab.cpp, llm_tokenizer_bpe), as llama.cpp spells them; tekken as
# Mistral's tokenizer.json spells it (llama.cpp's lookahead rewrite differs on non-ASCII capitals).
REFERENCE_PATTERNS = {
    "gpt-2": ([GPT2_CPP], False),
    "smollm": ([r"\p{N}", GPT2_CPP], False),
    "refact": ([r"\p{N}", GPT2_CPP], False),
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", GPT2_CPP, r"\p{N}+", "[0-9][0-9][0-9]"], False),
    "llama-bpe": ([CONTRACTIONS_CPP + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + REST_CPP], True),
    "qwen2": ([CONTRACTIONS_CPP + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + REST_CPP], False),
    "qwen35": (
        [
            CONTRACTIONS_CPP + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
            r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        ],
        False,
    ),
    "tekken": (
        [
            (
                r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            )
        ],
        True,
    ),
}
BPE_TEXTS = [
    "digits 1 12 123 1234 12345 1234567 3.14159 2,000,000",
    "DON'T I'M YOU'RE we'LL it's they'Ve she'D",
    "hello\n\n\nworld  \n  x\r\n\r\n end\n",
    "ἙΛΛΆΣ café naïve Ünïcödé русский 日本語のテキスト",
    "combining marks: nai\u0308ve cafe\u0301 x\u0301 हिन्दी ภาษาไทย",
    "$$$ !!! ... <=> ^~| foo-bar_baz (a)[b]{c} @#%&*",
    "camelCaseÉté ΑβΓδ aÉ HTTPServer iPhone McDonald's",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\n\tif x != 0: pass",
    "<|im_start|>user\n  leading and trailing  <|im_end|>",
]


# SmolLM2's vocabulary has no multi-digit tokens, no "'T" and no letter joined to a combining mark:
# merges appended (lowest priority) so that digit grouping, case-insensitive contractions and
# marks kept with their letter (qwen35) change ids. Byte-level spelling: U+0301 is "Ìģ", " " is "Ġ".
ACUTE = "".join(byte_symbols()[b] for b in "\u0301".encode())
EXTRA_MERGES = [
    *[("1", "2"), ("12", "3"), ("4", "5")],
    *[("'", "T"), ("'", "M"), ("'", "D")],
    *[(ACUTE[0], ACUTE[1]), ("Ġx", ACUTE)],
]


@pytest.fixture(scope="module")
def smollm_metadata():
    """The default model's byte-level vocabulary and merges (plus ``EXTRA_MERGES``), as plain values."""
    import mlx.core as mx

    from vllm_mlx.models.catalog import SMOLLM2, checkpoint_gguf

    _, raw = mx.load(str(checkpoint_gguf(SMOLLM2)), return_metadata=True)
    metadata = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in raw.items() if k.startswith(("tokenizer.", "general."))}
    tokens, types, merges = (list(metadata[f"tokenizer.ggml.{k}"]) for k in ("tokens", "token_type", "merges"))
    for left, right in EXTRA_MERGES:
        assert left + right not in tokens
        tokens.append(left + right)
        types.append(1)
        merges.append(f"{left} {right}")
    metadata.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges})
    return metadata


def with_pre(metadata: dict, pre: str) -> dict:
    return dict(metadata, **{"tokenizer.ggml.pre": pre})


@pytest.fixture(scope="module")
def bpe_encodings(smollm_metadata):
    """{pre: [ids of each of ``BPE_TEXTS``]} from the tokenizer we build for that pre-tokenizer."""
    encodings = {}
    for pre in REFERENCE_PATTERNS:
        tokenizer = build_tokenizer(with_pre(smollm_metadata, pre))
        encodings[pre] = [tokenizer.encode(text, add_special_tokens=False).ids for text in BPE_TEXTS]
    return encodings


@pytest.mark.parametrize("pre", sorted(REFERENCE_PATTERNS))
def test_bpe_pre_tokenizers_match_reference(pre, smollm_metadata, bpe_encodings):
    tokens = smollm_metadata["tokenizer.ggml.tokens"]
    special = [t for t, kind in zip(tokens, smollm_metadata["tokenizer.ggml.token_type"]) if kind == 3]
    patterns, ignore_merges = REFERENCE_PATTERNS[pre]
    merges = smollm_metadata["tokenizer.ggml.merges"]
    reference = ReferenceBPE(tokens, merges, special, patterns=patterns, ignore_merges=ignore_merges)
    for text, ids in zip(BPE_TEXTS, bpe_encodings[pre]):
        assert ids == reference.encode(text), text


def test_bpe_texts_tell_the_pre_tokenizers_apart(bpe_encodings):
    # Guards the test above against texts on which the regexes agree anyway.
    distinct = {json.dumps(ids) for pre, ids in bpe_encodings.items() if pre != "refact"}
    assert len(distinct) == len(REFERENCE_PATTERNS) - 1  # refact is smollm's list under another name


def test_ignore_merges_takes_whole_tokens():
    symbols = list(byte_symbols().values())
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": symbols + ["ab", "abc"],
        "tokenizer.ggml.token_type": [1] * (len(symbols) + 2),
        "tokenizer.ggml.merges": ["a b"],
    }
    abc = len(symbols) + 1
    ids = {pre: build_tokenizer(with_pre(metadata, pre)).encode("abc").ids for pre in ("llama-bpe", "gpt-2")}
    assert ids == {"llama-bpe": [abc], "gpt-2": [abc - 1, symbols.index("c")]}
    for pre in ("llama-bpe", "gpt-2"):
        patterns, ignore = REFERENCE_PATTERNS[pre]
        reference = ReferenceBPE(metadata["tokenizer.ggml.tokens"], ["a b"], [], patterns=patterns, ignore_merges=ignore)
        assert reference.encode("abc") == ids[pre]


def test_llama3_adds_bos_unless_the_file_says_no(smollm_metadata):
    metadata = with_pre(smollm_metadata, "llama-bpe")
    del metadata["tokenizer.ggml.add_bos_token"]  # SmolLM2's file says false
    bos = metadata["tokenizer.ggml.bos_token_id"]
    assert build_tokenizer(metadata).encode("hi").ids[0] == bos  # llama.cpp's default for llama-bpe
    assert tokenizer_config(metadata)["add_bos_token"] is True
    off = dict(metadata, **{"tokenizer.ggml.add_bos_token": False})
    assert bos not in build_tokenizer(off).encode("hi").ids
    assert tokenizer_config(off)["add_bos_token"] is False


# ---------------------------------------------------------------------------
# Refusals and tokenizer_config.json


@pytest.mark.parametrize(
    ("model", "pre", "named"),
    [("gpt2", "jais-2000", "jais-2000"), ("bert", "default", "bert"), ("t5", None, "t5")],
)
def test_unknown_tokenizer_refused_by_name(model, pre, named, smollm_metadata):
    metadata = dict(smollm_metadata, **{"tokenizer.ggml.model": model, "tokenizer.ggml.pre": pre})
    with pytest.raises(ModelSourceError) as info:
        build_tokenizer(metadata)
    assert named in str(info.value) and "llama-bpe" in str(info.value) and "qwen2" in str(info.value)


def test_config_context_length_and_named_templates(smollm_metadata):
    metadata = dict(
        smollm_metadata,
        **{
            "general.architecture": "qwen3",
            "qwen3.context_length": 40960,
            "llama.context_length": 8192,
            "tokenizer.chat_template": "{{ main }}",
            "tokenizer.chat_template.tool_use": "{{ tools }}",
        },
    )
    config = tokenizer_config(metadata)
    assert config["model_max_length"] == 40960
    assert config["chat_template"] == [
        {"name": "default", "template": "{{ main }}"},
        {"name": "tool_use", "template": "{{ tools }}"},
    ]
    assert tokenizer_config(smollm_metadata)["chat_template"] == smollm_metadata["tokenizer.chat_template"]


def test_eog_ids_as_llama_cpp_finds_them(smollm_metadata):
    from vllm_mlx.models.gguf.tokenizer import eog_token_ids

    tokens = smollm_metadata["tokenizer.ggml.tokens"]
    # SmolLM2: EOS <|im_end|> (2) and, by its text, <|endoftext|> (0).
    assert eog_token_ids(smollm_metadata) == sorted({tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")})
    # Gemma-style: EOS <eos> plus <end_of_turn>, found by text; a file's EOT id is added.
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "▁hi"],
        "tokenizer.ggml.token_type": [3, 3, 3, 3, 3, 4, 1],
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.eot_token_id": 6,
    }
    assert eog_token_ids(metadata) == [1, 5, 6]
    # "<end_of_turn>" typed user-defined is still special, as llama.cpp forces it to control.
    added = {t.content: t.special for t in build_tokenizer(metadata).get_added_tokens_decoder().values()}
    assert added["<end_of_turn>"] is True
    # gpt-oss: "<|end|>" beside "<|return|>" and "<|call|>" does not end generation.
    harmony = dict(metadata, **{"tokenizer.ggml.tokens": ["<|end|>", "<|return|>", "<|call|>", "x", "y", "z", "w"]})
    harmony.pop("tokenizer.ggml.eot_token_id")
    assert eog_token_ids(harmony) == [1, 2]
