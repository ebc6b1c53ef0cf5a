"""Chunker contract (see retrieval/chunker.py) on random texts and real passages, with SmolLM2's tokenizer."""
from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from retrieval import Chunk, Chunker, ChunkingSettings
from tests.helpers import MUSIQUE, ROOT, load_musique

SMALL = ChunkingSettings(target_tokens=24, max_tokens=32, min_tokens=4)


def invisible(chunker: Chunker, gap: str) -> bool:
    """Whitespace, or text the tokenizer drops entirely."""
    return gap.strip() == "" or chunker.encode(gap.strip()) == []


def check_contract(chunker: Chunker, text: str, chunks: list[Chunk]) -> None:
    position = 0
    for ordinal, chunk in enumerate(chunks):
        assert chunk.ordinal == ordinal
        assert chunk.text == text[chunk.start:chunk.end] == chunk.text.strip() != ""
        assert invisible(chunker, text[position:chunk.start])  # nothing the model sees between chunks
        assert chunk.token_ids == chunker.tokenizer(chunk.text, add_special_tokens=False,
                                                    split_special_tokens=True)["input_ids"]
        assert 1 <= chunk.n_tokens <= chunker.max_tokens
        assert chunk.content_hash == hashlib.sha256(chunk.text.encode()).hexdigest()
        position = chunk.end
    assert invisible(chunker, text[position:])


words = st.sampled_from(["the", "harbour", "Alderwick", "1847", "don't", "naïve", "東京", "🙂", "x" * 40,
                         "e.g.", "U.S.A.", "foo_bar", "a-b", "(note)", '"quoted."', "end."])
separators = st.sampled_from([" ", " ", " ", "  ", "\n", "\n\n", "\n \n\t", ". ", "! ", "? ", "\t", ""])
texts = st.lists(st.tuples(words, separators), max_size=120).map(lambda parts: "".join(w + s for w, s in parts))


@hyp_settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(texts, st.text(max_size=400)))
def test_contract_on_random_texts(tokenizer, text):
    chunker = Chunker(tokenizer, SMALL)
    check_contract(chunker, text, chunker.chunk("doc", text))


def test_contract_on_real_passages(tokenizer):
    chunker = Chunker(tokenizer)  # defaults: target 384, max 512, min 32
    passages = [c["text"] for q in load_musique(5) for c in q["ctxs"]] if MUSIQUE.exists() else []  # shared data
    passages += [p.read_text() for p in sorted((ROOT / "corpus").rglob("*.*"))]
    sizes = []
    for text in passages:
        chunks = chunker.chunk("doc", text)
        check_contract(chunker, text, chunks)
        sizes += [c.n_tokens for c in chunks]
    assert max(sizes) <= 512
    long_docs = "\n\n".join(passages[:10])  # ~6k tokens: many chunks near the target
    chunks = chunker.chunk("long", long_docs)
    check_contract(chunker, long_docs, chunks)
    assert all(c.n_tokens >= 192 for c in chunks[:-1]), [c.n_tokens for c in chunks]


def test_prefers_paragraph_then_sentence_boundaries(tokenizer):
    chunker = Chunker(tokenizer, ChunkingSettings(target_tokens=60, max_tokens=80, min_tokens=8))
    paragraph = "The lighthouse was built in 1891. It is 31 metres tall. Its lamp flashes every ten seconds."
    text = "\n\n".join([paragraph] * 8)  # ~22 tokens each: chunks should hold whole paragraphs
    chunks = chunker.chunk("doc", text)
    check_contract(chunker, text, chunks)
    assert len(chunks) > 1 and all(c.text.endswith("seconds.") and c.text.startswith("The") for c in chunks)

    sentences = " ".join(f"Sentence number {i} is here." for i in range(40))  # one paragraph, no newlines
    chunks = chunker.chunk("doc", sentences)
    check_contract(chunker, sentences, chunks)
    assert len(chunks) > 1 and all(c.text.endswith("here.") for c in chunks)


def test_cuts_space_free_runs_and_merges_tiny_tails(tokenizer):
    chunker = Chunker(tokenizer, ChunkingSettings(target_tokens=40, max_tokens=48, min_tokens=8))
    text = "start " + "ab9" * 400 + " end."
    chunks = chunker.chunk("doc", text)
    check_contract(chunker, text, chunks)
    assert len(chunks) > 10 and chunks[-1].text.endswith("end.")
    assert all(c.n_tokens >= 8 for c in chunks)  # " end." alone would be a 2-token chunk

    words = " ".join(["word"] * 41)  # just over the target: the tail of 1-2 words is merged back
    assert [c.n_tokens for c in chunker.chunk("doc", words)] == [41]


class CountingTokenizer:
    """The real tokenizer, counting the characters it is asked to read."""

    def __init__(self, tokenizer):
        self.tokenizer, self.chars = tokenizer, 0

    def __call__(self, text, **kwargs):
        self.chars += len(text)
        return self.tokenizer(text, **kwargs)


def test_chunking_reads_a_space_free_text_a_bounded_number_of_times(tokenizer):
    # Cutting a run of text with no space used to re-tokenize the rest of the run for every cut:
    # quadratic work (a 320k-character upload took 24 s, 2 MB hours). Now each character is read a
    # small, fixed number of times whatever the length.
    for length in (20_000, 80_000):
        counting = CountingTokenizer(tokenizer)
        chunker = Chunker(counting, ChunkingSettings())  # type: ignore[arg-type]
        text = "a" * length
        chunks = chunker.chunk("doc", text)
        check_contract(Chunker(tokenizer, ChunkingSettings()), text, chunks)
        assert counting.chars <= 8 * length, (length, counting.chars / length)


def test_empty_and_whitespace(tokenizer):
    chunker = Chunker(tokenizer, SMALL)
    assert chunker.chunk("doc", "") == []
    assert chunker.chunk("doc", " \n\n\t ") == []
    assert chunker.chunk("doc", "\x16") == []  # the tokenizer drops it: nothing for the model to read
    [chunk] = chunker.chunk("doc", "\n  Hello there.  \n")
    assert (chunk.text, chunk.start, chunk.end, chunk.doc_id) == ("Hello there.", 3, 15, "doc")
