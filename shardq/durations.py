"""Human durations ("250ms", "30s", "5m", "24h", "7d") to and from milliseconds."""

from __future__ import annotations

import math
import re

# Durations travel as int64 milliseconds. A longer one ("9" * 100_000 seconds) once
# overflowed float to infinity and failed as an OverflowError, not as bad input.
MAX_DURATION_MS = 2**63 - 1
_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration_ms(text: str) -> int:
    """Parse "1h30m", "250ms", "0s"; a bare number means seconds, like SQS."""
    cleaned = text.strip().lower()
    if not cleaned:
        raise ValueError("empty duration")
    if re.fullmatch(r"\d+(?:\.\d+)?", cleaned):
        return _bounded(float(cleaned) * 1000, text)
    position = 0
    total = 0.0
    for match in _PART.finditer(cleaned):
        if match.start() != position:
            break
        total += float(match.group(1)) * _UNITS_MS[match.group(2)]
        position = match.end()
    if position != len(cleaned) or position == 0:
        raise ValueError(f"not a duration: {shown_briefly(text)} (use e.g. 500ms, 30s, 5m, 24h, 7d)")
    return _bounded(total, text)


def _bounded(ms: float, text: str) -> int:
    if not (math.isfinite(ms) and ms <= MAX_DURATION_MS):
        raise ValueError(f"duration {shown_briefly(text)} is too long: at most {MAX_DURATION_MS} ms")
    return round(ms)


# Kept here, the module every other reader of settings text (queues, sizes) already
# imports, so their messages cut long input the same way without an import circle.
def shown_briefly(text: str, limit: int = 40) -> str:
    """`text` quoted for an error message, cut to its first `limit` characters (and its
    length said) when longer: an error must not echo back whatever a caller sent."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def format_age_ms(ms: int) -> str:
    """An age to read at a glance, as kubectl shows one: two units at most, rounded down
    (127168 -> "2m7s", 5400000 -> "90m", 93784000 -> "26h", 700000000 -> "8d")."""
    seconds = ms // 1000
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 120:
        return f"{seconds}s" if seconds else f"{ms}ms"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if hours < 3:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if days < 2:
        return f"{hours}h"
    if days < 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    return f"{days}d"


def format_duration_ms(ms: int) -> str:
    """The largest whole unit that states `ms` exactly: 345600000 -> "4d", 90000 -> "90s"."""
    if ms == 0:
        return "0s"
    for unit in ("d", "h", "m", "s"):
        size = _UNITS_MS[unit]
        if ms >= size and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"
