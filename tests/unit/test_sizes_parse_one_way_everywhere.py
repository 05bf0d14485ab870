"""A size means one thing wherever it is written: queue settings (`maxMessageBytes`,
queues.yaml, `--queue`) and `shardq serve --map-size` read it with one parser, and each
keeps its own rules on top (whole numbers for settings, at least 1 byte for the map)."""

from __future__ import annotations

import decimal
import re

import click
import pytest

from shard_server.cli import ByteSize
from shardq.durations import parse_duration_ms, shown_briefly
from shardq.errors import InvalidArgument
from shardq.queues import check_queue_name, queue_config_from_spec
from shardq.sizes import MAX_SIZE_BYTES, NotASize, parse_size

UNITS = {
    1: ("", "b"),
    1 << 10: ("k", "ki", "kib", "kb"),
    1 << 20: ("m", "mi", "mib", "mb"),
    1 << 30: ("g", "gi", "gib", "gb"),
    1 << 40: ("t", "ti", "tib", "tb"),
}
SPELLINGS = [(spelling, size) for size, spellings in UNITS.items() for spelling in spellings]
NOT_SIZES = ["", "lots", "-1", "+1", "1e9", "inf", "nan", ".5", "1.", "1 2", "1kibb", "1 KiB B", "1pb", "0x10", "1_000"]


def map_size(text: str) -> int:
    return ByteSize().convert(text, None, None)


def max_depth(text: str) -> int:
    # maxDepth has no ceiling below MAX_SIZE_BYTES, so it shows what the settings parser keeps.
    return queue_config_from_spec("orders", {"maxDepth": text}).max_depth


@pytest.mark.parametrize(("unit", "size"), SPELLINGS)
def test_every_unit_is_binary_in_any_case_and_both_callers_agree(unit: str, size: int) -> None:
    for spelled in (unit, unit.upper(), unit.capitalize()):
        for text in (f"3{spelled}", f" 3 {spelled} "):
            assert parse_size(text) == 3 * size
            assert map_size(text) == 3 * size
            assert max_depth(text) == 3 * size


@pytest.mark.parametrize(
    ("text", "size"),
    [("1.5GiB", decimal.Decimal(3 << 29)), ("0.5k", 512), ("1.3k", decimal.Decimal("1331.2")), ("0.25", "0.25")],
)
def test_decimals_are_read_exactly(text: str, size: decimal.Decimal | int | str) -> None:
    assert parse_size(text) == decimal.Decimal(size)


def test_a_whole_number_past_float_precision_stays_itself() -> None:
    assert parse_size("9007199254740993") == 9007199254740993  # float would make it ...992
    assert max_depth("9007199254740993") == 9007199254740993


@pytest.mark.parametrize("text", NOT_SIZES)
def test_text_that_is_not_a_size_is_refused_in_each_callers_words(text: str) -> None:
    with pytest.raises(NotASize):
        parse_size(text)
    with pytest.raises(click.BadParameter, match=r"is not a size: use e\.g\. 256MiB, 64GiB or a number of bytes"):
        map_size(text)
    with pytest.raises(ValueError, match="maxMessageBytes: expected a number, got"):
        queue_config_from_spec("orders", {"maxMessageBytes": text})


@pytest.mark.parametrize("text", ["9" * 400, "9" * 100_000 + "TiB", str(MAX_SIZE_BYTES + 1), "8388608TiB"])
def test_a_size_past_int64_is_refused_briefly_not_as_infinity(text: str) -> None:
    """Through float, "9" * 400 was infinity; through exact arithmetic it would reach LMDB."""
    with pytest.raises(ValueError, match="too large") as raised:
        parse_size(text)
    assert len(str(raised.value)) < 200
    with pytest.raises(click.BadParameter, match="too large"):
        map_size(text)
    with pytest.raises(ValueError, match=r"maxDepth: expected a number up to \d+") as refused:
        max_depth(text)
    assert len(str(refused.value)) < 200


def test_the_largest_size_is_accepted() -> None:
    assert parse_size(str(MAX_SIZE_BYTES)) == MAX_SIZE_BYTES
    assert map_size(str(MAX_SIZE_BYTES)) == MAX_SIZE_BYTES


def test_a_queue_setting_takes_a_decimal_only_when_it_comes_to_whole_bytes() -> None:
    assert queue_config_from_spec("orders", {"maxMessageBytes": "1.5k"}).max_message_bytes == 1536
    assert queue_config_from_spec("orders", {"maxMessageBytes": "2.0MiB"}).max_message_bytes == 2 << 20
    with pytest.raises(
        ValueError, match=r"maxMessageBytes: expected a whole number, got '1.3k' \(between 1331 and 1332\)"
    ):
        queue_config_from_spec("orders", {"maxMessageBytes": "1.3k"})
    with pytest.raises(ValueError, match="shards: expected a whole number"):
        queue_config_from_spec("orders", {"shards": "1.5"})


def test_a_fraction_finer_than_any_unit_is_not_taken_for_a_whole_number() -> None:
    """Through float, 4.000000000000000001k was 4096.0 and would have been taken."""
    with pytest.raises(ValueError, match="expected a whole number"):
        queue_config_from_spec("orders", {"maxMessageBytes": "4.000000000000000001k"})
    assert map_size("4.000000000000000001k") == 4096


def test_the_map_size_drops_a_fraction_of_a_byte_and_needs_at_least_one() -> None:
    assert map_size("1.5") == 1
    assert map_size("1.999") == 1
    for text in ("0", "0.5", "0b", "0GiB"):
        with pytest.raises(click.BadParameter, match=re.escape(f"'{text}' is not a size of at least 1 byte")):
            map_size(text)


def test_settings_still_take_what_they_took() -> None:
    """Plain numbers (from YAML, ints), and each unit spelling the settings knew before."""
    spec = {"maxMessageBytes": 4096, "maxDepth": "1k", "maxReceiveCount": "3", "deadLetterQueue": "dlq"}
    config = queue_config_from_spec("orders", spec)
    assert (config.max_message_bytes, config.max_depth, config.max_receive_count) == (4096, 1024, 3)
    with pytest.raises(ValueError, match="maxMessageBytes: expected a number, got True"):
        queue_config_from_spec("orders", {"maxMessageBytes": True})
    with pytest.raises(ValueError, match="maxMessageBytes: expected a number, got inf"):
        queue_config_from_spec("orders", {"maxMessageBytes": float("inf")})


def test_long_input_is_shown_briefly_the_same_way_by_every_message() -> None:
    assert shown_briefly("orders") == "'orders'"
    assert shown_briefly("x" * 40) == repr("x" * 40)
    assert shown_briefly("x" * 41) == f"{'x' * 40!r}... (41 characters)"
    assert shown_briefly("abcdef", limit=3) == "'abc'... (6 characters)"
    long = "y" * 20_000
    with pytest.raises(ValueError, match="not a duration") as duration:
        parse_duration_ms(long)
    with pytest.raises(InvalidArgument, match="is not a queue name") as name:
        check_queue_name(long)
    with pytest.raises(NotASize) as size:
        parse_size(long)
    for raised in (duration, name, size):
        assert shown_briefly(long) in str(raised.value)
        assert len(str(raised.value)) < 200


def test_durations_in_queue_settings_are_not_read_as_sizes() -> None:
    with pytest.raises(ValueError, match=r"^visibility: duration '9+'\.\.\. \(100000 characters\) is too long"):
        queue_config_from_spec("orders", {"visibility": "9" * 100_000})
    with pytest.raises(ValueError, match="visibility: not a duration"):
        queue_config_from_spec("orders", {"visibility": "1k"})
