"""PNG plots of the report, drawn with matplotlib's Agg backend (no display).

Figures are built and rendered through the object-oriented API with an Agg
canvas of their own, so drawing leaves pyplot's global backend and state alone.
Inputs are small, already-collected Python values; nothing here touches Spark.
"""

from __future__ import annotations

import datetime
import pathlib
from collections.abc import Mapping, Sequence

import matplotlib.dates as mdates
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from shardq.analytics.metrics import LatencyStats

_FIGURE_SIZE = (10, 4.5)
_DPI = 100
# Fixed colours per event type, so every plot reads the same way.
EVENT_COLOURS = {
    "SENT": "#1f77b4",
    "RECEIVED": "#ff7f0e",
    "DELETED": "#2ca02c",
    "DEAD_LETTERED": "#d62728",
    "EXPIRED": "#7f7f7f",
}
OUTCOME_COLOURS = {
    "deleted": "#2ca02c",
    "dead_lettered": "#d62728",
    "expired": "#7f7f7f",
    "purged": "#8c564b",
    "pending": "#ff7f0e",
}


# A throughput peak this many times the median rate gets a log scale and a label.
SPIKE_FACTOR = 20


def _new_figure() -> tuple[Figure, Axes]:
    figure = Figure(figsize=_FIGURE_SIZE, dpi=_DPI)
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    axes.grid(True, alpha=0.3)
    return figure, axes


def _save(figure: Figure, path: pathlib.Path) -> pathlib.Path:
    figure.tight_layout()
    figure.savefig(path)
    return path


def _no_data(axes: Axes, text: str) -> None:
    axes.text(0.5, 0.5, text, ha="center", va="center", fontsize=14, transform=axes.transAxes)
    axes.set_xticks([])
    axes.set_yticks([])


def plot_throughput(
    points: Sequence[tuple[datetime.datetime, str, float]],
    *,
    bucket_seconds: int,
    path: pathlib.Path,
) -> pathlib.Path:
    """`points` are (bucket start, event type, events per second); buckets
    without events are drawn as zero, so idle periods show as idle."""
    figure, axes = _new_figure()
    axes.set_title(f"Throughput (events per second, {bucket_seconds} s buckets)")
    if not points:
        _no_data(axes, "no events in the journal")
        return _save(figure, path)
    step = datetime.timedelta(seconds=bucket_seconds)
    first = min(start for start, _, _ in points)
    last = max(start for start, _, _ in points)
    buckets = [first + step * i for i in range(int((last - first) / step) + 1)]
    for event_type, colour in EVENT_COLOURS.items():
        rates = {start: rate for start, kind, rate in points if kind == event_type}
        if rates:
            values = [rates.get(bucket, 0.0) for bucket in buckets]
            # Each value holds for its whole bucket: close the last one at its end.
            axes.plot(
                # numpy's datetime64 has no zone: the values are UTC already.
                np.array([moment.replace(tzinfo=None) for moment in [*buckets, last + step]], dtype="datetime64[ms]"),
                [*values, values[-1]],
                drawstyle="steps-post",
                linewidth=2,
                label=event_type.lower().replace("_", " "),
                color=colour,
            )
    axes.set_ylabel("events / s")
    axes.set_xlabel("time (UTC)")
    positive = sorted(rate for _, _, rate in points if rate > 0)
    peak_start, peak_kind, peak_rate = max(points, key=lambda point: point[2])
    if positive and peak_rate > SPIKE_FACTOR * positive[len(positive) // 2]:
        # A bulk load dwarfs everything else: a log scale keeps the rest readable,
        # and the spike is marked so it is not mistaken for the normal rate.
        axes.set_yscale("symlog", linthresh=1)
        axes.annotate(
            f"peak: {peak_rate:,.0f} {peak_kind.lower().replace('_', ' ')}/s",
            xy=(mdates.date2num(peak_start.replace(tzinfo=None)), peak_rate),  # type: ignore[no-untyped-call]
            xytext=(10, -15),
            textcoords="offset points",
            arrowprops={"arrowstyle": "->", "color": "black"},
        )
        axes.set_ylabel("events / s (log scale)")
    else:
        axes.set_ylim(bottom=0)
    # matplotlib leaves this constructor unannotated.
    formatter = mdates.ConciseDateFormatter(axes.xaxis.get_major_locator())  # type: ignore[no-untyped-call]
    axes.xaxis.set_major_formatter(formatter)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _save(figure, path)


def plot_latency(stats: LatencyStats, *, path: pathlib.Path) -> pathlib.Path:
    figure, axes = _new_figure()
    axes.set_title(f"End-to-end latency, sent -> deleted ({stats.messages} messages)")
    if not stats.curve:
        _no_data(axes, "no deleted messages")
        return _save(figure, path)
    percentiles = [100 * p for p, _ in stats.curve]
    latencies = [ms for _, ms in stats.curve]
    axes.plot(percentiles, latencies, color=EVENT_COLOURS["DELETED"], linewidth=2)
    marks = {
        "p50": (50, stats.p50_ms),
        "p90": (90, stats.p90_ms),
        "p99": (99, stats.p99_ms),
        "max": (100, stats.max_ms),
    }
    for percentile, value in marks.values():
        if value is not None:
            axes.plot([percentile], [value], marker="o", color="black")
    # The numbers in a box, not as labels at the points, which pile up when the tail is flat.
    legend = "\n".join(f"{label:>4}  {_format_ms(value)}" for label, (_, value) in marks.items() if value is not None)
    if stats.mean_ms is not None:
        legend += f"\nmean  {_format_ms(stats.mean_ms)}"
    # Lower right: a quantile curve rises to the right, so that corner stays clear.
    axes.text(
        0.98,
        0.04,
        legend,
        transform=axes.transAxes,
        ha="right",
        va="bottom",
        family="monospace",
        bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "#bbb"},
    )
    if min(latencies) > 0 and max(latencies) / min(latencies) > 50:
        axes.set_yscale("log")
    else:
        axes.set_ylim(bottom=0, top=max(latencies) * 1.1 or 1)
    axes.set_xlim(0, 101)
    axes.set_xlabel("percentile of deleted messages")
    axes.set_ylabel("latency (ms)")
    return _save(figure, path)


