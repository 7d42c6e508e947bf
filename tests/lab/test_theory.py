import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tidegate.lab import theory
from tidegate.lab.theory import (
    MAX_STATES,
    ErlangAResult,
    erlang_a,
    erlang_b,
    erlang_c,
    mmc,
    mmck,
    mmck_blocking,
    pollaczek_khinchine,
)

# Float results from recurrences and sums of a few hundred terms: a few hundred ulps at most.
REL = 1e-12
# Property tests reach loads so light that waits underflow into subnormals, which carry few digits.
TINY = 1e-300


def close(x: float, y: float, rel: float = REL, tiny: float = 0.0) -> bool:
    return math.isclose(x, y, rel_tol=rel, abs_tol=tiny)


def direct_erlang_b(c: int, a: float) -> Fraction:
    """Erlang B from its factorial sum, in exact rational arithmetic."""
    load = Fraction(a)
    terms = [load**k / math.factorial(k) for k in range(c + 1)]
    return terms[-1] / sum(terms)


def direct_erlang_c(c: int, a: float) -> Fraction:
    """Erlang C from its factorial sum, in exact rational arithmetic."""
    load = Fraction(a)
    below = sum(load**k / math.factorial(k) for k in range(c))
    top = load**c / math.factorial(c) * c / (c - load)
    return top / (below + top)


def naive_chain(lam: float, mu: float, c: int, theta: float, states: int) -> ErlangAResult:
    """Erlang-A from a chain weighted from state 0 and cut at a fixed, generous length."""
    weights = [1.0]
    for n in range(1, states):
        weights.append(weights[-1] * lam / (min(n, c) * mu + max(n - c, 0) * theta))
    total = math.fsum(weights)
    queue = math.fsum(max(n - c, 0) * w for n, w in enumerate(weights)) / total
    busy = math.fsum(min(n, c) * w for n, w in enumerate(weights)) / total
    return ErlangAResult(
        p_abandon=theta * queue / lam,
        p_wait=math.fsum(weights[c:]) / total,
        mean_wait=queue / lam,
        mean_queue_length=queue,
        throughput=mu * busy,
    )


