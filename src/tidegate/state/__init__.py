"""Durable shared state behind small protocols, chosen by URL."""

from tidegate.state.base import (
    AuditRecord,
    BucketStore,
    CacheEntry,
    CacheStore,
    Claim,
    ClaimOutcome,
    FlagStore,
    IdempotencyStore,
    QuotaStore,
    StoredResponse,
)

__all__ = [
    "AuditRecord",
    "BucketStore",
    "CacheEntry",
    "CacheStore",
    "Claim",
    "ClaimOutcome",
    "FlagStore",
    "IdempotencyStore",
    "QuotaStore",
    "StoredResponse",
]
