"""The endpoints clients reach for besides chat, with the official `openai` and `anthropic` clients against a real
server (the embedded SmolLM2): OpenAI's /v1/completions (a raw prompt, streamed or not, its KV reused when repeated;
what it does not support refused with a 400), Anthropic's /v1/messages/count_tokens (the prompt /v1/messages runs,
a prefill's too), an unknown model id (a 404 model_not_found in each dialect's shape), /v1/responses (refused,
saying where to go), and OpenAI's /v1/embeddings (the retrieval embedder's vectors)."""
from __future__ import annotations

import anthropic
import httpx
import numpy as np
import openai
import pytest

from tests.helpers import MODEL, shared_embedder, shared_tokenizer

PROMPT = ("The lighthouse keeper climbed the stairs every evening at dusk, lit the great lamp, and wrote in his "
          "ledger the names of the ships that passed the rocks. On the night of the storm he wrote")
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)


def test_completions_continue_a_raw_prompt_and_reuse_its_kv(live_server):
    client = openai_client(live_server.url)
    ids = shared_tokenizer()(PROMPT)["input_ids"]
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert first.object == "text_completion" and first.choices[0].text.strip(), first
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens == len(ids)  # the prompt as it is: no chat template around it
    again = client.completions.create(model=MODEL, prompt=[PROMPT], max_tokens=12, temperature=0)
    # its KV stored by the first: read back, all but the last token (computed for the logits); the same answer
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1, again.usage
    assert again.choices[0].text == first.choices[0].text
    by_ids = client.completions.create(model=MODEL + "-chat", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == first.choices[0].text

    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == first.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens and not chunks[-1].choices

    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                        stop=[first.choices[0].text.strip()[:3]])
    assert stopped.choices[0].finish_reason == "stop" and len(stopped.choices[0].text) < len(first.choices[0].text)


def test_completions_refuse_what_they_do_not_support(live_server):
    client = openai_client(live_server.url)
    for refused in ({"echo": True}, {"n": 2}, {"best_of": 3}, {"suffix": "the end"}):
        name = next(iter(refused))
        with pytest.raises(openai.BadRequestError, match=f"{name}: not supported") as error:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, **refused)
        assert error.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="not in the vocabulary"):
        client.completions.create(model=MODEL, prompt=[1, 10**7], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="not in the vocabulary"):  # integers as JSON Schema counts them
        client.completions.create(model=MODEL, prompt=[1.0, 1e20], max_tokens=2)
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=2)


def test_count_tokens_is_the_prompt_messages_runs(live_server):
    client = anthropic_client(live_server.url)
    body = dict(model=MODEL, system="Be brief.", tools=TOOLS,
                messages=[{"role": "user", "content": "Is it raining in Oslo?"}])
    counted = client.messages.count_tokens(**body).input_tokens
    ran = client.messages.create(**body, max_tokens=1).usage
    assert counted == ran.input_tokens + ran.cache_read_input_tokens + ran.cache_creation_input_tokens
    bare = client.messages.count_tokens(model=MODEL, messages=body["messages"]).input_tokens
    assert bare < counted  # the tools and the system text are part of the prompt
    prefilled = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "Yes, in"}]}
    counted_prefill = client.messages.count_tokens(**prefilled).input_tokens  # the prefill is in the prompt
    ran = client.messages.create(**prefilled, max_tokens=1).usage
    assert counted_prefill == ran.input_tokens + ran.cache_read_input_tokens + ran.cache_creation_input_tokens
    assert counted_prefill > counted


