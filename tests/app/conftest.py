"""Server test fixtures: one real engine per session (SmolLM2-135M on CPU) over a tiny corpus,
apps built around it, a live uvicorn server for socket-level clients, and a stub engine for the
tests that must control timing (queue full, queue timeout, disconnects)."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.config import Settings, load_settings
from app.engine.query import QueryParams, QueryResult, QueryStats, Source

MODELS = Path(__file__).resolve().parents[2] / "data" / "models"

# Made-up facts, so an answer can only come from the passage.
CORPUS = {
    "harbor": ("Port Velmar lighthouse",
               "The lighthouse of Port Velmar was built in 1887 by the engineer Ada Quenby. Its lamp shines green "
               "and can be seen 30 kilometres out at sea. The keeper's cottage is now a small museum."),
    "bakery": ("Kestrel Bakery",
               "The Kestrel Bakery in Dunmore bakes rye bread with caraway seeds every Tuesday. It was founded by "
               "Tomas Brell in 1952 and still uses his wood-fired oven."),
    "volcano": ("Mount Orrin",
                "Mount Orrin is a dormant volcano on the island of Sarne. It last erupted in 1402, burying the "
                "village of Kell under ash. Its crater holds a blue lake."),
    "chess": ("The Halden Open",
              "The Halden Open is a chess tournament held every August in the town of Halden. The 2019 edition was "
              "won by Mira Sokol, who played the Caro-Kann defence in every game."),
}
# (question, the document that answers it, words of which a right answer holds at least one)
QUESTIONS = [
    ("Who built the lighthouse of Port Velmar?", "harbor", ("Quenby", "Ada")),
    ("In which year did Mount Orrin last erupt?", "volcano", ("1402",)),
    ("Who won the Halden Open in 2019?", "chess", ("Sokol", "Mira")),
    ("Who founded the Kestrel Bakery?", "bakery", ("Brell", "Tomas")),
]


def make_settings(data_dir: Path, **sections: dict[str, Any]) -> Settings:
    """Test settings: the converted model, short answers, two passages, no warm-up requests before ready (the
    session's engine serves many apps); `sections` override per key."""
    base: dict[str, dict[str, Any]] = {"model": {"cache_dir": str(MODELS)}, "retrieval": {"top_k": 2},
                                       "limits": {"default_max_new_tokens": 8},
                                       "server": {"warm_up": False}}  # an app a test: tests/app/test_warm_up.py
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return load_settings(data_dir=str(data_dir), **base)


@pytest.fixture(scope="session")
def server_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return make_settings(tmp_path_factory.mktemp("ragblend"))


@pytest.fixture(scope="session")
def server_engine(server_settings: Settings):
    """The real engine, loaded once: every app in the session shares it (one at a time)."""
    from app.components import Components
    from app.engine.rag_engine import RagEngine

    engine = RagEngine(server_settings, Components(server_settings))
    yield engine
    engine.parts.close()


@pytest.fixture(scope="session")
def make_app(server_settings: Settings, server_engine) -> Callable[..., FastAPI]:
    """create_app over the session engine, with settings sections overridden (e.g. server={"api_key": "k"})."""
    from app.api.server import create_app

    def make(**sections: dict[str, Any]) -> FastAPI:
        settings = make_settings(server_settings.data_dir, **sections) if sections else server_settings
        return create_app(settings, server_engine)
    return make


@pytest.fixture(scope="session")
def engine_with(server_settings: Settings, server_engine) -> Callable[..., Any]:
    """A RagEngine over the session's data dir with settings sections overridden (e.g. limits=...) whose
    parts come from that settings, sharing the session's loaded LLM and embedder."""
    from app.components import Components
    from app.engine.rag_engine import RagEngine

    def make(**sections: dict[str, Any]):
        settings = make_settings(server_settings.data_dir, **sections)
        parts = Components(settings)
        parts.llm, parts.embedder = server_engine.parts.llm, server_engine.parts.embedder
        return settings, RagEngine(settings, parts)
    return make


@pytest.fixture(scope="session")
def corpus(make_app) -> SimpleNamespace:
    """CORPUS ingested through POST /v1/documents, once per session: .docs, .questions, .ingested
    (each document's ingest response)."""
    with TestClient(make_app()) as client:
        responses = {doc_id: client.post("/v1/documents", json={"id": doc_id, "title": title, "text": text})
                     for doc_id, (title, text) in CORPUS.items()}
    assert all(r.status_code == 201 for r in responses.values()), {k: r.text for k, r in responses.items()}
    return SimpleNamespace(docs=CORPUS, questions=QUESTIONS,
                           ingested={doc_id: r.json()["data"][0] for doc_id, r in responses.items()})


@pytest.fixture(scope="module")
def client(make_app, corpus) -> Iterator[TestClient]:
    with TestClient(make_app()) as client:
        yield client


class LiveServer:
    """uvicorn serving `app` on a free loopback port, in a thread."""

    def __init__(self, app: FastAPI):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="session")
def live_server(make_app, corpus) -> Iterator[LiveServer]:
    with LiveServer(make_app()) as server:
        yield server


# ---- a stub engine, for timing-controlled tests -------------------------------------------------

def split_words(texts: list[str], add_special_tokens: bool = False, **_) -> dict[str, list[list[str]]]:
    """The stub's tokenizer: a word a token (for the prompt budgets)."""
    return {"input_ids": [text.split() for text in texts]}


