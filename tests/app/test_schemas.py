"""Schemas clients send, against a real server (the embedded SmolLM2) with the official `openai` and `anthropic`
clients and the OpenAI Agents SDK: a schema whose grammar would compile for minutes is a 400 (refused up front, or
stopped at `limits.grammar_compile_s`) and its resend too, while another request is served; a schema with no finite
document is a 400 before any prefill, plain and streamed, and a dead end met mid-answer ends that answer cleanly;
a tool name holding the call markup is a 400; tools whose parameters use `$defs`/`$ref` (pydantic's nested and
recursive models, the Agents SDK's and openai's strict schemas, Anthropic's input_schema) are called under every
tool_choice; openai's own pydantic helpers (`parse`, `stream`, `pydantic_function_tool`) get their objects back;
response_format with tools under auto is a call or a document of the schema."""
from __future__ import annotations

import json
import string
import threading

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from transformers import AutoTokenizer

from app.engine.tool_calls import tools_grammar
from blend.grammar import Grammars
from tests.helpers import MODEL

CHAT = {"retrieval": False}
ASK = [{"role": "user", "content": "Who is Ada Lovelace and where did she live?"}]


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def patterns(n: int, wrap: bool = False) -> dict:
    """The issue's bomb: a string matching n patterns at once (wrapped: each in a one-branch anyOf, which the
    up-front count does not follow, so only the compile limit stops it)."""
    parts = [{"type": "string", "pattern": f".*{c}.*"} for c in string.ascii_lowercase[:n]]
    return {"allOf": [{"anyOf": [p]} for p in parts] if wrap else parts}


def schema_body(schema: dict, **rest) -> dict:
    return {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **CHAT, **rest,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def short_chat(url: str, out: list) -> None:
    response = httpx.post(f"{url}/v1/chat/completions", timeout=300,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **CHAT})
    out.append(response.status_code)


def test_a_grammar_bomb_is_refused_and_its_resend_too_while_another_request_is_served(live_server):
    url = live_server.url
    for schema, reason in ((patterns(21), "21 string patterns at once"),  # refused before any compile
                           (patterns(18, wrap=True), "did not compile within 2 s")):  # stopped at the limit
        served: list[int] = []
        other = threading.Thread(target=short_chat, args=(url, served))
        other.start()
        for _ in range(2):  # the resend: refused from the failure remembered
            response = httpx.post(f"{url}/v1/chat/completions", json=schema_body(schema), timeout=300)
            assert response.status_code == 400 and reason in response.json()["error"]["message"], response.text
        other.join()
        assert served == [200]


DEAD = [{"$ref": "#"},
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}]


def test_a_schema_without_a_finite_document_is_a_400_and_a_dead_end_mid_answer_ends_it(live_server, capfd):
    url = live_server.url
    for schema in DEAD:
        for stream in (False, True):
            response = httpx.post(f"{url}/v1/chat/completions", json=schema_body(schema, stream=stream), timeout=300)
            assert response.status_code == 400 and "no finite document" in response.text, response.text
    anthropic_body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"name": "f", "input_schema": DEAD[2]}], "tool_choice": {"type": "any"}}
    response = httpx.post(f"{url}/v1/messages", json=anthropic_body, timeout=300)
    assert response.status_code == 400 and "no finite document" in response.text
    # a document exists (null), but the object branch the model opens gives out a few tokens in: the answer ends
    # there, with a finish reason, plain and streamed
    risky = {"anyOf": [{"type": "null"}, DEAD[2]]}
    client = client_of(url)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": risky}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, response_format=fmt,
                                         extra_body=CHAT)
    assert out.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, response_format=fmt,
                                                 extra_body=CHAT, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    err = capfd.readouterr().err
    bad = [line for line in err.splitlines() if "Traceback" in line or line.startswith("Warning:")]
    assert not bad, err[-3000:]


def test_a_tool_name_holding_the_call_markup_is_a_400(live_server):
    tool = {"type": "function", "function": {"name": "x</tool_call>y", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="call markup"):
        client_of(live_server.url).chat.completions.create(model=MODEL, messages=ASK, tools=[tool], max_tokens=8,
                                                           tool_choice="required", extra_body=CHAT)


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    address: Address


class Node(BaseModel):
    name: str
    children: list[Node] = []


class Employee(BaseModel):
    name: str
    manager: Employee | None = None


def tool(model: type[BaseModel], name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"Record a {name}.",
                                             "parameters": model.model_json_schema()}}


def test_tools_with_defs_and_refs_are_called_under_every_tool_choice(live_server):
    client = client_of(live_server.url)
    tools = [tool(Person, "record_person"), tool(Node, "record_tree")]
    assert "$defs" in tools[0]["function"]["parameters"] and "$ref" in tools[1]["function"]["parameters"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    # (the recursive tree compiles under each choice; a small model may nest it on until max_tokens, so the calls
    # asserted are the person's)
    for choice in ("required", {"type": "function", "function": {"name": "record_person"}}, "auto"):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                             max_tokens=80, temperature=0, extra_body=CHAT)
        calls = out.choices[0].message.tool_calls or []
        assert calls or choice == "auto", (choice, out.choices[0])
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    anthropic_client = anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0, timeout=300)
    message = anthropic_client.messages.create(
        model=MODEL, max_tokens=80, messages=ASK, tool_choice={"type": "any"},
        tools=[{"name": "record_person", "description": "Record a person.",
                "input_schema": Person.model_json_schema()}])
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses
    Person.model_validate(uses[0].input)


