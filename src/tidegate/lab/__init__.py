"""The virtual-time lab: a discrete-event engine that drives the policy objects, and the queueing
theory used to check it."""

__all__: list[str] = []
