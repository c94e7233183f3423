"""IncrementalDetokenizer against the real tokenizer of the built-in default model."""

from __future__ import annotations

import gc
import random
import string
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_mlx.engine.detokenizer import IncrementalDetokenizer
from vllm_mlx.engine.stop_strings import StopScanner, automaton

FFFD = "\ufffd"


@pytest.fixture(scope="session")
def tok():
    import mlx_lm

    from vllm_mlx.models import resolve_model

    return mlx_lm.tokenizer_utils.load(resolve_model("default"))


@pytest.fixture(scope="session")
def chat_prompt_ids(tok):
    return tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def stream(tok, ids, prompt=(), chunks=None, **kwargs):
    """Feed ``ids`` (one at a time, or in ``chunks`` sizes, cycled); return (detok, pieces)."""
    detok = IncrementalDetokenizer(tok, list(prompt), **kwargs)
    pieces, i, sizes = [], 0, list(chunks or [1])
    while i < len(ids):
        size = sizes[len(pieces) % len(sizes)]
        pieces.append(detok.add_tokens(ids[i : i + size]))
        i += size
    return detok, pieces


def expected_stop(text, stops):
    """The reference result: the text as if streamed one character at a time."""
    hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s and s in text]
    if not hits:
        return text, None
    end, neg_len, stop = min(hits)
    return text[: end + neg_len], stop


# Text with multi-byte characters (emoji incl. ZWJ/modifiers, CJK, accents), whitespace and code.
SNIPPETS = ["😀", "🦙", "👍🏽", "👨‍👩‍👧", "🇫🇷", "日本語", "中文", "한국어", "é", "ñ", "ü", "œ", "𝔘", " ", "  ", "\n",
            "\t", "\r\n", "def f(x):", "    return", "{'a': [1, 2]}", "x != y", "// c", "café", "naïve"]
TEXT = st.lists(
    st.one_of(st.sampled_from(SNIPPETS), st.characters(exclude_categories=("Cs",), exclude_characters=FFFD)),
    max_size=40,
).map("".join)
CHUNKS = st.lists(st.integers(1, 5), min_size=1, max_size=6)
PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(text=TEXT, chunks=st.one_of(st.just([1]), CHUNKS), with_prompt=st.booleans())
def test_stream_equals_full_decode(tok, chat_prompt_ids, text, chunks, with_prompt):
    ids = tok.encode(text)
    full = tok.decode(ids)
    detok, pieces = stream(tok, ids, chat_prompt_ids if with_prompt else (), chunks)
    if FFFD not in full:  # a few rare characters lose bytes in this vocabulary: no valid text then
        assert all(FFFD not in piece for piece in pieces)
    pieces.append(detok.finish())
    assert "".join(pieces) == detok.text == full
    assert detok.stop_string is None


@PROPERTY
@given(text=TEXT, chunks=st.one_of(st.just([1]), CHUNKS), data=st.data())
def test_stop_strings_match_character_streaming(tok, text, chunks, data):
    ids = tok.encode(text)
    full = tok.decode(ids)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if full and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[start : data.draw(st.integers(start + 1, min(len(full), start + 6)))])
        else:
            stops.append(data.draw(st.text(min_size=1, max_size=4)))
    want_text, want_stop = expected_stop(full, stops)
    detok, pieces = stream(tok, ids, chunks=chunks, stop=stops)
    pieces.append(detok.finish())
    visible = ""
    for piece in pieces:
        visible += piece
        assert want_text.startswith(visible)  # nothing shown that later turned out to be a stop
    assert visible == detok.text == want_text
    assert detok.stop_string == want_stop


def test_split_emoji_is_held_until_complete(tok):
    ids = tok.encode("a 🦙 b")
    assert any(FFFD in tok.decode([i]) for i in ids)
    detok, pieces = stream(tok, ids)
    assert pieces[0] == "a"
    emoji_piece = next(i for i, p in enumerate(pieces) if "🦙" in p)
    assert pieces[emoji_piece] == " 🦙"
    assert all(p == "" for p in pieces[1:emoji_piece])
    assert emoji_piece > 1  # the emoji really was split across tokens
    assert detok.finish() == ""
    assert detok.text == "a 🦙 b"


@pytest.mark.parametrize("stop, before, span", [("d.", "Hello worl", 2), ("d. Th", "Hello worl", 3),
                                                ("ld. T", "Hello wor", 3)])
def test_stop_string_across_tokens(tok, stop, before, span):
    ids = tok.encode("Hello world. The end")
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    pieces = []
    for i in ids:
        pieces.append(detok.add_tokens([i]))
        if detok.stop_string:
            break
    consumed = len(pieces)
    assert "".join(pieces) == detok.text == before
    assert detok.stop_string == stop
    assert stop in tok.decode(ids[consumed - span : consumed])
    assert stop not in tok.decode(ids[consumed - span + 1 : consumed])
    assert detok.add_tokens(ids[consumed:]) == ""
    assert detok.finish() == ""
    assert detok.text == before


