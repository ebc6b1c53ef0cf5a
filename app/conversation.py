"""A chat request's messages → what the engine needs: the system message, the earlier turns, the new
question, and the text to retrieve with.

- System and developer messages (anywhere) join into the system turn, after the server's own prompt.
- The new question is the last user message with text; the user and assistant messages before it are
  the earlier turns (tool and function messages are left out; so is anything after the question).
- Retrieval uses the question alone, unless it is a follow-up: then the previous exchange (the user's
  previous message and the answer to it) goes in front, so the search sees what "it" or "she" means.
  A follow-up, by a simple rule: the question has at most FOLLOW_UP_MAX_WORDS words, or a word that
  points back (REFERRING), or starts like a continuation (CONTINUING). Measured on constructed
  conversations in bench/followup.py (BENCHMARKS.md).
- In the prompt, the conversation keeps its newest exchanges that fit the context (`fit_conversation`).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from blend.prompt import exchange_starts

FOLLOW_UP_MAX_WORDS = 4
REFERRING = frozenset("""it its itself he him his himself she her hers herself they them their theirs themselves
this that these those there then such one ones same other former latter""".split())
CONTINUING = ("and ", "but ", "so ", "also ", "what about", "how about", "what else", "then ")
PREVIOUS_MAX_CHARS = 300
_WORD = re.compile(r"[a-z0-9']+")


class Message(Protocol):
    role: str

    def text(self) -> str: ...


@dataclass
class Conversation:
    system: str | None
    turns: tuple[tuple[str, str], ...]  # (role, text), role "user" or "assistant", oldest first
    question: str

    @classmethod
    def from_messages(cls, messages: Sequence[Message]) -> Conversation:
        """Raises ValueError when no user message has text."""
        last = next((i for i in range(len(messages) - 1, -1, -1)
                     if messages[i].role == "user" and messages[i].text().strip()), None)
        if last is None:
            raise ValueError("needs a user message with text")
        system = "\n\n".join(m.text().strip() for m in messages if m.role in ("system", "developer")
                             and m.text().strip())
        turns = tuple((m.role, m.text()) for m in messages[:last]
                      if m.role in ("user", "assistant") and m.text().strip())
        return cls(system or None, turns, messages[last].text())

    def retrieval_query(self) -> str:
        """The question, made self-contained with the previous exchange when it is a follow-up."""
        if not self.turns or not is_follow_up(self.question):
            return self.question
        previous = previous_exchange(self.turns)
        return " ".join([*previous, self.question.strip()])


def is_follow_up(question: str) -> bool:
    words = _WORD.findall(question.lower())
    return (len(words) <= FOLLOW_UP_MAX_WORDS or any(w in REFERRING for w in words)
            or question.strip().lower().startswith(CONTINUING))


def previous_exchange(turns: Sequence[tuple[str, str]]) -> list[str]:
    """The last user message and, if there is one after it, the reply to it (stripped, each cut to
    PREVIOUS_MAX_CHARS: the embedder reads only its first 256 word pieces, and the question must be in them)."""
    last_user = max((i for i, (role, _) in enumerate(turns) if role == "user"), default=None)
    exchange = [turns[-1]] if last_user is None else turns[last_user:last_user + 2]
    return [text.strip()[:PREVIOUS_MAX_CHARS] for _, text in exchange]


# ---- the conversation in the prompt: the newest exchanges that fit -------------------------------

CHARS_PER_TOKEN_BOUND = 64  # no token holds more characters (bounds the conversation worth rendering)


class ConversationFormat(Protocol):
    """What fitting needs from blend.PromptFormat: a conversation's token pieces."""

    def conversation_ids(self, turns: Sequence[tuple[str, str]], system: str | None) -> list[list[int]]: ...


def fit_conversation(prompt: ConversationFormat, turns: tuple[tuple[str, str], ...], system: str | None,
                     fixed: int, limit: int | None) -> tuple[tuple[tuple[str, str], ...], list[list[int]]]:
    """The newest exchanges whose conversation fits a `limit`-token context next to `fixed` other tokens,
    and their token pieces. A binary search over where the kept conversation starts (a few renders,
    however long the chat); exchanges more than CHARS_PER_TOKEN_BOUND characters per token of context
    back are not even tried."""
    if not turns:
        return (), []
    starts = exchange_starts(turns) + [len(turns)]
    if limit:  # no conversation of more characters than this fits: skip rendering it
        chars = [sum(len(text) for _, text in turns[start:]) for start in starts]
        starts = [s for s, n in zip(starts, chars) if n <= CHARS_PER_TOKEN_BOUND * limit] or [len(turns)]

    def fitting(i: int) -> list[list[int]] | None:
        conversation = prompt.conversation_ids(turns[starts[i]:], system)
        return conversation if not limit or fixed + sum(map(len, conversation)) <= limit else None

    kept, best = len(starts) - 1, []  # the last start keeps nothing, which always fits
    lo, hi = 0, len(starts) - 2
    while lo <= hi:  # the earliest start that fits (a later start only drops more)
        mid = (lo + hi) // 2
        if (conversation := fitting(mid)) is not None:
            kept, best, hi = mid, conversation, mid - 1
        else:
            lo = mid + 1
    return turns[starts[kept]:], best
