"""Grammar-constrained decoding in the one decode step (blend.grammar): constrained rows follow their grammar and
end only where it accepts; an unconstrained row in the same batch gets exactly the tokens it gets alone; a
grammar that meets a dead end ends its answer cleanly; a grammar that does not compile says why, and one whose
compile runs away is stopped at the limit (and refused at once when sent again); a schema that explodes or has no
finite document is refused before any compile. A tiny random Llama with SmolLM2's vocabulary and tokenizer."""
from __future__ import annotations

import json
import string

import jsonschema
import pytest
from transformers import AutoTokenizer

from blend import Blender, DecodeRuntime, SamplingParams
from blend.grammar import (
    MAX_PATTERNS,
    NUMBER_LIMIT,
    NUMBER_PLACES,
    GrammarError,
    Grammars,
    bounded,
    has_document,
    json_rule,
    refusal,
)
from tests.blend.conftest import random_ids, tiny_model

MODEL_DIR = "data/models/smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "rain": {"type": "boolean"}},
          "required": ["unit", "rain"], "additionalProperties": False}
GRAMMAR = f"start: {json_rule(SCHEMA)}"
BLENDERS: dict[DecodeRuntime, Blender] = {}
COMPILERS: dict[DecodeRuntime, Grammars] = {}


@pytest.fixture(scope="module")
def decoder() -> DecodeRuntime:
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = tiny_model("llama", vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2)
    blender = Blender(model, tokenizer=tokenizer, fingerprint="tiny-llama-smol")
    decoder = DecodeRuntime(blender, slots=4, max_len=256)
    BLENDERS[decoder], COMPILERS[decoder] = blender, Grammars(tokenizer, decoder.vocab, limit_s=2.0)
    yield decoder
    COMPILERS.pop(decoder).close()


def decoder_prefill(decoder: DecodeRuntime, prompt: list[int]):
    return BLENDERS[decoder].full_prefill(prompt)


def run_together(decoder: DecodeRuntime, rows: list[tuple], eos: frozenset[int] | None = None) -> list[list]:
    """Each (prompt, sampling, grammar) a sequence in a slot with its constraint, as the engine starts one; every
    step one batched DecodeRuntime.advance over every row still decoding (as the scheduler's runner does). Each
    row's tokens (an ending eos included), or its error last."""
    eos = decoder.eos_ids if eos is None else eos
    sequences, outputs = [], []
    for prompt, sampling, grammar in rows:
        constraint = COMPILERS[decoder].constraint(grammar) if grammar else None
        sequences.append(decoder.start(decoder_prefill(decoder, prompt), sampling, constraint, eos))
        outputs.append([sequences[-1].last])
    while running := [(s, out) for s, out in zip(sequences, outputs) if s.finish_reason is None and not s.released]:
        for (sequence, out), row in zip(running, decoder.advance([s for s, _ in running])):
            out.append(row)
            if isinstance(row, BaseException):
                sequence.release()
    for sequence in sequences:
        sequence.release()
    return outputs


def test_constrained_rows_follow_their_grammar_beside_a_free_row(decoder):
    tokenizer = BLENDERS[decoder].tokenizer
    prompts = [random_ids(9, 1), random_ids(17, 2), random_ids(12, 3), random_ids(12, 3)]
    free = SamplingParams(max_new_tokens=24)
    alone = run_together(decoder, [(prompts[0], free, None)])[0]
    sampled = SamplingParams(max_new_tokens=40, temperature=0.9, seed=5)
    rows = run_together(decoder, [(prompts[0], free, None), (prompts[1], SamplingParams(max_new_tokens=40), GRAMMAR),
                                  (prompts[2], sampled, GRAMMAR), (prompts[3], sampled, None)])
    assert rows[0] == alone  # the free row's answer is its answer alone, whatever its neighbours' grammars
    for tokens in rows[1:3]:
        document = json.loads(tokenizer.decode(tokens, skip_special_tokens=True))  # ended where it is complete
        assert set(document) == {"unit", "rain"} and document["unit"] in ("celsius", "fahrenheit")
    assert rows[3] != rows[2]  # the same prompt and seed unconstrained: the mask changed what was drawn


