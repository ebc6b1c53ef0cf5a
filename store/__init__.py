"""Tiered store of precomputed chunk KV caches (ChunkKV), keyed by model, context and tokens.

Lookups go memory -> disk -> Redis and promote hits; puts encode once (fp16, or int8 at about
half the bytes), write memory and disk at once and Redis in the background. Every entry is
checked (magic, version, lengths, sha256 per layer and over the header, model fingerprint, key)
on the way out; a bad one is deleted and reported as a miss. An entry can also be read one layer
at a time (`open(key)` -> LayeredEntry, `entry.layer(i)`), for a loader that overlaps loading
with compute. The disk tier may be shared by several processes. The store knows nothing about
models beyond a fingerprint.

Exports:
    TieredStore, build_store, KVStore   the store, its factory from StoreSettings, its interface
    StoreSettings                       this package's settings
    LayeredEntry, LayerReadError        an entry opened for per-layer reads; a layer that failed
    StoreClosedError                    the store was used after close()
    MemoryTier, DiskTier, RedisTier     the tiers (get/put/delete/contains/keys/stats on bytes)
    kv_key, validate_key                keys: sha256 hex of (fingerprint, context hash, token ids)
    encode, decode, read_header         the entry format
    bytes_per_token, CODECS             codec sizes; "fp16" and "int8"
    CorruptEntryError, KVMismatchError  what decode raises for damaged / another model's entries
    OldFormatError                      ... and for entries of another format version (a CorruptEntryError)
"""
from common.chunk_kv import KVMismatchError
from store.disk import DiskTier
from store.keys import kv_key, validate_key
from store.layered import LayeredEntry, LayerReadError
from store.memory import MemoryTier
from store.redis_tier import RedisTier
from store.serialize import CODECS, CorruptEntryError, OldFormatError, bytes_per_token, decode, encode, read_header
from store.settings import StoreSettings
from store.tiered import KVStore, StoreClosedError, TieredStore, build_store

__all__ = [
    "CODECS", "CorruptEntryError", "DiskTier", "KVMismatchError", "KVStore", "LayerReadError", "LayeredEntry",
    "MemoryTier", "OldFormatError", "RedisTier", "StoreClosedError", "StoreSettings", "TieredStore", "build_store",
    "bytes_per_token", "decode", "encode", "kv_key", "read_header", "validate_key",
]
