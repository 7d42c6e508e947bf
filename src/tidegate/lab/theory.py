"""Closed-form queueing results that the virtual-time lab is checked against.

Notation: ``lam`` is the arrival rate (Poisson), ``mu`` the service rate of one server
(exponential service unless said otherwise), ``c`` the number of servers, ``a = lam / mu`` the
offered load in Erlangs. Times come out in the unit the rates were given in: rates per second give
waits in seconds.

* :func:`erlang_b`: the blocking probability of a loss system (M/M/c/c).
* :func:`erlang_c`: the probability that an arrival waits in M/M/c.
* :func:`mmc`: M/M/c utilisation, waits and queue lengths.
* :func:`mmck_blocking` and :func:`mmck`: M/M/c/K, ``K`` places in all, including those in service.
* :func:`erlang_a`: M/M/c+M, where a waiting customer abandons after an exponential patience.
* :func:`pollaczek_khinchine`: M/G/1 from the mean and variability of the service time.
* :func:`ekmck`: E_k/M/c/K (or E_k/M/c), the queue of one worker behind a round-robin
  dispatcher: a worker of ``k`` that receives every ``k``-th Poisson arrival sees Erlang-``k``
  gaps between its arrivals.
* :func:`gimcc_blocking`: the loss probability of GI/M/c/c from the Laplace transform of the
  gaps (Takacs), an independent check of :func:`ekmck` with no waiting room.

Everything is pure ``math`` but :func:`ekmck`, which solves its chain with numpy (below). Nothing computes ``a**c / c!``: Erlang B runs its recurrence, and a
birth-death chain is weighted relative to its most likely state, which gets weight 1, so no weight
can overflow for any ``c``; weights that underflow are below 1e-308 of the mode and cannot move a
result. Sums use :func:`math.fsum`. Chains longer than :data:`MAX_STATES` are refused.

Arguments are checked: rates and times must be positive and finite, ``c`` an ``int`` of at least 1,
``K`` an ``int`` of at least ``c``. A bad argument raises :class:`ValueError` naming it; so does an
arrival rate that an infinite queue cannot keep up with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EKMCK_MAX_STATES",
    "ERLANG_A_TOLERANCE",
    "MAX_STATES",
    "EkMcKResult",
    "ErlangAResult",
    "MMcKResult",
    "MMcResult",
    "PKResult",
    "ekmck",
    "erlang_a",
    "erlang_b",
    "erlang_c",
    "gimcc_blocking",
    "mmc",
    "mmck",
    "mmck_blocking",
    "pollaczek_khinchine",
]

MAX_STATES = 1_000_000
"""The most states a birth-death chain may have: a bound on memory and on time (about a second)."""

ERLANG_A_TOLERANCE = 1e-15
"""Default truncation tolerance of :func:`erlang_a`.

The infinite Erlang-A chain is cut at the first state past the mode where a geometric bound on the
probability mass beyond it, and on that mass's contribution to the queue length, are both at most
this fraction of what has been summed so far. Results are then exact to about this relative error.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class MMcResult:
    """Steady state of M/M/c.

    ``utilisation`` is the fraction of time a server is busy, ``p_wait`` the probability that an
    arrival finds every server busy (Erlang C). ``mean_wait`` is the mean time in queue over all
    arrivals (zero for those who do not wait), ``mean_response`` adds the service time.
    ``mean_queue_length`` counts waiting customers, ``mean_in_system`` adds those in service.
    """

    utilisation: float
    p_wait: float
    mean_wait: float
    mean_response: float
    mean_queue_length: float
    mean_in_system: float


