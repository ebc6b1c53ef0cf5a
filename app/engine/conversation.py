"""A chat request's messages → its question and the text to retrieve with. (The prompt holds every message,
each a piece: app.engine.rag_engine, blend.prompt.ChatTemplate.)

- The question is the last user message with text; the user and assistant messages before it are the
  earlier turns the retrieval query may draw on (tool results are not: they are no question's words).
- Retrieval uses the question alone, unless it is a follow-up: then the previous exchange (the user's
  previous message and the answer to it) goes in front, so the search sees what "it" or "she" means.
  A follow-up, by a simple rule: the question has at most FOLLOW_UP_MAX_WORDS words, or a word that
  points back (REFERRING), or starts like a continuation (CONTINUING). Measured on constructed
  conversations in bench/followup.py (BENCHMARKS.md).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

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
    turns: tuple[tuple[str, str], ...]  # (role, text), role "user" or "assistant", oldest first
    question: str

    @classmethod
    def from_messages(cls, messages: Sequence[Message]) -> Conversation:
        """Raises ValueError when no user message has text."""
        last = next((i for i in range(len(messages) - 1, -1, -1)
                     if messages[i].role == "user" and messages[i].text().strip()), None)
        if last is None:
            raise ValueError("needs a user message with text")
        turns = tuple((m.role, m.text()) for m in messages[:last]
                      if m.role in ("user", "assistant") and m.text().strip())
        return cls(turns, messages[last].text())

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


CHARS_PER_TOKEN_BOUND = 64  # no token holds more characters (bounds a text worth counting)
