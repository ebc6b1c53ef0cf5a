"""A request to the engine (QueryParams) and what it returns (QueryResult: the answer, its sources, its stats
and the store keys its prompt used)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from app.engine.explain import Explain
from app.engine.tool_calls import ToolCallOut
from blend.decode import TokenLogprob
from blend.grammar import Grammar

SYSTEM_ROLES = ("system", "developer")  # their text joins the system turn (the head), wherever they stand
Mode = Literal["blend", "full", "reuse", "prefix"]  # prefix: the exact prefix reused, everything after it computed


class RequestError(ValueError):
    """The request cannot be served as asked (HTTP 400)."""


@dataclass
class QueryParams:
    question: str
    top_k: int | None = None
    mode: Mode = "blend"
    ratio: float | None = None
    selection: str | None = None  # a blend.selection policy; None: blend.selection
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    explain_tokens: int = 0  # > 0: attach an Explain of the prompt, listing at most this many tokens
    # A chat: its messages as OpenAI/HF dicts (role, content, tool_calls, tool_call_id, name), every one,
    # system ones included (an index into them names a message), the tools they may call, and the text to
    # retrieve with (default: the question).
    messages: tuple[dict, ...] = ()
    tools: tuple[dict, ...] = ()
    retrieval_query: str | None = None
    retrieve: bool = True  # False: no passages, the prompt is the conversation alone
    tenant: str = ""  # who asks (set from the API key): the store keys of a client's prompt text mix it in
    collection: str = ""  # whose documents it retrieves: the tenant's (retrieval.documents: tenant), or "" shared
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)
    # the answer's grammar (llguidance Lark, app.engine.tool_calls); the server compiles it before the request takes
    # a slot (app.serving.service), a program run alone (CLI, bench) where it starts
    grammar: str | Grammar | None = None
    tool_calls: bool = False  # parse the calls in the answer (with tools, but for tool_choice none)
    prompt_ids: tuple[int, ...] = ()  # a raw prompt's tokens (/v1/completions): no template, no messages
    top_logprobs: int | None = None  # None: no logprobs; n: each answer token's, with n alternatives
    # the last message (an assistant's) is the answer's start, a prefill: rendered open, the model continues it
    continue_final: bool = False

    @property
    def prefill(self) -> str:
        """The answer's start the client wrote ("" without continue_final): the answer is what follows it."""
        last = next((m for m in reversed(self.messages) if m["role"] not in SYSTEM_ROLES), None)
        return message_text(last) if self.continue_final and last and last["role"] == "assistant" else ""


def message_text(message: dict | None) -> str:
    return ((message or {}).get("content") or "").strip()


@dataclass
class Source:
    doc_id: str
    chunk_id: int
    title: str | None
    score: float
    text: str


@dataclass
class QueryStats:
    mode: str
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    retrieve_ms: float = 0.0
    kv_load_ms: float = 0.0
    prefill_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was read from the store and not recomputed
    exact_tokens: int = 0  # of those, the exact prefix: used as is
    recomputed_tokens: int = 0  # tokens read from the store at a new position that the blend recomputed
    recompute_ratio: float = 1.0
    selection: str | None = None
    completion_tokens: int = 0
    store_hits: dict[str, int] = field(default_factory=dict)  # passages per tier they came from; "computed" = miss
    fallback: str | None = None  # why a blend ran as full prefill
    queue_ms: float = 0.0  # time waiting for a slot on the model thread (set by the server)
    conversation_tokens: int = 0  # chat messages in the prompt (the question after passages not counted)
    conversation_cached_tokens: int = 0  # of those, read from the store
    spans: list[dict] = field(default_factory=list)  # app.engine.planner's spans in prompt order (the question apart):
    # kind, tokens, message (the last it covers), kv ("exact": read, used as is; "blended": read, RoPE-shifted and
    # blended; "compute": computed in the prefill, then stored) and tier (where it was read)
    dropped_messages: int = 0  # earlier messages left out: the conversation did not fit the context
    load_wait_ms: float = 0.0  # prefill time spent waiting for chunk KV layers (loading not hidden by compute)
    loading: dict | None = None  # blend.ratio auto: the controller's ratio, chunks recomputed from text, and why
    plan: dict | None = None  # planner.by_cost: spans found past the exact prefix, blended or computed whole (the
    # cheaper as predicted: blend, blend_ms, whole_ms); None where nothing was found, by_cost is off or the rates
    # are not settled yet (app.engine.loading.planning_rates)


@dataclass(frozen=True)
class KeyUse:
    """A store key the request's prompt read or wrote (a span's: app.engine.planner): its tokens and the last chat
    message it covers (its index in `QueryParams.messages`; None for the head, the passages' turn opening and
    passages). `cached`: read from the store, not computed for this request."""

    key: str
    tokens: int
    message: int | None
    cached: bool = False


@dataclass
class QueryResult:
    answer: str
    sources: list[Source]
    stats: QueryStats
    finish_reason: str
    explain: Explain | None = None
    kv_keys: list[KeyUse] = field(default_factory=list)  # in prompt order, the head first (full mode: none)
    tool_calls: list[ToolCallOut] = field(default_factory=list)  # the calls in the answer (`answer`: the rest)
    stop_sequence: str | None = None  # the stop string that ended the answer
    logprobs: list[TokenLogprob] | None = None  # each answer token's (params.top_logprobs), in order

    def to_dict(self) -> dict:
        return asdict(self)