@dataclass(frozen=True, slots=True, kw_only=True)
class MMcKResult:
    """Steady state of M/M/c/K.

    ``p_block`` is the probability that an arrival finds all ``K`` places taken and is turned
    away; ``throughput`` is the rate of admitted (and so of served) customers. ``mean_in_system``
    counts customers present, waiting or in service. ``mean_response`` and ``mean_wait`` are the
    mean time in the system and in the queue of an admitted customer.
    """

    p_block: float
    throughput: float
    mean_in_system: float
    mean_response: float
    mean_wait: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ErlangAResult:
    """Steady state of M/M/c+M (Erlang-A).

    ``p_abandon`` is the probability that an arrival gives up before service, ``p_wait`` the
    probability that it finds every server busy and has to wait. ``mean_wait`` is the mean time in
    queue over all arrivals, counting the time an abandoning customer waited before leaving and
    zero for those served at once. ``mean_queue_length`` counts waiting customers and
    ``throughput`` is the rate of customers served.
    """

    p_abandon: float
    p_wait: float
    mean_wait: float
    mean_queue_length: float
    throughput: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PKResult:
    """Steady state of M/G/1 by the Pollaczek-Khinchine formula.

    ``mean_wait`` is the mean time in queue, ``mean_response`` adds the mean service time, and
    ``mean_queue_length`` counts waiting customers.
    """

    mean_wait: float
    mean_response: float
    mean_queue_length: float