def test_held_prefix_is_released(tok):
    ids = tok.encode("Paris is nice")
    detok, pieces = stream(tok, ids, stop=["Paris!"])
    assert pieces[0] == ""  # "Paris" might become "Paris!"
    assert pieces[1] == "Paris is"
    assert detok.finish() == ""
    assert detok.text == "Paris is nice"
    assert detok.stop_string is None


@pytest.mark.parametrize("stops", [["end", "world"], ["world", "end"], ["The end", "o w"]])
def test_earliest_stop_wins(tok, stops):
    ids = tok.encode("Hello world. The end")
    for chunks in ([1], [len(ids)]):
        detok, pieces = stream(tok, ids, chunks=chunks, stop=stops)
        want = "Hello " if "world" in stops else "Hell"
        assert "".join(pieces) == detok.text == want
        assert detok.stop_string == ("world" if "world" in stops else "o w")


def test_skip_special_tokens(tok):
    ids = tok.encode("Hi") + [tok.convert_tokens_to_ids("<|im_end|>")]
    detok, pieces = stream(tok, ids)
    assert "".join(pieces) + detok.finish() == detok.text == "Hi"
    detok, pieces = stream(tok, ids, skip_special_tokens=False)
    assert "".join(pieces) + detok.finish() == detok.text == "Hi<|im_end|>"


def test_leading_space_of_first_output_token(tok):
    detok, pieces = stream(tok, tok.encode(" world"), prompt=tok.encode("Hello"))
    assert pieces == [" world"]
    assert detok.finish() == ""


def test_finish_flushes_held_text(tok):
    detok, pieces = stream(tok, tok.encode("I love Paris"), stop=["Paris!"])
    assert "".join(pieces) == detok.text == "I love "
    assert detok.finish() == "Paris"
    assert detok.text == "I love Paris"
    assert detok.finish() == "" and detok.add_tokens(tok.encode("!")) == ""


def test_finish_emits_truncated_character_as_is(tok):
    ids = tok.encode("a 🦙")[:-1]  # the model stopped in the middle of the emoji
    detok, pieces = stream(tok, ids)
    assert "".join(pieces) == "a"
    tail = detok.finish()
    assert tail.endswith(FFFD)
    assert detok.text == tok.decode(ids)


def test_long_run_of_split_characters_in_chunks(tok):
    # Chunks that always end inside a character stall the window; text is still never broken.
    text = "😀😀😀👨\u200d👩\u200d👧" * 3
    ids = tok.encode(text)
    detok, pieces = stream(tok, ids, chunks=[2, 5, 1])
    assert all(FFFD not in p for p in pieces)
    assert "".join(pieces) + detok.finish() == text


def test_plain_transformers_tokenizer(tok):
    plain = tok._tokenizer  # the transformers tokenizer the mlx-lm wrapper forwards to
    ids = tok.encode("Bonjour 🦙, ça va ? <|im_end|>")
    for t in (tok, plain):
        detok, pieces = stream(t, ids, prompt=tok.encode("Hi"), stop=["va ?"])
        assert "".join(pieces) == detok.text == "Bonjour 🦙, ça "
        assert detok.stop_string == "va ?"


def test_undecodable_run_does_not_grow_the_window(tok):
    lone_bytes = tok.encode("🦙")[1:2] * 100  # continuation bytes that never form a character
    detok, pieces = stream(tok, lone_bytes)
    assert len(detok._ids) <= 40
    assert "".join(pieces) + detok.finish() == tok.decode(lone_bytes)


def test_two_thousand_tokens_are_fast(tok):
    text = "The quick brown fox 🦊 jumps over the lazy dog; 日本語のテキスト, naïve café.\n" * 200
    ids = tok.encode(text)[:2000]
    assert len(ids) == 2000
    detok = IncrementalDetokenizer(tok, tok.encode("Tell me a story."), stop=["never appears", "END!"])
    start = time.perf_counter()
    out = "".join(detok.add_tokens([i]) for i in ids) + detok.finish()
    assert time.perf_counter() - start < 2.0
    assert out == tok.decode(ids)


# -- stop strings: the automaton against a reference, and its cost ----------------------------


def first_completing_match(text, stops):
    """Reference: read the text one character at a time; the first stop string to end wins, and
    of those ending at that character, the longest."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text.startswith(s, end - len(s)) and end >= len(s)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


def longest_partial_stop(text, stops):
    """Reference: the longest suffix of ``text`` that a stop string starts with (but is not)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


SMALL_TEXT = st.text(alphabet="ab😀", max_size=30)  # a small alphabet: many overlapping matches
SMALL_STOPS = st.lists(st.text(alphabet="ab😀", min_size=1, max_size=5), min_size=1, max_size=6)