def test_a_finished_grammar_ends_the_answer_and_a_refused_token_ends_it_too(decoder):
    # eos no end here (as with ignore_eos): the answer still ends where its grammar is complete
    tokens = run_together(decoder, [(random_ids(9, 4), SamplingParams(max_new_tokens=200), GRAMMAR)],
                          eos=frozenset())[0]
    assert len(tokens) < 60 and json.loads(BLENDERS[decoder].tokenizer.decode(tokens, skip_special_tokens=True))
    assert decoder.pool.free == 4
    constraint = COMPILERS[decoder].constraint(GRAMMAR)
    constraint.advance(BLENDERS[decoder].tokenizer.encode("x")[0])  # not how a JSON document opens: a dead end
    assert constraint.dead and constraint.finished  # the decode loop ends the answer there ("stop"), no error


def test_a_prefill_is_the_answers_start_and_the_rest_completes_it(decoder):
    """Constraint.start_with: the prefill's tokens taken first, so the decoded rest completes its document; a
    prefill the grammar refuses says so."""
    tokenizer = BLENDERS[decoder].tokenizer
    constraint = COMPILERS[decoder].constraint(GRAMMAR)
    prefill = '{"unit": "fahr'
    assert constraint.start_with(tokenizer.encode(prefill, add_special_tokens=False))
    assert not constraint.matcher.is_accepting()
    rest = 'enheit", "rain": true}'
    assert constraint.matcher.try_consume_tokens(tokenizer.encode(rest, add_special_tokens=False)) > 0
    assert constraint.matcher.is_accepting()  # the prefill and the rest: one whole document
    assert not COMPILERS[decoder].constraint(GRAMMAR).start_with(tokenizer.encode('{"unit": "kelvin"',
                                                                                   add_special_tokens=False))


def test_a_schema_that_does_not_compile_says_why(decoder):
    with pytest.raises(GrammarError, match="unknown|Unknown|invalid|Invalid|expected|Expected"):
        COMPILERS[decoder].constraint('start: %json {"type": "objekt"}')
    first = COMPILERS[decoder].constraint(GRAMMAR)
    assert COMPILERS[decoder].constraint(GRAMMAR).matcher is not first.matcher  # a fresh copy per answer


def patterns(n: int) -> dict:
    """A string that must match n patterns at once: their intersection compiles in time exponential in n."""
    return {"type": "string", "allOf": [{"pattern": f".*{c}.*"} for c in string.ascii_lowercase[:n]]}


def test_a_compile_past_the_limit_is_stopped_and_its_resend_refused_at_once(decoder):
    grammars = COMPILERS[decoder]
    bomb = f"start: {json_rule(patterns(21))}"  # ~160 s to compile; refusal() would refuse it first (below)
    with pytest.raises(GrammarError, match="too complex: its grammar did not compile within 2 s"):
        grammars.compile(bomb)
    with pytest.raises(GrammarError, match="too complex"):
        grammars.cached(bomb)  # the failure is remembered: no compile
    # the compile process was killed and replaced: the next grammar compiles
    assert grammars.constraint(f"start: {json_rule({'type': 'integer'})}").matcher is not None


