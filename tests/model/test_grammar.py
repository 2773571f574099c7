"""Grammar-constrained decoding: response formats, the compiled-grammar cache, the per-row mask and EOS rule, and
the engine invariants under constraints (valid output, batch invariance, cached == uncached, reuse)."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from pcr_rag import EngineConfig, InvalidRequestError, PCREngine
from pcr_rag.model.grammar import GrammarCompiler
from pcr_rag.request import RagPrompt, SamplingParams
from pcr_rag.response_format import GrammarError, ResponseFormat
from pcr_rag.testing import tiny_model

EOS = 2  # the tiny tokenizer's </s>


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sku: str = Field(pattern=r"^[A-Z]{2}-[0-9]{1,3}$")
    qty: int = Field(ge=1, le=20)


class Order(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int = Field(ge=0, le=9999)
    status: Literal["open", "shipped", "closed"]
    items: list[Item] = Field(max_length=3)


class Customer(BaseModel):
    """Nested and bounded (every string, number and list has a length limit), so even a random-weight model's
    output always completes within the token budget."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z]{1,8}$")
    tier: Literal["gold", "silver"] | None = None
    orders: list[Order] = Field(min_length=1, max_length=2)
    active: bool


NESTED = Customer.model_json_schema()
DOCS = ["The orders table lists every order with its id, status and line items. " * 3,
        "A customer is active when they placed an order in the last year. " * 3]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=0)


def _engine(tiny, path, **kw) -> PCREngine:
    model, tok = tiny
    cfg = dict(cache_dir=path, chunk_size=16, dram_capacity="32MiB", ssd_capacity="32MiB", max_new_tokens=200,
               device="cpu", prefill_chunk_tokens=32, max_active=4)
    cfg.update(kw)
    return PCREngine(model, tok, config=EngineConfig(**cfg))


# ---------------------------------------------------------------------------------------------------- formats
def test_response_format_accepts_the_usual_spellings():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    a = ResponseFormat.of(schema)
    assert a == ResponseFormat.of({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert a == ResponseFormat.json_schema(json.dumps(schema))
    assert a.kind == "json_schema" and a.schema == schema
    assert ResponseFormat.of("json") == ResponseFormat.of({"type": "json_object"}) == ResponseFormat("json_object")
    assert ResponseFormat.of({"type": "regex", "regex": "[ab]+"}).kind == "regex"
    assert ResponseFormat.of({"type": "grammar", "grammar": 'start: "yes" | "no"'}).kind == "grammar"
    assert ResponseFormat.of(Customer).schema == NESTED
    assert hash(SamplingParams(response_format=schema)) == hash(SamplingParams(response_format=schema))


@pytest.mark.parametrize("bad, match", [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "regex", "regex": "a(b"}, "regex"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, "undefined_rule"),
    ("yaml", "ambiguous"),
    (42, "must be a dict"),
    ({"type": "json_schema", "json_schema": {"name": "no schema"}}, "needs the schema"),
])
def test_formats_the_library_rejects_raise_invalid_request(bad, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(response_format=bad)
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams.from_kwargs(max_tokens=5, response_format=bad)


def test_bad_schema_fails_in_submit_before_any_compute(tiny, tmp_path):
    with _engine(tiny, tmp_path) as eng:
        bad = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
        with pytest.raises(InvalidRequestError, match="uniqueItems"):
            eng.generate("hello", response_format=bad)
        with pytest.raises(InvalidRequestError, match="uniqueItems"):
            eng.stream("hello", response_format=bad)
        assert eng.executor.steps == 0 and eng.scheduler.depth == 0
        assert eng.stats().requests["requests_finished"] == 0


# ---------------------------------------------------------------------------------------------------- matcher
def test_compiled_grammars_are_cached_by_format_and_bounded(tiny):
    _, tok = tiny
    compiler = GrammarCompiler(tok, 320, [EOS], cache_size=2)
    fmts = [ResponseFormat.of({"type": "regex", "regex": f"a{{{n}}}"}) for n in (1, 2, 3)]
    compiler.matcher(fmts[0])
    compiler.matcher(ResponseFormat.of({"type": "regex", "regex": "a{1}"}))  # equal format: a hit
    assert (compiler.hits, compiler.misses, len(compiler)) == (1, 1, 1)
    compiler.matcher(fmts[1])
    compiler.matcher(fmts[2])  # evicts fmts[0], the least recently used
    assert len(compiler) == 2
    compiler.matcher(fmts[0])
    assert compiler.misses == 4


def test_eos_only_where_the_grammar_may_end(tiny):
    _, tok = tiny
    compiler = GrammarCompiler(tok, 320, [EOS, 4])
    m = compiler.matcher(ResponseFormat.of({"type": "regex", "regex": "ab(c)?"}))
    ids = tok("abc", add_special_tokens=False)["input_ids"]
    assert not m.allowed()[EOS], "EOS is masked out before the text matches"
    m.accept(ids[0])
    m.accept(ids[1])  # "ab" is complete, "c" may still follow
    allowed = m.allowed()
    assert allowed[EOS] and allowed[4] and allowed[ids[2]] and not m.is_terminated()
    m.accept(ids[2])  # "abc": nothing but EOS may follow
    allowed = m.allowed()
    assert m.is_terminated() and set(allowed.nonzero().view(-1).tolist()) == {EOS, 4}
    logits = m.mask_logits(torch.zeros(320))
    assert int(torch.argmax(logits)) in (EOS, 4) and torch.isinf(logits[300:]).all()


def test_a_token_the_grammar_forbids_fails_the_request(tiny):
    _, tok = tiny
    m = GrammarCompiler(tok, 320, [EOS]).matcher(ResponseFormat.of({"type": "regex", "regex": "a+"}))
    with pytest.raises(GrammarError, match="violates"):
        m.accept(tok("b", add_special_tokens=False)["input_ids"][0])


# ---------------------------------------------------------------------------------------------------- engine
def test_100_nested_structured_requests_all_parse_and_validate(tiny, tmp_path):
    with _engine(tiny, tmp_path, max_active=8) as eng:
        handles = [eng.submit(RagPrompt(f"customer number {i}", tuple(DOCS)),
                              SamplingParams(max_new_tokens=400, temperature=1.0, seed=i, response_format=Customer))
                   for i in range(100)]
        results = [h.result(timeout=600) for h in handles]
        assert eng.grammars.misses == 1 and eng.grammars.hits == 99
    for r in results:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), NESTED)
        Customer.model_validate_json(r.text)
    assert len({r.text for r in results}) > 50, "sampled outputs should differ"


