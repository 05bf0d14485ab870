"""Queue settings read the same from --queue, queues.yaml and a Queue spec; bad ones
are refused with the setting's name."""

from __future__ import annotations

import math

import pytest

from shard_server.domain.validation import validate_message
from shardq.durations import format_duration_ms, parse_duration_ms
from shardq.errors import InvalidArgument
from shardq.queues import SETTING_NAMES, QueueConfig, merged_spec, parse_queue_option, queue_config_from_spec


def test_command_line_spec() -> None:
    config = parse_queue_option("orders:shards=4,fifo=true,visibility=10s,dead_letter_queue=dlq,max_receive_count=3")
    assert config == QueueConfig(
        name="orders", shards=4, fifo=True, visibility_timeout_ms=10_000, dead_letter_queue="dlq", max_receive_count=3
    )


def test_queue_resource_spec_with_camel_case_and_redrive_policy() -> None:
    spec = {
        "shards": 2,
        "visibilityTimeout": "45s",
        "retention": "14d",
        "maxMessageSize": "2MiB",
        "redrivePolicy": {"deadLetterQueue": "dlq", "maxReceiveCount": 5},
        "deliveryDelay": "1h",
    }
    config = queue_config_from_spec("orders", spec)
    assert config.visibility_timeout_ms == 45_000
    assert config.retention_ms == 14 * 86_400_000
    assert config.max_message_bytes == 2 * 1024 * 1024
    assert (config.dead_letter_queue, config.max_receive_count) == ("dlq", 5)
    # Beyond SQS's 15-minute delay cap: anything up to the retention period.
    assert config.delivery_delay_ms == 3_600_000


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("orders:shards=0", "shards"),
        ("orders:visibility=30d", "visibility timeout"),
        ("orders:color=blue", "color: unknown queue setting"),
        ("orders:dead_letter_queue=dlq", "go together"),
        ("Orders", "DNS label"),
        ("orders:visibility=soon", "visibility"),
        ("orders:fifo=maybe", "fifo"),
        ("orders:dead_letter_queue=orders,max_receive_count=1", "own dead-letter queue"),
    ],
)
def test_bad_settings_name_the_problem(spec: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_queue_option(spec)


@pytest.mark.parametrize(
    ("spec", "keys"),
    [
        ({"visibilityTimeout": "20s", "visibility": "10s"}, "visibility and visibilityTimeout"),
        ({"visibility_timeout": "20s", "visibilityTimeout": "10s"}, "visibilityTimeout and visibility_timeout"),
        ({"maxMessageBytes": "1KiB", "max_message_size": "2KiB"}, "maxMessageBytes and max_message_size"),
        (
            {"dlq": "a", "redrivePolicy": {"deadLetterQueue": "b", "maxReceiveCount": 2}},
            "dlq and redrivePolicy.deadLetterQueue",
        ),
    ],
)
def test_two_keys_for_one_setting_are_refused_naming_both(spec: dict[str, object], keys: str) -> None:
    """Whichever came last once won, silently."""
    with pytest.raises(ValueError, match=f"{keys} set the same setting"):
        queue_config_from_spec("orders", spec)


def test_a_key_given_twice_on_the_command_line_is_refused() -> None:
    with pytest.raises(ValueError, match="visibility is given twice"):
        parse_queue_option("orders:visibility=1s,visibility=2s")


@pytest.mark.parametrize("seconds", [math.inf, math.nan, -1, 10**30])
def test_a_bare_number_that_is_no_duration_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError, match=r"visibility: .* is not a duration"):
        queue_config_from_spec("orders", {"visibility": seconds})


def test_a_change_replaces_the_setting_however_either_key_is_spelled() -> None:
    assert merged_spec({"visibility": "10s", "shards": "2"}, {"visibilityTimeout": "20s"}) == {
        "shards": "2",
        "visibilityTimeout": "20s",
    }
    # One half of a redrive policy changed: the other half stays.
    assert merged_spec(
        {"redrivePolicy": {"deadLetterQueue": "dlq", "maxReceiveCount": 3}}, {"max_receive_count": "5"}
    ) == {"deadLetterQueue": "dlq", "max_receive_count": "5"}
    config = queue_config_from_spec("orders", merged_spec({"visibility": "10s"}, {"visibility_timeout": "20s"}))
    assert config.visibility_timeout_ms == 20_000


@pytest.mark.parametrize(
    ("text", "ms"), [("250ms", 250), ("30s", 30_000), ("1h30m", 5_400_000), ("2", 2_000), ("7d", 604_800_000)]
)
def test_durations(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["9" * 100_000, "9" * 400 + "d", "9223372036854775808ms"])
def test_a_duration_beyond_int64_milliseconds_is_too_long_not_an_overflow(text: str) -> None:
    with pytest.raises(ValueError, match="too long") as raised:
        parse_duration_ms(text)
    assert len(str(raised.value)) < 200


