"""Step 2, flags: the kill switch (``answer.mode``), decided before anything is spent.

``unavailable`` is an honest 503 with ``Retry-After``. ``degraded`` answers without a model at
once, from a cached answer (stale or fresh) or cited document excerpts, before the request takes
a rate-limit token, a budget reservation or an admission slot; with neither to offer it is the
same 503.
"""

from __future__ import annotations

from tidegate.errors import Unavailable
from tidegate.gateway.pipeline.degrade import answer_degraded
from tidegate.gateway.pipeline.request import Request
from tidegate.gateway.pipeline.steps import Outcome
from tidegate.policy.flags import KillSwitchMode, check_answering

__all__ = ["kill_switch"]


def kill_switch(request: Request) -> Outcome:
    """Refuse (``unavailable``), answer without a model (``degraded``), or go on (``full``)."""
    if check_answering(request.rt.flags) is not KillSwitchMode.DEGRADED:
        return False
    return _switched_off(request)


async def _switched_off(request: Request) -> bool:
    switched_off = Unavailable(
        "models are switched off (answer.mode=degraded)", policy="flags", retry_after=30.0
    )
    if await answer_degraded(request, switched_off):
        return True
    raise switched_off