def test_an_agents_sdk_tool_taking_a_nested_model_runs(live_server):
    import agents  # openai-agents: a test requirement, never the server's
    ran: list[Person] = []

    @agents.function_tool
    def record_person(person: Person) -> str:
        """Record a person and their address."""
        ran.append(person)
        return "Recorded."

    assert "$defs" in json.dumps(record_person.params_json_schema)  # the SDK's strict schema, with its refs
    client = openai.AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    model_id = [m.id for m in client_of(live_server.url).models.list()][1]  # `<model>-chat`: no retrieval
    agents.set_tracing_disabled(True)
    agent = agents.Agent(name="people", instructions="Record the person the user names.", tools=[record_person],
                         model=agents.OpenAIChatCompletionsModel(model=model_id, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=80, temperature=0),
                         tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "Ada Lovelace lived at 12 St James's Square, London.", max_turns=2)
    assert ran and isinstance(ran[0].address, Address) and result.final_output == "Recorded."


def test_the_official_clients_strict_pydantic_schemas_come_back_parsed(live_server):
    """openai's own pydantic helpers send what pydantic-ai (NativeOutput, ToolOutput), instructor (JSON_SCHEMA,
    TOOLS_STRICT) and LangChain (json_schema, function_calling with strict) send for a nested model: a strict schema
    ($defs, every property required, no additional ones) as response_format, plain and streamed, and as a strict
    tool; each comes back parsed into the model."""
    client = client_of(live_server.url)
    ask = dict(model=MODEL, messages=ASK, max_tokens=80, temperature=0, extra_body=CHAT)
    assert isinstance(client.chat.completions.parse(response_format=Person, **ask).choices[0].message.parsed, Person)
    with client.chat.completions.stream(response_format=Person, **ask) as stream:
        assert isinstance(stream.get_final_completion().choices[0].message.parsed, Person)
    strict = openai.pydantic_function_tool(Person, name="record_person")
    assert strict["function"]["strict"] and "$defs" in strict["function"]["parameters"]
    out = client.chat.completions.parse(tools=[strict], tool_choice="required", **ask)
    assert isinstance(out.choices[0].message.tool_calls[0].function.parsed_arguments, Person)


def test_response_format_with_tools_under_auto_is_a_call_or_a_document(live_server):
    client = client_of(live_server.url)
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60}},
              "required": ["answer"], "additionalProperties": False}
    tools = [tool(Person, "record_person")]
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=tools, max_tokens=120, temperature=0.8, seed=seed, extra_body=CHAT,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        message = out.choices[0].message
        if message.content:  # never prose: the document (then no call), or nothing but calls
            jsonschema.validate(json.loads(message.content), schema)
            assert not message.tool_calls
        for call in message.tool_calls or []:
            Person.model_validate_json(call.function.arguments)
        assert message.content or message.tool_calls or out.choices[0].finish_reason == "length"  # (a call cut)


def test_defs_parameters_take_a_valid_call_under_every_choice_and_response_format_with_auto_refuses_prose():
    """The grammars alone (no model): each choice's grammar takes a valid call of a tool whose parameters use
    $defs (pydantic), a recursive $ref or draft-7 `definitions`; with a response schema under auto, the document
    or a call, never prose."""
    tokenizer = AutoTokenizer.from_pretrained("data/models/smollm2-135m-instruct")
    grammars = Grammars(tokenizer, len(tokenizer))
    legacy = {"type": "object", "properties": {"at": {"$ref": "#/definitions/Point"}}, "required": ["at"],
              "definitions": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    tools = [tool(Person, "record_person"), tool(Node, "record_tree"),
             {"type": "function", "function": {"name": "mark", "parameters": legacy}}]
    calls = {"record_person": {"name": "Ada", "address": {"street": "12 St James's Square", "city": "London"}},
             "record_tree": {"name": "Ada", "children": [{"name": "Byron", "children": []}]},
             "mark": {"at": {"x": 3}}}

    def takes(grammar: str, text: str) -> bool:
        constraint, ids = grammars.constraint(grammar), tokenizer.encode(text, add_special_tokens=False)
        return constraint.matcher.try_consume_tokens(ids) == len(ids) and constraint.matcher.is_accepting()

    def call(name: str) -> str:
        return f'<tool_call>\n{json.dumps({"name": name, "arguments": calls[name]})}\n</tool_call>'
    try:
        for choice in ("auto", "required", *calls):
            grammar = tools_grammar(tools, choice)
            for name in calls if choice in ("auto", "required") else [choice]:
                assert takes(grammar, call(name)), (choice, name)
        answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
        both = tools_grammar(tools, "auto", answer_schema=answer)
        assert takes(both, '{"answer": "London"}') and takes(both, call("mark"))
        assert not takes(both, "Hello " + call("mark")) and not takes(both, "London")
        # openai's strict form of a recursive model (its $ref under anyOf with null, every property required):
        # a chain that ends in null is taken, one that leaves the required field out is not
        strict = openai.pydantic_function_tool(Employee, name="record_employee")
        calls["record_employee"] = {"name": "Bob", "manager": {"name": "Alice", "manager": None}}
        for grammar, text in ((tools_grammar([strict], "required"), call("record_employee")),
                              (tools_grammar([], None, answer_schema=strict["function"]["parameters"]),
                               json.dumps(calls["record_employee"]))):
            assert takes(grammar, text) and not takes(grammar, text.replace(', "manager": null', "")), text
    finally:
        grammars.close()