def test_duration_formatting_round_trips() -> None:
    for ms in (250, 30_000, 5_400_000, 604_800_000):
        assert parse_duration_ms(format_duration_ms(ms)) == ms


def test_an_unknown_setting_error_lists_every_valid_name_and_each_is_accepted() -> None:
    with pytest.raises(ValueError, match="unknown queue setting") as raised:
        queue_config_from_spec("orders", {"colour": "blue"})
    for name in SETTING_NAMES:
        assert name in str(raised.value)
    values = {
        "fifo": True,
        "contentBasedDedup": True,
        "priorityLanes": 3,
        "receiveWait": "20s",
        "deadLetterQueue": "dlq",
        "maxReceiveCount": 3,
        "redrivePolicy": {"deadLetterQueue": "dlq", "maxReceiveCount": 3},
        "shards": 2,
        "replicas": 1,
        "maxMessageBytes": "1KiB",
        "maxDepth": 10,
        "retention": "4d",
        "nackBackoffBase": "1s",
        "nackBackoffMax": "1m",
    }
    for name in SETTING_NAMES:
        spec: dict[str, object] = {name: values.get(name, "1h")}
        if name == "deadLetterQueue":
            spec["maxReceiveCount"] = 3
        if name == "maxReceiveCount":
            spec["deadLetterQueue"] = "dlq"
        queue_config_from_spec("orders", spec)  # accepted: no unknown-setting error


def test_duration_errors_are_shown_as_people_write_durations() -> None:
    config = QueueConfig(name="orders")  # retention 4 days
    with pytest.raises(InvalidArgument) as raised:
        validate_message(config, index=0, body=b"x", attributes={}, group_id="", dedup_id="", delay_ms=5 * 86_400_000)
    assert "must be 0s..4d (the retention period), got 5d" in str(raised.value)


def test_content_based_dedup_is_read_by_its_name_and_by_sqs_name_and_needs_a_dedup_window() -> None:
    assert not QueueConfig(name="orders").content_based_dedup
    assert queue_config_from_spec("orders", {"contentBasedDedup": True}).content_based_dedup
    assert queue_config_from_spec("orders", {"content_based_dedup": "true"}).content_based_dedup
    assert queue_config_from_spec("orders", {"ContentBasedDeduplication": "true"}).content_based_dedup
    with pytest.raises(ValueError, match="ContentBasedDeduplication and contentBasedDedup set the same setting"):
        queue_config_from_spec("orders", {"contentBasedDedup": True, "ContentBasedDeduplication": False})
    with pytest.raises(ValueError, match="contentBasedDedup: expected true or false, got 'sometimes'"):
        queue_config_from_spec("orders", {"contentBasedDedup": "sometimes"})
    with pytest.raises(ValueError, match="contentBasedDedup needs a dedup window"):
        queue_config_from_spec("orders", {"contentBasedDedup": True, "dedupWindow": "0s"})
    # Changed under its other name, the setting replaces the one it was created with.
    merged = merged_spec({"contentBasedDedup": True}, {"ContentBasedDeduplication": False})
    assert merged == {"ContentBasedDeduplication": False}
    assert not queue_config_from_spec("orders", merged).content_based_dedup


def test_priority_lanes_are_1_to_10_and_not_on_fifo_queues() -> None:
    assert QueueConfig(name="orders").priority_lanes == 1
    assert queue_config_from_spec("orders", {"priorityLanes": 10}).priority_lanes == 10
    assert queue_config_from_spec("orders", {"priority_lanes": "3"}).priority_lanes == 3
    for lanes in (0, 11):
        with pytest.raises(ValueError, match=r"priority lanes must be 1\.\.10"):
            queue_config_from_spec("orders", {"priorityLanes": lanes})
    with pytest.raises(ValueError, match="a FIFO queue has no priority lanes"):
        queue_config_from_spec("orders", {"fifo": True, "priorityLanes": 2})
    assert queue_config_from_spec("orders", {"fifo": True, "priorityLanes": 1}).fifo


def test_receive_wait_is_a_duration_up_to_a_long_polls_limit_also_by_its_sqs_name() -> None:
    assert QueueConfig(name="orders").receive_wait_ms == 0
    assert queue_config_from_spec("orders", {"receiveWait": "20s"}).receive_wait_ms == 20_000
    assert queue_config_from_spec("orders", {"ReceiveMessageWaitTimeSeconds": 20}).receive_wait_ms == 20_000
    assert queue_config_from_spec("orders", {"receive_wait": "15m"}).receive_wait_ms == 15 * 60_000
    with pytest.raises(ValueError, match=r"receive wait must be 0\.\.15m"):
        queue_config_from_spec("orders", {"receiveWait": "16m"})