def test_an_unknown_model_is_a_404_in_each_dialect(live_server):
    with pytest.raises(openai.NotFoundError) as error:
        openai_client(live_server.url).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert error.value.code == "model_not_found" and MODEL in error.value.message
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        openai_client(live_server.url).completions.create(model="gpt-3.5-turbo-instruct", prompt="hi", max_tokens=2)
    with pytest.raises(anthropic.NotFoundError) as anthropic_error:
        anthropic_client(live_server.url).messages.create(
            model="claude-sonnet-4-5", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert anthropic_error.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client(live_server.url).messages.count_tokens(
            model="claude-sonnet-4-5", messages=[{"role": "user", "content": "hi"}])
    spec = httpx.get(f"{live_server.url}/openapi.json").json()
    model = spec["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["anyOf"][0]
    assert model["enum"] == [MODEL, MODEL + "-chat"]  # the ids GET /v1/models lists, stated in the schema


def test_the_responses_api_is_refused_saying_where_to_go(live_server):
    with pytest.raises(openai.NotFoundError, match="/v1/chat/completions") as error:
        openai_client(live_server.url).responses.create(model=MODEL, input="hi")
    assert error.value.code == "not_served"


EMBEDDER = "all-MiniLM-L6-v2"
PASSAGES = ["The lighthouse keeper lit the lamp at dusk.", "Quarterly revenue rose by four percent.",
            "The ferry to the island leaves at noon."]


def test_embeddings_are_the_retrieval_embedders_vectors(live_server):
    client = openai_client(live_server.url)
    assert [m.id for m in client.models.list()][-1] == EMBEDDER  # listed last, after the chat ids
    by_default = client.embeddings.create(model=EMBEDDER, input=PASSAGES)  # the client asks for base64
    as_floats = client.embeddings.create(model=EMBEDDER, input=PASSAGES, encoding_format="float")
    vectors = np.array([d.embedding for d in by_default.data], dtype=np.float32)  # [3, 384]
    assert [d.index for d in by_default.data] == [0, 1, 2] and by_default.model == EMBEDDER
    assert np.array_equal(vectors, np.array([d.embedding for d in as_floats.data], dtype=np.float32))
    np.testing.assert_allclose(vectors, shared_embedder().embed(PASSAGES), atol=1e-5)  # what the index holds
    ids = shared_embedder().model.tokenizer(PASSAGES, add_special_tokens=False)["input_ids"]
    assert by_default.usage.prompt_tokens == sum(map(len, ids))
    question = np.array(client.embeddings.create(model=EMBEDDER, input="When does the boat sail?",
                                                 dimensions=384).data[0].embedding, dtype=np.float32)
    assert int(np.argmax(vectors @ question)) == 2  # a client's own retrieval finds the passage


def test_embeddings_refuse_what_they_cannot_embed(live_server):
    client = openai_client(live_server.url)
    for refused, says in (({"input": [101, 2023]}, "token ids"), ({"input": [[101], [2023]]}, "token ids"),
                          ({"input": "word " * 300}, "over the 254"), ({"input": "hi", "dimensions": 128}, "384")):
        with pytest.raises(openai.BadRequestError, match=says):
            client.embeddings.create(model=EMBEDDER, encoding_format="float", **refused)
    with pytest.raises(openai.NotFoundError, match="embeds with"):
        client.embeddings.create(model=MODEL, input="hi")
    with pytest.raises(openai.NotFoundError, match="is the embedder"):
        client.chat.completions.create(model=EMBEDDER, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.UnprocessableEntityError):
        client.embeddings.create(model=EMBEDDER, input="")
    spec = httpx.get(f"{live_server.url}/openapi.json").json()
    assert spec["components"]["schemas"]["EmbeddingRequest"]["properties"]["model"]["enum"] == [EMBEDDER]


def test_logprobs_are_each_answer_tokens_streamed_or_not(live_server):
    client = openai_client(live_server.url)
    body = dict(model=MODEL + "-chat", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=12,
                temperature=0, logprobs=True, top_logprobs=3)
    first = client.chat.completions.create(**body)  # computed, attending to its spans as the store keeps them (int8)
    answer = client.chat.completions.create(**body)  # read back from the store: the same answer, the same logprobs
    content = answer.choices[0].logprobs.content
    assert answer.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    assert answer.choices[0].message.content == first.choices[0].message.content
    # (within the decode pool's float16 rounding: a last-bit difference in a prompt's K/V may round to another half)
    assert [t.logprob for t in content] == pytest.approx([t.logprob for t in first.choices[0].logprobs.content],
                                                         abs=2e-3)
    assert len(content) == answer.usage.completion_tokens  # every answer token (an ending eos aside)
    assert "".join(t.token for t in content).strip() == answer.choices[0].message.content
    for token in content:
        alternatives = [a.logprob for a in token.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        # greedy: the token taken is the likeliest, with its logprob
        assert (token.top_logprobs[0].token, token.top_logprobs[0].logprob) == (token.token, token.logprob)
        assert token.logprob <= 0 and bytes(token.bytes).decode() == token.token
    streamed = list(client.chat.completions.create(**body, stream=True))
    last = [c for c in streamed if c.choices][-1].choices[0]
    assert last.finish_reason and [t.token for t in last.logprobs.content] == [t.token for t in content]
    assert [t.logprob for t in last.logprobs.content] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert client.chat.completions.create(**{**body, "logprobs": None, "top_logprobs": None}).choices[0].logprobs \
        is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(**{**body, "logprobs": None})

    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    legacy = completion.choices[0].logprobs
    assert "".join(legacy.tokens) == completion.choices[0].text and len(legacy.tokens) == len(legacy.token_logprobs)
    assert legacy.text_offset[0] == 0 and all(0 < len(top) <= 2 for top in legacy.top_logprobs)
    assert all(max(top.values()) == pytest.approx(lp) for top, lp in zip(legacy.top_logprobs, legacy.token_logprobs))
