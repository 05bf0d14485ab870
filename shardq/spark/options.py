"""The options of the "shardq" Spark data source, parsed and validated.

Pure: no pyspark, no gRPC. Spark hands options over as a case-insensitive
mapping of strings; everything here reads them through `_lowered` so that
`maxRowsPerBatch` and `maxrowsperbatch` mean the same.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
from collections.abc import Mapping

from shardq.queues import MAX_SEND_BATCH
from shardq.spark.offsets import ShardOffsets, offsets_from_json


class ReadKind(enum.StrEnum):
    MESSAGES = "messages"
    JOURNAL = "journal"


class StartingPosition(enum.StrEnum):
    EARLIEST = "earliest"
    LATEST = "latest"


class OptionError(ValueError):
    """An option is missing or malformed; the message names it."""


# Messages per streamed gRPC batch and per Arrow RecordBatch handed to Spark.
DEFAULT_EXPORT_BATCH_SIZE = 1000
# Messages per SendMessages call from the writer.
DEFAULT_SEND_BATCH_SIZE = 100
DEFAULT_RPC_TIMEOUT_SECONDS = 30.0
# How long a read keeps retrying while servers restart or a shard elects a leader.
DEFAULT_READ_RETRY_SECONDS = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class ReadOptions:
    endpoint: str
    queue: str
    read: ReadKind
    include_body: bool
    export_batch_size: int
    rpc_timeout_seconds: float
    # 0: a read fails at the first unavailable server.
    retry_seconds: float
    # Streaming only.
    max_rows_per_batch: int | None
    starting: StartingPosition | ShardOffsets
    fail_on_data_loss: bool


@dataclasses.dataclass(frozen=True, slots=True)
class WriteOptions:
    endpoint: str
    queue: str
    # Part of every generated dedup id; None means "pick one for this write".
    write_id: str | None
    # A column whose values are used as dedup ids instead of generated ones.
    dedup_id_column: str | None
    send_batch_size: int
    rpc_timeout_seconds: float
    # How long the writer keeps retrying a send the queue refused as full.
    queue_full_patience_seconds: float


READ_OPTION_NAMES = (
    "endpoint",
    "queue",
    "read",
    "includeBody",
    "batchSize",
    "rpcTimeoutSeconds",
    "retrySeconds",
    "maxRowsPerBatch",
    "startingOffsets",
    "failOnDataLoss",
)
WRITE_OPTION_NAMES = (
    "endpoint",
    "queue",
    "writeId",
    "dedupIdColumn",
    "batchSize",
    "rpcTimeoutSeconds",
    "queueFullPatienceSeconds",
)
# Options Spark itself adds to every source's options (e.g. `path` from load(path)).
_SPARK_OWN_OPTIONS = frozenset({"path", "paths"})


def _lowered(options: Mapping[str, str]) -> dict[str, str]:
    return {key.lower(): value for key, value in options.items()}


def _refuse_unknown(options: Mapping[str, str], known: tuple[str, ...]) -> None:
    """A misspelt option (`includBody`) is an error, not silently the default."""
    by_lower = {name.lower(): name for name in known}
    for key in options:
        lowered = key.lower()
        if lowered in by_lower or lowered in _SPARK_OWN_OPTIONS:
            continue
        close = difflib.get_close_matches(lowered, list(by_lower), n=1)
        hint = f"; did you mean {by_lower[close[0]]!r}?" if close else ""
        raise OptionError(f"unknown option {key!r}{hint} (options: {', '.join(known)})")


def _required(options: Mapping[str, str], name: str) -> str:
    value = options.get(name.lower(), "").strip()
    if not value:
        raise OptionError(f"option {name!r} is required")
    return value


def _optional_positive_int(options: Mapping[str, str], name: str) -> int | None:
    text = options.get(name.lower())
    if text is None or not text.strip():
        return None
    try:
        value = int(text)
    except ValueError:
        raise OptionError(f"option {name!r} must be an integer, got {text!r}") from None
    if value <= 0:
        raise OptionError(f"option {name!r} must be positive, got {value}")
    return value


def _number(options: Mapping[str, str], name: str) -> tuple[float, str] | None:
    """The option's value and its text; None when it is not given."""
    text = options.get(name.lower())
    if text is None or not text.strip():
        return None
    try:
        return float(text), text
    except ValueError:
        raise OptionError(f"option {name!r} must be a number, got {text!r}") from None


