"""The stream-interval governor: windows of loop-lag samples raise the interval of requests that do not choose one,
and calm windows lower it again (router/stream_governor.py)."""

from __future__ import annotations

import pytest

from switchyard.router.stream_governor import StreamIntervalGovernor

TARGET = 0.005
LAGGING = 0.008  # over the target, within twice it: one doubling per window


def windows(g: StreamIntervalGovernor, lags: list[float]) -> list[int]:
    """Feeds windows (window i: ten samples of `lags[i]`, evenly spread) to a fresh governor; the interval after
    each window closed (at the next window's first sample, the last one's at one more sample)."""
    out, w = [], g.window_s
    for i, lag in enumerate(lags):
        for j in range(10):
            g.observe(lag, (i + j / 10) * w)
            if j == 0 and i > 0:
                out.append(g.interval)
    g.observe(lags[-1], len(lags) * w)
    return [*out, g.interval]


def test_a_window_just_over_the_target_doubles_it_up_to_the_cap() -> None:
    g = StreamIntervalGovernor(1, 16, TARGET)
    assert g.interval == 1 and g.adaptive
    assert windows(g, [LAGGING] * 6) == [2, 4, 8, 16, 16, 16]
    assert g.last_lag_s == pytest.approx(LAGGING)


@pytest.mark.parametrize(
    ("lag", "after"),
    [(0.0051, 2), (0.01, 2), (0.0101, 4), (0.02, 4), (0.021, 8), (0.04, 8), (0.0401, 16), (0.5, 32)],
)
def test_a_window_far_over_the_target_multiplies_it_by_the_power_of_two_covering_lag_over_target(
    lag: float, after: int
) -> None:
    """A sudden overload is met in one window, not one doubling per window while a backlog builds."""
    assert windows(StreamIntervalGovernor(1, 32, TARGET), [lag])[0] == after
    assert windows(StreamIntervalGovernor(1, 12, TARGET), [lag])[0] == min(after, 12)  # the cap, not a power of two
    assert windows(StreamIntervalGovernor(3, 96, TARGET), [lag])[0] == 3 * after  # from the base, not from 1


def test_it_halves_after_calm_windows_in_a_row_down_to_the_base() -> None:
    g = StreamIntervalGovernor(2, 16, TARGET)
    calm = 0.0005  # under a quarter of the target
    assert windows(g, [LAGGING] * 3 + [calm] * 12) == [4, 8, 16] + [16, 16, 8, 8, 8, 4, 4, 4, 2, 2, 2, 2]


def test_between_a_quarter_of_the_target_and_the_target_it_holds_and_restarts_the_calm_count() -> None:
    g = StreamIntervalGovernor(1, 8, TARGET)
    calm, mid = 0.0005, 0.003
    # two calm windows, a middling one, then three calm ones: the first two do not count toward the three
    lags = [LAGGING, LAGGING] + [mid] * 5 + [calm, calm, mid, calm, calm, calm]
    assert windows(g, lags) == [2, 4] + [4] * 5 + [4, 4, 4, 4, 4, 2]


def test_a_lone_pause_does_not_raise_it_a_loop_throttled_every_period_does() -> None:
    """A window's lag is its mean less the largest sample: one 100 ms pause (a collection) among nine quick
    wake-ups decides nothing; three 30 ms stalls in ten samples (a CPU quota that runs out every period, where the
    median would still read the quick ones) double it."""
    g = StreamIntervalGovernor(1, 8, TARGET, window_s=1.0)
    for i, lag in enumerate([0.0003] * 9 + [0.1]):
        g.observe(lag, i * 0.1)
    g.observe(0.0003, 1.0)  # closes the window
    assert g.interval == 1 and g.last_lag_s == pytest.approx(0.0003)
    for i, lag in enumerate([0.0003, 0.0003, 0.03] * 3 + [0.0003]):
        g.observe(lag, 1.1 + i * 0.1)
    g.observe(0.0003, 2.2)
    assert g.interval == 2 and g.last_lag_s == pytest.approx((7 * 0.0003 + 2 * 0.03) / 9)  # the largest left out


def test_after_a_stall_each_window_is_judged_on_what_it_held() -> None:
    """After a stall longer than a window (the loop stopped), the next sample closes the stale window, judged on
    the samples it held, and opens one with the stall's lag in it."""
    g = StreamIntervalGovernor(1, 8, TARGET)
    g.observe(LAGGING, 0.0)
    g.observe(LAGGING, 10.0)  # ten seconds later: the first window (one lagging sample) closes
    assert g.interval == 2
    g.observe(0.0003, 30.0)  # closes a window holding the one sample at 10.0
    assert g.interval == 4


def test_without_headroom_it_never_moves() -> None:
    g = StreamIntervalGovernor(4, 4, TARGET)
    assert not g.adaptive
    assert windows(g, [0.5] * 3) == [4, 4, 4]


@pytest.mark.parametrize(
    ("base", "cap", "target", "window", "calm"),
    [(0, 4, TARGET, 1.0, 3), (5, 4, TARGET, 1.0, 3), (1, 4, 0.0, 1.0, 3), (1, 4, TARGET, 0.0, 3), (1, 4, TARGET, 1.0, 0)],
)
def test_bad_settings_are_refused(base: int, cap: int, target: float, window: float, calm: int) -> None:
    with pytest.raises(ValueError):
        StreamIntervalGovernor(base, cap, target, window, calm)