def isort_key(name: str) -> tuple[int, str]:
    """Constants, then classes, then functions, each alphabetical (ruff's RUF022 order)."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def test_all_is_sorted_and_complete() -> None:
    """The module exports a sorted __all__ whose every name exists."""
    assert theory.__all__ == sorted(theory.__all__, key=isort_key)
    for name in theory.__all__:
        assert hasattr(theory, name)


# Erlang B


def test_erlang_b_small_exact_values() -> None:
    """Erlang B gives the hand-computed values for one and two servers."""
    assert erlang_b(1, 1.0) == 0.5
    assert erlang_b(1, 3.0) == 0.75
    assert erlang_b(2, 1.0) == 0.2


def test_erlang_b_textbook_table_value() -> None:
    """Eight trunks offered 6.5 Erlangs lose about 15% of calls, as Erlang tables say."""
    blocking = erlang_b(8, 6.5)
    assert round(blocking, 4) == 0.1501
    assert close(blocking, float(direct_erlang_b(8, 6.5)))


@pytest.mark.parametrize(
    ("c", "a"),
    [(1, 0.25), (3, 2.0), (5, 0.1), (10, 5.0), (10, 30.0), (25, 20.5), (60, 75.25), (300, 280.5)],
)
def test_erlang_b_matches_factorial_sum(c: int, a: float) -> None:
    """The recurrence agrees with the exact factorial formula to 1e-12."""
    assert close(erlang_b(c, a), float(direct_erlang_b(c, a)))


def test_erlang_b_survives_a_thousand_servers() -> None:
    """A thousand servers neither overflow nor lose precision."""
    assert close(erlang_b(1000, 950.0), float(direct_erlang_b(1000, 950.0)))
    assert 0.0 < erlang_b(1000, 950.0) < 1.0


@settings(max_examples=200, deadline=None)
@given(c=st.integers(1, 400), a=st.floats(1e-6, 1e4))
def test_erlang_b_is_a_probability_that_falls_with_servers(c: int, a: float) -> None:
    """Erlang B lies in [0, 1] and one more server never raises it."""
    here, more = erlang_b(c, a), erlang_b(c + 1, a)
    assert 0.0 <= more <= here <= 1.0
    if here > 1e-300:
        assert more < here


# Erlang C


@pytest.mark.parametrize(
    ("c", "a"), [(1, 0.5), (2, 1.0), (3, 2.5), (10, 8.0), (50, 49.5), (200, 150.25)]
)
def test_erlang_c_matches_factorial_sum(c: int, a: float) -> None:
    """Erlang C computed from Erlang B agrees with the exact factorial formula."""
    assert close(erlang_c(c, a), float(direct_erlang_c(c, a)))


def test_erlang_c_two_servers_half_loaded() -> None:
    """M/M/2 at utilisation one half makes a third of arrivals wait."""
    assert close(erlang_c(2, 1.0), 1.0 / 3.0)


@pytest.mark.parametrize("rho", [1e-9, 0.1, 0.5, 0.9, 0.999999])
def test_erlang_c_single_server_is_utilisation(rho: float) -> None:
    """With one server the waiting probability equals the utilisation."""
    assert close(erlang_c(1, rho), rho, rel=1e-15)


@pytest.mark.parametrize(("c", "a"), [(1, 1.0), (3, 3.0), (3, 4.5)])
def test_erlang_c_refuses_an_unstable_load(c: int, a: float) -> None:
    """A load of c Erlangs or more has no steady state and is refused, naming a."""
    with pytest.raises(ValueError, match=r"^a must be below"):
        erlang_c(c, a)


@settings(max_examples=200, deadline=None)
@given(c=st.integers(1, 300), fraction=st.floats(1e-6, 1.0, exclude_max=True))
def test_erlang_c_is_at_least_erlang_b(c: int, fraction: float) -> None:
    """Waiting in M/M/c is at least as likely as blocking in M/M/c/c, and is a probability."""
    a = fraction * c
    assume(a < c)
    waiting = erlang_c(c, a)
    assert erlang_b(c, a) <= waiting <= 1.0


# M/M/c


@pytest.mark.parametrize(("lam", "mu"), [(0.5, 1.0), (3.0, 4.0), (0.001, 2.0), (9.99, 10.0)])
def test_mmc_single_server_closed_forms(lam: float, mu: float) -> None:
    """M/M/1 gives rho for the waiting probability, rho/(mu-lam) for the wait, rho/(1-rho) in system."""
    rho = lam / mu
    result = mmc(lam, mu, 1)
    assert close(result.utilisation, rho, rel=1e-15)
    assert close(result.p_wait, rho, rel=1e-14)
    assert close(result.mean_wait, rho / (mu - lam), rel=1e-14)
    assert close(result.mean_response, 1.0 / (mu - lam), rel=1e-14)
    assert close(result.mean_in_system, rho / (1.0 - rho), rel=1e-12)


def test_mmc_two_servers_known_values() -> None:
    """M/M/2 with lam=1, mu=1 waits 1/3 time units on average, as the textbook formula gives."""
    result = mmc(1.0, 1.0, 2)
    assert close(result.p_wait, 1.0 / 3.0)
    assert close(result.mean_wait, 1.0 / 3.0)
    assert close(result.mean_queue_length, 1.0 / 3.0)
    assert close(result.mean_in_system, 4.0 / 3.0)


def test_mmc_refuses_overload() -> None:
    """An arrival rate at or above c * mu is refused, naming lam."""
    with pytest.raises(ValueError, match=r"^lam must be below"):
        mmc(2.0, 1.0, 2)


def test_mmc_is_the_limit_of_mmck() -> None:
    """M/M/c/K with a very large K behaves like M/M/c."""
    infinite, finite = mmc(8.0, 1.0, 10), mmck(8.0, 1.0, 10, 2000)
    assert finite.p_block < 1e-150
    assert close(finite.mean_wait, infinite.mean_wait)
    assert close(finite.mean_response, infinite.mean_response)
    assert close(finite.mean_in_system, infinite.mean_in_system)


@st.composite
def stable_mmc(draw: st.DrawFn) -> tuple[float, float, int]:
    c = draw(st.integers(1, 200))
    mu = draw(st.floats(1e-3, 1e3))
    load = draw(st.floats(1e-6, 0.999))
    return load * c * mu, mu, c


@settings(max_examples=200, deadline=None)
@given(args=stable_mmc())
def test_mmc_obeys_littles_law(args: tuple[float, float, int]) -> None:
    """In M/M/c, L = lam W, Lq = lam Wq and W = Wq + 1/mu."""
    lam, mu, c = args
    assume(lam / mu < c)
    result = mmc(lam, mu, c)
    assert 0.0 < result.utilisation < 1.0
    assert 0.0 <= result.p_wait <= 1.0
    assert close(result.mean_queue_length, lam * result.mean_wait, rel=1e-9, tiny=TINY)
    assert close(result.mean_in_system, lam * result.mean_response, rel=1e-9, tiny=TINY)
    assert close(result.mean_response, result.mean_wait + 1.0 / mu, rel=1e-12)


# M/M/c/K


@pytest.mark.parametrize(
    ("lam", "mu", "c"), [(6.5, 1.0, 8), (0.3, 2.0, 1), (20.0, 1.0, 10), (280.5, 1.0, 300)]
)
def test_mmck_with_no_waiting_room_is_erlang_b(lam: float, mu: float, c: int) -> None:
    """M/M/c/K with K = c blocks exactly as Erlang B says."""
    expected = erlang_b(c, lam / mu)
    assert close(mmck_blocking(lam, mu, c, c), expected)
    assert close(mmck(lam, mu, c, c).p_block, expected)


@pytest.mark.parametrize(("lam", "k"), [(0.5, 1), (0.5, 5), (0.9, 40), (1.7, 3), (3.0, 60)])
def test_mm1k_closed_form(lam: float, k: int) -> None:
    """M/M/1/K matches the closed forms for its blocking probability and mean number present."""
    rho = lam  # mu = 1
    p_block = (1 - rho) * rho**k / (1 - rho ** (k + 1))
    in_system = rho / (1 - rho) - (k + 1) * rho ** (k + 1) / (1 - rho ** (k + 1))
    result = mmck(lam, 1.0, 1, k)
    assert close(mmck_blocking(lam, 1.0, 1, k), p_block)
    assert close(result.p_block, p_block)
    assert close(result.throughput, lam * (1 - p_block))
    assert close(result.mean_in_system, in_system)


def test_mm1k_at_critical_load_is_uniform() -> None:
    """M/M/1/K with lam = mu has every state equally likely."""
    result = mmck(2.0, 2.0, 1, 9)
    assert close(result.p_block, 0.1)
    assert close(result.mean_in_system, 4.5)


def test_mmck_under_extreme_overload_stays_finite() -> None:
    """A hundredfold overload with room for thousands neither overflows nor loses the throughput."""
    result = mmck(1000.0, 1.0, 10, 3000)
    assert math.isfinite(result.mean_response)
    assert close(result.throughput, 10.0)
    assert close(result.p_block, 0.99)
    assert result.mean_in_system > 2990.0


@st.composite
def any_mmck(draw: st.DrawFn) -> tuple[float, float, int, int]:
    c = draw(st.integers(1, 50))
    k = c + draw(st.integers(0, 200))
    mu = draw(st.floats(1e-2, 1e2))
    lam = draw(st.floats(1e-3, 10.0)) * c * mu
    return lam, mu, c, k


@settings(max_examples=200, deadline=None)
@given(args=any_mmck())
def test_mmck_obeys_littles_law_and_flow_balance(args: tuple[float, float, int, int]) -> None:
    """In M/M/c/K, L = X W and W = Wq + 1/mu, with X the admitted rate, and p_block is a probability."""
    lam, mu, c, k = args
    result = mmck(lam, mu, c, k)
    assert 0.0 <= result.p_block <= 1.0
    assert close(result.p_block, mmck_blocking(lam, mu, c, k), tiny=TINY)
    assert close(result.throughput, lam * (1.0 - result.p_block), rel=1e-9, tiny=TINY)
    assert result.throughput <= c * mu * (1 + 1e-12)
    assert close(
        result.mean_in_system, result.throughput * result.mean_response, rel=1e-9, tiny=TINY
    )
    assert close(result.mean_response, result.mean_wait + 1.0 / mu, rel=1e-9, tiny=TINY)


# Erlang-A


@pytest.mark.parametrize(("lam", "c"), [(0.5, 1), (8.0, 10), (45.0, 50)])
def test_erlang_a_with_endless_patience_approaches_erlang_c(lam: float, c: int) -> None:
    """As patience grows without bound, Erlang-A waits as often and as long as Erlang C."""
    limit = mmc(lam, 1.0, c)
    result = erlang_a(lam, 1.0, c, 1e-9)
    assert close(result.p_wait, limit.p_wait, rel=1e-6)
    assert close(result.mean_wait, limit.mean_wait, rel=1e-6)
    assert result.p_abandon < 1e-7


@pytest.mark.parametrize(("lam", "mu", "c"), [(7.0, 1.0, 5), (3.0, 2.0, 1), (20.0, 1.0, 25)])
def test_erlang_a_with_patience_equal_to_service_is_infinite_server(
    lam: float, mu: float, c: int
) -> None:
    """With theta = mu every customer leaves at rate mu, so the number present is Poisson(lam/mu)."""
    a = lam / mu
    pmf = [math.exp(-a) * a**n / math.factorial(n) for n in range(c)]
    idle = math.fsum((c - n) * p for n, p in enumerate(pmf))
    queue = a - c + idle  # E[(N - c)+] = E[N] - c + E[(c - N)+]
    result = erlang_a(lam, mu, c, mu)
    assert close(result.p_wait, 1.0 - math.fsum(pmf), rel=1e-11)
    assert close(result.mean_queue_length, queue, rel=1e-11)
    assert close(result.p_abandon, queue / a, rel=1e-11)
    assert close(result.throughput, mu * (c - idle), rel=1e-11)


@pytest.mark.parametrize(
    ("lam", "mu", "c", "theta"), [(12.0, 1.0, 10, 0.3), (2.0, 1.0, 3, 5.0), (30.0, 2.0, 8, 0.05)]
)
def test_erlang_a_matches_a_long_naive_chain(lam: float, mu: float, c: int, theta: float) -> None:
    """The adaptively truncated chain agrees with a naive chain cut far out in the tail."""
    expected = naive_chain(lam, mu, c, theta, 5000)
    result = erlang_a(lam, mu, c, theta)
    assert close(result.p_abandon, expected.p_abandon)
    assert close(result.p_wait, expected.p_wait)
    assert close(result.mean_wait, expected.mean_wait)
    assert close(result.mean_queue_length, expected.mean_queue_length)
    assert close(result.throughput, expected.throughput)


def test_erlang_a_tolerance_controls_the_error() -> None:
    """A looser truncation tolerance still lands within that tolerance of the default answer."""
    tight = erlang_a(12.0, 1.0, 10, 0.3)
    loose = erlang_a(12.0, 1.0, 10, 0.3, tolerance=1e-6)
    assert close(loose.mean_queue_length, tight.mean_queue_length, rel=1e-5)
    assert close(loose.p_wait, tight.p_wait, rel=1e-5)


def test_erlang_a_refuses_a_chain_that_is_too_long() -> None:
    """Near-infinite patience under heavy overload would need too many states and is refused."""
    with pytest.raises(ValueError, match=rf"^theta=.*more than {MAX_STATES} states"):
        erlang_a(1000.0, 1.0, 1, 1e-6)


@st.composite
def any_erlang_a(draw: st.DrawFn) -> tuple[float, float, int, float]:
    c = draw(st.integers(1, 40))
    mu = draw(st.floats(0.1, 10.0))
    lam = draw(st.floats(1e-3, 3.0)) * c * mu
    theta = draw(st.floats(0.05, 20.0)) * mu
    return lam, mu, c, theta


@settings(max_examples=150, deadline=None)
@given(args=any_erlang_a())
def test_erlang_a_balances_its_flows(args: tuple[float, float, int, float]) -> None:
    """Every arrival is served or abandons, probabilities lie in [0, 1] and Lq = lam Wq."""
    lam, mu, c, theta = args
    result = erlang_a(lam, mu, c, theta)
    assert 0.0 <= result.p_abandon <= 1.0
    assert 0.0 <= result.p_wait <= 1.0
    assert result.throughput <= c * mu * (1 + 1e-12)
    assert close(result.throughput, lam * (1.0 - result.p_abandon), rel=1e-9, tiny=TINY)
    assert close(result.mean_queue_length, lam * result.mean_wait, rel=1e-12, tiny=TINY)


# Pollaczek-Khinchine


@pytest.mark.parametrize(("lam", "mean_service"), [(0.5, 1.0), (3.0, 0.25), (0.01, 50.0)])
def test_pk_exponential_service_is_mm1(lam: float, mean_service: float) -> None:
    """With exponential service (scv = 1) P-K gives the M/M/1 wait, response and queue."""
    expected = mmc(lam, 1.0 / mean_service, 1)
    result = pollaczek_khinchine(lam, mean_service, 1.0)
    assert close(result.mean_wait, expected.mean_wait)
    assert close(result.mean_response, expected.mean_response)
    assert close(result.mean_queue_length, expected.mean_queue_length)


@pytest.mark.parametrize(("lam", "mean_service"), [(0.5, 1.0), (3.0, 0.25), (0.9, 1.0)])
def test_pk_constant_service_waits_half_as_long(lam: float, mean_service: float) -> None:
    """Constant service (M/D/1) waits exactly half as long as exponential service."""
    deterministic = pollaczek_khinchine(lam, mean_service, 0.0)
    exponential = pollaczek_khinchine(lam, mean_service, 1.0)
    assert close(deterministic.mean_wait, exponential.mean_wait / 2.0)
    assert close(deterministic.mean_queue_length, exponential.mean_queue_length / 2.0)


def test_pk_refuses_overload() -> None:
    """A utilisation of one or more has no steady state and is refused, naming lam."""
    with pytest.raises(ValueError, match=r"^lam must be below"):
        pollaczek_khinchine(2.0, 0.5, 1.0)


@settings(max_examples=200, deadline=None)
@given(
    lam=st.floats(1e-3, 1e3),
    load=st.floats(1e-6, 0.999),
    scv=st.floats(0.0, 100.0),
)
def test_pk_obeys_littles_law(lam: float, load: float, scv: float) -> None:
    """In M/G/1, Lq = lam Wq and the response is the wait plus the mean service time."""
    mean_service = load / lam
    assume(lam * mean_service < 1.0)
    result = pollaczek_khinchine(lam, mean_service, scv)
    assert close(result.mean_queue_length, lam * result.mean_wait, rel=1e-12, tiny=TINY)
    assert close(result.mean_response, result.mean_wait + mean_service, rel=1e-15)
    assert result.mean_wait >= 0.0


# argument checks

CALLS: dict[str, Callable[..., Any]] = {
    "erlang_b": erlang_b,
    "erlang_c": erlang_c,
    "mmc": mmc,
    "mmck_blocking": mmck_blocking,
    "mmck": mmck,
    "erlang_a": erlang_a,
    "pollaczek_khinchine": pollaczek_khinchine,
}
GOOD: dict[str, dict[str, Any]] = {
    "erlang_b": {"c": 2, "a": 1.0},
    "erlang_c": {"c": 2, "a": 1.0},
    "mmc": {"lam": 1.0, "mu": 1.0, "c": 2},
    "mmck_blocking": {"lam": 1.0, "mu": 1.0, "c": 2, "k": 4},
    "mmck": {"lam": 1.0, "mu": 1.0, "c": 2, "k": 4},
    "erlang_a": {"lam": 1.0, "mu": 1.0, "c": 2, "theta": 0.5},
    "pollaczek_khinchine": {"lam": 0.5, "mean_service": 1.0, "scv": 1.0},
}
BAD_VALUES: dict[str, list[Any]] = {
    "c": [0, -1, 1.0, True, "2"],
    "a": [0.0, -1.0, math.nan, math.inf],
    "lam": [0.0, -0.5, math.nan, math.inf],
    "mu": [0.0, -2.0, math.nan, math.inf],
    "theta": [0.0, -1.0, math.nan, math.inf],
    "k": [1, 4.0, False],
    "mean_service": [0.0, -1.0, math.nan, math.inf],
    "scv": [-0.1, math.nan, math.inf],
    "tolerance": [0.0, 1.0, -1e-9, math.nan],
}
CASES = [
    (function, argument, value)
    for function, arguments in GOOD.items()
    for argument in [*arguments, *(["tolerance"] if function == "erlang_a" else [])]
    for value in BAD_VALUES[argument]
]


@pytest.mark.parametrize(("function", "argument", "value"), CASES)
def test_bad_arguments_are_refused_by_name(function: str, argument: str, value: Any) -> None:
    """Each function refuses a bad argument with a ValueError that names it."""
    CALLS[function](**GOOD[function])
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        CALLS[function](**{**GOOD[function], argument: value})


def test_mmck_refuses_an_enormous_capacity() -> None:
    """A capacity beyond the state limit is refused rather than ground through."""
    with pytest.raises(ValueError, match=r"^k must be below"):
        mmck(1.0, 1.0, 1, MAX_STATES)


# E_k/M/c/K and GI/M/c/c


def test_ekmck_with_poisson_arrivals_is_mmck_and_mmc() -> None:
    finite = theory.ekmck(6.5, 1.0, 8, 1, 12)
    exact = mmck(6.5, 1.0, 8, 12)
    assert close(finite.p_block, exact.p_block, 1e-9)
    assert close(finite.mean_in_system, exact.mean_in_system, 1e-9)
    unbounded = theory.ekmck(6.5, 1.0, 8, 1)
    assert close(unbounded.mean_wait, mmc(6.5, 1.0, 8).mean_wait, 1e-9)
    assert close(unbounded.p_wait, mmc(6.5, 1.0, 8).p_wait, 1e-9)


@pytest.mark.parametrize("phases", [1, 2, 4, 8])
def test_ekmck_loss_matches_takacs(phases: int) -> None:
    """With no waiting room the chain agrees with the GI/M/c/c formula, and smoother arrivals
    (more phases) lose less."""
    rate = phases * 5.0

    def transform(s: float) -> float:
        return (rate / (rate + s)) ** phases

    chain = theory.ekmck(5.0, 1.0 / 0.815, 8, phases, 8).p_block
    assert close(chain, theory.gimcc_blocking(transform, 1.0 / 0.815, 8), 1e-9)
    if phases == 1:
        assert close(chain, erlang_b(8, 5.0 * 0.815), 1e-9)
    else:
        assert chain < erlang_b(8, 5.0 * 0.815)


def test_ek_m1_matches_the_gi_m1_closed_form() -> None:
    """E_3/M/1: P(wait) is the root sigma of sigma = phi(mu (1 - sigma)), W_q = sigma / (mu (1 - sigma))."""
    lam, mu, k = 0.7, 1.0, 3
    sigma = 0.5
    for _ in range(2000):
        sigma = (k * lam / (k * lam + mu * (1 - sigma))) ** k
    result = theory.ekmck(lam, mu, 1, k)
    assert close(result.p_wait, sigma, 1e-9)
    assert close(result.mean_wait, sigma / (mu * (1 - sigma)), 1e-9)


def test_ekmck_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="phases"):
        theory.ekmck(1.0, 1.0, 2, 0, 4)
    with pytest.raises(ValueError, match="stable"):
        theory.ekmck(3.0, 1.0, 2, 2)
    with pytest.raises(ValueError, match="k must be"):
        theory.ekmck(1.0, 1.0, 4, 2, 2)