# the sizes the server states in its OpenAPI description once ready (app.api.schemas.ragblend.state_sizes)
STUB_VOCAB, STUB_EMBEDDING_DIM = 32000, 384


class StubEngine:
    """Stands in for RagEngine: each query's answer is `max_tokens` tokens ("ok " each), one per decode step, each
    taking `step_s` after `gate` opens; it records what it saw (calls, tokens emitted, whether a query stopped
    early, the requests in flight at once and their peak). Its queries run through the real scheduler and
    runner (blend.driver): `batches` records each decode step's rows."""

    def __init__(self, settings: Settings, step_s: float = 0.0):
        self.settings, self.step_s = settings, step_s
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Semaphore(0)
        self.calls = 0
        self.cancelled = threading.Event()
        self.emitted = 0
        self.active = self.peak = 0
        self.batches: list[int] = []
        self.parts = SimpleNamespace(llm=SimpleNamespace(name="stub"), tokenizer=split_words, kv_cache=None,
                                     ingestor=None, retriever=None, store=SimpleNamespace(stats=lambda: {"tiers": {}}),
                                     blender=SimpleNamespace(unsupported=None, num_layers=1),
                                     runtime=SimpleNamespace(advance=self.advance, vocab=STUB_VOCAB),
                                     embedder=SimpleNamespace(name="stub-embedder", dim=STUB_EMBEDDING_DIM),
                                     close=lambda: None)

    def token(self) -> int:
        """One token's work on the model thread: wait for the gate, take `step_s`."""
        assert self.gate.wait(30), "gate never opened"
        time.sleep(self.step_s)
        self.emitted += 1
        return 0

    def advance(self, sequences) -> list[int]:
        self.batches.append(len(sequences))
        for sequence in sequences:
            sequence.accept(self.token())
        return [0] * len(sequences)

    def request(self, params: QueryParams) -> StubQuery:
        return StubQuery(self, params)

    def output(self, params: QueryParams) -> StubOutput:
        return StubOutput()

    def stream(self, params: QueryParams, cancelled: Callable[[], bool] = lambda: False
               ) -> Iterator[str | QueryResult]:
        from blend.driver import run_alone
        return run_alone(self.request(params), self.output(params), self.advance, 1, cancelled)


class StubSequence:
    """A stub query's decoding: `n` tokens, then "length"; released by the runner (early: the query stopped)."""

    def __init__(self, engine: StubEngine, n: int):
        self.engine, self.n, self.tokens, self.finish_reason, self.released = engine, n, [], None, False

    @property
    def last(self) -> int:
        return self.tokens[-1]

    def accept(self, token: int) -> None:
        self.tokens.append(token)
        if len(self.tokens) == self.n:
            self.finish_reason = "length"

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.engine.active -= 1
            if self.finish_reason is None:
                self.engine.cancelled.set()


class StubQuery:
    """A stub query's model work (blend.driver.Work)."""

    def __init__(self, engine: StubEngine, params: QueryParams):
        self.engine, self.params = engine, params

    def prepare(self) -> None:
        self.engine.calls += 1
        self.engine.started.release()

    def prefill(self):
        """Two pieces, as a real prefill's layer chunks: the prompt (one token-layer, after `gate` opens), then
        the first token. With `server.step_token_budget` 1 they run in two steps, so a request whose client left
        while the gate held its prompt ends before any token; closed early, it counts as stopped early."""
        engine = self.engine
        engine.active += 1
        engine.peak = max(engine.peak, engine.active)
        try:
            assert engine.gate.wait(30), "gate never opened"
            yield 1
        except GeneratorExit:  # ended before its first token (the runner closed its prefill)
            engine.active -= 1
            engine.cancelled.set()
            raise
        sequence = StubSequence(engine, self.params.max_tokens or 4)
        sequence.accept(engine.token())  # the first token, from the "prefill"
        return sequence

    def finish(self, sequence: StubSequence, reason: str) -> QueryResult:
        stats = QueryStats(mode=self.params.mode, ttft_ms=1.0, total_ms=2.0, prompt_tokens=10, cached_tokens=6,
                           completion_tokens=len(sequence.tokens), store_hits={"memory": 1})
        return QueryResult("", [Source("d", 1, "t", 0.5, "passage")], stats, reason)


class StubOutput:
    """A stub query's output side: each token is "ok "; the result carries the text."""

    stopped = False

    def __init__(self):
        self.text = ""

    def feed(self, item) -> list[str | QueryResult]:
        if isinstance(item, QueryResult):
            item.answer = self.text.strip()
            return [item]
        self.text += "ok " * len(item)
        return ["ok "] * len(item)


@pytest.fixture
def stub_app(tmp_path: Path) -> Callable[..., tuple[FastAPI, StubEngine]]:
    """make(step_s=0, **sections) -> (app, its StubEngine)."""
    from app.api.server import create_app

    def make(step_s: float = 0.0, **sections: dict[str, Any]) -> tuple[FastAPI, StubEngine]:
        engine = StubEngine(make_settings(tmp_path, **sections), step_s)
        return create_app(engine.settings, engine), engine
    return make


@pytest.fixture
def stub_settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path)


@pytest.fixture(scope="session")
def stub_engine_type() -> type[StubEngine]:
    return StubEngine


@pytest.fixture(scope="session")
def serve_live() -> type[LiveServer]:
    """`with serve_live(app) as live:` uvicorn on a free port; live.url."""
    return LiveServer
