"""The RAG prompt, cut into cacheable pieces: head | passage | passage | ... | suffix, and a chat's messages.

Rendered through the model's own chat template, so any chat model works:
    head    = <system turn> + <user turn opening>           (same for every request: cached once)
    passage = "{title}\n" + chunk + "\n\n"                   (one per chunk: KV precomputed at ingest)
    suffix  = instruction + "Question: {question}" + <turn end, assistant opening>   (always fresh)
A chat (ChatTemplate) is <system turn> | one piece per message | <assistant opening>: piece j is what the
render of the first j + 1 messages adds to the render of the first j, so the pieces are exactly the
template's own rendering of the whole chat (checked on the token ids), tool calls and results included.
A prefill (the answer's start, written by the client) goes in the assistant opening, the turn rendered open
(HF's continue_final_message), so the model continues it.
The instruction sits after the passages, next to the question: small models follow it far
better there than in the system turn alone.
Text from clients and documents is text: a control token's string written inside it (`<|im_end|>`, say)
is tokenized as plain text, never as the token (`PromptFormat.plain` marks it before the template renders it,
`PromptFormat.encode` splits it), so no one can forge a turn; text without one tokenizes as before.
Each piece is tokenized on its own; a passage reuses its chunk's stored token ids between the
tokens of its title line and of the blank line after it, so a query tokenizes only its question.
A full prefill runs the concatenation of the same ids: blended and full prefill read exactly the
same tokens.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from transformers import PreTrainedTokenizerBase

_SLOT = "\u0000RAGBLEND_SLOT\u0000"
# A control token's string inside client text stands as _ESCAPE and one plane-15 private-use character (_MARK + 1 +
# the token's index) from `plain` until `encode`, so the template renders it as text and encode knows it for text.
# The client's own _ESCAPE is escaped too (doubled), so a client's private-use text reads as itself: no text of theirs
# turns into a control token's name.
_MARK = 0xF0000
_ESCAPE = chr(_MARK)
_MARKS = re.compile(f"{_ESCAPE}(.)", re.S)
INSTRUCTION = "Answer the question with a short phrase from the passages above."


@dataclass
class PromptFormat:
    tokenizer: PreTrainedTokenizerBase
    system_prompt: str
    head_text: str = field(init=False)
    tail_text: str = field(init=False)

    def __post_init__(self) -> None:
        self.head_text, self.tail_text = self._split_template()

    def _split_template(self, system: str | None = None, prefill: str | None = None) -> tuple[str, str]:
        """The chat template rendered around a placeholder user message, cut at the placeholder; with a `prefill`
        (the answer's start), the assistant turn after it rendered open with it (HF's continue_final_message)."""
        answer = [{"role": "assistant", "content": self.plain(prefill.strip())}] if prefill else []

        def render(messages: list[dict]) -> str:
            return self.tokenizer.apply_chat_template([*messages, *answer], tokenize=False,
                                                      add_generation_prompt=not answer,
                                                      continue_final_message=bool(answer))
        try:
            text = render([{"role": "system", "content": self.system_text(system)}, {"role": "user", "content": _SLOT}])
        except Exception:  # templates without a system role: fold it into the (first) user turn
            text = render([{"role": "user", "content": f"{self.system_text(system)}\n\n{_SLOT}"}])
        head, tail = text.split(_SLOT)
        return head, tail

    def system_text(self, system: str | None = None) -> str:
        """The system turn: ours, then the client's system message if it sent one."""
        return f"{self.system_prompt}\n\n{self.plain(system.strip())}" if system and system.strip() \
            else self.system_prompt

    @cached_property
    def _controls(self) -> tuple[list[str], re.Pattern[str]]:
        """The tokenizer's control (special) tokens' strings, and a pattern finding them, longest first."""
        names = {t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special}
        names = sorted(names | set(self.tokenizer.all_special_tokens), key=len, reverse=True)
        return names, re.compile("|".join(map(re.escape, names)) or "(?!)")

    def plain(self, text: str) -> str:
        """Client or document text made safe to render: each control token's string in it marked as text."""
        names, pattern = self._controls
        index = {name: i for i, name in enumerate(names)}
        text = text.replace(_ESCAPE, _ESCAPE * 2)
        return pattern.sub(lambda m: _ESCAPE + chr(_MARK + 1 + index[m.group()]), text)

    def plain_data(self, value):
        """`plain` on every string of a message or tool definition (JSON data)."""
        if isinstance(value, str):
            return self.plain(value)
        if isinstance(value, dict):
            return {k: v if k == "role" else self.plain_data(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.plain_data(v) for v in value]
        return value

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text: the control tokens written in it are tokens, the marked ones text."""
        if _ESCAPE not in text:  # nothing marked: the tokenizer's own reading
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        names, pattern = self._controls
        ids, position = [], 0
        for match in pattern.finditer(text):  # the template's own control tokens
            ids += self._text_ids(text[position:match.start()])
            ids.append(self.tokenizer.convert_tokens_to_ids(match.group()))
            position = match.end()
        return ids + self._text_ids(text[position:])

    def _text_ids(self, text: str) -> list[int]:
        names = self._controls[0]
        text = _MARKS.sub(lambda m: names[ord(m.group(1)) - _MARK - 1] if 0 < ord(m.group(1)) - _MARK <= len(names)
                          else m.group(1), text)  # a marked name, or the client's own (doubled) _ESCAPE
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []

    @cached_property
    def head_ids(self) -> list[int]:
        return self.encode(self.head_text)

    @cached_property
    def separator_ids(self) -> list[int]:
        return self.encode("\n\n")

    def passage_ids(self, chunk_ids: Sequence[int], title: str | None = None) -> list[int]:
        """A passage as the model reads it: its title line, the chunk's own token ids, a blank line."""
        title_ids = self.encode(self.plain(f"{title.strip()}\n")) if title and title.strip() else []
        return title_ids + list(chunk_ids) + self.separator_ids

    def text_passage_ids(self, text: str, title: str | None = None) -> list[int]:
        """`passage_ids` of a raw text (the compare harness's dataset passages)."""
        return self.passage_ids(self.encode(self.plain(text.strip())), title)

    def suffix_ids(self, question: str, system: str | None = None, prefill: str | None = None) -> list[int]:
        """Instruction, question, the user turn's end and the assistant turn's opening (and `prefill`, the
        answer's start, in it)."""
        custom = (system and system.strip()) or prefill
        tail = self._split_template(system, prefill)[1] if custom else self.tail_text
        return self.encode(f"{INSTRUCTION}\nQuestion: {self.plain(question.strip())}{tail}")

    @cached_property
    def chat(self) -> ChatTemplate:
        """A chat's messages through this model's template, one token span per message."""
        return ChatTemplate(self)


# ---- a chat's messages as pieces: one token span per message ------------------------------------

_PROBE = "ragblend_probe_tool"


@dataclass
class ChatLayout:
    """A chat rendered through the chat template and cut into token spans: `head` (the system turn) +
    `messages` (one span per message, in order) + `tail` (the assistant turn's opening) are exactly the
    template's own rendering of the whole chat, tokenized (`split`: False when the template's renders do not
    extend one another or the spans do not tokenize as the whole does: then `messages` holds one span of
    every message, the last message's)."""

    head: list[int]
    messages: list[list[int]]
    tail: list[int]
    split: bool = True


class ChatTemplate:
    """Renders chat messages (OpenAI/HF dicts: role, content, tool_calls, tool_call_id, name) and `tools`
    through the model's chat template. A template that ignores tools or tool calls (SmolLM2's, say) gets them
    as text instead, in the Hermes form many models are trained on: the tools in the system turn, each call
    as `<tool_call>{json}</tool_call>` in its assistant message, so no token of the request is lost."""

    def __init__(self, prompt: PromptFormat):
        self.prompt = prompt
        self.native_tool_calls = self._probe_renders([
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [_call("c", _PROBE, "{}")]}])
        tool = {"type": "function", "function": {"name": _PROBE, "description": "", "parameters": {}}}
        self.native_tools = self._probe_renders([{"role": "user", "content": "x"}], [tool])

    def _probe_renders(self, messages: list[dict], tools: list[dict] | None = None) -> bool:
        try:
            return _PROBE in self.prompt.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that refuses them does not render them
            return False

    def system_message(self, system: str | None, tools: Sequence[dict] | None) -> dict:
        text = self.prompt.system_text(system)
        if tools and not self.native_tools:
            text += "\n\n" + hermes_tools(tools, self.prompt.plain)
        return {"role": "system", "content": text}

    def normalized(self, message: dict) -> dict:
        """The message as the template takes it: text content, tool calls as text where it cannot render them."""
        out = {k: v for k, v in message.items() if v is not None}
        out["content"] = (message.get("content") or "").strip()
        calls = message.get("tool_calls") or []
        if calls and not self.native_tool_calls:
            texts = [json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])})
                     for c in calls]
            out["content"] = "\n".join([out["content"]] * bool(out["content"])
                                       + [f"<tool_call>\n{t}\n</tool_call>" for t in texts])
            del out["tool_calls"]
        return self.prompt.plain_data(out)

    def render(self, system: dict, messages: Sequence[dict], tools: Sequence[dict] | None,
               generation: bool, continued: bool = False) -> str:
        """`continued`: the last message (an assistant's) rendered open, to be continued (no generation prompt)."""
        return self.prompt.tokenizer.apply_chat_template(
            [system, *messages], tools=self.prompt.plain_data(list(tools)) if tools and self.native_tools else None,
            tokenize=False, add_generation_prompt=generation and not continued, continue_final_message=continued)

    def layout(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
               system: str | None = None, prefill: dict | None = None) -> ChatLayout:
        """`messages` (no system ones: `system` is the client's system text) as a ChatLayout. The span of a
        message is what rendering it adds to the render of the messages before it: each message is rendered
        after the system turn alone (linear in the chat), and only where that does not give the whole chat's
        rendering (a template that renders a message by its neighbours) after every message before it.
        `prefill`: an assistant's message after them, the answer's start: the tail is the assistant turn
        rendered open with it (HF's continue_final_message), which the model continues."""
        sys_message, chat = self.system_message(system, tools), [self.normalized(m) for m in messages]
        render = lambda part, generation=False: self.render(sys_message, part, tools, generation)  # noqa: E731
        try:
            base, body = render([]), render(chat)
            whole = self.render(sys_message, [*chat, self.normalized(prefill)], tools, False, continued=True) \
                if prefill else render(chat, True)
        except Exception as exc:  # noqa: BLE001 - the template's own rules (alternating roles, say)
            raise ChatTemplateError(f"the model's chat template refuses these messages: {exc}") from exc
        texts = _spans(render, base, body, chat)
        encode = self.prompt.encode
        tail_text = whole[len(body):] if whole.startswith(body) else ""
        if texts is not None and body.startswith(base) and tail_text:
            head, spans, tail = encode(base), [encode(t) for t in texts], encode(tail_text)
            if head + [i for s in spans for i in s] + tail == encode(whole):
                return ChatLayout(head, spans, tail)
        # One span for every message (the template renders nothing as a sum of messages, or tokens merge
        # across a boundary): still the template's own rendering, cached as one piece.
        head = encode(base) if whole.startswith(base) else []
        rest = encode(whole[len(base):] if head else whole)
        return ChatLayout(head, [rest] if messages else [], [] if messages else rest, split=False)

    def opening_ids(self, system: str | None = None) -> list[int]:
        """The user turn's opening (what precedes a user message's text): the passages' turn opens with it."""
        head, rest = self.prompt._split_template(system)
        full = self.render(self.system_message(system, None), [], None, False)
        return self.prompt.encode(head[len(full):]) if head.startswith(full) else self.prompt.encode(head)


