"""The RAG prompt, cut into cacheable pieces: head | passage | passage | ... | suffix.

Rendered through the model's own chat template, so any chat model works:
    head    = <system turn> + <user turn opening>           (same for every request: cached once)
    passage = "{title}\n" + chunk + "\n\n"                   (one per chunk: KV precomputed at ingest)
    suffix  = instruction + "Question: {question}" + <turn end, assistant opening>   (always fresh)
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

    def __post_init__(self) -> None:
        self.head_text, self.tail_text = self._split_template()

    def _split_template(self) -> tuple[str, str]:
        """The chat template rendered around a placeholder user message, cut at the placeholder."""
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": _SLOT}]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # templates without a system role: fold it into the user turn
            messages = [{"role": "user", "content": f"{self.system_prompt}\n\n{_SLOT}"}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, tail = text.split(_SLOT)
        return head, tail

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @cached_property
    def head_ids(self) -> list[int]:
        return self.encode(self.head_text)

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
