"""Grammar-constrained decoding through llguidance: a request's grammar as a token mask on its row of the one
decode step.

    Grammars(tokenizer, vocab).compile(grammar) -> Grammar          a Lark grammar (llguidance's dialect, `%json`
                                                                    included) compiled once per text (LRU), first
                                                                    in a child process within `limit_s` (a compile
                                                                    past it is killed: GrammarError, "too complex");
                                                                    a failure is remembered by the text's hash
    Grammar.constraint() -> Constraint                              each request a copy of the compiled matcher
    token_masks(constraints) -> [B, V] bool | None                  the rows' allowed tokens, built on the host
                                                                    (rows without a constraint: every token)
    refusal(schema) -> str | None                                   why a JSON schema is refused before any compile:
                                                                    more than MAX_PATTERNS string patterns to
                                                                    intersect, or no finite document it allows

A compile blocks its caller (never the model thread: the server compiles before a request takes a slot). A grammar
that meets a dead end mid-answer (no token allowed: llguidance's limits, say) ends that answer at its next token,
an eos, with finish reason "stop" rather than an error.

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

import hashlib
import json
import logging
import queue
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from copy import copy

import llguidance
import llguidance.torch
import numpy as np
import torch

from blend import grammar_compile
from blend.grammar_compile import GrammarError, compile_matcher

__all__ = ["GrammarError", "Grammar", "Grammars", "Constraint", "token_masks", "json_rule", "bounded", "refusal"]

log = logging.getLogger("ragblend.blend")

GRAMMAR_CACHE = 64     # compiled grammars kept (by their text)
FAILED_CACHE = 1024    # grammars that failed, kept by their text's hash: a resend is refused at once
MAX_PATTERNS = 8       # string patterns one value may have to match at once (an allOf's): their intersection
#                        compiles in time exponential in their count (16: ~2 s, 21: ~160 s)
CHILD_START_S = 120.0  # a compile child's start (its tokenizer built): not counted against the compile limit


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


def refusal(schema) -> str | None:
    """Why `schema` is refused before any compile (None: it may be compiled): more than MAX_PATTERNS string
    patterns that one value must match at once, or no finite document it allows (`has_document`)."""
    patterns = max((_intersected_patterns(node, schema, set()) for node in _nodes(schema)), default=0)
    if patterns > MAX_PATTERNS:
        return (f"the schema is too complex: a value must match {patterns} string patterns at once "
                f"(at most {MAX_PATTERNS}: their intersection compiles in time exponential in their count)")
    if not has_document(schema):
        return ("the schema allows no finite document (such as a $ref cycle without a way out, or an object "
                "that requires itself)")
    return None


def _nodes(schema) -> list[dict]:
    """Every subschema of `schema` (dicts), itself first."""
    out, todo = [], [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            out.append(node)
            todo += _children(node)
    return out


def _children(node: dict) -> list:
    children = [node[k] for k in (*_SCHEMAS, "not", "if", "contains", "propertyNames") if k in node]
    children += [s for k in _SCHEMA_LISTS if isinstance(node.get(k), list) for s in node[k]]
    children += [s for k in (*_SCHEMA_MAPS, "dependentSchemas") if isinstance(node.get(k), dict)
                 for s in node[k].values()]
    return children


def _intersected_patterns(node, root, seen: set[int]) -> int:
    """The string patterns a value matching `node` must match at once: its own, its allOf's and its $ref's."""
    if not isinstance(node, dict) or id(node) in seen:
        return 0
    seen.add(id(node))
    parts = [*(node["allOf"] if isinstance(node.get("allOf"), list) else ()), _target(node, root)]
    return ("pattern" in node) + sum(_intersected_patterns(p, root, seen) for p in parts)


def has_document(schema) -> bool:
    """Whether some finite JSON document may satisfy `schema`: the least fixpoint of "has a document" over its
    subschemas, through its local `$ref`s. Conservative: False only where none can (a `$ref` to itself, a cycle
    of `$defs`, an object that requires itself); a keyword it does not follow counts as satisfiable."""
    nodes, done = _nodes(schema), set()

    def ok(node) -> bool:
        return node is not False and (not isinstance(node, dict) or id(node) in done)

    changed = True
    while changed:
        changed = False
        for node in nodes:
            if id(node) not in done and _satisfiable(node, schema, ok):
                done.add(id(node))
                changed = True
    return ok(schema)


def _satisfiable(node: dict, root, ok) -> bool:
    """Whether `node` has a document, given which of its subschemas have (`ok`)."""
    target = _target(node, root)
    if target is not None and not ok(target):
        return False
    lists = {k: node[k] for k in ("allOf", "anyOf", "oneOf") if isinstance(node.get(k), list) and node[k]}
    if not all(map(ok, lists.get("allOf", ()))) or not all(any(map(ok, lists[k])) for k in ("anyOf", "oneOf")
                                                             if k in lists):
        return False
    types = node.get("type")
    if not isinstance(types, (str, list)):
        return True
    return any(_type_satisfiable(node, t, ok) for t in ([types] if isinstance(types, str) else types))


def _type_satisfiable(node: dict, kind, ok) -> bool:
    if kind == "object":
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        other = True if node.get("patternProperties") else node.get("additionalProperties", True)
        required = node.get("required") if isinstance(node.get("required"), list) else []
        return all(ok(properties.get(name, other)) for name in required if isinstance(name, str))
    if kind == "array":
        least = node.get("minItems", 0) if isinstance(node.get("minItems"), int) else 0
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        items = node.get("items", True) if not isinstance(node.get("items"), list) else True
        return all(ok(prefix[i] if i < len(prefix) else items) for i in range(min(least, len(prefix) + 1)))
    return True


def _target(node: dict, root):
    """The subschema `node`'s local `$ref` ("#", "#/$defs/a") names in `root`; None where it names none."""
    ref = node.get("$ref")
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and part in target:
            target = target[part]
        elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        else:
            return None
    return target