def _check_positive(name: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_count(name: str, value: int, minimum: int) -> None:
    # bool is an int subclass; True servers is a typo, not a count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def erlang_b(c: int, a: float) -> float:
    """The probability that an arrival to M/M/c/c finds all ``c`` servers busy and is lost.

    ``a`` is the offered load in Erlangs. Runs the recurrence ``B(0) = 1``,
    ``B(k) = a B(k-1) / (k + a B(k-1))``, which is stable for any ``c``.
    """
    _check_count("c", c, 1)
    _check_positive("a", a)
    blocking = 1.0
    for k in range(1, c + 1):
        carried = a * blocking
        blocking = carried / (k + carried)
    return blocking


def erlang_c(c: int, a: float) -> float:
    """The probability that an arrival to M/M/c has to wait; ``a`` must be below ``c``."""
    blocking = erlang_b(c, a)
    if a >= c:
        raise ValueError(f"a must be below c={c} for the queue to be stable, got {a!r}")
    return c * blocking / (c - a * (1.0 - blocking))


def mmc(lam: float, mu: float, c: int) -> MMcResult:
    """Steady state of M/M/c; ``lam`` must be below ``c * mu``."""
    _check_positive("lam", lam)
    _check_positive("mu", mu)
    _check_count("c", c, 1)
    a = lam / mu
    if a >= c:
        raise ValueError(f"lam must be below c * mu = {c * mu!r} for a stable queue, got {lam!r}")
    p_wait = erlang_c(c, a)
    mean_wait = p_wait / (c * mu - lam)
    mean_queue_length = p_wait * a / (c - a)
    return MMcResult(
        utilisation=a / c,
        p_wait=p_wait,
        mean_wait=mean_wait,
        mean_response=mean_wait + 1.0 / mu,
        mean_queue_length=mean_queue_length,
        mean_in_system=mean_queue_length + a,
    )


def _death_rate(n: int, mu: float, c: int, theta: float) -> float:
    """Departure rate in state ``n``: busy servers finishing plus waiting customers giving up."""
    return min(n, c) * mu + max(n - c, 0) * theta


def _mode(lam: float, mu: float, c: int, theta: float, top: int) -> int:
    """The most likely state in ``[0, top]`` of a chain with birth rate ``lam``.

    The weight of state ``n`` over state ``n - 1`` is ``lam / death(n)``; the death rate never
    falls as ``n`` grows, so weights rise while ``lam >= death(n)`` and fall after: the mode is
    the last such ``n``, found by bisection.
    """
    low, high = 0, top
    while low < high:
        middle = (low + high + 1) // 2
        if lam >= _death_rate(middle, mu, c, theta):
            low = middle
        else:
            high = middle - 1
    return low


def _weights_to_mode(lam: float, mu: float, c: int, theta: float, mode: int) -> list[float]:
    """Unnormalised weights of states ``0..mode``, the mode's weight being 1."""
    weights = [1.0]
    weight = 1.0
    for n in range(mode, 0, -1):
        weight *= _death_rate(n, mu, c, theta) / lam
        weights.append(weight)
    weights.reverse()
    return weights


def _mmck_weights(lam: float, mu: float, c: int, k: int) -> list[float]:
    _check_positive("lam", lam)
    _check_positive("mu", mu)
    _check_count("c", c, 1)
    _check_count("k", k, c)
    if k >= MAX_STATES:
        raise ValueError(f"k must be below {MAX_STATES}, got {k!r}")
    mode = _mode(lam, mu, c, 0.0, k)
    weights = _weights_to_mode(lam, mu, c, 0.0, mode)
    weight = 1.0
    for n in range(mode + 1, k + 1):
        weight *= lam / _death_rate(n, mu, c, 0.0)
        weights.append(weight)
    return weights


def mmck_blocking(lam: float, mu: float, c: int, k: int) -> float:
    """The probability that an arrival to M/M/c/K finds all ``k`` places taken.

    With ``k == c`` this is Erlang B.
    """
    weights = _mmck_weights(lam, mu, c, k)
    return weights[k] / math.fsum(weights)


def mmck(lam: float, mu: float, c: int, k: int) -> MMcKResult:
    """Steady state of M/M/c/K: ``c`` servers and ``k`` places in all, those in service included.

    Any ``lam`` is allowed: the finite capacity keeps the system stable.
    """
    weights = _mmck_weights(lam, mu, c, k)
    total = math.fsum(weights)
    # Summing the admitted states avoids 1 - p_block, which cancels when nearly all are blocked.
    throughput = lam * math.fsum(weights[:k]) / total
    mean_in_system = math.fsum(n * w for n, w in enumerate(weights)) / total
    mean_queue_length = math.fsum(n * w for n, w in enumerate(weights[c + 1 :], start=1)) / total
    return MMcKResult(
        p_block=weights[k] / total,
        throughput=throughput,
        mean_in_system=mean_in_system,
        mean_response=mean_in_system / throughput,
        mean_wait=mean_queue_length / throughput,
    )


def erlang_a(
    lam: float, mu: float, c: int, theta: float, *, tolerance: float = ERLANG_A_TOLERANCE
) -> ErlangAResult:
    """Steady state of M/M/c+M: waiting customers abandon at rate ``theta`` each.

    State ``c + n`` empties at rate ``c * mu + n * theta``, so the queue is stable for any
    ``lam``. The infinite chain is truncated as :data:`ERLANG_A_TOLERANCE` describes, with
    ``tolerance`` in its place. A small ``theta`` under overload needs a long chain; past
    :data:`MAX_STATES` states this raises, and :func:`erlang_c` is the better model anyway
    when patience is that long and ``lam < c * mu``.
    """
    _check_positive("lam", lam)
    _check_positive("mu", mu)
    _check_count("c", c, 1)
    _check_positive("theta", theta)
    if not 0.0 < tolerance < 1.0:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance!r}")
    # Past this state the death rate exceeds lam, so the mode lies at or below it.
    excess = max(0.0, lam - c * mu) / theta
    if c + excess + 1 >= MAX_STATES:
        raise ValueError(
            f"theta={theta!r} is too small for this overload: the chain would need more than "
            f"{MAX_STATES} states"
        )
    mode = _mode(lam, mu, c, theta, c + math.ceil(excess) + 1)
    weights = _weights_to_mode(lam, mu, c, theta, mode)
    total = math.fsum(weights)
    queued = math.fsum(n * w for n, w in enumerate(weights[c + 1 :], start=1))
    n, weight = mode, 1.0
    while True:
        # Past the mode every ratio is below 1 and no larger than this one, so the rest of the
        # chain is bounded by a geometric series with ratio `ratio`.
        ratio = lam / _death_rate(n + 1, mu, c, theta)
        if ratio < 1.0:
            mass_tail = weight * ratio / (1.0 - ratio)
            queue_tail = mass_tail * (max(n - c, 0) + 1.0 / (1.0 - ratio))
            if mass_tail <= tolerance * total and queue_tail <= tolerance * queued:
                break
        if n + 1 >= MAX_STATES:
            raise ValueError(
                f"theta={theta!r} is too small for this load: the chain would need more than "
                f"{MAX_STATES} states"
            )
        n += 1
        weight *= ratio
        weights.append(weight)
        total += weight
        queued += max(n - c, 0) * weight

    total = math.fsum(weights)
    mean_queue_length = math.fsum(n * w for n, w in enumerate(weights[c + 1 :], start=1)) / total
    busy = math.fsum(min(n, c) * w for n, w in enumerate(weights)) / total
    return ErlangAResult(
        p_abandon=theta * mean_queue_length / lam,
        p_wait=math.fsum(weights[c:]) / total,
        mean_wait=mean_queue_length / lam,
        mean_queue_length=mean_queue_length,
        throughput=busy * mu,
    )