DEAD = [{"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]},
        {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"],
         "$defs": {"n": {"anyOf": [{"$ref": "#/$defs/m"}]}, "m": {"type": "object", "required": ["x"],
                                                                 "properties": {"x": {"$ref": "#/$defs/n"}}}}}]
LIVE = [{"type": "object", "properties": {"c": {"$ref": "#"}}},  # a tree: a child may be left out
        {"$defs": {"Node": {"type": "object", "properties": {"children": {"type": "array",
                                                                          "items": {"$ref": "#/$defs/Node"}}},
                            "required": ["children"]}}, "$ref": "#/$defs/Node"},  # [] ends it
        {"anyOf": [{"$ref": "#"}, {"type": "null"}]}, {"type": "object", "required": ["x"]}, patterns(MAX_PATTERNS)]


def test_a_schema_with_no_finite_document_or_too_many_patterns_is_refused_before_any_compile(decoder):
    for schema in DEAD:
        assert not has_document(schema), schema
        assert "no finite document" in refusal(schema)
    for schema in LIVE:
        assert has_document(schema) and refusal(schema) is None, schema
    assert "21 string patterns" in refusal(patterns(21))
    by_ref = {"$defs": {c: {"pattern": f".*{c}.*"} for c in "abcdefghijklmnop"}, "type": "string",
              "allOf": [{"$ref": f"#/$defs/{c}"} for c in "abcdefghijklmnop"]}  # 5 s to compile, through $refs
    assert "16 string patterns" in refusal(by_ref)
    # where a dead schema reaches the compiler all the same, its first step says it has no document
    with pytest.raises(GrammarError, match="allows no document"):
        COMPILERS[decoder].compile(f"start: {json_rule(DEAD[0])}")


def test_a_dead_end_mid_answer_ends_that_answer_cleanly_beside_another(decoder):
    # an object that requires itself compiles (its first token is `{`) but its parser gives out a few tokens in
    needs_itself = f"start: {json_rule(DEAD[2])}"  # never accepts: an answer ends before max_tokens at a dead end
    free = SamplingParams(max_new_tokens=24)
    alone = run_together(decoder, [(random_ids(9, 1), free, None)])[0]
    rows = run_together(decoder, [(random_ids(9, 1), free, None),
                                  (random_ids(12, 7), SamplingParams(max_new_tokens=60), needs_itself)])
    assert rows[0] == alone  # the other row is untouched
    assert all(isinstance(t, int) for t in rows[1]) and len(rows[1]) < 60  # ended at the dead end: no error
    assert BLENDERS[decoder].tokenizer.decode(rows[1], skip_special_tokens=True).startswith("{")



MANY = f'start: doc ("\\n" doc)*\ndoc: {json_rule(SCHEMA)}'  # documents one after another, as calls are


def test_an_answer_ends_at_a_whole_document_rather_than_be_cut_by_max_tokens(decoder):
    tokenizer = BLENDERS[decoder].tokenizer
    first, second = '{"unit": "celsius", "rain": true}', '{"unit": "fahrenheit", "rain": false}'
    constraint = COMPILERS[decoder].constraint(MANY)
    ids = tokenizer.encode(first, add_special_tokens=False)
    for token in ids[:-1]:
        constraint.advance(token)
    assert not constraint.out_of_room(0)  # mid-document: never ended here
    constraint.advance(ids[-1])
    room = len(ids) + len(ids) // 2  # another call half again as long as the longest
    assert constraint.longest == len(ids) and constraint.out_of_room(room - 1)
    assert not constraint.out_of_room(room)  # it still fits
    for token in tokenizer.encode("\n" + second, add_special_tokens=False):
        constraint.advance(token)
    assert constraint.longest >= len(ids) and constraint.since == 0

    # in the decode loop: whatever max_tokens, the answer is whole documents (it ends at eos, which the grammar
    # allows between documents, or where the next would not fit)
    for budget in (20, 45, 60, 75):
        tokens = run_together(decoder, [(random_ids(9, budget), SamplingParams(max_new_tokens=budget), MANY)],
                              eos=frozenset())[0]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert len(tokens) < budget, text
        for line in text.split("\n"):
            assert set(json.loads(line)) == {"unit", "rain"}


def taken(decoder: DecodeRuntime, schema: dict, text: str) -> tuple[str, bool]:
    """How much of `text` (fed a character at a time) the grammar of `schema` takes, and whether it may end there."""
    tokenizer, constraint = BLENDERS[decoder].tokenizer, COMPILERS[decoder].constraint(f"start: {json_rule(schema)}")
    for i, char in enumerate(text):
        token = tokenizer.encode(char, add_special_tokens=False)
        if not constraint.matcher.try_consume_tokens(token):
            return text[:i], constraint.matcher.is_accepting()
    return text, constraint.matcher.is_accepting()


def test_a_number_ends_at_its_bound_where_json_would_let_it_run_on(decoder):
    # the failure seen at temperature 0: `1.0000000…` until max_tokens cut the document
    confidence = {"type": "number", "minimum": 0, "maximum": 1}
    assert taken(decoder, confidence, "1." + "0" * 20) == ("1." + "0" * NUMBER_PLACES, True)
    assert taken(decoder, confidence, "0.75") == ("0.75", True)
    digits = "9" * 20
    assert taken(decoder, {"type": "integer"}, digits) == (digits[:len(str(NUMBER_LIMIT)) - 1], True)
    assert taken(decoder, {"type": "number", "multipleOf": 0.5}, "2.5") == ("2.5", True)  # the client's own step
    pi = {"type": "number", "enum": [3.14159265358979]}  # listed values stand as they are
    assert taken(decoder, pi, "3.14159265358979") == ("3.14159265358979", True)
    # values the schema leaves open are bounded too: an open object's properties, an array's items, any value
    text, _ = taken(decoder, {"type": "object"}, '{"b": [1, {"c": 3.' + "3" * 20)
    assert text == '{"b": [1, {"c": 3.' + "3" * NUMBER_PLACES
    assert taken(decoder, {}, '[1.5, "x", null, {"k": false}]') == ('[1.5, "x", null, {"k": false}]', True)
    # an object that lists its properties holds those alone (a weak model copies `"type": "string"` in)
    listed = {"type": "object", "properties": {"city": {"type": "string"}}}
    assert taken(decoder, listed, '{"city": "Oslo", "type": "string"}') == ('{"city": "Oslo"', False)
    assert taken(decoder, listed, '{"city": "Oslo"}') == ('{"city": "Oslo"}', True)
    composed = {**listed, "allOf": [{"properties": {"days": {"type": "integer"}}, "required": ["days"]}]}
    assert taken(decoder, composed, '{"city": "Oslo", "days": 3}') == ('{"city": "Oslo", "days": 3}', True)


SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "number"}, "i": {"type": "integer", "minimum": 3}},
     "required": ["n"]},
    {"type": "array", "items": {"anyOf": [{"type": "number", "exclusiveMaximum": 0}, {"type": "string"}]}},
    {"type": ["number", "null"], "minimum": 10**18},
    {"type": "object", "additionalProperties": True, "not": {"required": ["x"]}},
    {"$defs": {"p": {"type": "number", "maximum": -1}}, "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}},
]
DOCUMENTS = [None, 0, -1, 3, 2.5, 1e18, 1.123456789, 10**16, -(10**16), "s", [], [1.5, "t"], [-0.5, 2],
             {"n": 1.5}, {"n": 1.5, "i": 2}, {"n": 1, "i": 4, "z": 1.123456789}, {"x": 1}, {"p": -2.5}, {"p": 0}]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_a_bounded_schema_allows_only_what_the_schema_allows_and_everything_within_its_bounds(schema):
    allowed = jsonschema.Draft202012Validator(bounded(schema))
    original = jsonschema.Draft202012Validator(schema)
    for document in DOCUMENTS:
        if allowed.is_valid(document):
            assert original.is_valid(document), document
        elif original.is_valid(document):  # refused only for a number past the bounds or an unlisted property
            listed = schema.get("properties")
            unlisted = isinstance(document, dict) and listed is not None and set(document) - set(listed)
            assert unlisted or "1.123456789" in json.dumps(document) or "10000000000000000" in json.dumps(document)
