"""One process of the two-process disk tier test: puts, gets and range reads on a shared directory.

    python tests/store/disk_worker.py ROOT CAP SEED OPS SYNC_DIR

Every value is `key | writer | op | random bytes | sha256 of what precedes`, so a read that mixed
two writes, or read half of one, fails its check. Checks after every put that the directory's
byte total (shared by both processes) is within the cap. Starts when both workers are ready and,
when done, waits for the other, then prints its view of the tier's stats and what it saw, as JSON.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from store import DiskTier  # noqa: E402

KEYS = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(24)]  # shared by both workers


def make_value(rng: random.Random, key: str, writer: int, op: int) -> bytes:
    body = key.encode() + writer.to_bytes(2, "little") + op.to_bytes(4, "little") + rng.randbytes(
        rng.randrange(4_000, 40_000))
    return body + hashlib.sha256(body).digest()


def check_value(key: str, data: bytes) -> None:
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest or not body.startswith(key.encode()):
        raise AssertionError(f"torn or foreign value under {key[:12]} ({len(data)} bytes)")


def barrier(sync_dir: str, name: str, seed: int) -> None:
    """Wait until both workers reached `name` (a file per worker in `sync_dir`)."""
    Path(sync_dir, f"{name}-{seed}").touch()
    deadline = time.monotonic() + 120
    while len(list(Path(sync_dir).glob(f"{name}-*"))) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other worker never reached {name}")
        time.sleep(0.005)


def main() -> None:
    root, cap, seed, ops, sync_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    tier = DiskTier(root, cap)
    rng = random.Random(seed)
    seen = {"puts": 0, "hits": 0, "range_hits": 0, "max_bytes": 0}
    barrier(sync_dir, "ready", seed)
    seen["start"] = time.time()
    for op in range(ops):
        key = rng.choice(KEYS)
        draw = rng.random()
        if draw < 0.45:
            tier.put_bytes(key, make_value(rng, key, seed, op))
            seen["puts"] += 1
            nbytes = tier.stats()["bytes"]
            seen["max_bytes"] = max(seen["max_bytes"], nbytes)
            if nbytes > cap:
                raise AssertionError(f"{nbytes} bytes on a {cap}-byte cap")
        elif draw < 0.8:
            if (data := tier.get_bytes(key)) is not None:
                check_value(key, data)
                seen["hits"] += 1
        elif (reader := tier.reader(key)) is not None:
            head = reader.read(0, 64)  # read it in pieces through one handle, as a layered read does
            rest = reader.read(64, 1 << 20)
            reader.close()
            check_value(key, head + rest)
            seen["range_hits"] += 1
    seen["end"] = time.time()
    barrier(sync_dir, "done", seed)
    print(json.dumps({"stats": tier.stats(), "seen": seen}))


if __name__ == "__main__":
    main()
