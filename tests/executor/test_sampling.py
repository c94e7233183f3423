"""Batched per-request sampling (vllm_mlx.executor.sampling) on real MLX."""

import time

import mlx.core as mx
import numpy as np
import pytest

from vllm_mlx.core.request import SamplingParams
from vllm_mlx.executor import sampling
from vllm_mlx.executor.sampling import SamplingRow, apply_filters, apply_penalties, row_seed, sample

V = 50
PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05])


def row(seed=0, step=0, prompt=(0,), output=(), banned=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, step, list(prompt), list(output), list(banned))


def random_logits(n, vocab=V, scale=2.0, seed=0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, vocab)) * scale).astype(np.float32)


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def draws(logits_row, n=4000, seed=0, **params) -> np.ndarray:
    """Sample the same logits ``n`` times in one batch, one (seed, step) per row."""
    logits = mx.array(np.tile(np.asarray(logits_row, np.float32), (n, 1)))
    return np.array(sample(logits, [row(seed=seed, step=s, **params) for s in range(n)]).token_ids)


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------------
# Greedy, penalties, banning


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = mx.array(random_logits(6)).astype(dtype)
    out = sample(logits, [row(temperature=0) for _ in range(6)])
    assert out.token_ids == np.argmax(np.array(logits.astype(mx.float32)), -1).tolist()
    assert all(type(t) is int for t in out.token_ids)
    assert out.logprobs == [None] * 6


def np_penalties(x, prompt, output, rep=1.0, pres=0.0, freq=0.0) -> np.ndarray:
    x = x.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        x[t] -= pres + freq * list(output).count(t)
    return x


PENALTY_CASES = [
    # Repetition on a prompt token: 3.0 / 2 = 1.5 < 2.0, so token 3 wins.
    (dict(repetition_penalty=2.0), [0, 1, 3.0, 2.0, -1.0], (2,), (), 3),
    # Repetition on a negative output logit pushes it further down: -0.5 * 1.5 < -0.55.
    (dict(repetition_penalty=1.5), [-0.6, -0.5, -2.0, -3.0, -0.55], (3,), (1,), 4),
    # Presence: once per present output token (3.0 - 1.5 < 2.0).
    (dict(presence_penalty=1.5), [3.0, 2.0, 0.0, 0.0, 0.0], (1,), (0, 0, 0), 1),
    # Frequency: count x penalty (token 0 three times: 3.0 - 1.2 < 2.5; token 1 once).
    (dict(frequency_penalty=0.4), [3.0, 2.6, 2.5, 0.0, 0.0], (), (0, 0, 0, 1), 2),
    # All together.
    (
        dict(repetition_penalty=1.2, presence_penalty=0.2, frequency_penalty=0.3),
        [2.0, 1.9, 1.7, -1.0, 0.5],
        (0, 3),
        (1, 1, 4),
        2,
    ),
]


@pytest.mark.parametrize("params,logits,prompt,output,expected", PENALTY_CASES)
def test_penalties_match_numpy_reference(params, logits, prompt, output, expected):
    x = np.array(logits, np.float32)
    ref = np_penalties(
        x, prompt, output,
        params.get("repetition_penalty", 1.0),
        params.get("presence_penalty", 0.0),
        params.get("frequency_penalty", 0.0),
    )
    assert int(np.argmax(x)) != expected and int(np.argmax(ref)) == expected
    r = row(prompt=prompt, output=output, temperature=0, **params)
    got = apply_penalties(mx.array(x[None]), [r])
    np.testing.assert_allclose(np.array(got)[0], ref, rtol=1e-6, atol=1e-6)
    assert sample(mx.array(x[None]), [r]).token_ids == [expected]


def test_penalties_only_touch_penalised_rows():
    x = random_logits(3)
    rows = [row(output=(1, 2)), row(output=(1, 2), frequency_penalty=1.0), row(output=(5,))]
    got = np.array(apply_penalties(mx.array(x), rows))
    np.testing.assert_array_equal(got[[0, 2]], x[[0, 2]])
    np.testing.assert_allclose(got[1], np_penalties(x[1], (0,), (1, 2), freq=1.0), rtol=1e-6)


def test_banned_tokens_are_never_sampled():
    x = random_logits(1)[0]
    top = int(np.argmax(x))
    second = int(np.argsort(-x)[1])
    greedy = sample(mx.array(x[None]), [row(temperature=0, banned=(top,))])
    assert greedy.token_ids == [second]
    flat = np.zeros(V, np.float32)
    banned = tuple(range(0, V, 2))
    got = draws(flat, n=500, banned=banned, top_p=0.9)
    assert not set(got.tolist()) & set(banned)