def plot_receive_counts(rows: Sequence[tuple[int, str, int]], *, path: pathlib.Path) -> pathlib.Path:
    """`rows` are (receive count, outcome, messages); bars stacked by outcome."""
    figure, axes = _new_figure()
    axes.set_title("Deliveries per message (redeliveries show as counts above 1)")
    if not rows:
        _no_data(axes, "no messages in the journal")
        return _save(figure, path)
    counts = sorted({count for count, _, _ in rows})
    bottoms = dict.fromkeys(counts, 0)
    for outcome, colour in OUTCOME_COLOURS.items():
        heights = {count: messages for count, kind, messages in rows if kind == outcome}
        if not heights:
            continue
        values = [heights.get(count, 0) for count in counts]
        axes.bar(
            counts,
            values,
            bottom=[bottoms[c] for c in counts],
            color=colour,
            label=outcome.replace("_", " "),
            width=0.8,
        )
        for count, value in zip(counts, values, strict=True):
            bottoms[count] += value
    # A numeric axis: gaps in the counts (1, 2, 5) show as gaps.
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlim(min(counts) - 0.6, max(counts) + 0.6)
    axes.set_xlabel("times received")
    axes.set_ylabel("messages")
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.legend()
    return _save(figure, path)


def plot_dead_letters(by_reason: Mapping[str, int], *, path: pathlib.Path) -> pathlib.Path:
    figure, axes = _new_figure()
    total = sum(by_reason.values())
    axes.set_title(f"Dead-lettered messages by reason ({total} in total)")
    if not by_reason:
        _no_data(axes, "no dead-lettered messages")
        return _save(figure, path)
    reasons = sorted(by_reason, key=lambda reason: by_reason[reason])
    bars = axes.barh(reasons, [by_reason[r] for r in reasons], color=EVENT_COLOURS["DEAD_LETTERED"])
    axes.bar_label(bars, padding=3)
    axes.set_xlabel("messages")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(figure, path)


