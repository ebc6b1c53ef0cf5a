"""Documents of other shapes than prose, generated deterministically (no downloads), for bench/byo_rag.py: text with
little entropy, as a client pastes it — JSON tool results, markdown and CSV tables, source code, log lines and
templated prose (records written from one template). Each `document(shape, rng)` is one multi-line document of
~150-250 tokens; a question's documents share the shape, never the values."""
from __future__ import annotations

import json
import random

SHAPES = ("json", "markdown", "csv", "code", "logs", "templated")
FIRST = ["Ada", "Bruno", "Chiara", "Dmitri", "Elif", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena", "Mateo",
         "Nia", "Oskar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Ximena", "Yusuf", "Zoe"]
LAST = ["Abbott", "Brandt", "Castillo", "Dubois", "Eriksen", "Fontaine", "Grieve", "Haddad", "Ionescu", "Jansen",
        "Kowalski", "Lindqvist", "Moreau", "Nakamura", "Okafor", "Petrov", "Quist", "Rossi", "Schmidt", "Tanaka"]
CITIES = ["Lisbon", "Oslo", "Quito", "Hanoi", "Accra", "Perth", "Tartu", "Cusco", "Malmo", "Ghent", "Split", "Porto",
          "Kyoto", "Dakar", "Lyon", "Bergen", "Hobart", "Tunis", "Riga", "Izmir"]
ITEMS = ["kettle", "lamp", "drill", "backpack", "monitor", "bicycle", "blender", "tent", "router", "camera", "chair",
         "speaker", "heater", "scanner", "printer", "jacket", "stove", "keyboard", "mixer", "sander"]
ADJECTIVES = ["compact", "durable", "lightweight", "quiet", "portable", "waterproof", "modular", "refurbished"]
SERVICES = ["auth", "billing", "search", "gateway", "orders", "inventory", "mailer", "scheduler"]
LEVELS = ["INFO", "INFO", "INFO", "WARN", "ERROR", "DEBUG"]
PATHS = ["/api/v1/orders", "/api/v1/users", "/api/v1/search", "/healthz", "/api/v1/cart", "/api/v1/payments"]
VERBS = ["load", "parse", "fetch", "store", "check", "render", "update", "merge"]
NOUNS = ["invoice", "profile", "session", "order", "report", "ticket", "shipment", "account"]


def document(shape: str, rng: random.Random) -> str:
    return _MAKERS[shape](rng)


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST)} {rng.choice(LAST)}"


def _record(rng: random.Random) -> dict:
    return {"id": rng.randrange(10_000, 99_999), "name": _person(rng), "city": rng.choice(CITIES),
            "item": rng.choice(ITEMS), "quantity": rng.randrange(1, 20), "price": round(rng.uniform(5, 900), 2),
            "status": rng.choice(["shipped", "pending", "returned", "delivered"])}


def _json(rng: random.Random) -> str:
    """A tool result: JSON records on one line, as an API returns them."""
    return json.dumps({"results": [_record(rng) for _ in range(rng.randrange(3, 5))], "page": rng.randrange(1, 9)})


def _markdown(rng: random.Random) -> str:
    rows = [_record(rng) for _ in range(rng.randrange(7, 10))]
    lines = ["| id | name | city | item | qty | price |", "|---|---|---|---|---:|---:|"]
    lines += [f"| {r['id']} | {r['name']} | {r['city']} | {r['item']} | {r['quantity']} | {r['price']} |" for r in rows]
    return "\n".join(lines)


def _csv(rng: random.Random) -> str:
    rows = [_record(rng) for _ in range(rng.randrange(8, 12))]
    return "\n".join(["id,name,city,item,quantity,price,status"] + [
        f"{r['id']},{r['name']},{r['city']},{r['item']},{r['quantity']},{r['price']},{r['status']}" for r in rows])


def _code(rng: random.Random) -> str:
    """Python functions written from one template (the boilerplate of a generated client)."""
    out = []
    for _ in range(rng.randrange(3, 5)):
        verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
        field, limit = rng.choice(["id", "owner", "created_at", "total"]), rng.randrange(2, 50)
        out.append(f"def {verb}_{noun}(client, {noun}_id: int, retries: int = {rng.randrange(1, 6)}):\n"
                   f"    \"\"\"{verb.capitalize()} one {noun} by its id.\"\"\"\n"
                   f"    response = client.get(f\"/{noun}s/{{{noun}_id}}\", timeout={rng.randrange(5, 60)})\n"
                   f"    if response.status_code != 200:\n"
                   f"        raise RuntimeError(f\"{noun} {{{noun}_id}}: {{response.status_code}}\")\n"
                   f"    return response.json()[\"{field}\"][:{limit}]\n")
    return "\n".join(out).rstrip("\n")


def _logs(rng: random.Random) -> str:
    start = rng.randrange(0, 86_000)
    lines = []
    for k in range(rng.randrange(8, 11)):
        t = start + 3 * k + rng.randrange(3)
        lines.append(f"2026-12-0{rng.randrange(1, 8)}T{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d}Z "
                     f"{rng.choice(LEVELS)} [{rng.choice(SERVICES)}] {rng.choice(['GET', 'POST'])} "
                     f"{rng.choice(PATHS)} status={rng.choice([200, 200, 201, 404, 500])} "
                     f"latency_ms={rng.randrange(2, 900)} request_id={rng.getrandbits(32):08x}")
    return "\n".join(lines)


def _templated(rng: random.Random) -> str:
    """Product records written from one template, one paragraph: the same sentences, other values."""
    out = []
    for _ in range(rng.randrange(3, 5)):
        r = _record(rng)
        out.append(f"The {rng.choice(ADJECTIVES)} {r['item']} (order {r['id']}) was ordered by {r['name']} from "
                   f"{r['city']}. It costs {r['price']} euros and ships within {rng.randrange(1, 9)} days. "
                   f"Customers rate it {rng.randrange(1, 6)} out of 5. Status: {r['status']}.")
    return " ".join(out)


_MAKERS = {"json": _json, "markdown": _markdown, "csv": _csv, "code": _code, "logs": _logs, "templated": _templated}