def _positive_float(options: Mapping[str, str], name: str, default: float) -> float:
    given = _number(options, name)
    if given is None:
        return default
    value, _ = given
    if value <= 0:
        raise OptionError(f"option {name!r} must be positive, got {value}")
    return value


def _non_negative_float(options: Mapping[str, str], name: str, default: float) -> float:
    given = _number(options, name)
    if given is None:
        return default
    value, text = given
    if not value >= 0 or value == float("inf"):  # also refuses nan
        raise OptionError(f"option {name!r} must be a finite number of seconds, at least 0, got {text!r}")
    return value


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    text = options.get(name.lower())
    if text is None or not text.strip():
        return default
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise OptionError(f"option {name!r} must be true or false, got {text!r}")


def parse_starting(text: str | None) -> StartingPosition | ShardOffsets:
    """`earliest` (default), `latest`, or JSON offsets like {"0": 17, "1": 5}."""
    if text is None or not text.strip():
        return StartingPosition.EARLIEST
    stripped = text.strip()
    if stripped.lower() in (StartingPosition.EARLIEST.value, StartingPosition.LATEST.value):
        return StartingPosition(stripped.lower())
    try:
        decoded = json.loads(stripped)
        return offsets_from_json(decoded)
    except (ValueError, TypeError) as error:
        raise OptionError(
            f"option 'startingOffsets' must be earliest, latest or JSON like {{\"0\": 17}}, got {text!r} ({error})"
        ) from None


def read_options_from_spark(options: Mapping[str, str]) -> ReadOptions:
    _refuse_unknown(options, READ_OPTION_NAMES)
    lowered = _lowered(options)
    read_text = lowered.get("read", ReadKind.MESSAGES.value).strip().lower()
    try:
        read = ReadKind(read_text)
    except ValueError:
        raise OptionError(f"option 'read' must be 'messages' or 'journal', got {read_text!r}") from None
    return ReadOptions(
        endpoint=_required(lowered, "endpoint"),
        queue=_required(lowered, "queue"),
        read=read,
        include_body=_bool(lowered, "includeBody", False),
        export_batch_size=_optional_positive_int(lowered, "batchSize") or DEFAULT_EXPORT_BATCH_SIZE,
        rpc_timeout_seconds=_positive_float(lowered, "rpcTimeoutSeconds", DEFAULT_RPC_TIMEOUT_SECONDS),
        retry_seconds=_non_negative_float(lowered, "retrySeconds", DEFAULT_READ_RETRY_SECONDS),
        max_rows_per_batch=_optional_positive_int(lowered, "maxRowsPerBatch"),
        starting=parse_starting(lowered.get("startingoffsets")),
        fail_on_data_loss=_bool(lowered, "failOnDataLoss", True),
    )


def write_options_from_spark(options: Mapping[str, str]) -> WriteOptions:
    _refuse_unknown(options, WRITE_OPTION_NAMES)
    lowered = _lowered(options)
    send_batch_size = _optional_positive_int(lowered, "batchSize") or DEFAULT_SEND_BATCH_SIZE
    if send_batch_size > MAX_SEND_BATCH:
        raise OptionError(f"option 'batchSize' of a write is at most {MAX_SEND_BATCH}, got {send_batch_size}")
    write_id = lowered.get("writeid", "").strip() or None
    dedup_id_column = lowered.get("dedupidcolumn", "").strip() or None
    return WriteOptions(
        endpoint=_required(lowered, "endpoint"),
        queue=_required(lowered, "queue"),
        write_id=write_id,
        dedup_id_column=dedup_id_column,
        send_batch_size=send_batch_size,
        rpc_timeout_seconds=_positive_float(lowered, "rpcTimeoutSeconds", DEFAULT_RPC_TIMEOUT_SECONDS),
        queue_full_patience_seconds=_positive_float(lowered, "queueFullPatienceSeconds", 60.0),
    )
