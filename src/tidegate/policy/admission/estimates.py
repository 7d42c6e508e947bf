"""The admission controller's arithmetic, pure: how much work is served before a new arrival,
and whether a request can still meet its deadline after it."""

from __future__ import annotations

from collections.abc import Sequence

from tidegate.policy.admission.options import DequeueOrder

__all__ = ["deadline_admits", "work_ahead"]


def work_ahead(
    depths: Sequence[int], index: int, *, order: DequeueOrder, weights: Sequence[float] = ()
) -> float:
    """How many waiting entries will be served before a new arrival of class ``index``.

    ``"fifo"``: all of them. ``"strict"``: those of the same or a higher class. ``"weighted"``:
    its own class, plus what each other class is served while the new arrival's class works
    through its backlog and the arrival itself, in proportion to the weights, capped at that
    class's backlog. Later arrivals of higher classes are not foreseen.
    """
    if order == "fifo":
        return float(sum(depths))
    if order == "strict":
        return float(sum(depths[: index + 1]))
    own = depths[index]
    rounds = (own + 1) / weights[index]
    total = float(own)
    for other, depth in enumerate(depths):
        if other != index:
            total += min(float(depth), rounds * weights[other])
    return total


def deadline_admits(
    *, now: float, estimated_wait: float, mean_service_time: float, deadline_at: float | None
) -> bool:
    """Whether a request can start after the estimated wait and finish by its deadline."""
    return deadline_at is None or now + estimated_wait + mean_service_time <= deadline_at
