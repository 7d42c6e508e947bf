"""The replication statistics: Student-t quantiles, intervals, batch means, MSER-5, trends."""

from __future__ import annotations

import math
import random

import pytest

from tidegate.lab import stats
from tidegate.lab.stats import batch_means, interval, mser5, t_cdf, t_quantile, trend

# Two-sided 95% and 99% points of Student's t from the standard tables (four decimals).
T_TABLE = {
    1: (12.7062, 63.6567),
    2: (4.3027, 9.9248),
    3: (3.1824, 5.8409),
    4: (2.7764, 4.6041),
    5: (2.5706, 4.0321),
    9: (2.2622, 3.2498),
    10: (2.2281, 3.1693),
    19: (2.0930, 2.8609),
    29: (2.0452, 2.7564),
    30: (2.0423, 2.7500),
    60: (2.0003, 2.6603),
    120: (1.9799, 2.6174),
}


def test_all_is_sorted_and_complete() -> None:
    assert stats.__all__ == sorted(stats.__all__, key=lambda n: (0 if n[0].isupper() else 1, n))
    for name in stats.__all__:
        assert hasattr(stats, name)


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_t_quantiles_match_the_tables(df: int) -> None:
    low, high = T_TABLE[df]
    assert t_quantile(0.975, df) == pytest.approx(low, abs=5e-5)
    assert t_quantile(0.995, df) == pytest.approx(high, abs=5e-5)
    assert t_quantile(0.025, df) == -t_quantile(0.975, df)


def test_t_approaches_the_normal_and_the_cdf_inverts_the_quantile() -> None:
    assert t_quantile(0.975, 100_000) == pytest.approx(1.959964, abs=1e-4)
    assert t_quantile(0.5, 7) == 0.0
    for df in (1, 2, 7, 30):
        for p in (0.6, 0.9, 0.975, 0.999):
            assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-12)
    assert t_cdf(math.inf, 3) == 1.0


def test_bad_arguments_are_refused() -> None:
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="degrees of freedom"):
            t_quantile(0.9, bad)
    with pytest.raises(ValueError, match="p must be"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="batches"):
        batch_means([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="three"):
        trend([1.0, 2.0])


def test_interval_is_the_t_interval_and_skips_nan() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    result = interval(values)
    stderr = math.sqrt(5.0 / 3.0 / 4.0)
    assert result.mean == 2.5
    assert result.stderr == pytest.approx(stderr)
    assert result.half_width == pytest.approx(3.1824463 * stderr)
    assert result.contains(2.5)
    assert not result.contains(10.0)
    assert interval([*values, math.nan]).n == 4
    single = interval([7.0])
    assert single.mean == 7.0
    assert math.isnan(single.half_width)
    assert single.as_dict()["half_width"] is None
    assert single.format(1) == "7.0"
    assert result.format(2, 100) == f"250.00 ± {100 * result.half_width:.2f}"


def test_intervals_cover_the_mean_about_95_percent_of_the_time() -> None:
    rng = random.Random(3)
    covered = sum(
        interval([rng.gauss(5.0, 2.0) for _ in range(10)]).contains(5.0) for _ in range(2000)
    )
    assert 0.93 < covered / 2000 < 0.97


def test_batch_means_drop_the_leading_remainder() -> None:
    assert batch_means([9.0, 1.0, 2.0, 3.0, 4.0], 2) == [1.5, 3.5]


def test_mser5_deletes_a_transient_and_leaves_a_flat_series() -> None:
    rng = random.Random(1)
    flat = [rng.gauss(10.0, 1.0) for _ in range(500)]
    assert mser5(flat) <= 50
    ramp = [10.0 * (1 - math.exp(-i / 30.0)) + rng.gauss(0.0, 0.2) for i in range(500)]
    assert 60 <= mser5(ramp) <= 250
    assert mser5([1.0] * 7) == 0


def test_trend_finds_a_rising_series_and_not_a_flat_one() -> None:
    rng = random.Random(2)
    assert trend([float(i) + rng.gauss(0, 0.5) for i in range(20)]).t > 20
    assert abs(trend([rng.gauss(0, 1) for _ in range(20)]).t) < 4
    assert trend([2.0, 4.0, 6.0]).t == math.inf
