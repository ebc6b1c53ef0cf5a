"""Tool calls out and answers held to a schema, with the official `openai` and `anthropic` clients against a
real server (the embedded SmolLM2): tool_choice required / named / any, a parallel call, a streamed call,
json_schema strict; the calls' arguments checked with jsonschema against the tool's parameters. Plus the
parser of calls out of text (app.engine.tool_calls)."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from app.engine.tool_calls import CallStream, split_tool_calls
from tests.helpers import MODEL

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone.",
                                           "parameters": TIME}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Europe/Paris?"}]
CHAT = {"retrieval": False}


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def check_calls(calls) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_parse_calls_from_text():
    text = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    content, calls = split_tool_calls(text)
    assert content == "Let me look." and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Oslo", "unit": "celsius"} and calls[0].id != calls[1].id
    stream, events = CallStream(), []
    for ch in text:  # a character at a time: nothing of the opener leaks into the text
        events += stream.feed(ch)
    events += stream.finish()
    assert "".join(v for k, v in events if k == "text") == "Let me look.\n"
    assert [v.name for k, v in events if k == "call"] == ["get_time", "get_weather"]
    # a call cut by max_tokens is dropped, neither a call nor text; a repeated identical call is dropped
    assert split_tool_calls('no call <tool_call>\n{"name": "get_time", "argu') == ("no call", [])
    content, calls = split_tool_calls(text + "\n" + text.split("\n", 1)[1])
    assert content == "Let me look." and [c.name for c in calls] == ["get_time", "get_weather"]


def test_a_prefill_is_read_first_and_not_returned():
    """The answer's start the client wrote (a prefill): a call it opens comes back whole, its text does not, and
    the continuation keeps the space it starts with."""
    opened = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "'
    content, [call] = split_tool_calls('UTC"}}\n</tool_call>', prefill=opened)
    assert content == "" and call.name == "get_time" and json.loads(call.arguments) == {"timezone": "UTC"}
    assert split_tool_calls(" 1887.\n", prefill="Built in") == (" 1887.", [])
    stream = CallStream("Let me look.")
    assert stream.feed(' Done.') == [("text", " Done.")] and stream.content == [" Done."]


def test_tool_choice_required_named_parallel_and_streamed(live_server):
    client = client_of(live_server.url)
    common = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, extra_body=CHAT)
    required = client.chat.completions.create(**common, tool_choice="required", temperature=0)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    check_calls(choice.message.tool_calls)
    named = client.chat.completions.create(**common, temperature=0.7, seed=3,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"] and named.choices[0].finish_reason == "tool_calls"
    check_calls(calls)

    # streamed: the deltas carry index, id, name, then argument fragments; the SDK's accumulator rebuilds them
    with client.chat.completions.stream(**common, tool_choice="required", temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert final.choices[0].finish_reason == "tool_calls"

    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(**common, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_parallel_calls(live_server):
    """Two calls in one answer, with tool_choice required (the grammar allows several)."""
    client = client_of(live_server.url)
    messages = [{"role": "system", "content": "Call every tool the question needs, one call per tool."}, *ASK]
    for seed in range(8):  # sampled: some answer makes both calls
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                             max_tokens=120, temperature=0.8, seed=seed, extra_body=CHAT)
        calls = out.choices[0].message.tool_calls
        check_calls(calls)
        if len(calls) > 1:
            assert len({c.id for c in calls}) == len(calls)
            return
    pytest.fail("no answer made parallel calls")


def test_required_calls_are_whole_whatever_max_tokens(live_server):
    """Under "one call or more" a small model calls on until max_tokens: the answer ends at its last whole call
    where another as long would not fit, so every answer is whole calls (none cut, none repeated) and says
    tool_calls."""
    client = client_of(live_server.url)
    for seed, max_tokens in enumerate((45, 60, 75, 90, 45, 60)):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                             max_tokens=max_tokens, temperature=0.7 if seed else 0, seed=seed,
                                             extra_body=CHAT)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, (max_tokens, choice)
        assert not choice.message.content and out.usage.completion_tokens < max_tokens
        check_calls(choice.message.tool_calls)
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert len(set(calls)) == len(calls)


def test_json_schema_strict_and_bad_schemas(live_server):
    client = client_of(live_server.url)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40},
                                               "confident": {"type": "boolean"}},
              "required": ["answer", "confident"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=60,
        temperature=0, extra_body=CHAT,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert out.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError, match="compile"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objekt"}}})
    deep: dict = {"type": "object"}
    for _ in range(20):
        deep = {"type": "object", "properties": {"x": deep}}
    with pytest.raises(openai.BadRequestError, match="nested deeper"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": deep}})
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, top_logprobs=2, extra_body=CHAT)
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model=MODEL, max_tokens=5, extra_body=CHAT, messages=[
            {"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])


ANTHROPIC_TOOLS = [{"name": f["function"]["name"], "description": f["function"]["description"],
                    "input_schema": f["function"]["parameters"]} for f in TOOLS]


def test_anthropic_tool_use_any_streamed_and_a_long_tool_result(live_server):
    client = anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0, timeout=300)
    request = dict(model=MODEL, max_tokens=80, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})
    message = client.messages.create(**request)
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses, message.content
    for use in uses:
        jsonschema.validate(use.input, PARAMETERS[use.name])
    with client.messages.stream(**request) as stream:  # greedy: the same calls, their input as input_json_delta
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    assert final.stop_reason == "tool_use"

    named = client.messages.create(**{**request, "tool_choice": {"type": "tool", "name": "get_time"}})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        client.messages.create(**{**request, "tool_choice": {"type": "tool", "name": "nope"}})

    # the client runs the tool; its result (longer than a question may be, as OpenAI tool messages take it)
    result = "Sunny, 21 degrees. " + "x" * 3_004
    answer = client.messages.create(model=MODEL, max_tokens=20, tools=ANTHROPIC_TOOLS,
                                    messages=[*ASK, {"role": "assistant", "content": message.content},
                                              {"role": "user", "content": [{"type": "tool_result",
                                                                            "tool_use_id": uses[0].id,
                                                                            "content": result}]}],
                                    tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert all(b.type == "text" for b in answer.content)
    stopped = client.messages.create(model=MODEL, max_tokens=30, stop_sequences=["zzz", "e"],
                                     messages=[{"role": "user", "content": "Describe the weather in Paris."}])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "e")


def test_an_openai_agents_loop_runs_its_tool(live_server):
    """The OpenAI Agents SDK, unmodified, over the chat endpoint: the model calls the tool (required on the
    first turn; the SDK resets it to auto after), the SDK runs it and sends the result, the model answers."""
    import agents  # openai-agents: a test requirement (requirements.txt), never the server's
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"Sunny and 21 degrees in {city}."

    client = openai.AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    model_id = [m.id for m in client_of(live_server.url).models.list()][1]  # `<model>-chat`: no retrieval
    agents.set_tracing_disabled(True)
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool's help.", tools=[get_weather],
                         model=agents.OpenAIChatCompletionsModel(model=model_id, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=60, temperature=0))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert ran, "the tool never ran"
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert calls and outputs and outputs[0].output.startswith("Sunny")
    assert isinstance(result.final_output, str) and result.final_output.strip()
