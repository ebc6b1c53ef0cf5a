"""Where a model's cachegen tables live: beside its store, shared, so every process and replica codes with
the same ones.

A cachegen entry names its tables by content hash (store.codecs.CacheGenTables.id), never holds them. The
tables of one (model, bins) pair are kept under one name, in a file under the store's directory (every
process on the host) and, with Redis, under a key beside its entries (every replica). The first writer
wins; everyone else adopts what is there, so replicas agree even when their own fits would differ (another
device's float rounding). The tables are fitted deterministically from a fixed sample (app/cachegen.py),
so a lost copy is fitted again the same way. Safetensors, never pickle; damaged tables are refitted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import redis

from store.codecs import BinPlan, CacheGenTables

log = logging.getLogger("ragblend.store")


class TablesShelf:
    """Named blobs in a directory and, optionally, in Redis (`prefix` + "cachegen-tables:" + name, no TTL:
    the tables must outlive the entries coded with them). First writer wins in both."""

    def __init__(self, directory: Path, redis_url: str | None = None, password: str | None = None,
                 prefix: str = "ragblend:", timeout_s: float = 5.0) -> None:
        self.directory = Path(directory)
        self._redis = None if redis_url is None else redis.Redis.from_url(
            redis_url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._prefix = f"{prefix}cachegen-tables:"

    def get(self, name: str) -> bytes | None:
        """The blob under `name`: Redis's (shared widest) if it has one, else the file's."""
        data = self._on_redis(lambda r: r.get(self._prefix + name))
        if data is not None:
            return data
        path = self.directory / name
        return path.read_bytes() if path.exists() else None

    def _on_redis(self, call):
        """`call(client)`, or None without Redis or when it fails: Redis is an optimisation, never a
        dependency (a replica that cannot reach it fits and keeps its own tables, so its entries in Redis
        are misses for the others until it can)."""
        if self._redis is None:
            return None
        try:
            return call(self._redis)
        except redis.RedisError as exc:
            log.warning("store: cachegen tables not shared through Redis: %s", exc)
            return None

    def put_if_absent(self, name: str, data: bytes) -> bytes:
        """Store `data` under `name` where nothing is yet; the blob that is there now (ours or an earlier
        writer's). With Redis, Redis decides and the file follows it; without, the first file stays."""
        shared = self._on_redis(lambda r: r.set(self._prefix + name, data, nx=True) is not None
                                and r.get(self._prefix + name))
        if shared:
            return self._write(name, shared, replace=True)
        return self._write(name, data, replace=False)

    def _write(self, name: str, data: bytes, replace: bool) -> bytes:
        """Write the file whole (a temporary file, then linked or renamed into place); what it holds after."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / name
        with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as tmp:
            tmp.write(data)
        try:
            if replace:
                os.replace(tmp.name, path)
            else:
                os.link(tmp.name, path)  # fails if the file exists: the first writer's stays
            return data
        except FileExistsError:
            return path.read_bytes()
        finally:
            Path(tmp.name).unlink(missing_ok=True)

    def delete(self, name: str) -> None:
        self._on_redis(lambda r: r.delete(self._prefix + name))
        (self.directory / name).unlink(missing_ok=True)

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()


def tables_name(fingerprint: str, plan: BinPlan) -> str:
    """The shelf name of the tables of one model and bin plan."""
    return hashlib.sha256(json.dumps([fingerprint, plan.as_dict()]).encode()).hexdigest() + ".safetensors"


def shared_tables(shelf: TablesShelf, fingerprint: str, plan: BinPlan,
                  fit: Callable[[], CacheGenTables]) -> CacheGenTables:
    """The tables of (`fingerprint`, `plan`) from the shelf; fitted with `fit` and shelved when there are none
    (or they are damaged: refitted). Whoever shelved first wins: what comes back may be another's fit."""
    name = tables_name(fingerprint, plan)
    data = shelf.get(name)
    if data is not None:
        try:
            tables = CacheGenTables.from_bytes(data)
            if (tables.fingerprint, tables.plan) == (fingerprint, plan):
                return tables
            raise ValueError("tables of another model or bins under this name")
        except ValueError as exc:
            log.warning("store: cachegen tables %s unusable (%s): fitted again", name[:16], exc)
            shelf.delete(name)
    fitted = fit()
    if (fitted.fingerprint, fitted.plan) != (fingerprint, plan):
        raise ValueError(f"fitted tables are for {fitted.fingerprint!r} with {fitted.plan}, not this model's bins")
    return CacheGenTables.from_bytes(shelf.put_if_absent(name, fitted.to_bytes()))