@settings(max_examples=400, deadline=None)
@given(text=SMALL_TEXT, stops=SMALL_STOPS, cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_scanner_matches_the_reference_however_the_text_is_cut(text, stops, cuts):
    scanner = StopScanner(tuple(stops))
    want_text, want_stop = first_completing_match(text, stops)
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    visible = fed = ""
    for start, end in zip(bounds, bounds[1:]):
        fed += text[start:end]
        visible += scanner.feed(text[start:end])
        if scanner.stop_string is None:  # everything is shown but the partial stop string
            assert visible == fed[: len(fed) - longest_partial_stop(fed, stops)]
    if scanner.stop_string is None:
        visible += scanner.flush()
    assert (visible, scanner.stop_string) == (want_text, want_stop)


@PROPERTY
@given(text=st.lists(st.sampled_from(["a", "b", "ab", " ", "ba", "é", "😀"]), max_size=25).map("".join),
       stops=st.lists(st.text(alphabet="ab é😀", min_size=1, max_size=4), min_size=1, max_size=5),
       chunks=CHUNKS)  # fmt: skip
def test_detokenizer_stops_match_the_reference_for_any_token_split(tok, text, stops, chunks):
    ids = tok.encode(text)
    want_text, want_stop = first_completing_match(tok.decode(ids), stops)
    detok, pieces = stream(tok, ids, chunks=chunks, stop=stops)
    pieces.append(detok.finish())
    assert all(want_text.startswith("".join(pieces[: i + 1])) for i in range(len(pieces)))
    assert ("".join(pieces), detok.stop_string) == (want_text, want_stop)


def test_the_automaton_is_shared_by_equal_stop_lists():
    assert automaton(("ab", "cd")) is automaton(("ab", "cd"))
    assert automaton(("ab", "cd")) is not automaton(("cd", "ab"))


def random_stops(seed, count, low, high, alphabet=string.ascii_lowercase + " "):
    """Stop strings no other test uses, so their automaton is built (and measured) here."""
    rng = random.Random(seed)
    return [f"{seed}" + "".join(rng.choices(alphabet, k=rng.randint(low, high))) for _ in range(count)]


def timed_stream(tok, ids, prompt, n=1, **kwargs):
    """Stream ``ids`` through ``n`` detokenizers (a request's completions); (seconds, peak bytes, texts)."""
    gc.collect()
    tracemalloc.start()
    start = time.perf_counter()
    detoks = [IncrementalDetokenizer(tok, prompt, **kwargs) for _ in range(n)]
    for i in ids:
        for detok in detoks:
            detok.add_tokens([i])
    texts = [detok.text + detok.finish() for detok in detoks]
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return elapsed, peak, texts


@pytest.fixture(scope="module")
def story_ids(tok):
    ids = tok.encode("the quick brown fox jumps over the lazy dog and then it naps in the sun. " * 200)[:2000]
    assert len(ids) == 2000
    return ids


def test_one_16k_stop_string_with_n_8_costs_linear_memory(tok, story_ids):
    stop = random_stops(16, 1, 16384, 16384, string.ascii_letters)[0]
    prompt = tok.encode("Tell me a story.")
    base, base_peak, _ = timed_stream(tok, story_ids[:32], prompt, n=8, stop=["never appears"])
    elapsed, peak, texts = timed_stream(tok, story_ids[:32], prompt, n=8, stop=[stop])
    assert texts == [tok.decode(story_ids[:32])] * 8
    # One shared automaton of a few ints per character (every prefix as a string took ~2 GB).
    assert peak - base_peak < 64 * len(stop)
    assert elapsed < 5 * base + 2.0


def test_a_long_held_prefix_streams_in_linear_time(tok, story_ids):
    # The output runs along a 16K stop string: all of it is held back until the end.
    text = tok.decode(story_ids)
    stop = (text * 2)[: 16384 - 1] + "!"
    base, base_peak, _ = timed_stream(tok, story_ids, [], stop=["never appears"])
    elapsed, peak, texts = timed_stream(tok, story_ids, [], stop=[stop])
    assert texts == [text]
    assert peak - base_peak < 64 * len(stop)
    assert elapsed < 5 * base + 2.0


def test_a_held_prefix_shifts_in_linear_time():
    # "aaaa..." along "a" * 16K + "b": the held text stays 16K long and shifts by each new chunk.
    scanner = StopScanner(("a" * 16384 + "b",))
    start = time.perf_counter()
    shown = "".join(scanner.feed("a" * 4) for _ in range(20_000))
    elapsed = time.perf_counter() - start
    assert shown == "a" * (80_000 - 16384) and scanner.flush() == "a" * 16384
    assert elapsed < 2.0  # ~0.03 s: each chunk is held once and shown once, the held text never copied


def test_ten_thousand_stop_strings_cost_is_per_character(tok, story_ids):
    stops = random_stops(10_000, 10_000, 3, 11)
    prompt = tok.encode("Tell me a story.")
    base, base_peak, _ = timed_stream(tok, story_ids[:32], prompt, stop=["never appears"])
    elapsed, peak, texts = timed_stream(tok, story_ids[:32], prompt, stop=stops)
    assert texts == [tok.decode(story_ids[:32])]
    assert peak - base_peak < 64 * sum(map(len, stops))  # built once, a few ints per character
    assert elapsed < 5 * base + 2.0
    # Built, the automaton makes a token's cost independent of the number of stop strings.
    base, _, _ = timed_stream(tok, story_ids, prompt, stop=["never appears"])
    elapsed, _, texts = timed_stream(tok, story_ids, prompt, stop=stops)
    assert texts == [tok.decode(story_ids)]
    assert elapsed < 3 * base + 0.2
