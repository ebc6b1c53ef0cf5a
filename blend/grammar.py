"""Grammar-constrained decoding through llguidance: a request's grammar as a token mask on its row of the one
decode step.

    Grammars(tokenizer, vocab).constraint(grammar) -> Constraint    a Lark grammar (llguidance's dialect, `%json`
                                                                    included) compiled once per text (LRU), each
                                                                    request a copy of the compiled matcher
    token_masks(constraints) -> [B, V] bool | None                  the rows' allowed tokens, built on the host
                                                                    (rows without a constraint: every token)

The mask is applied in blend.decode.sample_rows before the choice, so a constrained row draws only what its
grammar allows next (its end, eos, only where the grammar accepts) and an unconstrained row's logits are
untouched. The decode loop (blend.decode.decode_loop) moves the matcher on with each token the answer takes.

Chosen by measurement on this CPU (SmolLM2's 49k vocabulary, a 3-field tool schema; /work/notes/agents.md):
llguidance fills a row's mask in 0.19-0.31 ms inside JSON and 0.013 ms in free text, compiles the schema in
11 ms (a copy of a compiled matcher: 7 us); xgrammar 0.2.8 took 0.73 / 0.90 ms a token at batch 1 / 4 with
its mask applied, 13.7 ms to compile (0.1 ms cached), and pulls triton. llguidance's Lark grammars also say
"free text, then calls" directly, which "auto" tool choice needs.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch

GRAMMAR_CACHE = 64  # compiled grammars kept (by their text)


# JSON as models write it, one form only: no run of whitespace for a weak model to fall into
JSON_FORM = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# A number has at most NUMBER_PLACES decimals and a magnitude of at most NUMBER_LIMIT (integers a double holds
# exactly), unless its schema says otherwise: JSON's grammar lets a number run on, and a weak model writes
# `1.0000000…` until max_tokens cuts its document.
NUMBER_PLACES, NUMBER_LIMIT = 8, 10**15
ANY_VALUE = "ragblend_json_value"  # the $defs entry of a bounded any-value
_ANY = {"anyOf": [{"type": ["null", "boolean", "string"]},
                  {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT,
                   "multipleOf": 10.0**-NUMBER_PLACES},
                  {"type": "array", "items": {"$ref": f"#/$defs/{ANY_VALUE}"}},
                  {"type": "object", "additionalProperties": {"$ref": f"#/$defs/{ANY_VALUE}"}}]}
_SCHEMAS = ("additionalProperties", "items", "additionalItems", "then", "else")        # keywords holding a schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")                   # ... a list of schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")           # ... a name -> schema map
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}
# an object's properties may come from these too: its own listed ones are then not all it may hold
_COMPOSED = {"patternProperties", "allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas", "dependencies"}


def json_rule(schema: dict) -> str:
    """A Lark rule body for a JSON value matching `schema` (llguidance's `%json`), in JSON_FORM, its numbers
    bounded (`bounded`)."""
    return "%json " + json.dumps({**bounded(schema), "x-guidance": JSON_FORM})


def bounded(schema: dict) -> dict:
    """`schema` narrowed so that every number it allows is bounded (NUMBER_PLACES, NUMBER_LIMIT), an object that
    lists its properties holds those alone, and every other value it leaves open is a bounded any-value ($defs
    ANY_VALUE): a document it allows is one `schema` allows."""
    root = _bound(schema)
    return {**root, "$defs": {**root.get("$defs", {}), ANY_VALUE: _ANY}} if isinstance(root, dict) else root


def _bound(schema):
    """One schema node narrowed (`bounded`); `not` and `if` are left as they are: narrowing them would widen."""
    if schema is True or (isinstance(schema, dict) and schema.keys() <= _ANNOTATIONS):  # any value
        return {"$ref": f"#/$defs/{ANY_VALUE}"}
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMAS:
        if isinstance(out.get(key), (dict, bool)):
            out[key] = _bound(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_bound(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _bound(s) for name, s in out[key].items()}
    types = out.get("type")
    types = {types} if isinstance(types, str) else set(types or ())
    if "object" in types and "additionalProperties" not in out:
        out["additionalProperties"] = _unlisted(out)
    if "array" in types and "items" not in out and "prefixItems" not in out:
        out["items"] = {"$ref": f"#/$defs/{ANY_VALUE}"}
    if types & {"number", "integer"} and not {"enum", "const"} & out.keys():  # (listed values are bounded)
        out.update(_number_bounds(out, "number" in types))
    return out


def _unlisted(schema: dict):
    """What an object may hold besides its listed properties, where its schema does not say: nothing when it lists
    them all (as xgrammar's strict mode: a call's arguments are its parameters, not `"type": "string"` copied
    from the schema), else a bounded any-value."""
    listed = schema.get("properties")
    if listed and not _COMPOSED & schema.keys() and set(schema.get("required", ())) <= listed.keys():
        return False
    return {"$ref": f"#/$defs/{ANY_VALUE}"}


def _number_bounds(schema: dict, fractional: bool) -> dict:
    """The bounds a number schema lacks: a side with none gets NUMBER_LIMIT (or NUMBER_LIMIT past the other side's
    bound, where that lies beyond it); a fractional number without multipleOf gets NUMBER_PLACES decimals."""
    low = next((schema[k] for k in ("minimum", "exclusiveMinimum") if _is_number(schema.get(k))), None)
    high = next((schema[k] for k in ("maximum", "exclusiveMaximum") if _is_number(schema.get(k))), None)
    bounds = {}
    if low is None:
        bounds["minimum"] = min(-NUMBER_LIMIT, (high if high is not None else 0) - NUMBER_LIMIT)
    if high is None:
        bounds["maximum"] = max(NUMBER_LIMIT, (low if low is not None else 0) + NUMBER_LIMIT)
    if fractional and "multipleOf" not in schema:
        bounds["multipleOf"] = 10.0**-NUMBER_PLACES
    return bounds


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class GrammarError(ValueError):
    """A grammar (or JSON schema) the engine cannot compile; the message is llguidance's reason."""


class GrammarDeadEnd(RuntimeError):
    """The answer reached a state its grammar has no continuation for."""


class Constraint:
    """One answer's grammar state (an llguidance matcher): the mask of its next token, moved on token by token."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.since = 0    # tokens since the grammar last accepted (could have ended)
        self.longest = 0  # the longest such stretch so far (a tool call, say)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of bitmask ([B, ceil(V/32)] int32, host): the tokens allowed next."""
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)
        if self.matcher.is_error():
            raise GrammarDeadEnd(f"the answer's grammar failed: {self.matcher.get_error()}")
        if not bitmask[row].any():
            raise GrammarDeadEnd("the answer's grammar allows no next token")

    def advance(self, token: int) -> None:
        """The answer took `token` (one its mask allowed)."""
        if not self.matcher.consume_token(token):
            raise GrammarDeadEnd(f"the answer's grammar refused token {token}: {self.matcher.get_error()}")
        self.since += 1
        if self.matcher.is_accepting():
            self.longest, self.since = max(self.longest, self.since), 0

    def out_of_room(self, tokens_left: int) -> bool:
        """The answer may end here, and another stretch half again as long as the longest so far (another call:
        calls vary, a longer argument) would not fit in `tokens_left`: ending here keeps it whole, where
        max_tokens would cut it mid-call. Free text accepts at every token (stretches of 1), so it is never
        ended early."""
        room = self.longest + self.longest // 2
        return self.since == 0 and room > tokens_left and self.matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (its eos taken, or its last token)."""
        return self.matcher.is_stopped()


class Grammars:
    """Compiles grammars for one tokenizer (its llguidance form built at the first grammar: ~1 s)."""

    def __init__(self, tokenizer, vocab: int):
        self.tokenizer, self.vocab = tokenizer, vocab
        self._ll_tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()

    def constraint(self, grammar: str) -> Constraint:
        """A fresh Constraint of a Lark grammar (GrammarError where it does not compile)."""
        matcher = self._compiled.get(grammar)
        if matcher is None:
            matcher = self._compile(grammar)
            self._compiled[grammar] = matcher
            if len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(grammar)
        return Constraint(matcher.deep_copy())

    def _compile(self, grammar: str):
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab)
        try:
            spec = llguidance.LLMatcher.grammar_from_lark(grammar)
            error = llguidance.LLMatcher.validate_grammar(spec, self._ll_tokenizer)
        except (ValueError, RuntimeError) as exc:
            raise GrammarError(str(exc)) from None
        if error:
            raise GrammarError(error.split("<state>")[0].strip()[:1000])
        matcher = llguidance.LLMatcher(self._ll_tokenizer, spec)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher


def token_masks(constraints: Sequence[Constraint | None], vocab: int) -> torch.Tensor | None:
    """[B, vocab] bool on the host: row b the tokens constraints[b] allows next, every token where it is None;
    None when no row has a constraint (the step then masks nothing)."""
    rows = [b for b, c in enumerate(constraints) if c is not None]
    if not rows:
        return None
    bitmask = torch.full((len(constraints), (vocab + 31) // 32), -1, dtype=torch.int32)   # [B, words]
    for b in rows:
        constraints[b].fill(bitmask, b)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]  # [B, V]
    return torch.from_numpy(bits).bool()
