"""The RAG prompt, cut into cacheable pieces: head | conversation | passage | passage | ... | suffix.

Rendered through the model's own chat template, so any chat model works:
    head    = <system turn> + <user turn opening>           (same for every request: cached once;
                                                             a client's system message makes another head)
    conversation = earlier turns, one piece per exchange:   (an exact prefix, cached from turn to turn)
              "{user message}" + <turn end> + <assistant turn> + "{reply}" + <turn end> + <user turn opening>
    passage = "{title}\n" + chunk + "\n\n"                   (one per chunk: KV precomputed at ingest)
    suffix  = instruction + "Question: {question}" + <turn end, assistant opening>   (always fresh)
The conversation pieces are cut from renders of the whole conversation: piece j is what the render
of the first j exchanges adds to the render of the first j - 1, so head + pieces is exactly the
template's own rendering of the conversation, ending where the new user message begins.
The instruction sits after the passages, next to the question: small models follow it far
better there than in the system turn alone.
Each piece is tokenized on its own; a passage reuses its chunk's stored token ids between the
tokens of its title line and of the blank line after it, so a query tokenizes only its question.
A full prefill runs the concatenation of the same ids: blended and full prefill read exactly the
same tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from transformers import PreTrainedTokenizerBase

_SLOT = "\u0000RAGBLEND_SLOT\u0000"
INSTRUCTION = "Answer the question with a short phrase from the passages above."


@dataclass
class PromptFormat:
    tokenizer: PreTrainedTokenizerBase
    system_prompt: str
    head_text: str = field(init=False)
    tail_text: str = field(init=False)
    _heads: dict[str, list[int]] = field(init=False, default_factory=dict, repr=False)  # system message -> head ids

    def __post_init__(self) -> None:
        self.head_text, self.tail_text = self._split_template()

    def _split_template(self, system: str | None = None, turns: Sequence[tuple[str, str]] = ()) -> tuple[str, str]:
        """The chat template rendered around a placeholder user message, cut at the placeholder."""
        messages = [{"role": role, "content": text} for role, text in turns] + [{"role": "user", "content": _SLOT}]
        try:
            text = self.tokenizer.apply_chat_template([{"role": "system", "content": self.system_text(system)},
                                                       *messages], tokenize=False, add_generation_prompt=True)
        except Exception:  # templates without a system role: fold it into the (first) user turn
            first = messages[0]["content"]
            messages[0] = {"role": "user", "content": f"{self.system_text(system)}\n\n{first}"}
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, tail = text.split(_SLOT)
        return head, tail

    def system_text(self, system: str | None = None) -> str:
        """The system turn: ours, then the client's system message if it sent one."""
        return f"{self.system_prompt}\n\n{system.strip()}" if system and system.strip() else self.system_prompt

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @cached_property
    def head_ids(self) -> list[int]:
        return self.encode(self.head_text)

    def head_ids_for(self, system: str | None = None) -> list[int]:
        """The head with the client's system message in the system turn (`head_ids` without one)."""
        if not system or not system.strip():
            return self.head_ids
        key = system.strip()
        if key not in self._heads:
            if len(self._heads) >= 64:  # a bounded memo: clients usually send one of a few system prompts
                self._heads.pop(next(iter(self._heads)))
            self._heads[key] = self.encode(self._split_template(key)[0])
        return self._heads[key]

    def conversation_ids(self, turns: Sequence[tuple[str, str]], system: str | None = None) -> list[list[int]]:
        """Earlier turns — (role, text), role "user" or "assistant", oldest first — as token pieces that
        follow `head_ids_for(system)`: one per exchange (user messages, then the assistant's reply), the
        last ending with the new user turn's opening. A template whose renders do not extend one another
        gets one plain-text transcript piece instead."""
        turns = [(role, text.strip()) for role, text in turns]
        if not turns:
            return []
        cuts = [i + 1 for i, (role, _) in enumerate(turns) if role == "assistant"]
        cuts += [len(turns)] if not cuts or cuts[-1] != len(turns) else []
        before, texts = self._split_template(system)[0], []
        for cut in cuts:
            try:
                prefix = self._split_template(system, turns[:cut])[0]
            except Exception:  # e.g. a template that insists on alternating roles
                prefix = ""
            if not prefix.startswith(before):
                return [self.encode(_transcript(turns))]
            texts.append(prefix[len(before):])
            before = prefix
        return [self.encode(text) for text in texts]

    @cached_property
    def separator_ids(self) -> list[int]:
        return self.encode("\n\n")

    def passage_ids(self, chunk_ids: Sequence[int], title: str | None = None) -> list[int]:
        """A passage as the model reads it: its title line, the chunk's own token ids, a blank line."""
        title_ids = self.encode(f"{title.strip()}\n") if title and title.strip() else []
        return title_ids + list(chunk_ids) + self.separator_ids

    def text_passage_ids(self, text: str, title: str | None = None) -> list[int]:
        """`passage_ids` of a raw text (the compare harness's dataset passages)."""
        return self.passage_ids(self.encode(text.strip()), title)

    def suffix_ids(self, question: str) -> list[int]:
        return self.encode(f"{INSTRUCTION}\nQuestion: {question.strip()}{self.tail_text}")


def _transcript(turns: Sequence[tuple[str, str]]) -> str:
    lines = [f"{'User' if role == 'user' else 'Assistant'}: {text}" for role, text in turns]
    return "Earlier in this conversation:\n" + "\n".join(lines) + "\n\n"


def exchange_starts(turns: Sequence[tuple[str, str]]) -> list[int]:
    """Index of the first message of each exchange in `turns` (an exchange ends with an assistant reply):
    dropping the oldest exchanges means starting the conversation at one of these."""
    return [0] + [i + 1 for i, (role, _) in enumerate(turns[:-1]) if role == "assistant"]