def test_banning_changes_neither_the_callers_logits_nor_logprobs():
    logits = mx.array(random_logits(1))
    before = np.array(logits)
    top = int(np.argmax(before))
    out = sample(logits, [row(temperature=0, banned=(top, 1, 2), logprobs=3)])
    np.testing.assert_array_equal(np.array(logits), before)
    assert out.token_ids[0] != top
    assert out.logprobs[0].top[top] == pytest.approx(np_log_softmax(before)[0, top], abs=1e-5)


def test_empty_batch():
    assert sample(mx.zeros((0, V)), []) == sampling.SamplerOutput([], [])


# ---------------------------------------------------------------------------
# Filters that collapse to greedy


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_degenerate_filters_equal_greedy(params):
    x = random_logits(64, scale=1.0, seed=3)
    greedy = sample(mx.array(x), [row(temperature=0) for _ in range(64)]).token_ids
    rows = [row(seed=s, step=s, temperature=1.5, **params) for s in range(64)]
    assert sample(mx.array(x), rows).token_ids == greedy


# ---------------------------------------------------------------------------
# Seeds


MIXED = [
    dict(temperature=0),
    dict(),
    dict(top_k=5),
    dict(top_p=0.8),
    dict(min_p=0.1, temperature=0.7),
    dict(top_k=10, top_p=0.9, repetition_penalty=1.3, logprobs=3),
    dict(temperature=0, presence_penalty=0.5),
    dict(temperature=1.3, frequency_penalty=0.2, logprobs=0),
]


@pytest.mark.parametrize("vocab", [V, 4096])
def test_same_seed_same_token_alone_or_anywhere_in_a_batch(vocab):
    x = random_logits(8, vocab, scale=1.0, seed=7)
    rows = [row(seed=100 + i, step=i, prompt=(1, 2), output=(3, 3), **p) for i, p in enumerate(MIXED)]
    batch = sample(mx.array(x), rows)
    for i, r in enumerate(rows):
        alone = sample(mx.array(x[i : i + 1]), [r])
        assert alone.token_ids == [batch.token_ids[i]]
        assert alone.logprobs == [batch.logprobs[i]]
    # The same row first and last among the others.
    for i, r in enumerate(rows):
        others = [j for j in range(8) if j != i]
        for order in ([i] + others, others + [i]):
            out = sample(mx.array(x[order]), [rows[j] for j in order])
            assert out.token_ids[order.index(i)] == batch.token_ids[i]


def test_steps_and_seeds_change_the_draw():
    flat = np.zeros(V, np.float32)
    by_step = draws(flat, n=200, seed=5)
    assert len(set(by_step.tolist())) > 30
    by_seed = sample(
        mx.array(np.tile(flat, (200, 1))), [row(seed=s, step=3) for s in range(200)]
    ).token_ids
    assert len(set(by_seed)) > 30
    # Same (seed, step) repeated: identical.
    again = sample(mx.array(np.tile(flat, (4, 1))), [row(seed=9, step=2) for _ in range(4)])
    assert len(set(again.token_ids)) == 1


def test_row_seed_mixes_both_inputs():
    values = {row_seed(s, t) for s in range(50) for t in range(50)}
    assert len(values) == 2500
    assert all(0 <= v < 2**64 for v in values)
    assert row_seed(-1, 0) == row_seed(2**64 - 1, 0)


# ---------------------------------------------------------------------------
# Distributions (fixed seeds: deterministic, the bounds are not flaky)


def test_temperature_one_matches_softmax():
    counts = np.bincount(draws(np.log(PROBS)), minlength=5)
    assert chi_square(counts, PROBS) < 18.5  # chi2(4 dof) at p = 0.001


def test_low_temperature_sharpens():
    sharp = PROBS**2 / (PROBS**2).sum()
    counts = np.bincount(draws(np.log(PROBS), temperature=0.5), minlength=5)
    assert chi_square(counts, sharp) < 18.5
    assert counts[0] / counts.sum() > 0.5


def test_top_k_keeps_the_k_most_likely():
    counts = np.bincount(draws(np.log(PROBS), top_k=2), minlength=5)
    assert counts[2:].sum() == 0
    assert chi_square(counts[:2], PROBS[:2] / PROBS[:2].sum()) < 10.8  # 1 dof, p = 0.001


def test_top_p_keeps_exactly_the_nucleus():
    # Mass before token 0: 0, token 1: 0.4 (< 0.6, kept), token 2: 0.7 (dropped).
    counts = np.bincount(draws(np.log(PROBS), top_p=0.6), minlength=5)
    assert counts[2:].sum() == 0 and counts[1] > 0
    assert chi_square(counts[:2], PROBS[:2] / PROBS[:2].sum()) < 10.8
    # 0.75 needs a third token.
    assert set(draws(np.log(PROBS), n=1000, top_p=0.75).tolist()) == {0, 1, 2}