def hermes_tools(tools: Sequence[dict], plain: Callable[[str], str] = str) -> str:
    """Tools (OpenAI's form) described in the Hermes form, and how to call them (app.engine.tool_calls parses it);
    `plain`: what makes the client's text safe to render (PromptFormat.plain)."""
    listed = plain("\n".join(json.dumps(t, sort_keys=True) for t in tools))
    return (f"You may call these tools:\n<tools>\n{listed}\n</tools>\nTo call one, write "
            f'<tool_call>\n{{"name": <its name>, "arguments": <its arguments>}}\n</tool_call>')


class ChatTemplateError(ValueError):
    """The model's chat template cannot render these messages."""


def _spans(render, base: str, body: str, chat: list[dict]) -> list[str] | None:
    """Each message's text in the whole chat's render `body`: rendered after the system turn alone where that
    adds up to `body`, else after every message before it (a template that renders a message by its
    neighbours); None where the renders do not extend one another."""
    try:
        texts = [render([m])[len(base):] for m in chat]
        if base + "".join(texts) == body:
            return texts
        renders = [base] + [render(chat[:k]) for k in range(1, len(chat))] + [body]
    except Exception:  # noqa: BLE001 - a part of the chat the template will not render alone
        return None
    if not all(b.startswith(a) for a, b in zip(renders, renders[1:])):
        return None
    return [b[len(a):] for a, b in zip(renders, renders[1:])]


def _arguments(text: str):
    """A call's arguments as the Hermes form writes them (and app.engine.tool_calls' grammar makes the model write
    them): a JSON object, not a string holding one; text that is not JSON as it is."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
