"""A misspelt Spark option is an error naming it and the nearest valid one, not a
silently ignored setting (pure: no Spark needed)."""

from __future__ import annotations

import pytest

from shardq.spark.options import (
    READ_OPTION_NAMES,
    WRITE_OPTION_NAMES,
    OptionError,
    read_options_from_spark,
    write_options_from_spark,
)


def test_a_misspelt_read_option_is_refused_with_a_suggestion() -> None:
    with pytest.raises(OptionError) as refused:
        read_options_from_spark({"endpoint": "e:1", "queue": "q", "includBody": "true"})
    assert "unknown option 'includBody'" in str(refused.value)
    assert "did you mean 'includeBody'?" in str(refused.value)


def test_a_misspelt_write_option_is_refused() -> None:
    with pytest.raises(OptionError, match="unknown option 'dedupColumn'"):
        write_options_from_spark({"endpoint": "e:1", "queue": "q", "dedupColumn": "id"})


def test_every_documented_option_is_accepted_in_any_case() -> None:
    read = {name.upper(): "1" for name in READ_OPTION_NAMES}
    read.update({"ENDPOINT": "e:1", "QUEUE": "q", "READ": "journal", "INCLUDEBODY": "true"})
    read.update({"STARTINGOFFSETS": "earliest", "FAILONDATALOSS": "false"})
    assert read_options_from_spark(read).include_body is True
    write = {name.lower(): "1" for name in WRITE_OPTION_NAMES}
    write.update({"endpoint": "e:1", "queue": "q", "writeid": "w", "dedupidcolumn": "id"})
    assert write_options_from_spark(write).dedup_id_column == "id"
    # Spark's own `path` (from load(path)) is not ours to refuse.
    assert read_options_from_spark({"endpoint": "e:1", "queue": "q", "path": "x"}).queue == "q"


def test_the_read_retry_budget_is_seconds_at_least_zero() -> None:
    base = {"endpoint": "e:1", "queue": "q"}
    assert read_options_from_spark(base).retry_seconds == 60.0
    assert read_options_from_spark({**base, "retrySeconds": "0"}).retry_seconds == 0.0
    assert read_options_from_spark({**base, "retryseconds": "2.5"}).retry_seconds == 2.5
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(OptionError, match="option 'retrySeconds' must be"):
            read_options_from_spark({**base, "retrySeconds": bad})