class Constraint:
    """One answer's grammar state (an llguidance matcher): the mask of its next token, moved on token by token.
    A dead end (no token allowed, a token refused) ends the answer: its mask allows `eos` alone, then it is
    finished."""

    def __init__(self, matcher, eos: int):
        self.matcher, self.eos = matcher, eos
        self.dead = False  # the grammar has no way on: the answer ends at its next token
        self.since = 0     # tokens since the grammar last accepted (could have ended)
        self.longest = 0   # the longest such stretch so far (a tool call, say)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of bitmask ([B, ceil(V/32)] int32, host): the tokens allowed next."""
        if not self.dead:
            llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)
            if self.matcher.is_error() or not bitmask[row].any():
                self._end("no next token")
        if self.dead:  # eos alone
            bit = 1 << (self.eos % 32)
            bitmask[row] = 0
            bitmask[row, self.eos // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # (bit 31: the sign)

    def advance(self, token: int) -> None:
        """The answer took `token` (one its mask allowed)."""
        if self.dead:
            return
        if not self.matcher.consume_token(token):
            return self._end(f"token {token} refused")
        self.since += 1
        if self.matcher.is_accepting():
            self.longest, self.since = max(self.longest, self.since), 0

    def start_with(self, tokens: Sequence[int]) -> bool:
        """The answer starts with `tokens`, already written (a client's prefill): False where the grammar refuses
        them (the constraint is then no use)."""
        for token in tokens:
            if not self.matcher.consume_token(token):
                return False
            self.since = 0 if self.matcher.is_accepting() else self.since + 1
        return not self.matcher.is_error()

    def _end(self, why: str) -> None:
        self.dead = True
        log.info("an answer's grammar met a dead end: the answer ends there",
                 extra={"reason": why, "error": self.matcher.get_error().split("<state>")[0].strip()[:300]})

    def out_of_room(self, tokens_left: int) -> bool:
        """The answer may end here, and another stretch half again as long as the longest so far (another call:
        calls vary, a longer argument) would not fit in `tokens_left`: ending here keeps it whole, where
        max_tokens would cut it mid-call. Free text accepts at every token (stretches of 1), so it is never
        ended early."""
        room = self.longest + self.longest // 2
        return self.since == 0 and room > tokens_left and self.matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (its eos taken, or its last token), or it met a dead
        end."""
        return self.dead or self.matcher.is_stopped()


class Grammar:
    """A compiled grammar: each answer's Constraint a copy of its matcher (7 us)."""

    def __init__(self, matcher, eos: int):
        self.matcher, self.eos = matcher, eos

    def constraint(self) -> Constraint:
        return Constraint(self.matcher.deep_copy(), self.eos)


class Grammars:
    """Compiles grammars for one tokenizer (its llguidance form built at `start` or the first grammar: ~1 s),
    each first in one of `workers` child processes (CompilePool) within `limit_s`, then here. Thread-safe."""

    def __init__(self, tokenizer, vocab: int, *, limit_s: float = 2.0, workers: int = 2):
        self.tokenizer, self.vocab, self.limit_s, self.workers = tokenizer, vocab, limit_s, workers
        self._lock, self._start_lock = threading.Lock(), threading.Lock()  # the caches; the first build
        self._ll_tokenizer, self._pool = None, None
        self._compiled: OrderedDict[str, Grammar] = OrderedDict()
        self._failed: OrderedDict[str, str] = OrderedDict()  # sha256 of a grammar -> why it failed

    def start(self) -> None:
        """Build the tokenizer's llguidance form and the compile pool (else the first grammar does)."""
        with self._start_lock:
            if self._ll_tokenizer is None:
                backend = copy(self.tokenizer.backend_tokenizer)  # as llguidance.hf.from_tokenizer serialises it
                backend.no_padding()
                backend.no_truncation()
                setup = {"tokenizer": backend.to_str(), "n_vocab": self.vocab, "eos": self.tokenizer.eos_token_id}
                self._ll_tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=self.vocab,
                                                            eos_token=setup["eos"])
                self._pool = CompilePool(json.dumps(setup), self.workers, self.limit_s)

    def cached(self, grammar: str) -> Grammar | None:
        """The compiled `grammar` where it is cached (None where it is not compiled yet); GrammarError where it
        failed before. At once: a resend of a grammar that failed is refused without a compile."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
            failed = self._failed.get(_key(grammar))
        if failed is not None:
            raise GrammarError(failed)
        return None

    def compile(self, grammar: str) -> Grammar:
        """The compiled `grammar` (GrammarError where it does not compile, within the limit)."""
        compiled = self.cached(grammar)
        if compiled is not None:
            return compiled
        self.start()
        try:
            self._pool.check(grammar)  # bounded: where it compiles there, it compiles here in about as long
            compiled = Grammar(compile_matcher(grammar, self._ll_tokenizer), self._ll_tokenizer.eos_token)
        except GrammarError as exc:
            with self._lock:
                _keep(self._failed, _key(grammar), str(exc), FAILED_CACHE)
            raise
        with self._lock:
            _keep(self._compiled, grammar, compiled, GRAMMAR_CACHE)
        return compiled

    def constraint(self, grammar: str | Grammar) -> Constraint:
        """A fresh Constraint of a grammar, compiled here where it is given as text."""
        return (grammar if isinstance(grammar, Grammar) else self.compile(grammar)).constraint()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()


def _key(grammar: str) -> str:
    return hashlib.sha256(grammar.encode()).hexdigest()


def _keep(cache: OrderedDict, key, value, size: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    if len(cache) > size:
        cache.popitem(last=False)


class CompilePool:
    """`workers` child processes (blend/grammar_compile.py) that compile a grammar before the caller does, each
    within `limit_s`: a child past it is killed and replaced (in the background), so a compile that runs away
    holds a CPU for `limit_s` at most, and the caller none. A caller waits for a free child."""

    def __init__(self, setup: str, workers: int, limit_s: float):
        self.setup, self.limit_s, self.closed = setup, limit_s, False
        self._idle: queue.Queue[subprocess.Popen | None] = queue.Queue()
        for _ in range(workers):
            self._replace()

    def check(self, grammar: str) -> None:
        """GrammarError where `grammar` does not compile, or not within the limit."""
        child = self._idle.get()
        try:
            child = child if child is not None and child.poll() is None else self._spawn()
            error = self._ask(child, grammar)
        except BaseException:
            _kill(child)
            self._replace()
            raise
        if self.closed:
            _kill(child)
        else:
            self._idle.put(child)
        if error is not None:
            raise GrammarError(error)

    def _replace(self) -> None:
        """A fresh child for the pool, started in the background (None where it fails: the next caller tries)."""
        def spawn() -> None:
            try:
                child = None if self.closed else self._spawn()
            except (OSError, RuntimeError):
                log.exception("a grammar compile process failed to start")
                child = None
            self._idle.put(child)
            if self.closed:
                _kill(child)
        threading.Thread(target=spawn, name="ragblend-grammar-spawn", daemon=True).start()

    def _spawn(self) -> subprocess.Popen:
        child = subprocess.Popen([sys.executable, grammar_compile.__file__], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        child.stdin.write(self.setup + "\n")
        child.stdin.flush()
        if not (self._reply(child, CHILD_START_S) or {}).get("ready"):
            _kill(child)
            raise RuntimeError("the grammar compile process did not start")
        return child

    def _ask(self, child: subprocess.Popen, grammar: str) -> str | None:
        child.stdin.write(json.dumps({"grammar": grammar}) + "\n")
        child.stdin.flush()
        reply = self._reply(child, self.limit_s)
        if reply is None:
            raise GrammarError(f"the schema is too complex: its grammar did not compile within {self.limit_s:g} s")
        if "error" not in reply:
            raise GrammarError("the schema's grammar could not be compiled (its compile process ended)")
        return reply["error"]

    @staticmethod
    def _reply(child: subprocess.Popen, limit_s: float) -> dict | None:
        """The child's next line ({} where it ended), None where it has none within `limit_s`."""
        ready, _, _ = select.select([child.stdout], [], [], limit_s)
        if not ready:
            return None
        line = child.stdout.readline()
        return json.loads(line) if line else {}

    def close(self) -> None:
        self.closed = True
        while not self._idle.empty():
            _kill(self._idle.get_nowait())


def _kill(child: subprocess.Popen | None) -> None:
    if child is not None:
        child.kill()
        child.wait()


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
