"""A prefill (the answer's start, an assistant's message last) rendered open, as HF's continue_final_message renders
it, on SmolLM2's ChatML tokenizer and tiny Llama-3-style and Mistral-style ones: the prompt ends with the prefill's
text, no end of turn after it, in the chat layout (no retrieval) and in the question's suffix (retrieval)."""
from __future__ import annotations

import pytest

from blend.prompt import INSTRUCTION, PromptFormat
from tests.blend.test_prompt_text import FAMILIES, chat_ids, controls

CHAT = [{"role": "user", "content": "Give the lighthouse as JSON"}]
PREFILL = {"role": "assistant", "content": '{"name": "'}


@pytest.fixture(params=list(FAMILIES))
def family(request):
    tokenizer, forged = FAMILIES[request.param]()
    return PromptFormat(tokenizer, "Answer briefly."), forged


def test_a_chat_with_a_prefill_is_the_templates_render_left_open(family):
    prompt, _ = family
    tokenizer = prompt.tokenizer
    ids = chat_ids(prompt, CHAT, prefill=PREFILL)
    whole = tokenizer.apply_chat_template([{"role": "system", "content": "Answer briefly."}, *CHAT, PREFILL],
                                          tokenize=False, continue_final_message=True)
    assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids).endswith(PREFILL["content"])  # the turn left open: no end of turn after it
    answered = chat_ids(prompt, CHAT)  # the same chat answered afresh: the prefill extends its opening
    assert len(ids) > len(answered) and controls(tokenizer, ids) == controls(tokenizer, answered)
    layout = prompt.chat.layout(CHAT, prefill=PREFILL)
    assert layout.split and layout.head + layout.messages[0] == answered[:len(layout.head) + len(layout.messages[0])]


def test_the_suffix_holds_the_prefill_after_the_assistant_opening(family):
    prompt, _ = family
    tokenizer = prompt.tokenizer
    ids = prompt.suffix_ids("where is it?", prefill='{"name": "')
    text = f"{INSTRUCTION}\nQuestion: where is it?{prompt.tail_text}"
    assert tokenizer.decode(ids).startswith(tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]))
    assert tokenizer.decode(ids).endswith('{"name": "')
    assert controls(tokenizer, ids) == controls(tokenizer, prompt.suffix_ids("where is it?"))
    with_system = prompt.suffix_ids("where is it?", system="be kind", prefill="The answer")
    assert tokenizer.decode(with_system).endswith("The answer")


def test_a_forged_turn_in_a_prefill_is_text(family):
    prompt, forged = family
    tokenizer = prompt.tokenizer
    forging = {"role": "assistant", "content": f"Sure{forged}"}
    ids = chat_ids(prompt, CHAT, prefill=forging)
    assert controls(tokenizer, ids) == controls(tokenizer, chat_ids(prompt, CHAT, prefill=PREFILL))
    assert tokenizer.decode(ids).endswith(forged)
    assert controls(tokenizer, prompt.suffix_ids("where", prefill=f"Sure{forged}")) == \
        controls(tokenizer, prompt.suffix_ids("where"))
