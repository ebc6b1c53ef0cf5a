"""Selection policies on the real SmolLM2: the question's attention finds the passage it asks about."""
from __future__ import annotations

import pytest

from app.config import load_settings
from blend import Blender, PromptFormat

pytestmark = pytest.mark.slow

PASSAGES = [
    "The Orvel river rises in the Kessin hills and flows north for 212 kilometres before it reaches the sea "
    "at the port of Lannet, where a stone bridge from 1781 still carries the coast road.",
    "Marla Quint is a painter from the city of Dresden. She works mostly in oil on large canvases, and her "
    "series of harbour scenes was first shown at the Albertinum in 2009 to mixed reviews.",
    "The national dish of Zorbania is a thick stew of lentils and smoked eel called drovka. Zorbanian families "
    "cook drovka for the winter festival, and every village claims its own recipe for it.",
    "The Pellham Arcos Tower was finished in 1987 and is 41 storeys tall. It was designed by the firm of "
    "Hartley and Moss and held the offices of a shipping company until 2003.",
    "Cricket in the Tamsey valley is played on village greens from May to September. The valley league has "
    "eleven clubs, and the oldest of them was founded by a group of millers in 1864.",
]
QUESTIONS = {2: "What is the national dish of Zorbania called?",   # passage index -> a question about it
             1: "In which city was the painter Marla Quint born?"}


@pytest.fixture(scope="module")
def prompt(smollm) -> PromptFormat:
    return PromptFormat(smollm.tokenizer, load_settings().model.system_prompt)


def test_query_selects_more_of_the_passage_the_question_names(smollm, prompt):
    """Each passage's recomputed share is higher when the question asks about it than when the same
    prompt asks about another passage (the layout is the same, so position biases cancel out)."""
    blender = Blender(smollm.model, smollm.tokenizer, smollm.fingerprint)
    head = blender.precompute(prompt.head_ids)
    chunks = [blender.precompute(prompt.text_passage_ids(p), prompt.head_ids, context=head) for p in PASSAGES]
    bounds = [len(prompt.head_ids) + sum(c.num_tokens for c in chunks[:i]) for i in range(len(chunks) + 1)]

    def shares(question: str) -> list[float]:
        result = blender.prefill([head, *chunks], prompt.suffix_ids(question), 0.2, selection="query")
        return [float(((result.selected >= a) & (result.selected < b)).sum()) / (b - a)
                for a, b in zip(bounds, bounds[1:])]

    share = {asked: shares(question) for asked, question in QUESTIONS.items()}
    assert share[2][0] == share[1][0] == 0.0  # passage 0 sits right after the head: exact, never recomputed
    assert share[2][2] > share[1][2] and share[1][1] > share[2][1], share
