"""`ragblend compare`: blended prefill against full prefill on a QA dataset — quality and TTFT.

The dataset is the CacheBlend/MuSiQue format: a JSON list of
`{"question", "answers": [...], "ctxs": [{"title", "text"}, ...]}`. Each question's prompt is
head | first K passages (dataset order) | suffix, answered greedily in these MODES:

    full        every token through every layer (the reference)
    reuse       ratio 0: the cached chunk KVs concatenated (RoPE-shifted), only the question computed
    POLICY@R    selective recompute of R of the cached tokens, chosen by a blend.selection policy
                (`--selection`, default blend.selection; `hkvd` and `random` always run as baselines)
    blend@1     ratio 1: every policy recomputes everything, so it runs once (equals full prefill)

Per question, step by step:
    1. precompute the head's and passages' KV (untimed, as at ingest), each passage passed through the
       store codec and back (`--codec`), as serving reads them from the store (the head stays exact)
    2. full prefill, timed; its greedy answer is the reference token sequence
    3. every other mode right after it, timed the same way (TTFT = prefill + choosing the first
       token), so each mode's TTFT ratio compares two back-to-back runs on the same prompt
    4. agreement with full prefill, teacher-forced over the reference tokens: mean KL(full || mode)
       and top-1 agreement per answer position; plus exact equality of the greedy answers
    5. answer F1 / EM / Rouge-L against the gold answers; report.json rewritten atomically

Outputs in `--out`: report.json (per question + aggregate), report.md, quality_vs_ttft.png.
`wins_vs_hkvd` in the aggregate counts the questions where a policy's KL is below hkvd's at the
same ratio.
`ttft_ratio` in the aggregate is the mean over questions of (mode TTFT / full TTFT of the same
question); `ttft_ratio_of_medians` is median(mode TTFT) / median(full TTFT).
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from app.cli.answer_metrics import answer_scores
from blend import Blender, ChunkKV, DecodeRuntime, Prefill, PromptFormat, SamplingParams, TextStream, hash_ids
from common import write_atomic
from store import get_codec

log = logging.getLogger("ragblend.compare")

REPORT_JSON, REPORT_MD, PLOT_PNG = "report.json", "report.md", "quality_vs_ttft.png"
TARGET = {"ratio": 0.15, "top1": 0.95, "kl": 0.05, "ttft_ratio": 0.25}  # for the default policy
METRICS = ("kl", "top1", "same_answer", "f1", "em", "rouge_l")


# ---- configuration and modes ------------------------------------------------------------------

@dataclass(frozen=True)
class CompareConfig:
    dataset: str
    passages: int
    ratios: list[float]
    precompute: str      # "head" | "zero"
    codec: str           # "none" or a store codec: "native" | "fp16" | "int8" | "int4" | "cachegen"
    check_layer: int
    deviation: str
    selections: list[str]  # policies compared; the first is the default
    max_tokens: int
    seed: int
    threads: int         # torch intra-op threads the timings ran with
    codec_bins: dict | None = None  # cachegen: its bins per layer band (store.cachegen_bins)


@dataclass(frozen=True)
class Mode:
    name: str
    ratio: float | None  # None: full prefill
    selection: str = "hkvd"


def fmt_ratio(ratio: float) -> str:
    return f"{ratio:g}"


def build_modes(ratios: Iterable[float], selections: Iterable[str] = ("hkvd",)) -> list[Mode]:
    """full, reuse (ratio 0), POLICY@R for each policy (plus hkvd and random) and 0 < R < 1, blend@1."""
    ratios = sorted(set(ratios))
    policies = list(dict.fromkeys([*selections, "hkvd", "random"]))
    modes = [Mode("full", None)] + [Mode("reuse", 0.0)] * (0 in ratios)
    modes += [Mode(f"{p}@{fmt_ratio(r)}", r, p) for p in policies for r in ratios if 0 < r < 1]
    return modes + [Mode("blend@1", 1.0, policies[0])] * (1 in ratios)


# ---- one question -------------------------------------------------------------------------------

@dataclass
class PromptKV:
    segments: list[ChunkKV]   # head, then passages
    suffix_ids: list[int]
    full_ids: list[int]       # the same tokens, concatenated


@dataclass
class Timed:
    prefill: Prefill
    ttft_s: float


class Harness:
    """Runs every mode on one question with one Blender and its DecodeRuntime; knows nothing about files."""

    def __init__(self, blender: Blender, runtime: DecodeRuntime, prompt: PromptFormat, config: CompareConfig):
        self.blender, self.runtime, self.prompt, self.config = blender, runtime, prompt, config
        self.modes = build_modes(config.ratios, config.selections)
        self.head_ids = prompt.head_ids
        self.codec = None if config.codec == "none" else get_codec(config.codec, bins=config.codec_bins)
        self.head_kv = blender.precompute(self.head_ids)  # exact, as serving keeps it (app.engine.kv.ChunkKVCache.head)
        self.sampling = SamplingParams(max_new_tokens=config.max_tokens)

    def _through_codec(self, kv: ChunkKV) -> ChunkKV:
        """The KV as serving would read it back from the store (the codec's round trip, as store.put's)."""
        return kv if self.codec is None else self.codec.round_trip(kv)

    def prepare(self, item: dict[str, Any]) -> PromptKV:
        """1. Head + first K passages (dataset order) + question suffix, chunk KVs precomputed."""
        ctxs = item["ctxs"][: self.config.passages]
        passages = [self.prompt.text_passage_ids(c["text"], c.get("title") or None) for c in ctxs]
        if self.config.precompute == "head":
            kvs = [self.blender.precompute(p, self.head_ids, context=self.head_kv) for p in passages]
        else:
            kvs = [self.blender.precompute(p) for p in passages]
        suffix = self.prompt.suffix_ids(item["question"])
        full_ids = self.head_ids + [t for p in passages for t in p] + suffix
        return PromptKV([self.head_kv, *map(self._through_codec, kvs)], suffix, full_ids)

    def timed(self, mode: Mode, pkv: PromptKV, seed: int) -> Timed:
        """TTFT as serving sees it: the prefill plus choosing the first token."""
        start = time.perf_counter()
        if mode.ratio is None:
            prefill = self.blender.full_prefill(pkv.full_ids)
        else:
            prefill = self.blender.prefill(pkv.segments, pkv.suffix_ids, mode.ratio, selection=mode.selection,
                                           seed=seed)
        int(prefill.logits.argmax())  # the first token (greedy)
        return Timed(prefill, time.perf_counter() - start)

    def answer(self, prefill: Prefill) -> tuple[list[int], str]:
        """The greedy answer as serving makes it (the decode loop through the driver, in a pool slot; the
        prefill's own cache is left as it was for teacher forcing): its tokens, eos included when generated,
        and its text (blend.TextStream: eos ends it, special tokens dropped)."""
        stream = TextStream(self.prompt.tokenizer, eos_ids=self.runtime.eos_ids)
        for _ in self.runtime.generate(prefill, self.sampling, stream):
            pass
        return stream.ids, stream.text.strip()

    def run(self, index: int, item: dict[str, Any]) -> dict[str, Any]:
        pkv = self.prepare(item)
        golds = gold_answers(item)
        seed = self.config.seed + index
        # 2. The reference: full prefill, its greedy answer and teacher-forced log-probs.
        full = self.timed(self.modes[0], pkv, seed)
        ref, ref_text = self.answer(full.prefill)
        ref_logp = torch.log_softmax(self.blender.teacher_force(full.prefill, ref), dim=-1)  # [A, V]
        results = {"full": mode_result(ref_text, golds, full, full.ttft_s, kl=0.0, top1=1.0, same=True)}
        # 3-5. Every other mode, back to back with the reference.
        for mode in self.modes[1:]:
            run = self.timed(mode, pkv, seed)
            tokens, text = self.answer(run.prefill)
            logp = torch.log_softmax(self.blender.teacher_force(run.prefill, ref), dim=-1)
            kl, top1 = agreement(ref_logp, logp)
            results[mode.name] = mode_result(text, golds, run, full.ttft_s, kl=kl, top1=top1, same=tokens == ref)
        return {"index": index, "question": item["question"], "answers": golds, "prompt_tokens": len(pkv.full_ids),
                "cached_tokens": len(pkv.full_ids) - len(pkv.suffix_ids), "reference_tokens": len(ref),
                "reference_answer": ref_text, "modes": results}


def agreement(ref_logp: torch.Tensor, logp: torch.Tensor) -> tuple[float, float]:
    """(mean KL(ref || mode), top-1 agreement) over answer positions; both log-probs [A, V]."""
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)  # [A]
    top1 = (ref_logp.argmax(-1) == logp.argmax(-1)).float()            # [A]
    return float(kl.mean()), float(top1.mean())


def mode_result(answer: str, golds: list[str], run: Timed, full_ttft_s: float, *, kl: float, top1: float,
                same: bool) -> dict[str, Any]:
    stats = run.prefill.stats
    return {"answer": answer, **answer_scores(answer, golds), "kl": kl, "top1": top1, "same_answer": float(same),
            "ttft_s": run.ttft_s, "ttft_ratio": run.ttft_s / full_ttft_s, "exact_tokens": stats.exact_tokens,
            "recomputed_tokens": stats.recomputed_tokens, "timings_ms": stats.timings_ms}


def gold_answers(item: dict[str, Any]) -> list[str]:
    """The gold answers, plus a reference `summary` where the dataset has one."""
    answers = item.get("answers") or []
    answers = [answers] if isinstance(answers, str) else list(answers)
    return answers + ([item["summary"]] if item.get("summary") else [])


# ---- aggregate and outputs -------------------------------------------------------------------

def aggregate(questions: list[dict[str, Any]], modes: list[str]) -> dict[str, dict[str, float]]:
    """Per mode: means of the quality metrics, median TTFT, the TTFT ratio to full prefill, and for
    POLICY@R the questions where its KL is below hkvd@R's."""
    out: dict[str, dict[str, Any]] = {}
    full_ttft = [q["modes"]["full"]["ttft_s"] for q in questions]
    for name in modes:
        rows = [q["modes"][name] for q in questions if name in q["modes"]]
        if not rows:
            continue
        ttft = [r["ttft_s"] for r in rows]
        ratios = [r["ttft_ratio"] for r in rows]
        out[name] = {**{m: statistics.fmean(r[m] for r in rows) for m in METRICS},
                     "ttft_s": statistics.median(ttft), "ttft_ratio": statistics.fmean(ratios),
                     "ttft_ratio_median": statistics.median(ratios),
                     "ttft_ratio_of_medians": statistics.median(ttft) / statistics.median(full_ttft),
                     "recomputed_tokens": statistics.fmean(r["recomputed_tokens"] for r in rows), "n": len(rows)}
        baseline = f"hkvd@{name.split('@')[1]}" if "@" in name else None
        if baseline in modes and name not in (baseline, "blend@1"):
            pairs = [q["modes"] for q in questions if name in q["modes"] and baseline in q["modes"]]
            out[name]["wins_vs_hkvd"] = sum(m[name]["kl"] < m[baseline]["kl"] for m in pairs)
    return out


def render_markdown(report: dict[str, Any]) -> str:
    cfg, agg = report["config"], report["aggregate"]
    lines = [f"# ragblend compare — {len(report['questions'])} questions × {cfg['passages']} passages", "",
             f"- model `{report['model']['name']}` (fingerprint `{report['model']['fingerprint']}`), "
             f"commit `{report['commit']}`",
             f"- dataset `{cfg['dataset']}`; precompute `{cfg['precompute']}`, codec `{cfg['codec']}`, "
             f"check layer {cfg['check_layer']}, deviation `{cfg['deviation']}`, default selection "
             f"`{cfg['selections'][0]}`, max tokens {cfg['max_tokens']}, "
             f"seed {cfg['seed']}, {cfg['threads']} torch thread(s)",
             f"- prompt: system `{report['prompt']['system_prompt']}`, suffix `{report['prompt']['suffix']!r}`",
             f"- mean prompt {report['mean_prompt_tokens']:.0f} tokens, median full-prefill TTFT "
             f"{agg['full']['ttft_s']:.2f} s",
             "- KL = mean KL(full ‖ mode) and top-1 = share of positions with the same argmax, both teacher-forced "
             "over full prefill's greedy answer; same answer = identical greedy tokens; F1/EM/Rouge-L vs gold "
             "(SQuAD normalisation, best gold answer)",
             "- TTFT = prefill + first token (precompute excluded); TTFT/full = mean over questions of the ratio "
             "to the full prefill timed just before, ratio of medians in brackets",
             "- wins vs hkvd = questions where the policy's KL is below hkvd's at the same ratio", "",
             "| mode | KL | top-1 | same answer | F1 | EM | Rouge-L | TTFT median (s) | TTFT / full | wins vs hkvd |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, a in agg.items():
        wins = f"{a['wins_vs_hkvd']}/{a['n']}" if "wins_vs_hkvd" in a else ""
        lines.append(f"| {name} | {a['kl']:.4f} | {a['top1']:.3f} | {a['same_answer']:.2f} | {a['f1']:.3f} | "
                     f"{a['em']:.2f} | {a['rouge_l']:.3f} | {a['ttft_s']:.2f} | {a['ttft_ratio']:.3f} "
                     f"({a['ttft_ratio_of_medians']:.3f}) | {wins} |")
    lines += ["", "## One line per setting", ""]
    lines += [f"- **{name}**: top-1 {a['top1']:.3f}, KL {a['kl']:.4f}, same answer {a['same_answer']:.0%}, "
              f"F1 {a['f1']:.3f}, at {a['ttft_ratio']:.2f}× full-prefill TTFT" for name, a in agg.items()]
    target = f"{cfg['selections'][0]}@{fmt_ratio(TARGET['ratio'])}"
    if target in agg:
        a = agg[target]
        met = a["top1"] >= TARGET["top1"] and a["kl"] <= TARGET["kl"] and a["ttft_ratio"] <= TARGET["ttft_ratio"]
        lines += ["", f"Target {target}: top-1 ≥ {TARGET['top1']}, KL ≤ {TARGET['kl']}, TTFT ≤ "
                      f"{TARGET['ttft_ratio']}× — {'met' if met else 'not met'} (top-1 {a['top1']:.3f}, "
                      f"KL {a['kl']:.4f}, TTFT {a['ttft_ratio']:.3f}×)"]
    lines += ["", f"![quality vs TTFT]({PLOT_PNG})", ""]
    return "\n".join(lines)


def plot(agg: dict[str, dict[str, float]], path: Path) -> None:
    """x = TTFT relative to full prefill, y = top-1 agreement; one curve per policy over its ratios,
    reuse, blend@1 and full as single points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    families = list(dict.fromkeys(n.split("@")[0] for n in agg))
    colors = plt.get_cmap("tab10")
    for i, family in enumerate(families):
        names = sorted((n for n in agg if n.split("@")[0] == family), key=lambda n: agg[n]["ttft_ratio"])
        color = {"full": "black", "reuse": "tab:orange", "blend": "tab:gray"}.get(family, colors(i % 10))
        xs, ys = [agg[n]["ttft_ratio"] for n in names], [agg[n]["top1"] for n in names]
        ax.plot(xs, ys, color=color, marker="*" if family == "full" else "o",
                linestyle="-" if len(names) > 1 else "", label=family)
        for n, x, y in zip(names, xs, ys):
            ax.annotate(f"{n} KL {agg[n]['kl']:.3f}", (x, y), textcoords="offset points", xytext=(6, 4 - 10 * (i % 3)),
                        fontsize=7, color=color)
    ax.set_xlabel("TTFT / full prefill (same question, back to back)")
    ax.set_ylabel("top-1 agreement with full prefill")
    ax.set_title("Answer agreement vs time to first token")
    ax.margins(x=0.12, y=0.15)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the run ------------------------------------------------------------------------------------

def load_dataset(path: Path, limit: int) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list) or not all(isinstance(d, dict) and "question" in d and "ctxs" in d for d in data):
        raise ValueError(f"{path}: expected a JSON list of {{question, answers, ctxs}} objects")
    return data[:limit]


def run_identity(loaded, config: CompareConfig, prompt: PromptFormat) -> dict[str, Any]:
    """What a report's numbers depend on: model, config and prompt; resume requires all three equal."""
    return {"model": {"name": loaded.name, "fingerprint": loaded.fingerprint}, "config": asdict(config),
            "prompt": {"system_prompt": prompt.system_prompt, "head_hash": hash_ids(prompt.head_ids)[:16],
                       "suffix": prompt.tokenizer.decode(prompt.suffix_ids("{question}"))}}


def load_previous(path: Path, identity: dict[str, Any]) -> list[dict[str, Any]]:
    """Questions already in `path` under the same identity (resume), else raises ValueError."""
    if not path.exists():
        return []
    report = json.loads(path.read_text())
    changed = [key for key, value in identity.items() if report.get(key) != value]
    if changed:
        raise ValueError(f"{path} was written with another {' and '.join(changed)}; use another --out or drop "
                         "--resume")
    return report.get("questions", [])


def build_report(identity: dict[str, Any], modes: list[Mode], questions: list[dict[str, Any]],
                 commit: str) -> dict[str, Any]:
    questions = sorted(questions, key=lambda q: q["index"])
    commits = list(dict.fromkeys(q.get("commit", "unknown") for q in questions)) or [commit]
    return {**identity, "commit": ", ".join(commits), "modes": [m.name for m in modes],
            "ttft_ratio_method": "mean over questions of mode TTFT / full-prefill TTFT of the same question",
            "mean_prompt_tokens": statistics.fmean(q["prompt_tokens"] for q in questions) if questions else 0.0,
            "aggregate": aggregate(questions, [m.name for m in modes]), "questions": questions}


def write_outputs(out: Path, report: dict[str, Any], final: bool) -> None:
    write_atomic(out / REPORT_JSON, json.dumps(report, indent=1))
    if final and report["questions"]:
        write_atomic(out / REPORT_MD, render_markdown(report))
        plot(report["aggregate"], out / PLOT_PNG)


def warm_up(harness: Harness) -> None:
    """One small run of each mode, so the first question's timings carry no first-call cost."""
    passage = {"title": "Warm-up", "text": "A short passage to warm up every prefill path. " * 4}
    pkv = harness.prepare({"question": "Is this warm?", "ctxs": [passage, passage]})
    for mode in harness.modes:
        harness.timed(mode, pkv, seed=0)
