"""A Lark grammar compiled into an llguidance matcher and checked for a way forward; and the child process that
does it first, so that a grammar whose compile runs away can be stopped (blend.grammar.CompilePool kills it).

    compile_matcher(grammar, tokenizer) -> LLMatcher     GrammarError where it does not compile, or where its
                                                         first step allows nothing (a `$ref` to itself, say)
    python blend/grammar_compile.py                      the child: a JSON line with the tokenizer, then one
                                                         line per grammar, each answered {"error": str | null}

This module imports llguidance alone (no torch, no transformers), so the child starts in a fraction of a second;
it runs as a script, so the child imports none of the parent's modules either. llguidance's compile holds no GIL
but cannot be interrupted, and its limits (fuel) do not bound it: an `allOf` of N string patterns compiles in
time exponential in N (N = 14: 0.3 s, 16: 2 s, 21: ~160 s on this CPU). Its log is silenced (log_level 0): what
it would warn of comes back as the error.
"""
from __future__ import annotations

import json
import sys

import llguidance


class GrammarError(ValueError):
    """A grammar (or JSON schema) the engine cannot compile; the message says why (llguidance's reason)."""


def compile_matcher(grammar: str, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """The matcher of a Lark grammar, its first mask computed: GrammarError where it has none to give."""
    try:
        spec = llguidance.LLMatcher.grammar_from_lark(grammar)
        error = llguidance.LLMatcher.validate_grammar(spec, tokenizer)
    except (ValueError, RuntimeError) as exc:
        raise GrammarError(f"the schema does not compile: {exc}") from None
    if error:
        raise GrammarError(f"the schema does not compile: {_reason(error)}")
    matcher = llguidance.LLMatcher(tokenizer, spec, log_level=0)
    first = matcher.compute_bitmask()  # where a grammar can reach no document, its first step says so
    if matcher.is_error():
        raise GrammarError(f"the schema allows no document ({_reason(matcher.get_error())})")
    if not any(first):
        raise GrammarError("the schema allows no document (its grammar allows no first token)")
    return matcher


def _reason(error: str) -> str:
    """llguidance's message without its parser state dump."""
    return error.split("<state>")[0].strip()[:1000]


def main() -> None:
    """The child: builds the tokenizer from the first line, says it is ready, then answers one line per grammar."""
    setup = json.loads(sys.stdin.readline())
    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=setup["eos"])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            compile_matcher(json.loads(line)["grammar"], tokenizer)
            error = None
        except GrammarError as exc:
            error = str(exc)
        print(json.dumps({"error": error}), flush=True)


if __name__ == "__main__":
    main()
