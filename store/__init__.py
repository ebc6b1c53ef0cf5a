"""Tiered store of precomputed chunk KV caches (ChunkKV), keyed by model, context and tokens.

Lookups go gpu -> memory -> disk -> Redis and promote hits. Every tier is one `Tier` over one `Entry`
(store/base.py): the gpu and memory tiers keep tensors in the model's dtype (a hit is no copy, no
decode), disk and Redis keep the encoded entry (store/codecs.py: native, fp16, int8, int4 or the
entropy-coded cachegen), encoded once per put; Redis is written by its own background thread. Every byte-tier entry is
checked (magic, version, lengths, xxh3-128 per layer and over the header, model fingerprint, key) on
the way out; a bad one is deleted and reported as a miss. An entry can also be read one layer at a
time (`open(key)` -> LayeredEntry or ResidentEntry, `entry.layer(i, device, dtype)`), its layers read
ahead on a small pool, for a loader that overlaps loading with compute. The disk tier may be shared by
several processes. The store knows nothing about models beyond a fingerprint and the Placement it is
handed (common.placement: the device the model's KV lives on, whether host buffers are pinned).
Entries a client asked to keep are held under leases (store/leases.py: its docstring is the API for the
request side), kept in a ledger the app hands in (the metadata database) and honoured by every tier's LRU.

Exports:
    TieredStore, build_store, KVStore   the store (store/tiered.py), its factory (store/factory.py), its interface
    StoreSettings                       this package's settings
    Tier, Entry                         what every tier is, and the entry every tier takes and gives (store/base.py)
    MemoryTier                          the tensor tiers ("memory", "gpu": ChunkKVs on a device)
    ByteTier, DiskTier, RedisTier, BytesTier   the tiers of encoded entries (BytesTier: in-process, for tests)
    LayeredEntry, ResidentEntry         an entry opened for per-layer reads (byte tier / tensor tier)
    LayerReadError                      a layer that failed
    StoreClosedError                    the store was used after close()
    Leases, LeaseLedger, LeaseResult    leases: the store's view of them, where they live, what lease() did
    family_id                           the id a lease family (a client's text) is known by
    kv_key, validate_key                keys: sha256 hex of (fingerprint, context hash, token ids)
    encode, decode, read_header         the entry format
    bytes_per_token, CODECS, get_codec  codec sizes; "native", "fp16", "int8", "int4"; the Codec objects
    CODEC_NAMES                         ... and "cachegen", which codes with fitted tables:
    CacheGenTables, register_tables     its probability model (fit, to_bytes/from_bytes) and its codec
    CorruptEntryError, KVMismatchError  what decode raises for damaged / another model's entries
    OldFormatError                      ... and for entries of another format version (a CorruptEntryError)
"""
from common.chunk_kv import KVMismatchError
from store.base import Entry, Tier
from store.byte_tier import ByteTier
from store.codecs import CODEC_NAMES, CacheGenTables, register_tables
from store.disk import DiskTier
from store.factory import build_store
from store.keys import kv_key, validate_key
from store.layered import LayeredEntry, LayerReadError, ResidentEntry
from store.leases import LeaseLedger, LeaseResult, Leases, family_id
from store.memory import BytesTier, MemoryTier
from store.redis_tier import RedisTier
from store.serialize import (
                             CODECS,
                             CorruptEntryError,
                             OldFormatError,
                             bytes_per_token,
                             decode,
                             encode,
                             get_codec,
                             read_header,
)
from store.settings import StoreSettings
from store.tiered import KVStore, StoreClosedError, TieredStore

__all__ = [
    "ByteTier", "BytesTier", "CODECS", "CODEC_NAMES", "CacheGenTables", "CorruptEntryError", "DiskTier", "Entry",
    "KVMismatchError", "KVStore", "LayerReadError", "LayeredEntry", "LeaseLedger", "LeaseResult", "Leases",
    "MemoryTier", "OldFormatError", "RedisTier", "ResidentEntry", "StoreClosedError", "StoreSettings", "Tier",
    "TieredStore", "build_store", "bytes_per_token", "decode", "encode", "family_id", "get_codec", "kv_key",
    "read_header", "register_tables", "validate_key",
]
