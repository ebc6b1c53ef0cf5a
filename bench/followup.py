"""Follow-up retrieval: which text to search with at a conversation's second turn.

    python bench/followup.py [--top-k 3]

Constructed two-turn conversations over the demo corpus (corpus/): follow-ups that lean on the first
turn ("When was it automated?") and topic switches that do not. For each, the document that answers
the second question is known. Compares what the search sees:
    alone      the new question only
    always     the previous exchange (user message + answer) and the new question, every time
    rule       app.engine.conversation's rule: the previous exchange only when the question is a follow-up
    rule_user  the same rule, with only the previous user message (not the answer) in front
Prints JSON: hit@1 and hit@k per strategy, for follow-ups, switches and all; and the rule's decisions.
Retrieval only (the real embedder and FAISS index); no LLM is loaded.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.conversation import Conversation, is_follow_up  # noqa: E402
from app.engine.ingest import collect_files, read_documents  # noqa: E402
from retrieval import Chunker, ChunkingSettings, Retriever  # noqa: E402
from tests.helpers import ROOT, shared_embedder, shared_tokenizer  # noqa: E402

LIGHTHOUSE, FESTIVAL, HISTORY, TOWN = "alderwick/lighthouse", "alderwick/lantern-festival", "alderwick/history", \
    "alderwick/town"
BREAD, TIDES, GEARS = "howto/harbour-oat-bread", "howto/tides", "howto/bicycle-gears"
ABOUT, HOURS, SHIPPING, RETURNS = "bluefin-faq/about", "bluefin-faq/hours", "bluefin-faq/shipping", \
    "bluefin-faq/returns"

# (previous question, its answer, new question, the document that answers the new question)
FOLLOW_UPS = [
    ("Who was the first keeper of Gull Point Lighthouse?", "Tobias Wren.", "When was it automated?", LIGHTHOUSE),
    ("Who was the first keeper of Gull Point Lighthouse?", "Tobias Wren.", "How far can its lamp be seen?",
     LIGHTHOUSE),
    ("When is the Lantern Festival held?", "On the second Saturday of October.", "Who started it?", FESTIVAL),
    ("Who started the Lantern Festival?", "Edith Marr.", "Why did she start it?", FESTIVAL),
    ("Who founded Alderwick?", "Mara Quill.", "What did she build?", HISTORY),
    ("When did the railway reach Alderwick?", "In 1903.", "And when did the cannery close?", HISTORY),
    ("Who is the mayor of Alderwick?", "Rosa Penhale.", "When was she elected?", TOWN),
    ("What does Bluefin Marine Supply sell?", "Ropes, nets, paint and engine parts.", "Who founded it?", ABOUT),
    ("When is the Bluefin shop open?", "Monday to Friday from 8 to 6, and Saturday from 9 to 1.",
     "What about Sunday?", HOURS),
    ("How much does standard delivery cost at Bluefin?", "5 pounds.", "And express?", SHIPPING),
    ("How long do I have to return an item to Bluefin?", "30 days.", "What is the warranty on engine parts?",
     RETURNS),
    ("How long does harbour oat bread bake?", "35 minutes.", "At what temperature?", BREAD),
    ("What is a bicycle's gear ratio?", "The chainring's teeth divided by the cog's.",
     "Which one is good for climbing hills?", GEARS),
    ("What causes the tides?", "Mainly the pull of the Moon's gravity.", "Why are there two of them a day?",
     TIDES),
]
SWITCHES = [
    ("Who was the first keeper of Gull Point Lighthouse?", "Tobias Wren.",
     "What time does the Lantern Festival procession start?", FESTIVAL),
    ("Who founded Bluefin Marine Supply?", "Ines Navarro.", "How many people live in Alderwick?", TOWN),
    ("What causes the tides?", "Mainly the pull of the Moon's gravity.", "What does Bluefin Marine Supply sell?",
     ABOUT),
    ("When is the Lantern Festival held?", "On the second Saturday of October.",
     "When was the new harbour wall finished?", HISTORY),
    ("Who is the mayor of Alderwick?", "Rosa Penhale.", "Why does the sea have two high tides a day?", TIDES),
    ("How long does harbour oat bread bake?", "35 minutes.", "How does a low bicycle gear help on hills?", GEARS),
    ("What does Bluefin Marine Supply sell?", "Ropes, nets, paint and engine parts.",
     "How tall is Gull Point Lighthouse?", LIGHTHOUSE),
    ("What is a bicycle's gear ratio?", "The chainring's teeth divided by the cog's.",
     "How much honey goes into harbour oat bread?", BREAD),
]


def message(role: str, text: str) -> SimpleNamespace:
    return SimpleNamespace(role=role, text=lambda: text)


def queries(previous: str, answer: str, question: str) -> dict[str, str]:
    chat = Conversation.from_messages([message("user", previous), message("assistant", answer),
                                       message("user", question)])
    return {"alone": question, "always": f"{previous} {answer} {question}", "rule": chat.retrieval_query(),
            "rule_user": f"{previous} {question}" if is_follow_up(question) else question}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top-k", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ragblend-followup-") as tmp:
        retriever = Retriever(Path(tmp) / "index", shared_embedder())
        chunker = Chunker(shared_tokenizer(), ChunkingSettings())
        files, _ = collect_files([ROOT / "corpus"])
        for path, doc_id in files:
            for doc in read_documents(path, doc_id)[0]:
                retriever.add_document(doc.doc_id, chunker.chunk(doc.doc_id, doc.text), title=doc.title)
        report: dict = {"documents": len(retriever.list_documents()), "top_k": args.top_k, "strategies": {},
                        "rule_says_follow_up": {"follow_ups": [is_follow_up(q) for _, _, q, _ in FOLLOW_UPS],
                                                "switches": [is_follow_up(q) for _, _, q, _ in SWITCHES]}}
        for strategy in ("alone", "always", "rule", "rule_user"):
            scores = {}
            for name, cases in (("follow_ups", FOLLOW_UPS), ("switches", SWITCHES),
                                ("all", FOLLOW_UPS + SWITCHES)):
                found = [[h.chunk.doc_id for h in retriever.search(queries(p, a, q)[strategy], args.top_k)]
                         for p, a, q, _ in cases]
                scores[name] = {"hit@1": round(sum(f[0] == d for f, (*_, d) in zip(found, cases)) / len(cases), 3),
                                f"hit@{args.top_k}": round(sum(d in f for f, (*_, d) in zip(found, cases))
                                                           / len(cases), 3), "n": len(cases)}
            report["strategies"][strategy] = scores
        retriever.close()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
