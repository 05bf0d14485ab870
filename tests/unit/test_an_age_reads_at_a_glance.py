"""A Queue's "Oldest age" column reads as kubectl's ages do: it showed the exact
duration, which for most ages is raw milliseconds ("127168ms")."""

from __future__ import annotations

import pytest

from shardq.durations import format_age_ms


@pytest.mark.parametrize(
    ("ms", "shown"),
    [
        (450, "450ms"),
        (1_999, "1s"),
        (119_999, "119s"),
        (127_168, "2m7s"),
        (180_000, "3m"),
        (5_400_000, "90m"),
        (3 * 3_600_000 + 61_000, "3h1m"),
        (93_784_000, "26h"),
        (2 * 86_400_000 + 3_600_000, "2d1h"),
        (700_000_000, "8d"),
    ],
)
def test_an_age_is_shown_in_two_units_at_most(ms: int, shown: str) -> None:
    assert format_age_ms(ms) == shown
