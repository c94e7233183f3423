"""``TokenBound``: the fewest tokens a text's length allows, and the tokenizers that have none.

The bound must never exceed the real count (a prompt that fits would be refused): checked on the
default model's real tokenizer (byte-level BPE) with hypothesis, whitespace runs, special tokens
and non-ASCII text included. Tokenizers that can drop text get no bound.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from vllm_mlx.engine.token_bound import TokenBound, token_bound  # noqa: E402


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def default_bound(default_tokenizer):
    return token_bound(default_tokenizer)


def test_the_default_tokenizer_has_the_longest_token_as_its_bound(default_tokenizer):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    bound = token_bound(default_tokenizer)
    assert bound.max_token_chars == max(len(t) for t in default_tokenizer.get_vocab())
    assert token_bound(TokenizerWrapper(default_tokenizer)) == bound  # as the engine holds it
    assert bound.min_tokens("") == 0 and bound.min_tokens("a") == 1
    assert bound.min_tokens("a" * (bound.max_token_chars + 1)) == 2
    assert TokenBound().min_tokens("a" * 10**6) == 0  # no bound: nothing is refused untokenized


def test_characters_the_tokenizer_drops_are_not_counted(default_tokenizer, default_bound):
    """SmolLM2's byte-level vocabulary has no token for six ASCII control bytes: a text of them
    alone is no tokens at all (hypothesis found "\\x16"), and the bound counts them out."""
    assert default_bound.dropped == {chr(b) for b in (4, 6, 19, 20, 22, 29)}
    for text in ("\x16", "\x16" * 500, "a\x16b", "\x04\x06" * 100 + "x"):
        assert len(default_tokenizer.encode(text, add_special_tokens=False)) >= default_bound.min_tokens(text)
    assert default_bound.min_tokens("\x16" * 500) == 0


pieces = st.one_of(
    st.text(max_size=30),
    st.text(alphabet="\x04\x06\x13\x14\x16\x1da", max_size=100),  # the control bytes SmolLM2 drops
    st.text(alphabet=" \n\t", min_size=1, max_size=200),
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "#" * 90, "é" * 50, "漢字", "🙂" * 10, "1234567890"]),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(pieces, max_size=8).map("".join))
def test_the_bound_never_exceeds_the_real_count(default_tokenizer, default_bound, text):
    bound = default_bound
    assert len(default_tokenizer.encode(text, add_special_tokens=False)) >= bound.min_tokens(text)


def fast_tokenizer(model, pre_tokenizer=None, added: list | None = None):
    tok = tokenizers.Tokenizer(model)
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    if added:
        tok.add_special_tokens(added)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_tokenizer_that_drops_whitespace_has_no_bound():
    from tokenizers.models import WordPiece
    from tokenizers.pre_tokenizers import Whitespace

    wordpiece = fast_tokenizer(WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"), Whitespace())
    text = "a" + " " * 1000
    assert len(wordpiece.encode(text, add_special_tokens=False)) == 1  # a length bound would refuse it
    assert token_bound(wordpiece) == TokenBound()


def test_an_added_token_that_swallows_whitespace_means_no_bound():
    from tokenizers import AddedToken
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(ByteLevel.alphabet())}
    plain = fast_tokenizer(BPE(vocab, []), ByteLevel(add_prefix_space=False))
    assert token_bound(plain) == TokenBound(1)
    stripping = fast_tokenizer(BPE(vocab, []), ByteLevel(add_prefix_space=False), [AddedToken("<s>", rstrip=True)])
    assert token_bound(stripping) == TokenBound()


def test_something_that_is_not_a_fast_tokenizer_has_no_bound():
    assert token_bound(object()) == TokenBound()


def test_the_rendered_text_tokenizes_as_the_template_does(default_tokenizer):
    """The server renders, checks the length, then encodes: the same ids as the template's own
    tokenizing (special tokens in the text included)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from vllm_mlx.engine.chat import template_text, template_token_ids

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <|im_end|> there 🙂"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  spaces  \n\n and lines"},
    ]
    for tokenizer in (default_tokenizer, TokenizerWrapper(default_tokenizer)):
        text = template_text(tokenizer, messages)
        assert tokenizer.encode(text, add_special_tokens=False) == template_token_ids(tokenizer, messages)