def plot_shard_load(rows: Sequence[tuple[int, int, int, int]], *, path: pathlib.Path) -> pathlib.Path:
    """`rows` are (shard, sent, received, deleted): grouped bars per shard."""
    figure, axes = _new_figure()
    axes.set_title("Load per shard")
    if not rows:
        _no_data(axes, "no events in the journal")
        return _save(figure, path)
    width = 0.27
    positions = range(len(rows))
    for offset, (label, column) in enumerate((("sent", 1), ("received", 2), ("deleted", 3))):
        axes.bar(
            [p + (offset - 1) * width for p in positions],
            [row[column] for row in rows],
            width=width,
            label=label,
            color=EVENT_COLOURS[label.upper()],
        )
    axes.set_xticks(list(positions), [f"shard {row[0]}" for row in rows])
    axes.set_ylabel("events")
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.legend()
    return _save(figure, path)


def plot_backlog(rows: Sequence[tuple[datetime.datetime, int, float | None]], *, path: pathlib.Path) -> pathlib.Path:
    """`rows` are (bucket end, messages waiting, oldest message's age in s or None)."""
    figure, axes = _new_figure()
    axes.set_title("Backlog and oldest message age over time")
    if not rows:
        _no_data(axes, "no events in the journal")
        return _save(figure, path)
    times = np.array([moment.replace(tzinfo=None) for moment, _, _ in rows], dtype="datetime64[ms]")
    marker = "o" if len(rows) <= 30 else None  # a handful of buckets: show each
    axes.plot(
        times,
        [backlog for _, backlog, _ in rows],
        color=OUTCOME_COLOURS["pending"],
        linewidth=2,
        marker=marker,
        label="backlog",
    )
    axes.set_ylabel("messages waiting")
    axes.set_ylim(bottom=0)
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    ages = axes.twinx()
    ages.plot(
        times,
        [age if age is not None else np.nan for _, _, age in rows],
        color="#555555",
        linestyle="--",
        linewidth=1.5,
        marker=marker,
        label="oldest age",
    )
    ages.set_ylabel("oldest message age (s)")
    ages.set_ylim(bottom=0)
    axes.set_xlabel("time (UTC)")
    formatter = mdates.ConciseDateFormatter(axes.xaxis.get_major_locator())  # type: ignore[no-untyped-call]
    axes.xaxis.set_major_formatter(formatter)
    lines = [*axes.get_lines(), *ages.get_lines()]
    axes.legend(lines, [str(line.get_label()) for line in lines], loc="upper left")
    return _save(figure, path)


def plot_wait_and_processing(
    messages: int,
    wait_curve: Sequence[tuple[float, float]],
    processing_curve: Sequence[tuple[float, float]],
    *,
    path: pathlib.Path,
) -> pathlib.Path:
    """Where the end-to-end time goes: waiting to be received vs being processed."""
    figure, axes = _new_figure()
    axes.set_title(f"Waiting (sent -> received) vs processing (received -> deleted), {messages} messages")
    if not wait_curve:
        _no_data(axes, "no deleted messages")
        return _save(figure, path)
    for label, curve, colour in (
        ("waiting in the queue", wait_curve, OUTCOME_COLOURS["pending"]),
        ("processing", processing_curve, OUTCOME_COLOURS["deleted"]),
    ):
        axes.plot([100 * p for p, _ in curve], [ms for _, ms in curve], linewidth=2, color=colour, label=label)
    values = [ms for _, ms in (*wait_curve, *processing_curve) if ms > 0]
    if values and max(values) / min(values) > 50:
        axes.set_yscale("log")
    else:
        axes.set_ylim(bottom=0)
    axes.set_xlim(0, 101)
    axes.set_xlabel("percentile of deleted messages")
    axes.set_ylabel("time (ms)")
    axes.legend(loc="upper left")
    return _save(figure, path)


def _format_ms(ms: float) -> str:
    if ms >= 60_000:
        return f"{ms / 60_000:.1f} min"
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    return f"{ms:.0f} ms"