def test_top_p_applies_after_top_k():
    # Within top-2 the renormalised masses are 4/7 and 3/7: top_p=0.5 keeps token 0 only.
    assert set(draws(np.log(PROBS), n=500, top_k=2, top_p=0.5).tolist()) == {0}


def test_top_p_candidates_give_the_full_sort_answer(monkeypatch):
    # Flat rows spill past 4 candidates (full sort), peaked ones fit; top-k rows never spill.
    scales = np.array([0.2, 0.5, 1.0, 3.0, 8.0] * 6, np.float32)[:, None]
    x = mx.array(random_logits(30, seed=5) * scales)
    params = [
        SamplingParams(top_p=p, top_k=k)
        for p, k in zip([0.3, 0.7, 0.95] * 10, [0, 0, 0, 0, 0, 3, 0, 0, 0, 40] * 3)
    ]
    full = np.array(apply_filters(x, params))
    monkeypatch.setattr(sampling, "SORT_CANDIDATES", 4)
    np.testing.assert_array_equal(np.array(apply_filters(x, params)), full)
    kept = np.isfinite(full).sum(-1)
    assert kept.min() == 1 and kept.max() > 4  # both paths were exercised


def test_min_p_drops_unlikely_tokens():
    # p >= 0.3 * 0.4 = 0.12 keeps tokens 0, 1, 2.
    counts = np.bincount(draws(np.log(PROBS), min_p=0.3), minlength=5)
    assert counts[3:].sum() == 0
    assert chi_square(counts[:3], PROBS[:3] / PROBS[:3].sum()) < 13.9  # 2 dof


# ---------------------------------------------------------------------------
# Logprobs


def test_logprobs_are_the_raw_log_softmax():
    x = random_logits(4, seed=11)
    params = dict(logprobs=5, repetition_penalty=1.8, presence_penalty=1.0, frequency_penalty=0.5)
    rows = [
        row(seed=1, prompt=(1, 2, 3), output=(4, 4), **params),
        row(temperature=0, logprobs=20, output=(int(np.argmax(x[1])),), presence_penalty=2.0),
        row(seed=2, logprobs=0, temperature=0.3),
        row(seed=3),
    ]
    out = sample(mx.array(x), rows)
    ref = np_log_softmax(x)
    for i, n in enumerate([5, 20, 0]):
        lp = out.logprobs[i]
        token = out.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(ref[i, token], abs=1e-5)
        assert len(lp.top) == n
        assert list(lp.top) == np.argsort(-ref[i])[:n].tolist()
        for t, v in lp.top.items():
            assert v == pytest.approx(ref[i, t], abs=1e-5)
        assert np.exp(list(lp.top.values())).sum() <= 1 + 1e-5
    assert out.logprobs[3] is None
    # Penalties changed the greedy row's token but not its reported logprobs.
    assert out.token_ids[1] != int(np.argmax(x[1]))


def test_logprobs_of_the_sampled_token_are_included_when_in_top():
    x = random_logits(1, seed=2)
    out = sample(mx.array(x), [row(temperature=0, logprobs=3)])
    lp = out.logprobs[0]
    assert lp.top[lp.token_id] == lp.logprob


def test_more_logprobs_than_vocab():
    x = np.log(PROBS)[None].astype(np.float32)
    lp = sample(mx.array(x), [row(temperature=0, logprobs=20)]).logprobs[0]
    assert list(lp.top) == [0, 1, 2, 3, 4]
    assert np.exp(list(lp.top.values())).sum() == pytest.approx(1.0, abs=1e-5)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="logits"):
        sample(mx.zeros((2, V)), [row()])


# ---------------------------------------------------------------------------
# Speed sanity


def test_large_vocab_mixed_batch_is_fast():
    n, vocab = 32, 49152
    x = mx.array(random_logits(n, vocab, scale=3.0))
    mx.eval(x)
    rows = [
        row(seed=i, step=10, prompt=range(i, i + 500), output=range(100, 140), **MIXED[i % 8])
        for i in range(n)
    ]
    sample(x, rows)  # warm-up
    start = time.perf_counter()
    out = sample(x, rows)
    elapsed = time.perf_counter() - start
    print(f"sample(N={n}, V={vocab}, mixed): {elapsed * 1000:.1f} ms")
    assert len(out.token_ids) == n and all(0 <= t < vocab for t in out.token_ids)
    assert elapsed < 5.0
