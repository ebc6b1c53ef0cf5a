"""Grammar bounds: a schema whose grammar would compile for minutes neither stalls the server nor another client.

    python bench/grammar_bounds.py [--repeat 3] [--url http://127.0.0.1:8000]

Starts one `ragblend serve` on a temporary data dir, or uses the server at `--url` (requests run with
`retrieval: false`). Measures, client-side:
- `refused_up_front_s`: the issue's N = 21 body (an allOf of 21 string patterns), refused before any compile;
- `compile_limit_s`: the same patterns each wrapped in a one-branch anyOf (the up-front count does not follow
  anyOf, so the compile runs, in a child process, until `limits.grammar_compile_s` kills it), to its 400;
- `resend_ms`: each sent again (refused from the failure remembered by its hash);
- a short streamed chat's TTFT alone (the median of `--repeat`) and sent 0.2 s after the limited bomb (the
  median of `--repeat`, each with a fresh bomb: another letter set, so not the remembered failure), and their ratio.
Prints JSON on stdout (with the commit and load average), progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.serve import served  # noqa: E402
from common import git_commit  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def log(message: str) -> None:
    print(f"[bench/grammar_bounds] {message}", file=sys.stderr, flush=True)


def bomb(n: int, wrap: bool, offset: int = 0) -> dict:
    """A string that must match n patterns `.*x.*` at once (wrapped: each in a one-branch anyOf)."""
    parts = [{"type": "string", "pattern": f".*{LETTERS[(offset + i) % 26]}{i}.*"} for i in range(n)]
    return {"allOf": [{"anyOf": [p]} for p in parts] if wrap else parts}


def refused(url: str, schema: dict) -> tuple[float, str]:
    """Seconds to the answer of the issue's body with `schema`, and its error message (a 400 expected)."""
    body = {"messages": [{"role": "user", "content": "x"}], "retrieval": False, "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    if response.status_code != 400:
        raise SystemExit(f"expected a 400, got {response.status_code}: {response.text[:300]}")
    return elapsed, response.json()["error"]["message"]


def ttft(url: str) -> float:
    body = {"messages": [{"role": "user", "content": "Who keeps the lamp?"}], "max_tokens": 4, "retrieval": False,
            "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                choices = json.loads(line[5:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    return time.perf_counter() - start
    raise SystemExit("no content in the short answer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--patterns", type=int, default=21)
    parser.add_argument("--url", help="a running server (default: one started here)")
    args = parser.parse_args()
    with nullcontext(args.url) if args.url else served() as url:
        ttft(url)  # warm-up
        alone = [ttft(url) for _ in range(args.repeat)]
        log(f"alone: {alone}")
        up_front, message = refused(url, bomb(args.patterns, wrap=False))
        resend_up_front, _ = refused(url, bomb(args.patterns, wrap=False))
        log(f"up front: {up_front:.3f} s ({message})")
        limited, during = [], []
        for i in range(args.repeat):
            result: dict = {}
            schema = bomb(args.patterns, wrap=True, offset=i)
            thread = threading.Thread(target=lambda: result.update(zip(("s", "message"), refused(url, schema))))
            thread.start()
            time.sleep(0.2)
            during.append(ttft(url))
            thread.join()
            limited.append(result["s"])
            log(f"limited: {result}; short during: {during[-1]:.3f} s")
        resend_limited, _ = refused(url, bomb(args.patterns, wrap=True, offset=0))
    median = statistics.median
    print(json.dumps({"commit": git_commit(), "loadavg": os.getloadavg(), "patterns": args.patterns,
                      "refused_up_front_s": round(up_front, 3), "resend_up_front_ms": round(resend_up_front * 1e3, 1),
                      "compile_limit_s": [round(s, 3) for s in limited], "limit_message": result["message"],
                      "resend_limited_ms": round(resend_limited * 1e3, 1),
                      "short_ttft_alone_s": round(median(alone), 3),
                      "short_ttft_during_bomb_s": round(median(during), 3),
                      "ttft_ratio": round(median(during) / median(alone), 2)}, indent=1))


if __name__ == "__main__":
    main()