def test_constrained_tokens_do_not_depend_on_batch_company_or_cache(tiny, tmp_path):
    """Constrained and unconstrained requests together, cold then cached, equal each request run alone without
    cache; the repeated document set is reused under constraints too."""
    fmt = ResponseFormat.of(Customer)
    reqs = [(RagPrompt(f"question {i}", tuple(DOCS)),
             SamplingParams(max_new_tokens=40, response_format=fmt if i % 2 == 0 else None,
                            temperature=0.0 if i < 4 else 0.8, seed=i))
            for i in range(6)]
    with _engine(tiny, tmp_path / "alone", enable_cache=False, max_active=1) as eng:
        ref = [eng.submit(p, s).result(timeout=120) for p, s in reqs]
    with _engine(tiny, tmp_path / "busy", max_active=4) as eng:
        for round_ in range(2):
            got = [h.result(timeout=120) for h in [eng.submit(p, s) for p, s in reqs]]
            for a, b in zip(ref, got):
                assert a.token_ids == b.token_ids
            if round_ == 1:
                assert all(r.metrics.reused_tokens >= 32 for r in got[:2])
    for (_, s), r in zip(reqs, ref):
        if s.response_format is not None:  # 40 tokens may cut the object short; what is there follows the schema
            assert r.text.startswith('{"name": "')
            if r.finish_reason == "stop":
                Customer.model_validate_json(r.text)


def test_stop_strings_still_apply_under_a_grammar(tiny, tmp_path):
    with _engine(tiny, tmp_path, enable_cache=False) as eng:
        r = eng.generate("spell it", response_format={"type": "regex", "regex": "abcabcabc"}, stop=["ca"])
    assert r.text == "ab" and r.finish_reason == "stop"


def test_structured_requests_reuse_document_kv(tiny, tmp_path):
    with _engine(tiny, tmp_path) as eng:
        eng.generate("first", DOCS, max_new_tokens=2)
        r = eng.generate("second", DOCS, response_format=Customer, max_new_tokens=600)
    Customer.model_validate_json(r.text)
    assert r.metrics.reused_tokens >= 2 * 16


@pytest.mark.slow
def test_default_model_structured_cached_equals_uncached(tmp_path):
    """On the real model: structured answers are the same with and without the cache, and the repeated document
    set is reused (the schema instruction goes after the documents)."""
    from pcr_rag.model.model import load_model

    loaded = load_model()
    doc = ("The Great Barrier Reef is the world's largest coral reef system. It lies in the Coral Sea off the coast "
           "of Queensland, Australia, and is made of over 2,900 individual reefs and 900 islands. ") * 4

    class Place(BaseModel):
        name: str
        country: str

    kw = dict(chunk_size=64, max_new_tokens=80, device="cpu")
    questions = ["Which reef is this about?", "Where is the reef?"]
    with PCREngine(loaded.model, loaded.tokenizer, EngineConfig(cache_dir=tmp_path / "off", enable_cache=False,
                                                                **kw)) as off:
        ref = [off.generate(q, [doc], response_format=Place) for q in questions]
    with PCREngine(loaded.model, loaded.tokenizer, EngineConfig(cache_dir=tmp_path / "on", **kw)) as on:
        got = [on.generate(q, [doc], response_format=Place) for q in questions]
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        assert b.text.startswith('{"name": "')
        if b.finish_reason == "stop":  # not cut by max_new_tokens
            Place.model_validate_json(b.text)
    assert got[1].metrics.reused_tokens >= 128
