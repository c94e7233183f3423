"""Structured outputs on real MLX and real llguidance: per-request constraints inside the batch.

Oracles: every constrained output validates (``jsonschema``, ``re.fullmatch``, membership);
free rows are token-for-token what they are without the constrained rows (greedy); a preempted
constrained request equals the same request without preemption. The tiny random-weight llama
serves the fast engine tests (its text is gibberish, but the constraint still has to hold); the
default model serves the JSON Schema and ``response_format`` tests; hypothesis fuzzes schemas
in one batch on the tiny model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from factories import run_to_end
from vllm_mlx import SamplingParams
from vllm_mlx.engine.core import EngineCore
from vllm_mlx.executor.bitmask import StepMasks
from vllm_mlx.llm import LLM
from vllm_mlx.structured import StructuredOutputsParams
from vllm_mlx.structured.grammar import ConstraintError, GrammarCompiler, close_objects
from vllm_mlx.structured.matcher import ERROR_PREFIX, RequestConstraint

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog.", "One two three four five six", "Why?"]
FREE = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
REGEX = r"[a-z]{3}-[0-9]{2,4}"


def constrained(max_tokens: int = 24, **kind) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=StructuredOutputsParams(**kind))


def run_one(engine: EngineCore, prompt, params: SamplingParams):
    request_id = engine.add_request(prompt, params)
    return run_to_end(engine)[request_id]


@pytest.fixture
def tiny_engine(tiny_model_dir):
    engines = []

    def make(**options) -> EngineCore:
        engines.append(EngineCore(model=str(tiny_model_dir), **options))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


# -- parameters (no model) --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "several are (regex, choice)"),
        ({"choice": []}, "non-empty list of strings"),
        ({"choice": ["a", 1]}, "non-empty list of strings"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": 3}, "JSON Schema"),
        ({"json_object": False}, "must be True"),
        ({"regex": ""}, "non-empty string"),
        ({"grammar": "start: x", "disable_any_whitespace": 1}, "must be a bool"),
    ],
)
def test_params_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_params_from_request_body_and_sampling_params():
    params = StructuredOutputsParams.from_dict({"choice": ["yes", "no"]})
    assert params.kind == "choice" and params.choice == ("yes", "no")
    with pytest.raises(ValueError, match="unsupported fields: guided_json"):
        StructuredOutputsParams.from_dict({"json": {}, "guided_json": {}})
    assert SamplingParams(structured_outputs=params).clone(n=2).structured_outputs is params
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_close_objects_adds_additional_properties_false_to_every_object():
    schema = {"type": "object", "properties": {"a": {"type": "object"}, "b": {"type": "array", "items": {"properties": {}}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left alone


# -- the compiler and the batch mask (real llguidance, real MLX, no model) ---------------------


@pytest.fixture(scope="module")
def compiler(default_model_dir):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    return GrammarCompiler(tokenizer, tokenizer.eos_token_ids, cache_size=2)


@pytest.mark.parametrize(
    "kind, message",
    [
        ({"json": {"type": "foo"}}, "invalid JSON schema: Invalid type: foo"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum (5) is greater than maximum (1)"),
        ({"regex": "(abc"}, "invalid regex"),
        ({"grammar": "start: undefined_rule"}, 'unknown name: "undefined_rule"'),
    ],
)
def test_invalid_constraints_name_the_problem(compiler, kind, message):
    with pytest.raises(ConstraintError, match=re.escape(message)) as info:
        compiler.compile(StructuredOutputsParams(**kind))
    assert "\n" not in str(info.value)


def test_compiled_grammars_are_cached_by_content_and_bounded(compiler):
    before = compiler.stats()
    a = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    again = compiler.compile(StructuredOutputsParams(json=json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}})))
    assert again is a and compiler.stats()["hits"] == before["hits"] + 1
    for regex in ("a+", "b+", "c+"):  # cache_size=2: the oldest go
        compiler.compile(StructuredOutputsParams(regex=regex))
    assert compiler.stats()["cached"] == 2
    assert compiler.compile(StructuredOutputsParams(regex="c+")) is compiler.compile(StructuredOutputsParams(regex="c+"))


class _Row:
    """The two fields of a ``Request`` that ``StepMasks`` reads."""

    def __init__(self, request_id, constraint=None, output_token_ids=()):
        self.request_id, self.constraint, self.output_token_ids = request_id, constraint, list(output_token_ids)


def test_one_mask_for_the_batch_leaves_free_rows_and_masks_vocabulary_padding(compiler):
    grammar = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
    vocab = grammar.vocab_size
    width = vocab + 40  # a model whose logits have padding columns past the tokenizer's vocabulary
    logits = mx.random.normal((3, width))
    logits[:, vocab:] = 100.0  # padding would win every argmax if it were not masked
    rows = [_Row("free"), _Row("c1", RequestConstraint(grammar, {2})), _Row("c2", RequestConstraint(grammar, {2}))]
    masks = StepMasks.build(rows)
    assert masks.rows == [1, 2] and not masks.errors
    masked = masks.apply(logits)
    assert mx.array_equal(masked[0], logits[0])  # the free row is untouched
    allowed = np.isfinite(np.array(masked[1:]))
    assert not allowed[:, vocab:].any()
    first_tokens = {compiler.ll_tokenizer.tokenize_str(w)[0] for w in ("yes", "no")}
    assert set(np.nonzero(allowed[0])[0]) >= first_tokens
    assert StepMasks.build([_Row("a"), _Row("b")]) is None  # no constraint: nothing to pay


def test_a_matcher_that_cannot_follow_the_accepted_tokens_fails_its_row_alone(compiler):
    grammar = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
    maybe = compiler.ll_tokenizer.tokenize_str("maybe")
    rows = [_Row("bad", RequestConstraint(grammar, {2}), maybe), _Row("good", RequestConstraint(grammar, {2}))]
    masks = StepMasks.build(rows)
    assert not masks.bitmask[0].any() and masks.bitmask[1].any()
    yes = compiler.ll_tokenizer.tokenize_str("yes")[0]
    rejected = masks.rejected(rows, [yes, yes])
    assert list(rejected) == ["bad"] and rejected["bad"].startswith(f"{ERROR_PREFIX}the choice constraint failed")
    assert "bad" in StepMasks.build(rows).rejected(rows, [yes, yes])  # the error sticks


def test_masks_work_on_a_thread_other_than_the_one_that_imported_the_module():
    """MLX streams are per thread: a module-level MLX array made by the thread that imported
    the module cannot be evaluated by a later engine thread once the first one's streams are
    cleared (seen when one server test's engine thread imported it and the next one masked)."""
    script = """
import threading
import mlx.core as mx
import numpy as np

def importer():
    from vllm_mlx.executor import bitmask  # noqa: F401
    from vllm_mlx.platform.threads import clear_thread_streams
    mx.eval(mx.zeros(1))
    clear_thread_streams()

thread = threading.Thread(target=importer)
thread.start()
thread.join()
from vllm_mlx.executor.bitmask import RowMask, StepMasks
masks = StepMasks([RowMask(0, None, force_token=2)], np.full((1, 1), 0b101, dtype=np.int32), {})
out = masks.apply(mx.zeros((1, 32)))
mx.eval(out)
print(int(np.isfinite(np.array(out)).sum()))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"


# -- the engine on the tiny model --------------------------------------------------------------


def test_regex_and_choice_hold_and_free_rows_are_unchanged(tiny_engine):
    engine = tiny_engine()
    free_ids = [engine.add_request(p, FREE) for p in PROMPTS[:2]]
    done = run_to_end(engine)
    expected = [done[i].token_ids for i in free_ids]
    choices = ["alpha", "beta gamma", "δέλτα \"quoted\""]
    ids = [
        engine.add_request(PROMPTS[0], FREE),
        engine.add_request(PROMPTS[1], constrained(regex=REGEX)),
        engine.add_request(PROMPTS[2], constrained(choice=choices)),
        engine.add_request(PROMPTS[1], FREE),
        engine.add_request(PROMPTS[3], constrained(regex=r"(ab|cd){1,5}!")),
        engine.add_request(PROMPTS[0], constrained(grammar='root ::= "x" [0-9] ("+" [0-9])?')),  # GBNF
        engine.add_request(PROMPTS[2], constrained(grammar='start: "(" NUM ")"\nNUM: /[0-9]{1,3}/')),  # Lark
    ]
    final = run_to_end(engine)
    assert [final[ids[0]].token_ids, final[ids[3]].token_ids] == expected
    assert re.fullmatch(REGEX, final[ids[1]].text), final[ids[1]].text
    assert final[ids[2]].text in choices
    assert re.fullmatch(r"(ab|cd){1,5}!", final[ids[4]].text), final[ids[4]].text
    assert re.fullmatch(r"x[0-9](\+[0-9])?", final[ids[5]].text) and re.fullmatch(r"\([0-9]{1,3}\)", final[ids[6]].text)
    for i in ids[5:]:
        assert final[i].finish_reason == "stop", final[i].error
    assert engine.get_stats()["structured_outputs"] == {"cached": 5, "hits": 0, "misses": 5}
    for i in (ids[1], ids[2], ids[4]):
        assert final[i].finish_reason == "stop", final[i].error
    assert engine.kv_cache.stats().num_used_blocks == 0


@pytest.fixture(scope="module")
def padded_vocab_model_dir(tmp_path_factory, default_model_dir):
    """The tiny llama with 96 logits rows past the tokenizer's vocabulary (as models pad theirs),
    their embeddings (tied to the head) scaled up so that padding ids win every free argmax."""
    from tiny_model import build_tiny_llama

    tokenizer_dir = tmp_path_factory.mktemp("padded-tokenizer")
    vocab = json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer_dir / name).write_bytes((default_model_dir / name).read_bytes())
    (tokenizer_dir / "config.json").write_text(json.dumps({"vocab_size": vocab + 96}))
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-padded"), tokenizer_dir)
    weights = mx.load(str(model_dir / "model.safetensors"))
    weights["model.embed_tokens.weight"][vocab:] *= 50
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    return model_dir, vocab


def test_logits_past_the_tokenizer_vocabulary_are_never_sampled(padded_vocab_model_dir):
    model_dir, vocab = padded_vocab_model_dir
    engine = EngineCore(model=str(model_dir))
    try:
        free = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, skip_special_tokens=False))
        regex = engine.add_request(PROMPTS[1], constrained(regex=REGEX))
        final = run_to_end(engine)
    finally:
        engine.shutdown()
    assert any(t >= vocab for t in final[free].token_ids)  # what an unmasked row does here
    assert final[regex].finish_reason == "stop", final[regex].error
    assert max(final[regex].token_ids) < vocab and re.fullmatch(REGEX, final[regex].text)


def test_n_siblings_have_independent_matchers(tiny_engine):
    engine = tiny_engine()
    params = SamplingParams(
        n=3, max_tokens=16, temperature=1.0, top_p=0.9, min_p=0.01, repetition_penalty=1.2, seed=7,
        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{4,8}\."),
    )
    out = run_one(engine, PROMPTS[1], params)
    texts = [c.text for c in out.outputs]
    assert all(re.fullmatch(r"[a-z]{4,8}\.", t) for t in texts), texts
    assert len(set(texts)) > 1  # different seeds, different words: each matcher followed its own


def test_a_constraint_that_admits_nothing_fails_alone(tiny_engine):
    engine = tiny_engine()
    expected = run_one(engine, PROMPTS[1], FREE).token_ids
    nothing = engine.add_request(PROMPTS[0], constrained(regex=r"[^\s\S]"))  # the empty language
    min_tokens = SamplingParams(
        max_tokens=8, min_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(choice=["a"])
    )
    conflict = engine.add_request(PROMPTS[2], min_tokens)
    free = engine.add_request(PROMPTS[1], FREE)
    final = run_to_end(engine)
    assert final[nothing].finish_reason == "error"
    assert final[nothing].error == f"{ERROR_PREFIX}the regex constraint admits no complete output from here"
    assert final[conflict].finish_reason == "error"
    assert "min_tokens" in final[conflict].error
    assert final[free].token_ids == expected and final[free].finish_reason == "length"
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_an_invalid_constraint_is_refused_before_anything_is_queued(tiny_engine):
    engine = tiny_engine()
    with pytest.raises(ValueError, match="invalid JSON schema: Invalid type: foo"):
        engine.add_request(PROMPTS[0], constrained(json={"type": "foo"}))
    assert not engine.has_unfinished_requests()


def test_preemption_mid_constraint_continues_identically(tiny_engine):
    # Constraints that stay open for all 30 tokens, so preemption lands mid-constraint.
    params = [
        constrained(max_tokens=30, regex=r"[a-z ]{200,}"),
        constrained(max_tokens=30, regex=r"[0-9]{10,}"),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        constrained(max_tokens=30, regex=r"(ab|[xyz]+ )+"),
    ]
    prompts = PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0] * 3
    roomy = tiny_engine()
    ids = [roomy.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = run_to_end(roomy)
    expected = [final[i].token_ids for i in ids]
    assert roomy.scheduler.num_preemptions == 0
    roomy.shutdown()  # one live engine per model
    tight = tiny_engine(block_size=4, num_kv_blocks=16, max_num_batched_tokens=8)  # 15 usable blocks
    ids = [tight.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = run_to_end(tight)
    assert tight.scheduler.num_preemptions > 0
    assert [final[i].token_ids for i in ids] == expected
    assert len(expected[0]) == 30  # still constrained when preempted
    assert re.fullmatch(r"[a-z ]+", final[ids[0]].text) and re.fullmatch(r"[0-9]+", final[ids[1]].text)
    assert tight.kv_cache.stats().num_used_blocks == 0


# Fuzzed JSON Schemas: bounded leaves (so a random model can finish), nested objects and arrays.
_LEAVES = st.one_of(
    st.builds(lambda lo, n: {"type": "integer", "minimum": lo, "maximum": lo + n}, st.integers(-50, 50), st.integers(0, 1000)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.just({"type": "boolean"}),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(lambda e: {"enum": e}),
)
_SCHEMAS = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 2)),
        st.dictionaries(st.sampled_from("abcd"), inner, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
        ),
    ),
    max_leaves=5,
)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(_SCHEMAS, min_size=6, max_size=6))
def test_fuzzed_schemas_in_one_batch_each_hold(tiny_model_dir, schemas):
    engine = EngineCore(model=str(tiny_model_dir), max_num_seqs=8)
    try:
        compact = [StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in schemas]
        params = [SamplingParams(max_tokens=48, temperature=0, structured_outputs=c) for c in compact]
        ids = [engine.add_request(PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params)]
        ids.append(engine.add_request(PROMPTS[0], FREE))
        final = run_to_end(engine)
    finally:
        engine.shutdown()
    for request_id, schema in zip(ids, schemas):
        out = final[request_id]
        assert out.finish_reason in ("stop", "length"), out.error
        if out.finish_reason == "stop":  # a whole document; cut short, it is a prefix of one
            jsonschema.validate(json.loads(out.text), schema)
    assert sum(final[i].finish_reason == "stop" for i in ids[:-1]) >= 3  # not vacuous: most finish
    assert final[ids[-1]].finish_reason == "length"


# -- JSON Schema on the default model -----------------------------------------------------------

SCHEMAS = {
    "Describe a famous scientist as JSON with name and age.": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "Give me a color as JSON.": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
        "required": ["color", "hex"],
        "additionalProperties": False,
    },
    "List some fruits as JSON.": {
        "type": "object",
        "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3}},
        "required": ["fruits"],
        "additionalProperties": False,
    },
    "Which city is the capital of France? Answer as JSON.": {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
                "required": ["name", "country"],
                "additionalProperties": False,
            }
        },
        "required": ["city"],
        "additionalProperties": False,
    },
}
FREE_CHATS = ["Tell me a joke.", "What is 2 + 2?"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(max_num_seqs=16)
    yield engine
    engine.shutdown()


def chat_prompt(llm, question: str) -> dict:
    return llm.chat_prompt([{"role": "user", "content": question}])


@pytest.mark.e2e
def test_json_schemas_in_a_mixed_batch_validate_and_free_rows_are_unchanged(llm):
    free_prompts = [chat_prompt(llm, q) for q in FREE_CHATS]
    free_params = SamplingParams(max_tokens=16, temperature=0)
    expected = [o.token_ids for o in llm.generate(free_prompts, free_params)]
    prompts = [chat_prompt(llm, q) for q in SCHEMAS] + free_prompts
    params = [constrained(max_tokens=48, json=s) for s in SCHEMAS.values()] + [free_params] * 2
    outs = llm.generate(prompts, params)
    for out, schema in zip(outs, SCHEMAS.values()):
        assert out.finish_reason == "stop", (out.text, out.error)
        jsonschema.validate(json.loads(out.text), schema)
    assert [o.token_ids for o in outs[len(SCHEMAS) :]] == expected


@pytest.mark.e2e
@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(_SCHEMAS, min_size=12, max_size=12))
def test_sixteen_concurrent_rows_fuzzed_schemas_and_free_rows_on_the_default_model(llm, schemas):
    """12 fuzzed schemas and 4 free rows in one batch: every finished constrained row validates
    under its own schema, and the free rows are token for token what they are alone."""
    free_prompts = [chat_prompt(llm, q) for q in (*FREE_CHATS, "Name a planet.", "Say hello.")]
    free_params = SamplingParams(max_tokens=12, temperature=0)
    expected = [o.token_ids for o in llm.generate(free_prompts, free_params)]
    questions = [f"Describe item {i} as JSON." for i in range(len(schemas))]
    params = [
        SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True))
        for s in schemas
    ]
    outs = llm.generate([chat_prompt(llm, q) for q in questions] + free_prompts, params + [free_params] * 4)
    for out, schema in zip(outs, schemas):
        assert out.finish_reason in ("stop", "length"), out.error
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
    assert sum(o.finish_reason == "stop" for o in outs[: len(schemas)]) >= 6
    assert [o.token_ids for o in outs[len(schemas) :]] == expected


@pytest.mark.e2e
def test_response_format_pydantic_model_gives_parsed_objects(llm):
    pydantic = pytest.importorskip("pydantic")

    class Capital(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)

    params = SamplingParams(max_tokens=40, temperature=0)
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in JSON."}], params, response_format=Capital)
    assert isinstance(out.parsed, Capital) and out.parsed == Capital.model_validate_json(out.text)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"], "additionalProperties": False}
    [out] = llm.generate(chat_prompt(llm, "Is Paris in France? Answer in JSON."), params, response_format=schema)
    assert out.parsed in ({"answer": "yes"}, {"answer": "no"})
    [cut] = llm.generate(chat_prompt(llm, "Is Paris in France?"), SamplingParams(max_tokens=2, temperature=0), response_format=schema)
    assert cut.finish_reason == "length" and cut.parsed is None  # a prefix of a document does not parse
    with pytest.raises(ValueError, match="not both"):
        llm.generate("x", constrained(regex="a"), response_format=schema)
