"""The RAG prompt, cut into cacheable pieces: head | passage | passage | ... | suffix.

Rendered through the model's own chat template, so any chat model works:
    head    = <system turn> + <user turn opening>           (same for every request: cached once)
    passage = "{title}\n{text}\n\n"                           (one per chunk: KV precomputed at ingest)
    suffix  = instruction + "Question: {question}" + <turn end, assistant opening>   (always fresh)
The instruction sits after the passages, next to the question: small models follow it far
better there than in the system turn alone.
Each piece is tokenized on its own; a full prefill runs the concatenation of the same ids, so
blended and full prefill read exactly the same tokens.
"""
from __future__ import annotations

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

    @staticmethod
    def passage_text(text: str, title: str | None = None) -> str:
        body = text.strip()
        return f"{title.strip()}\n{body}\n\n" if title else f"{body}\n\n"

    def passage_ids(self, text: str, title: str | None = None) -> list[int]:
        return self.encode(self.passage_text(text, title))

    def suffix_ids(self, question: str) -> list[int]:
        return self.encode(f"{INSTRUCTION}\nQuestion: {question.strip()}{self.tail_text}")
