"""What an admission controller knows at one instant, for metrics, the admin API and the lab."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["AdmissionSnapshot"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionSnapshot:
    """Counters (since construction) and gauges (now) of one controller, keyed by class."""

    at: float
    in_flight: int
    depth: Mapping[str, int]
    admitted: Mapping[str, int]
    started: Mapping[str, int]
    finished: Mapping[str, int]
    cancelled: Mapping[str, int]
    expired: Mapping[str, int]
    refused: Mapping[str, Mapping[str, int]]
    service_rate: float
    mean_service_time: float
    offered_rate: float
    load: float
    priority_active: bool
