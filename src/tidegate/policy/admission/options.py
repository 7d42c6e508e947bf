"""How an admission controller bounds, admits and orders work: its frozen options, checked once."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal, TypeAlias

__all__ = ["AdmissionMode", "AdmissionOptions", "DequeueOrder"]

AdmissionMode: TypeAlias = Literal["queue_cap", "deadline"]
DequeueOrder: TypeAlias = Literal["fifo", "strict", "weighted"]

_MODES: Final[frozenset[str]] = frozenset({"queue_cap", "deadline"})
_ORDERS: Final[frozenset[str]] = frozenset({"fifo", "strict", "weighted"})


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionOptions:
    """How the admission controller bounds, admits and orders work.

    ``classes`` are priority classes, highest first. ``queue_cap`` bounds each class's waiting
    tickets in every mode (an int applies to every class; ``None`` means unbounded). ``mode``
    ``"deadline"`` additionally refuses a request whose deadline the work ahead of it would miss.
    ``service_rate`` is completions per second for the whole controller; ``None`` measures it as
    ``slots / mean service time``, the mean being an exponentially weighted moving average of
    finished tickets' service times that starts at ``initial_service_time``.
    ``conditional_priority`` is a threshold on the offered load factor (offered requests per
    second, smoothed over ``overload_window`` seconds, divided by the service rate): above it the
    configured priority applies; at or below it admission is class-blind and dequeue is FIFO.
    """

    #: Priority classes, highest first.
    classes: tuple[str, ...] = ("critical", "standard", "batch")
    #: Global in-flight slots: tickets started and not yet finished or cancelled.
    slots: int = 64
    #: Waiting tickets allowed per class: one int for all, a mapping per class, ``None`` unbounded.
    queue_cap: Mapping[str, int | None] | int | None = 256
    #: Started tickets one tenant may hold; further tickets of the tenant wait parked.
    tenant_max_in_flight: int | None = None
    #: Waiting tickets one tenant may hold; more are refused with ``BulkheadFull``.
    tenant_max_waiting: int | None = None
    #: ``"queue_cap"``: caps only. ``"deadline"``: caps plus the deadline admission test.
    mode: AdmissionMode = "deadline"
    #: Completions per second for the whole controller; ``None`` measures it from completions.
    service_rate: float | None = None
    #: Starting guess for the measured mean service time, in seconds.
    initial_service_time: float = 1.0
    #: Weight of each new service time in the moving average, in (0, 1].
    service_time_smoothing: float = 0.1
    #: Drop tickets whose deadline has passed when ``start()`` meets them.
    drop_expired_at_dequeue: bool = True
    #: Count only the work that will be served first when judging a request (class-aware).
    priority_at_admission: bool = True
    #: Order of service across classes: ``"fifo"``, ``"strict"`` priority, or ``"weighted"`` share.
    dequeue: DequeueOrder = "strict"
    #: Per-class weights for ``"weighted"``; ``None`` means halving per class (4, 2, 1 for three).
    weights: Mapping[str, float] | None = None
    #: Offered load factor above which priority applies; ``None`` means always.
    conditional_priority: float | None = None
    #: Smoothing time constant of the offered-rate estimate, in seconds.
    overload_window: float = 10.0

    def __post_init__(self) -> None:
        # Checked field by field in declaration order, so the first bad field is the one named.
        classes = _checked_classes(self.classes)
        object.__setattr__(self, "classes", classes)
        _check_count("slots", self.slots, minimum=1)
        object.__setattr__(self, "queue_cap", _checked_caps(self.queue_cap, classes))
        _check_tenant_limits(self.tenant_max_in_flight, self.tenant_max_waiting)
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}, got {self.mode!r}")
        _check_service(self.service_rate, self.initial_service_time, self.service_time_smoothing)
        if self.dequeue not in _ORDERS:
            raise ValueError(f"dequeue must be one of {sorted(_ORDERS)}, got {self.dequeue!r}")
        object.__setattr__(self, "weights", _checked_weights(self.weights, classes))
        _check_overload(self.conditional_priority, self.dequeue, self.overload_window)

    def cap_for(self, klass: str) -> int | None:
        """The waiting cap of ``klass`` (``None``: unbounded)."""
        if isinstance(self.queue_cap, Mapping):
            return self.queue_cap[klass]
        return self.queue_cap

    def weight_for(self, klass: str) -> float:
        """The share weight of ``klass`` under ``dequeue="weighted"``."""
        if self.weights is not None:
            return float(self.weights[klass])
        return float(2 ** (len(self.classes) - 1 - self.classes.index(klass)))


def _check_count(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_positive(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _checked_classes(given: tuple[str, ...]) -> tuple[str, ...]:
    classes = tuple(given)
    if not classes:
        raise ValueError("classes must name at least one class")
    for klass in classes:
        if not isinstance(klass, str) or not klass:
            raise ValueError(f"classes must be non-empty strings, got {klass!r}")
    if len(set(classes)) != len(classes):
        raise ValueError(f"classes must be distinct, got {classes!r}")
    return classes


def _checked_caps(
    queue_cap: Mapping[str, int | None] | int | None, classes: tuple[str, ...]
) -> Mapping[str, int | None] | int | None:
    """The caps as given, a mapping copied (so the caller's dict cannot change them later)."""
    if not isinstance(queue_cap, Mapping):
        if queue_cap is not None:
            _check_count("queue_cap", queue_cap, minimum=0)
        return queue_cap
    caps = dict(queue_cap)
    if set(caps) != set(classes):
        raise ValueError(
            f"queue_cap must name exactly the classes {classes!r}, got {sorted(caps)!r}"
        )
    for klass, cap in caps.items():
        if cap is not None:
            _check_count(f"queue_cap[{klass!r}]", cap, minimum=0)
    return MappingProxyType(caps)


def _check_tenant_limits(max_in_flight: int | None, max_waiting: int | None) -> None:
    if max_in_flight is not None:
        _check_count("tenant_max_in_flight", max_in_flight, minimum=1)
    if max_waiting is not None:
        _check_count("tenant_max_waiting", max_waiting, minimum=0)


def _check_service(rate: float | None, initial_time: float, smoothing: float) -> None:
    if rate is not None:
        _check_positive("service_rate", rate)
    _check_positive("initial_service_time", initial_time)
    _check_positive("service_time_smoothing", smoothing)
    if smoothing > 1:
        raise ValueError(f"service_time_smoothing must be in (0, 1], got {smoothing!r}")


def _checked_weights(
    weights: Mapping[str, float] | None, classes: tuple[str, ...]
) -> Mapping[str, float] | None:
    """The weights copied, as the caps are; ``None`` stays ``None`` (halving per class)."""
    if weights is None:
        return None
    copied = dict(weights)
    if set(copied) != set(classes):
        raise ValueError(
            f"weights must name exactly the classes {classes!r}, got {sorted(copied)!r}"
        )
    for klass, weight in copied.items():
        _check_positive(f"weights[{klass!r}]", weight)
    return MappingProxyType(copied)


def _check_overload(threshold: float | None, dequeue: DequeueOrder, window: float) -> None:
    if threshold is not None:
        _check_positive("conditional_priority", threshold)
        if dequeue == "fifo":
            raise ValueError(
                "conditional_priority needs dequeue 'strict' or 'weighted': "
                "with 'fifo' there is no priority to make conditional"
            )
    _check_positive("overload_window", window)
