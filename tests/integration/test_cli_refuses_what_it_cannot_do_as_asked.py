"""The `shardq` command line refuses what it cannot do as asked, in one line that names
the option, file line or setting at fault, instead of doing something else (null read as
"None", --max 0 read as "all", options silently ignored) or printing a traceback."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

from tests.support.ports import free_port
from tests.support.servers import ServerFactory, ServerProcess

QUEUE = "orders-dlq"


@dataclasses.dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str


def shardq(*args: str, endpoint: str = "", stdin: bytes = b"") -> Ran:
    environment = {"PATH": "/usr/bin:/bin"} | ({"SHARDQ_ENDPOINT": endpoint} if endpoint else {})
    done = subprocess.run(
        [sys.executable, "-m", "shardq", *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        check=False,
        env=environment,
    )
    return Ran(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))


def ok(server: ServerProcess, *args: str) -> str:
    done = shardq(*args, endpoint=server.endpoint)
    assert done.returncode == 0, done.stderr
    return done.stdout


def refused(done: Ran, *, exit_code: int, saying: tuple[str, ...]) -> None:
    assert done.returncode == exit_code, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    for text in saying:
        assert text in done.stderr, (text, done.stderr)


def visible(server: ServerProcess, queue: str = QUEUE) -> int:
    count = json.loads(ok(server, "stats", "--queue", queue, "--json"))["visible"]
    assert isinstance(count, int)
    return count


def jsonl(*lines: object) -> str:
    return "".join(json.dumps(line) + "\n" for line in lines)


def test_null_optional_fields_count_as_absent_so_each_line_is_its_own_message(
    server: ServerProcess, tmp_path: pathlib.Path
) -> None:
    source = tmp_path / "nulls.jsonl"
    source.write_text(
        jsonl(
            {"body": "a", "dedup_id": None, "group_id": None},
            {"body": "b", "dedup_id": None, "attributes": None},
            {"body": "c", "dedup_id": None, "delay": None},
        )
    )
    first = ok(server, "send", "--queue", QUEUE, "--file", str(source), "--json")
    assert json.loads(first) == {"sent": 3, "duplicates": 0}
    assert visible(server) == 3
    # Each line got the dedup id derived from it, as a line without the key does.
    again = ok(server, "send", "--queue", QUEUE, "--file", str(source), "--json")
    assert json.loads(again) == {"sent": 0, "duplicates": 3}
    assert visible(server) == 3


def test_redrive_max_takes_a_positive_count_and_refuses_zero_or_less(server: ServerProcess) -> None:
    for body in ("one", "two"):
        ok(server, "send", "--queue", QUEUE, "--body", body)
    for bad in ("0", "-1"):
        done = shardq("redrive", "--from", QUEUE, "--to", "orders", "--max", bad, endpoint=server.endpoint)
        refused(done, exit_code=2, saying=("Invalid value for '--max'", f"{bad} is not in the range x>=1"))
    assert visible(server) == 2
    assert ok(server, "redrive", "--from", QUEUE, "--to", "orders", "--max", "1").strip() == "moved 1"
    assert visible(server) == 1


def test_a_file_line_that_is_not_utf8_is_named_from_a_file_and_from_stdin(
    server: ServerProcess, tmp_path: pathlib.Path
) -> None:
    content = b'{"body": "fine"}\n{"body":"caf\xe9"}\n'
    source = tmp_path / "latin1.jsonl"
    source.write_bytes(content)
    expected = "line 2: not UTF-8 text (byte 0xe9 at column 13)"
    from_file = shardq("send", "--queue", QUEUE, "--file", str(source), endpoint=server.endpoint)
    from_stdin = shardq("send", "--queue", QUEUE, "--file", "-", endpoint=server.endpoint, stdin=content)
    for done in (from_file, from_stdin):
        refused(done, exit_code=1, saying=(expected,))
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert visible(server) == 0


def test_serve_with_broken_yaml_names_the_file_line_and_column(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "queues.yaml"
    config.write_text("queues:\n  orders:\n    shards: 4\n   visibility: [30s\n")
    done = shardq("serve", "--data-dir", str(tmp_path / "data"), "--port", str(free_port()), "--config", str(config))
    refused(done, exit_code=1, saying=(f"{config}: not valid YAML at line 4, column 4",))
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_send_file_refuses_the_options_a_line_carries_itself(server: ServerProcess, tmp_path: pathlib.Path) -> None:
    source = tmp_path / "one.jsonl"
    source.write_text(jsonl({"body": "a"}))
    options = ("--delay", "60s", "--attr", "a=b", "--group", "g", "--dedup-id", "X", "--priority", "0")
    done = shardq("send", "--queue", QUEUE, "--file", str(source), *options, endpoint=server.endpoint)
    refused(
        done,
        exit_code=2,
        saying=(
            "--delay, --attr, --group, --dedup-id, --priority cannot be used with --file",
            "a --file line carries its own delay, attributes, group_id, dedup_id and priority",
        ),
    )
    assert visible(server) == 0


def test_a_request_refused_whole_names_the_file_line_and_what_was_acknowledged(
    server: ServerProcess, tmp_path: pathlib.Path
) -> None:
    # A blank line 11 puts each later message one line below its place in the file's
    # messages: message 230 (the 30th of the third batch of 100) is on line 231.
    messages: list[dict[str, object]] = [{"body": f"m{n}"} for n in range(1, 261)]
    messages[229]["attributes"] = {"shardq.x": "reserved"}
    source = tmp_path / "bulk.jsonl"
    source.write_text(jsonl(*messages[:10]) + "\n" + jsonl(*messages[10:]))
    done = shardq("send", "--queue", QUEUE, "--file", str(source), endpoint=server.endpoint)
    refused(
        done,
        exit_code=1,
        saying=(
            "line 231: INVALID_ARGUMENT: messages[29].attributes",
            "200 of 260 messages acknowledged before it; its batch, from line 202, stored nothing",
        ),
    )
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert visible(server) == 200


def test_unknown_keys_and_two_bodies_in_a_file_line_are_refused(server: ServerProcess, tmp_path: pathlib.Path) -> None:
    typo = tmp_path / "typo.jsonl"
    typo.write_text(jsonl({"body": "a"}, {"body": "b", "dedupId": "x", "delay_ms": 5}))
    done = shardq("send", "--queue", QUEUE, "--file", str(typo), endpoint=server.endpoint)
    refused(
        done,
        exit_code=1,
        saying=(
            "line 2: unknown key(s) 'dedupId', 'delay_ms'",
            "the keys are body, body_base64, attributes, group_id, dedup_id, delay",
        ),
    )
    both = tmp_path / "both.jsonl"
    both.write_text(jsonl({"body": "a", "body_base64": "Yg=="}))
    done = shardq("send", "--queue", QUEUE, "--file", str(both), endpoint=server.endpoint)
    refused(done, exit_code=1, saying=("line 1: give 'body' or 'body_base64', not both",))
    assert visible(server) == 0


def test_a_map_size_that_is_not_a_size_names_the_option(tmp_path: pathlib.Path) -> None:
    done = shardq("serve", "--data-dir", str(tmp_path / "data"), "--port", str(free_port()), "--map-size", "lots")
    refused(done, exit_code=2, saying=("Invalid value for '--map-size'", "'lots' is not a size"))


def test_an_endpoint_whose_host_does_not_resolve_says_so_once() -> None:
    # .invalid never resolves (RFC 6761), whatever the resolver's search domains.
    done = shardq("receive", "--queue", QUEUE, "--endpoint", "no-such-host.invalid:7600")
    refused(
        done,
        exit_code=1,
        saying=("cannot resolve host 'no-such-host.invalid' (from --endpoint/SHARDQ_ENDPOINT",),
    )
    assert "UNAVAILABLE: UNAVAILABLE" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_peek_refuses_more_than_one_call_can_show(server: ServerProcess) -> None:
    ok(server, "send", "--queue", QUEUE, "--body", "look")
    done = shardq("receive", "--queue", QUEUE, "--peek", "--max", "2500", endpoint=server.endpoint)
    refused(done, exit_code=2, saying=("--peek shows at most 1000 messages",))
    assert len(ok(server, "receive", "--queue", QUEUE, "--peek", "--max", "1000").splitlines()) == 1


def test_queues_show_settings_that_are_zero(server_factory: ServerFactory) -> None:
    server = server_factory("instant:visibility=0s,dedup_window=0s")
    (listed,) = [json.loads(line) for line in ok(server, "queues", "--json").splitlines()]
    assert listed["settings"]["visibility_timeout_ms"] == 0
    assert listed["settings"]["dedup_window_ms"] == 0
    table = ok(server, "queues")
    assert "visibility_timeout=0s" in table
    assert "dedup_window=0s" in table
    assert "dead_letter_queue=-" in table


def test_a_visibility_timeout_out_of_range_names_the_timeout_option(server: ServerProcess) -> None:
    """It named `changes[0].visibility_timeout_ms`, a request field the user never wrote."""
    ok(server, "send", "--queue", QUEUE, "--body", "held")
    (received,) = [json.loads(line) for line in ok(server, "receive", "--queue", QUEUE, "--json").splitlines()]
    done = shardq(
        "change-visibility", "--queue", QUEUE, "--receipt", received["receipt"], "--timeout", "400d",
        endpoint=server.endpoint,
    )  # fmt: skip
    refused(done, exit_code=2, saying=("Invalid value for --timeout: must be",))
    assert "changes[0]" not in done.stderr


def test_line_dedup_options_go_with_a_file_only(server: ServerProcess) -> None:
    done = shardq("send", "--queue", QUEUE, "--body", "one", "--no-line-dedup", endpoint=server.endpoint)
    refused(done, exit_code=2, saying=("--line-dedup/--no-line-dedup go with --file",))
    assert visible(server) == 0


def test_a_redrive_that_leaves_messages_behind_says_so(server: ServerProcess) -> None:
    """It printed "moved N" alone, which read as the whole queue moved."""
    ok(server, "send", "--queue", QUEUE, "--body", "claimed elsewhere")
    ok(server, "receive", "--queue", QUEUE, "--visibility", "60s")  # in flight: not movable now
    ok(server, "send", "--queue", QUEUE, "--body", "movable")
    done = shardq("redrive", "--from", QUEUE, "--to", "orders", endpoint=server.endpoint)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "moved 1"
    assert f"warning: 1 message(s) of {QUEUE} were not moved" in done.stderr
