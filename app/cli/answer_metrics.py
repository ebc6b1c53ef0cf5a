"""Answer-quality metrics against gold answers: SQuAD exact match and token F1, LCS Rouge-L.

Every metric takes the best (max) over the gold answers, after SQuAD normalisation:
lowercase, strip punctuation, drop the articles a/an/the, collapse whitespace.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation (the official evaluation script's steps, in its order)."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def _f_measure(overlap: int, n_pred: int, n_gold: int) -> float:
    if overlap == 0:
        return 0.0
    precision, recall = overlap / n_pred, overlap / n_gold
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, gold: str) -> float:
    """Token-level F1 on normalised bag-of-words overlap."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    overlap = sum((Counter(pred) & Counter(ref)).values())
    return _f_measure(overlap, len(pred), len(ref))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) time, O(len(b)) memory)."""
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0  # row[j - 1] of the previous row
        for j, y in enumerate(b, start=1):
            diagonal, row[j] = row[j], diagonal + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l(prediction: str, gold: str) -> float:
    """Rouge-L F-measure (beta = 1) over normalised tokens."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    return _f_measure(lcs_length(pred, ref), len(pred), len(ref))


def best_over(metric: Callable[[str, str], float], prediction: str, golds: Sequence[str]) -> float:
    """max of `metric` over the gold answers (0 when there are none)."""
    return max((metric(prediction, g) for g in golds), default=0.0)


def answer_scores(prediction: str, golds: Sequence[str]) -> dict[str, float]:
    """{"f1", "em", "rouge_l"}, each the best over `golds`."""
    return {"f1": best_over(f1_score, prediction, golds), "em": best_over(exact_match, prediction, golds),
            "rouge_l": best_over(rouge_l, prediction, golds)}