def pollaczek_khinchine(lam: float, mean_service: float, scv: float) -> PKResult:
    """Steady state of M/G/1 from the mean service time and its squared coefficient of variation.

    ``scv`` is the service time's variance over its squared mean: 0 for constant service (M/D/1),
    1 for exponential service (M/M/1). ``lam * mean_service`` must be below 1.
    """
    _check_positive("lam", lam)
    _check_positive("mean_service", mean_service)
    if not math.isfinite(scv) or scv < 0:
        raise ValueError(f"scv must be a finite number >= 0, got {scv!r}")
    rho = lam * mean_service
    if rho >= 1.0:
        raise ValueError(
            f"lam must be below 1 / mean_service = {1.0 / mean_service!r} for a stable queue, "
            f"got {lam!r}"
        )
    mean_wait = rho * (1.0 + scv) * mean_service / (2.0 * (1.0 - rho))
    return PKResult(
        mean_wait=mean_wait,
        mean_response=mean_wait + mean_service,
        mean_queue_length=rho * rho * (1.0 + scv) / (2.0 * (1.0 - rho)),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EkMcKResult:
    """Steady state of E_k/M/c/K (``K`` places in all, or unbounded).

    ``p_block`` is the share of arrivals that find all places taken, ``p_wait`` the share of
    admitted arrivals that find every server busy. ``mean_in_system`` is the time-average
    number present; ``mean_response`` and ``mean_wait`` are per admitted arrival.
    """

    p_block: float
    p_wait: float
    throughput: float
    mean_in_system: float
    mean_response: float
    mean_wait: float


#: Past this many states (levels x phases) :func:`ekmck` refuses: seconds of work.
EKMCK_MAX_STATES = 2_000_000


def _gap_sigma(lam: float, mu: float, c: int, phases: int) -> float:
    """The root in (0, 1) of ``sigma = phi(c mu (1 - sigma))`` for Erlang gaps: the geometric
    rate at which the queue length's distribution decays in GI/M/c."""
    rate = phases * lam
    sigma = 0.0
    for _ in range(100_000):
        following = (rate / (rate + c * mu * (1.0 - sigma))) ** phases
        if abs(following - sigma) < 1e-15:
            return following
        sigma = following
    return sigma


def ekmck(lam: float, mu: float, c: int, phases: int, k: int | None = None) -> EkMcKResult:
    """Steady state of E_k/M/c/K: arrivals at rate ``lam`` whose gaps are Erlang with ``phases``
    phases (``phases == 1`` is Poisson), ``c`` exponential servers of rate ``mu`` each, and
    ``k`` places in all (``None``: an unbounded queue, which needs ``lam < c * mu``).

    The chain is (number present, phase of the next arrival); an arrival comes when the last
    phase ends and is turned away when all ``k`` places are taken. Arrivals therefore see the
    chain's states in its last phase, which gives the blocking and waiting shares. The chain is
    a birth-death process in levels, solved exactly by eliminating the levels from the top
    (linear level reduction, with ``phases x phases`` blocks). An unbounded queue is cut where
    the geometric tail of GI/M/c (ratio ``sigma``) falls below 1e-14 of the mass.
    """
    import numpy as np

    _check_positive("lam", lam)
    _check_positive("mu", mu)
    _check_count("c", c, 1)
    _check_count("phases", phases, 1)
    if k is None:
        if lam >= c * mu:
            raise ValueError(
                f"lam must be below c * mu = {c * mu!r} for a stable queue, got {lam!r}"
            )
        sigma = _gap_sigma(lam, mu, c, phases)
        top = c + 1 + math.ceil(math.log(1e-14) / math.log(sigma)) if sigma > 0 else c + 1
    else:
        _check_count("k", k, c)
        top = k
    if (top + 1) * phases > EKMCK_MAX_STATES:
        raise ValueError(f"the chain would need more than {EKMCK_MAX_STATES} states")
    rate = phases * lam
    advance = np.zeros((phases, phases))
    for j in range(phases - 1):
        advance[j, j + 1] = rate
    up = np.zeros((phases, phases))
    up[phases - 1, 0] = rate
    identity = np.eye(phases)

    def local(n: int) -> Any:
        block = advance.copy()
        if n == top:  # a full system turns the arrival away: the phase restarts
            block[phases - 1, 0] += rate
        out = rate + min(n, c) * mu
        return block - out * identity

    # pi_{n+1} = pi_n R_n, from the top level down.
    ratios: list[Any] = [None] * top
    below = local(top)
    for n in range(top - 1, -1, -1):
        ratios[n] = up @ np.linalg.inv(-below)
        below = local(n) + ratios[n] * (min(n + 1, c) * mu)  # R_n times the level's departures
    # pi_0 below = 0: the left null vector of `below`.
    system = below.T.copy()
    system[-1, :] = 1.0
    rhs = np.zeros(phases)
    rhs[-1] = 1.0
    levels = [np.linalg.solve(system, rhs)]
    for n in range(top):
        levels.append(levels[-1] @ ratios[n])
    mass = np.array([level.sum() for level in levels])
    seen = np.array([level[phases - 1] for level in levels])
    total, seen_total = float(mass.sum()), float(seen.sum())
    probability = mass / total
    arriving = seen / seen_total
    p_block = float(arriving[top]) if k is not None else 0.0
    admitted = 1.0 - p_block
    throughput = lam * admitted
    present = np.arange(top + 1, dtype=float)
    mean_in_system = float((present * probability).sum())
    queued = float((np.maximum(present - c, 0.0) * probability).sum())
    waiting_seen = float(arriving[c:top].sum()) if k is not None else float(arriving[c:].sum())
    return EkMcKResult(
        p_block=p_block,
        p_wait=waiting_seen / admitted if admitted > 0 else math.nan,
        throughput=throughput,
        mean_in_system=mean_in_system,
        mean_response=mean_in_system / throughput,
        mean_wait=queued / throughput,
    )


def gimcc_blocking(transform: Callable[[float], float], mu: float, c: int) -> float:
    """The loss probability of GI/M/c/c, where ``transform(s)`` is the Laplace-Stieltjes
    transform of the gap between arrivals: ``1 / sum_j C(c, j) / prod_{i<=j} (phi_i / (1 -
    phi_i))`` with ``phi_i = transform(i mu)`` (Takacs). With Poisson gaps it is Erlang B."""
    _check_positive("mu", mu)
    _check_count("c", c, 1)
    terms = [1.0]
    product = 1.0
    for j in range(1, c + 1):
        phi = transform(j * mu)
        product *= phi / (1.0 - phi)
        terms.append(math.comb(c, j) / product)
    return 1.0 / math.fsum(terms)
