"""`python -m app.cli.prepare`: convert the embedded model once and report how fast the cache loads."""
from __future__ import annotations

import time

from app.components import Components
from app.config import load_settings


def main() -> None:
    settings = load_settings()
    start = time.perf_counter()
    loaded = Components(settings).llm
    print(f"model {loaded.name} ready in {time.perf_counter() - start:.1f}s "
          f"(load from cache {loaded.load_s:.2f}s, fingerprint {loaded.fingerprint})")


if __name__ == "__main__":
    main()
