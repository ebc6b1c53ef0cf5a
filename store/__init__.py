"""Tiered store of precomputed chunk KV caches (ChunkKV), keyed by model, context and tokens.

Lookups go gpu -> memory -> disk -> Redis and promote hits. The gpu and memory tiers hold
tensors in the model's dtype (a hit is no copy, no decode); puts encode once for the byte tiers
(codec native, fp16, or int8 at about half fp16's bytes), write disk at once and Redis in the
background. Every byte-tier entry is checked (magic, version, lengths, xxh3-128 per layer and
over the header, model fingerprint, key) on the way out; a bad one is deleted and reported as a
miss. An entry can also be read one layer at a time (`open(key)` -> LayeredEntry or
ResidentEntry, `entry.layer(i, device, dtype)`), its layers read ahead on a small pool, for a
loader that overlaps loading with compute. The disk tier may be shared by several processes.
The store knows nothing about models beyond a fingerprint and a device.

Exports:
    TieredStore, build_store, KVStore   the store, its factory from StoreSettings, its interface
    StoreSettings                       this package's settings
    LayeredEntry, ResidentEntry         an entry opened for per-layer reads (byte tier / tensor tier)
    LayerReadError                      a layer that failed
    StoreClosedError                    the store was used after close()
    MemoryTier                          the tensor tiers ("memory", "gpu": ChunkKVs on a device)
    DiskTier, RedisTier, BytesTier      the byte tiers (get/put/delete/contains/keys/stats on bytes)
    kv_key, validate_key                keys: sha256 hex of (fingerprint, context hash, token ids)
    encode, decode, read_header         the entry format
    bytes_per_token, CODECS, get_codec  codec sizes; "native", "fp16", "int8"; the Codec objects
    CorruptEntryError, KVMismatchError  what decode raises for damaged / another model's entries
    OldFormatError                      ... and for entries of another format version (a CorruptEntryError)
"""
from common.chunk_kv import KVMismatchError
from store.disk import DiskTier
from store.keys import kv_key, validate_key
from store.layered import LayeredEntry, LayerReadError, ResidentEntry
from store.memory import BytesTier, MemoryTier
from store.redis_tier import RedisTier
from store.serialize import (CODECS, CorruptEntryError, OldFormatError, bytes_per_token, decode, encode, get_codec,
                             read_header)
from store.settings import StoreSettings
from store.tiered import KVStore, StoreClosedError, TieredStore, build_store

__all__ = [
    "BytesTier", "CODECS", "CorruptEntryError", "DiskTier", "KVMismatchError", "KVStore", "LayerReadError", "LayeredEntry",
    "MemoryTier", "OldFormatError", "RedisTier", "ResidentEntry", "StoreClosedError", "StoreSettings",
    "TieredStore", "build_store", "bytes_per_token", "decode", "encode", "get_codec", "kv_key", "read_header",
    "validate_key",
]
