"""The `shardq` command line: queue operations against any server.

Commands that need more than the client (`serve`, `local`, `analytics`) are
contributed through the `shardq.cli` entry-point group by the packages that
implement them, so this package never imports the server.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import json
import math
import os
import pathlib
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO, ParamSpec, TypeVar

import click

from shardq.aio import DEFAULT_ENDPOINT
from shardq.bearer_tokens import TOKEN_FILE_ENV
from shardq.client import Client
from shardq.durations import format_duration_ms, parse_duration_ms
from shardq.errors import InvalidArgument, Reason, ShardqError
from shardq.queues import MAX_RECEIVE_BATCH
from shardq.status import UNRESOLVED_HOST_TEXTS
from shardq.tls import CA_FILE_ENV, SERVER_NAME_ENV, TLS_ENV
from shardq.types import EntryResult, Message, QueueAttributes, ReceivedMessage

P = ParamSpec("P")
R = TypeVar("R")
FILE_BATCH = 100
# The keys a `send --file` line may have; any other is refused, so a typo ("dedupId")
# is not silently dropped.
FILE_LINE_KEYS = ("body", "body_base64", "attributes", "group_id", "dedup_id", "delay", "priority")
# The field path of a whole-request refusal that one message of the batch caused.
FIELD_OF_A_MESSAGE = re.compile(r"messages\[(\d+)\]")


class Duration(click.ParamType[int]):
    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_duration_ms(str(value))
        except ValueError as error:
            self.fail(str(error), param, ctx)


class Rate(click.ParamType[float]):
    name = "rate"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        text = str(value).strip().lower().removesuffix("/s")
        try:
            rate = float(text)
        except ValueError:
            self.fail(f"{value!r} is not a rate like 500/s", param, ctx)
        if not (math.isfinite(rate) and rate >= 0):
            self.fail(f"{value!r} is not a rate: a finite number >= 0 (0: no limit), like 500/s", param, ctx)
        return rate


DURATION = Duration()


def host_of(endpoint: str) -> str:
    """The host part of a gRPC target: `dns:///h:7600`, `h:7600`, `[::1]:7600` or `h`."""
    target = endpoint.rpartition("///")[2]
    host, colon, port = target.rpartition(":")
    if not colon or not port.isdigit() or (":" in host and not host.startswith("[")):
        return target
    return host.removeprefix("[").removesuffix("]")


# What gRPC's transport says when TLS is what failed (its words, from BoringSSL).
UNTRUSTED_CERTIFICATE_TEXTS = ("CERTIFICATE_VERIFY_FAILED", "BAD_SIGNATURE", "certificate signature failure")


def explain_tls(text: str, endpoint: str) -> str | None:
    """A TLS failure in words, or None for another failure."""
    speaking_tls = bool(os.environ.get(CA_FILE_ENV) or os.environ.get(TLS_ENV))
    if "WRONG_VERSION_NUMBER" in text:
        return f"{endpoint} does not speak TLS (it answered the handshake in plaintext): drop --ca-file/--tls"
    if any(words in text for words in UNTRUSTED_CERTIFICATE_TEXTS):
        trusted = os.environ.get(CA_FILE_ENV) or "the system's trusted roots"
        return f"{endpoint}'s TLS certificate is not signed by a CA in {trusted}: check --ca-file/SHARDQ_CA_FILE"
    if "Hostname Verification" in text:
        name = os.environ.get(SERVER_NAME_ENV) or host_of(endpoint)
        return (
            f"{endpoint}'s TLS certificate does not carry the name {name!r}: "
            "give --tls-server-name with a name it carries"
        )
    if "Socket closed" in text and not speaking_tls:
        return (
            f"{endpoint} closed the connection at once: if it serves TLS, give --ca-file (or --tls); "
            f"otherwise check that it is a shardq server ({text})"
        )
    return None


def explain(error: ShardqError, endpoint: str | None) -> str:
    """One line saying what went wrong and what to check; transport failures in words."""
    text = str(error)
    if error.reason is Reason.UNAVAILABLE and error.message.startswith(f"{Reason.UNAVAILABLE}: "):
        # A transport failure's message starts with its gRPC status code, which for
        # UNAVAILABLE repeats the reason: say it once.
        text = error.message
    if error.reason is not Reason.UNAVAILABLE or endpoint is None:
        return text
    tls_hint = explain_tls(text, endpoint)
    if tls_hint is not None:
        return tls_hint
    if "Connection refused" in text:
        return (
            f"no shardq server at {endpoint} (connection refused): is `shardq serve` running there? "
            "Check --endpoint or SHARDQ_ENDPOINT."
        )
    if "HTTP/2" in text or "Expected SETTINGS frame" in text:
        return (
            f"{endpoint} is not a shardq gRPC endpoint (it does not speak HTTP/2; a metrics or web port?): "
            "check --endpoint."
        )
    if "Deadline" in text or "timed out" in text.lower():
        return f"{endpoint} did not answer in time: check that the server is up and reachable ({text})"
    if any(words in text for words in UNRESOLVED_HOST_TEXTS):
        return (
            f"cannot resolve host {host_of(endpoint)!r} (from --endpoint/SHARDQ_ENDPOINT {endpoint!r}): check the name"
        )
    return f"{endpoint}: {text}"


def fail_cleanly(command: Callable[P, R]) -> Callable[P, R]:
    """One-line reason and a non-zero exit for any queue error."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except ShardqError as error:
            endpoint = kwargs.get("endpoint")
            raise click.ClickException(explain(error, endpoint if isinstance(endpoint, str) else None)) from None

    return wrapper


def _use_environment(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    # Every client this process makes reads its token file (shardq.bearer_tokens) and TLS
    # settings (shardq.tls) from the environment: the options set it for them.
    def use(context: click.Context, parameter: click.Parameter, value: Any) -> None:
        if value:
            os.environ[name] = "1" if value is True else str(value)

    return use


def tls_options(command: Callable[P, R]) -> Callable[P, R]:
    """--ca-file, --tls and --tls-server-name, for servers that serve TLS."""
    for option in (
        click.option(
            "--tls-server-name",
            default=None,
            envvar=SERVER_NAME_ENV,
            expose_value=False,
            callback=_use_environment(SERVER_NAME_ENV),
            help="the name the server's certificate must carry, when --endpoint's host is not it "
            "(a pod IP, a port-forward to 127.0.0.1)",
        ),
        click.option(
            "--tls",
            is_flag=True,
            default=False,
            expose_value=False,
            callback=_use_environment(TLS_ENV),
            help="speak TLS, checking the server's certificate against the system's trusted roots",
        ),
        click.option(
            "--ca-file",
            default=None,
            envvar=CA_FILE_ENV,
            expose_value=False,
            callback=_use_environment(CA_FILE_ENV),
            help="speak TLS, checking the server's certificate against these CA certificates (PEM)",
        ),
    ):
        command = option(command)
    return command


def endpoint_option(command: Callable[P, R]) -> Callable[P, R]:
    """--endpoint, --token-file for servers that authenticate their clients, and the TLS
    options for servers that serve TLS."""
    command = tls_options(command)
    with_token = click.option(
        "--token-file",
        default=None,
        envvar=TOKEN_FILE_ENV,
        expose_value=False,
        callback=_use_environment(TOKEN_FILE_ENV),
        help="a ServiceAccount token for servers started with --client-auth kubernetes (re-read as it is rewritten)",
    )(command)
    return click.option(
        "--endpoint", default=DEFAULT_ENDPOINT, show_default=True, envvar="SHARDQ_ENDPOINT", help="host:port"
    )(with_token)


def body_to_json(body: bytes) -> dict[str, str]:
    try:
        return {"body": body.decode()}
    except UnicodeDecodeError:
        return {"body_base64": base64.b64encode(body).decode()}


def message_to_json(message: ReceivedMessage) -> dict[str, Any]:
    return {
        "id": message.message_id,
        **body_to_json(message.body),
        "receipt": message.receipt,
        "receive_count": message.receive_count,
        "sent_at": message.sent_at_ms,
        "first_received_at": message.first_received_at_ms,
        "visible_until": message.visible_until_ms,
        "attributes": message.attributes,
        "group_id": message.group_id,
        "dedup_id": message.dedup_id,
        "shard": message.shard,
        "priority": message.priority,
    }


def parse_attributes(items: tuple[str, ...]) -> dict[str, str]:
    attributes: dict[str, str] = {}
    for item in items:
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise click.BadParameter(f"{item!r} is not key=value", param_hint="--attr")
        attributes[key] = value
    return attributes


def optional_string(data: dict[str, Any], key: str, number: int) -> str:
    """A line's optional string field: "" when absent; a whole number is taken as its digits."""
    value = data.get(key, "")
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise click.ClickException(f"line {number}: {key} must be a string")
    return str(value)


def message_from_json_line(line: str, number: int) -> Message:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as error:
        raise click.ClickException(f"line {number}: not JSON ({error.msg})") from None
    if not isinstance(data, dict):
        raise click.ClickException(f"line {number}: expected a JSON object")
    unknown = sorted(set(data) - set(FILE_LINE_KEYS))
    if unknown:
        raise click.ClickException(
            f"line {number}: unknown key(s) {', '.join(map(repr, unknown))}; the keys are {', '.join(FILE_LINE_KEYS)}"
        )
    # null is absent, as a missing key is: code that writes every key ("dedup_id": null)
    # must not send the dedup id "None", which made such lines duplicates of each other.
    data = {key: value for key, value in data.items() if value is not None}
    if "body" in data and "body_base64" in data:
        raise click.ClickException(f"line {number}: give 'body' or 'body_base64', not both")
    if "body_base64" in data:
        try:
            body = base64.b64decode(data["body_base64"], validate=True)
        except (binascii.Error, TypeError):
            raise click.ClickException(f"line {number}: body_base64 is not base64") from None
    elif isinstance(data.get("body"), str):
        body = data["body"].encode()
    else:
        raise click.ClickException(f"line {number}: needs a string 'body' or 'body_base64'")
    delay = data.get("delay")
    try:
        delay_ms = None if delay is None else parse_duration_ms(str(delay))
    except ValueError as error:
        raise click.ClickException(f"line {number}: delay: {error}") from None
    attributes = data.get("attributes", {})
    if not isinstance(attributes, dict) or not all(isinstance(v, str) for v in attributes.values()):
        raise click.ClickException(f"line {number}: attributes must map strings to strings")
    group_id = optional_string(data, "group_id", number)
    dedup_id = optional_string(data, "dedup_id", number)
    priority = data.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise click.ClickException(f"line {number}: priority must be a whole number from 0, got {priority!r}")
    return Message(body, attributes, group_id, dedup_id, delay_ms, priority)


def refuse_unless_utf8(line: str, number: int) -> None:
    """Refuse a line read with surrogate escapes that held bytes which are not UTF-8."""
    try:
        line.encode()
    except UnicodeEncodeError as error:
        # surrogateescape reads byte b as the code point U+DC00 + b.
        byte = ord(line[error.start]) - 0xDC00
        raise click.ClickException(
            f"line {number}: not UTF-8 text (byte 0x{byte:02x} at column {error.start + 1})"
        ) from None


def read_jsonl(path: pathlib.Path, *, line_dedup: bool) -> Iterator[tuple[int, Message]]:
    """Messages of a JSON-lines file (`-`: stdin), each with its line number. With
    `line_dedup`, a message without a dedup id gets one derived from its line number and
    content, so sending the same file again stores nothing twice (within the queue's
    dedup window)."""
    # Bytes that are not UTF-8 are read as surrogate escapes and refused line by line: a
    # decode error raised by the stream would not say which line, and stdin (which the
    # locale may decode differently) must read as a file does.
    from_stdin = str(path) == "-"
    source: BinaryIO = sys.stdin.buffer if from_stdin else path.open("rb")
    lines = io.TextIOWrapper(source, encoding="utf-8", errors="surrogateescape")
    try:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                refuse_unless_utf8(line, number)
                message = message_from_json_line(line, number)
                if line_dedup and not message.dedup_id:
                    digest = hashlib.sha256(line.strip().encode()).hexdigest()[:24]
                    message = dataclasses.replace(message, dedup_id=f"line{number}:{digest}")
                yield number, message
    finally:
        if from_stdin:
            lines.detach()  # closing the wrapper would close the process's stdin
        else:
            lines.close()


def explain_refused_batch(
    error: ShardqError, *, endpoint: str, line_numbers: Sequence[int], acknowledged: int, total: int
) -> str:
    """A `send --file` batch the server refused whole, in the file's terms: the line of the
    message at fault when the error names one (`messages[i]...`), and what was stored."""
    match = FIELD_OF_A_MESSAGE.match(error.field) or FIELD_OF_A_MESSAGE.match(error.message)
    if match is None or int(match.group(1)) >= len(line_numbers):
        so_far = f"{acknowledged} of {total} messages acknowledged before line {line_numbers[0]}"
        return f"{explain(error, endpoint)} ({so_far})"
    # The index counts the messages of the refused request, which is this batch; the
    # server refuses such a request whole, so nothing of the batch was stored.
    return (
        f"line {line_numbers[int(match.group(1))]}: {error} ({acknowledged} of {total} messages acknowledged "
        f"before it; its batch, from line {line_numbers[0]}, stored nothing)"
    )


@click.group()
@click.version_option(package_name="shardq")
def main() -> None:
    """shardq: a durable, SQS-class message queue."""


@main.command()
@endpoint_option
@click.option("--queue", required=True)
@click.option("--body", help="message body (UTF-8)")
@click.option(
    "--file",
    "file_",
    type=click.Path(exists=True, dir_okay=False, allow_dash=True, path_type=pathlib.Path),
    help="JSON lines (- for stdin): {body | body_base64, attributes, group_id, dedup_id, delay, priority}; "
    "null is the same as absent",
)
@click.option(
    "--line-dedup/--no-line-dedup",
    default=True,
    show_default=True,
    help="with --file: give each line without a dedup_id one derived from the line, so a re-run is safe "
    "(default: on, unless the queue has content-based dedup)",
)
@click.option("--delay", type=DURATION, default=None)
@click.option("--group", "group_id", default="")
@click.option("--dedup-id", default="")
@click.option(
    "--priority",
    type=click.IntRange(min=0),
    default=None,
    help="its priority lane: 0 (default) to the queue's priorityLanes - 1, highest delivered first",
)
@click.option("--attr", "attrs", multiple=True, help="key=value, repeatable")
@click.option("--json", "as_json", is_flag=True)
@fail_cleanly
def send(
    endpoint: str,
    queue: str,
    body: str | None,
    file_: pathlib.Path | None,
    delay: int | None,
    group_id: str,
    dedup_id: str,
    priority: int | None,
    attrs: tuple[str, ...],
    as_json: bool,
    line_dedup: bool,
) -> None:
    """Send one message (--body) or many (--file, with a progress bar)."""
    if (body is None) == (file_ is None):
        raise click.UsageError("give exactly one of --body or --file")
    line_dedup_given = click.get_current_context().get_parameter_source("line_dedup")
    if body is not None and line_dedup_given is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--line-dedup/--no-line-dedup go with --file: a --body message has --dedup-id")
    if file_ is not None:
        given = {
            "--delay": delay is not None,
            "--attr": bool(attrs),
            "--group": bool(group_id),
            "--dedup-id": bool(dedup_id),
            "--priority": priority is not None,
        }
        refused = [option for option, is_given in given.items() if is_given]
        if refused:
            raise click.UsageError(
                f"{', '.join(refused)} cannot be used with --file: a --file line carries its own "
                "delay, attributes, group_id, dedup_id and priority"
            )
    with Client(endpoint) as client:
        if body is not None:
            message = Message(body.encode(), parse_attributes(attrs), group_id, dedup_id, delay, priority or 0)
            (result,) = client.send_messages(queue, [message])
            if not result.ok:
                raise click.ClickException(f"{result.error_reason}: {result.error_message}")
            if as_json:
                click.echo(json.dumps({"id": result.message_id, "duplicate": result.duplicate, "shard": result.shard}))
            else:
                click.echo(result.message_id + (" (duplicate)" if result.duplicate else ""))
            return
        assert file_ is not None
        by_content = False
        if line_dedup and line_dedup_given is not click.core.ParameterSource.COMMANDLINE:
            # A queue with content-based dedup already makes a re-run safe, and a line's own
            # id would keep two lines of one body apart, which the queue means to store once.
            by_content = bool(client.queue_settings(queue)["content_based_dedup"])
            line_dedup = not by_content
        sent = duplicates = 0
        from tqdm import tqdm

        numbered = list(read_jsonl(file_, line_dedup=line_dedup))
        messages = [message for _, message in numbered]
        try:
            with tqdm(total=len(messages), unit="msg", file=sys.stderr, disable=None) as progress:
                for start in range(0, len(messages), FILE_BATCH):
                    line_numbers = [number for number, _ in numbered[start : start + FILE_BATCH]]
                    try:
                        results = client.send_messages_streamed(queue, messages[start : start + FILE_BATCH])
                    except ShardqError as error:
                        raise click.ClickException(
                            explain_refused_batch(
                                error,
                                endpoint=endpoint,
                                line_numbers=line_numbers,
                                acknowledged=sent + duplicates,
                                total=len(messages),
                            )
                        ) from None
                    failed = [r for r in results if not r.ok]
                    if failed:
                        index = results.index(failed[0])
                        before = sent + duplicates + sum(1 for r in results[:index] if r.ok)
                        raise click.ClickException(
                            f"line {line_numbers[index]}: {failed[0].error_reason}: {failed[0].error_message} "
                            f"({before} of {len(messages)} messages acknowledged before it)"
                        )
                    sent += sum(1 for r in results if not r.duplicate)
                    duplicates += sum(1 for r in results if r.duplicate)
                    progress.update(len(results))
        except KeyboardInterrupt:
            acknowledged = sent + duplicates
            again = (
                "re-run the same command to send the rest: lines already stored are recognised by their "
                "dedup ids (within the queue's dedup window)"
                if line_dedup or by_content
                else "a batch in flight may have been stored too; re-running may store it twice"
            )
            click.echo(f"interrupted: {acknowledged} of {len(messages)} messages acknowledged; {again}", err=True)
            sys.exit(130)
        click.echo(
            json.dumps({"sent": sent, "duplicates": duplicates}) if as_json else f"sent {sent}, {duplicates} duplicates"
        )


@main.command()
@endpoint_option
@click.option("--queue", required=True)
@click.option("--max", "max_messages", default=1, show_default=True, type=int)
@click.option("--visibility", type=DURATION, default=None, help="visibility timeout (default: the queue's)")
@click.option(
    "--wait",
    type=DURATION,
    default=None,
    help="long-poll up to this long [default: the queue's receiveWait, 0 unless set]",
)
@click.option("--json", "as_json", is_flag=True, help="one JSON object per line")
@click.option("--peek", is_flag=True, help="look without claiming: no receipts, nothing changes")
@click.option(
    "--delete",
    "delete_on_receive",
    is_flag=True,
    help="delete what is received in the same commit (at most once: no receipts, never handed out again)",
)
@fail_cleanly
def receive(
    endpoint: str,
    queue: str,
    max_messages: int,
    visibility: int | None,
    wait: int | None,
    as_json: bool,
    peek: bool,
    delete_on_receive: bool,
) -> None:
    """Receive messages; each stays invisible to others until its visibility timeout
    (with --delete, each is deleted as it is received)."""
    if max_messages < 1:
        raise click.BadParameter("must be at least 1", param_hint="--max")
    if peek and delete_on_receive:
        raise click.UsageError("--peek changes nothing: it cannot be used with --delete")
    if peek and max_messages > MAX_RECEIVE_BATCH:
        # A receive pages past one call's limit because each page claims what it returns;
        # a peek claims nothing, so a second call would show the same messages again.
        raise click.UsageError(
            f"--peek shows at most {MAX_RECEIVE_BATCH} messages: give --max {MAX_RECEIVE_BATCH} or less"
        )
    if peek:
        with Client(endpoint) as client:
            peeked = client.peek_messages(queue, max_messages=max_messages)
        for message in peeked:
            if as_json:
                click.echo(
                    json.dumps({key: value for key, value in message_to_json(message).items() if key != "receipt"})
                )
            else:
                text = body_to_json(message.body)
                click.echo(f"{message.message_id}\t{text.get('body', text.get('body_base64'))}")
        return
    with Client(endpoint) as client:
        # The server hands out at most MAX_RECEIVE_BATCH per call: page until --max or empty
        # (only the first call long-polls). Each page is shown as it comes: with --delete, a
        # later page's failure must not take the earlier pages' messages with it.
        received = 0
        while received < max_messages:
            page = client.receive_messages(
                queue,
                max_messages=min(max_messages - received, MAX_RECEIVE_BATCH),
                visibility_timeout_ms=visibility,
                wait_time_ms=0 if received else wait,
                delete_on_receive=delete_on_receive,
            )
            if not page:
                break
            received += len(page)
            for message in page:
                _show_received(message, as_json=as_json, receipt=not delete_on_receive)


def _show_received(message: ReceivedMessage, *, as_json: bool, receipt: bool) -> None:
    if as_json:
        shown = message_to_json(message)
        click.echo(json.dumps(shown if receipt else {k: v for k, v in shown.items() if k != "receipt"}))
    else:
        text = body_to_json(message.body)
        line = f"{message.message_id}\t{text.get('body', text.get('body_base64'))}"
        click.echo(f"{line}\t{message.receipt}" if receipt else line)


def _report_entries(kind: str, results: list[Any]) -> None:
    failed = [r for r in results if not r.ok]
    if failed:
        raise click.ClickException(f"{kind} failed: {failed[0].reason}: {failed[0].message}")


@main.command()
@endpoint_option
@click.option("--queue", required=True)
@click.option("--receipt", "receipts", multiple=True, required=True)
@fail_cleanly
def delete(endpoint: str, queue: str, receipts: tuple[str, ...]) -> None:
    """Delete received messages by receipt."""
    with Client(endpoint) as client:
        results = client.delete_messages(queue, list(receipts))
    _report_each_receipt(receipts, results, action="delete", done="deleted")


def _report_each_receipt(receipts: tuple[str, ...], results: list[EntryResult], *, action: str, done: str) -> None:
    """One line per receipt, in the order given (some may succeed while others fail);
    a non-zero exit naming the reasons if any failed."""
    for receipt, result in zip(receipts, results, strict=True):
        shown = receipt if len(receipt) <= 24 else receipt[:21] + "..."
        if result.ok:
            click.echo(f"{done}\t{shown}")
        else:
            click.echo(f"failed\t{shown}\t{result.reason}: {result.message}")
    reasons = sorted({result.reason for result in results if not result.ok})
    if reasons:
        failed = sum(1 for result in results if not result.ok)
        others = f" (the others were {done})" if failed < len(results) else ""
        raise click.ClickException(f"{failed} of {len(results)} {action}s failed: {', '.join(reasons)}{others}")


@main.command()
@endpoint_option
@click.option("--queue", required=True)
@click.option("--receipt", "receipts", multiple=True, required=True)
@click.option("--reason", default="", help="why: kept as the messages' last error, and on their dead-letter copies")
@click.option(
    "--dead-letter",
    is_flag=True,
    help="send them to the queue's dead-letter queue now, whatever their receive counts",
)
@fail_cleanly
def release(endpoint: str, queue: str, receipts: tuple[str, ...], reason: str, dead_letter: bool) -> None:
    """Give received messages back: visible again after the queue's backoff, or with
    --dead-letter, to its dead-letter queue now (a message that will never succeed)."""
    with Client(endpoint) as client:
        results = client.release_messages(queue, list(receipts), reason=reason, dead_letter=dead_letter)
    if dead_letter:
        _report_each_receipt(receipts, results, action="dead-letter", done="dead-lettered")
    else:
        _report_each_receipt(receipts, results, action="release", done="released")


@main.command("change-visibility")
@endpoint_option
@click.option("--queue", required=True)
@click.option("--receipt", required=True)
@click.option("--timeout", type=DURATION, required=True, help="new visibility timeout from now (0s: visible now)")
@fail_cleanly
def change_visibility(endpoint: str, queue: str, receipt: str, timeout: int) -> None:
    """Extend or shorten a received message's visibility timeout."""
    with Client(endpoint) as client:
        try:
            results = client.change_visibility(queue, [(receipt, timeout)])
        except InvalidArgument as error:
            if error.field != "changes[0].visibility_timeout_ms":
                raise
            # In the option's name, not the request field's the user never wrote.
            raise click.BadParameter(error.message.removeprefix(f"{error.field}: "), param_hint="--timeout") from None
        _report_entries("change-visibility", results)
    click.echo("ok")


@main.command()
@endpoint_option
@click.option("--queue", required=True)
@click.option("--json", "as_json", is_flag=True)
@fail_cleanly
def stats(endpoint: str, queue: str, as_json: bool) -> None:
    """Approximate visible / in-flight / delayed counts and the oldest message's age."""
    with Client(endpoint) as client:
        attributes = client.attributes(queue)
    summary = {
        "queue": attributes.queue,
        "visible": attributes.visible,
        "in_flight": attributes.in_flight,
        "delayed": attributes.delayed,
        "dead_letter_pending": attributes.dead_letter_pending,
        "oldest_age_ms": attributes.oldest_age_ms,
        # The queue's shards, counted or not (it said 1 for a 2-shard queue whose other
        # shard had no leader answering).
        "shards": len(attributes.shards) + len(attributes.uncounted_shards),
        "uncounted_shards": list(attributes.uncounted_shards),
    }
    warn_if_uncounted(attributes)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        for key, value in summary.items():
            shown = (",".join(map(str, value)) or "-") if isinstance(value, list) else value
            click.echo(f"{key:>20}  {shown}")


def warn_if_uncounted(attributes: QueueAttributes) -> None:
    """On stderr: the counts leave out shards whose leader did not answer."""
    if not attributes.complete:
        shards = ", ".join(map(str, attributes.uncounted_shards))
        click.echo(
            f"warning: {attributes.queue}: shard(s) {shards} not counted (no leader answered); "
            "the counts leave out their messages",
            err=True,
        )


@main.command()
@endpoint_option
@click.option("--queue", required=True)
@fail_cleanly
def purge(endpoint: str, queue: str) -> None:
    """Remove every message of the queue."""
    with Client(endpoint) as client:
        click.echo(f"purged {client.purge(queue)}")


@main.command()
@endpoint_option
@fail_cleanly
@click.option("--json", "as_json", is_flag=True, help="one JSON object per queue")
@click.option("--prefix", default="", help="only queues whose names start with this")
@click.option(
    "--dead-letter-queue",
    default="",
    metavar="QUEUE",
    help="only queues whose dead letters go to QUEUE (what `shardq redrive` of it returns messages to)",
)
def queues(endpoint: str, as_json: bool, prefix: str, dead_letter_queue: str) -> None:
    """List the queues the server hosts, with their depth and settings."""
    with Client(endpoint) as client:
        rows = []
        for name in client.list_queues(prefix, dead_letter_queue=dead_letter_queue):
            # One call a queue: the attributes carry its settings.
            attributes = client.attributes(name)
            rows.append((name, attributes, attributes.settings))
    if as_json:
        for name, attributes, settings in rows:
            depth = {"visible": attributes.visible, "in_flight": attributes.in_flight, "delayed": attributes.delayed}
            uncounted = list(attributes.uncounted_shards)
            click.echo(json.dumps({"queue": name, **depth, "uncounted_shards": uncounted, "settings": settings}))
            warn_if_uncounted(attributes)
        return
    click.echo(f"{'QUEUE':<24} {'VISIBLE':>8} {'IN-FLIGHT':>9} {'DELAYED':>8}  SETTINGS")
    for name, attributes, settings in rows:
        click.echo(
            f"{name:<24} {attributes.visible:>8} {attributes.in_flight:>9} {attributes.delayed:>8}  "
            + describe_settings(settings)
        )
    for _, attributes, _ in rows:
        warn_if_uncounted(attributes)


def describe_settings(settings: dict[str, Any]) -> str:
    """Settings as people write them: shards=4 visibility_timeout=30s dead_letter_queue=dlq."""
    shown = []
    for key, value in sorted(settings.items()):
        if key.endswith("_ms"):
            shown.append(f"{key.removesuffix('_ms')}={format_duration_ms(int(value))}")
        elif isinstance(value, bool):
            shown.append(f"{key}={str(value).lower()}")
        else:
            # An empty setting (no dead-letter queue) as `-`, so `key=` does not look cut off.
            shown.append(f"{key}={value if value != '' else '-'}")
    return " ".join(shown)


def parse_settings(items: tuple[str, ...]) -> dict[str, str]:
    settings: dict[str, str] = {}
    for item in items:
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise click.BadParameter(f"{item!r} is not key=value", param_hint="--set")
        settings[key.strip()] = value.strip()
    return settings


@main.command("create-queue")
@endpoint_option
@click.argument("name")
@click.option("--set", "items", multiple=True, metavar="KEY=VALUE", help="a setting, repeatable (as in --queue)")
@fail_cleanly
def create_queue(endpoint: str, name: str, items: tuple[str, ...]) -> None:
    """Create a queue (kept across restarts); the same settings again is a no-op."""
    with Client(endpoint) as client:
        settings = client.create_queue(name, parse_settings(items))
    click.echo(f"{name}: {describe_settings(settings)}")


@main.command("delete-queue")
@endpoint_option
@click.argument("name")
@click.option("--yes", is_flag=True, help="do not ask for confirmation")
@fail_cleanly
def delete_queue(endpoint: str, name: str, yes: bool) -> None:
    """Delete a queue created at run time, with all its messages."""
    if not yes:
        click.confirm(f"delete queue {name!r} and every message in it?", abort=True)
    with Client(endpoint) as client:
        deleted = client.delete_queue(name)
    click.echo(f"deleted queue {name} ({deleted} message{'' if deleted == 1 else 's'})")


@main.command("set-attributes")
@endpoint_option
@click.argument("name")
@click.option("--set", "items", multiple=True, required=True, metavar="KEY=VALUE", help="a setting, repeatable")
@fail_cleanly
def set_attributes(endpoint: str, name: str, items: tuple[str, ...]) -> None:
    """Change a runtime queue's settings (not shards, fifo or replicas)."""
    with Client(endpoint) as client:
        settings = client.set_queue_attributes(name, parse_settings(items))
    click.echo(f"{name}: {describe_settings(settings)}")


@main.command()
@endpoint_option
@click.option("--from", "source", required=True, help="the dead-letter queue")
@click.option(
    "--to",
    "destination",
    default="",
    help="the queue to move them to (default: each back to the queue it was dead-lettered from)",
)
@click.option("--rate", type=Rate(), default=0.0, help="messages per second, e.g. 500/s (default: unlimited)")
@click.option(
    "--max", "max_messages", type=click.IntRange(min=1), default=None, help="stop after this many (default: all)"
)
@fail_cleanly
def redrive(endpoint: str, source: str, destination: str, rate: float, max_messages: int | None) -> None:
    """Move messages from a dead-letter queue back to a queue, at a bounded rate."""
    from tqdm import tqdm

    moved = remaining = kept = 0
    started = False
    try:
        with Client(endpoint) as client, tqdm(unit="msg", file=sys.stderr, disable=None) as progress:
            for step in client.redrive(
                source=source,
                destination=destination,
                rate_per_second=rate,
                # The server reads 0 as "all", which is why --max itself cannot be 0.
                max_messages=0 if max_messages is None else max_messages,
            ):
                started = True
                progress.total = step.moved + step.remaining + step.kept
                progress.update(step.moved + step.kept - moved - kept)
                moved, remaining, kept = step.moved, step.remaining, step.kept
    except ShardqError:
        # Stopped part way (a source shard's leader never answered, the destination refused):
        # what moved and what is left count as much as the reason, which follows.
        if started:
            report_redrive(source, moved=moved, remaining=remaining, kept=kept)
        raise
    report_redrive(source, moved=moved, remaining=remaining, kept=kept)


def report_redrive(source: str, *, moved: int, remaining: int, kept: int) -> None:
    if kept:
        click.echo(
            f"warning: {kept} message(s) of {source} stayed there: they were not dead-lettered from a queue that "
            "sends its dead letters to it (sent to it directly, or their queue since changed); move them with --to",
            err=True,
        )
    if remaining:
        # Messages left: they could not be claimed now. "moved N" alone read as the whole
        # queue moved (found with a leader killed mid-redrive).
        click.echo(
            f"warning: {remaining} message(s) of {source} were not moved: in flight, delayed, or on a shard "
            "whose leader did not hand them out (one failing over); run the redrive again to move them",
            err=True,
        )
    click.echo(f"moved {moved}")


@main.group()
def analytics() -> None:
    """Spark analytics over the queues' journals (needs the spark extra and Java)."""


@analytics.command("report")
@endpoint_option
@click.option("--queue", required=True)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=pathlib.Path))
@click.option("--since", default=None, help="an ISO time or a duration back from now, e.g. 24h")
@click.option("--master", default=None, help="Spark master, e.g. local[2] (default: local, or spark-submit's)")
@click.option(
    "--conf",
    "conf",
    multiple=True,
    metavar="KEY=VALUE",
    help="a Spark setting, repeatable (e.g. spark.driver.bindAddress=127.0.0.1)",
)
@fail_cleanly
def analytics_report(
    endpoint: str, queue: str, out_dir: pathlib.Path, since: str | None, master: str | None, conf: tuple[str, ...]
) -> None:
    """Throughput, latency, redelivery and dead-letter report: Parquet, PNG plots and HTML."""
    try:
        from shardq.analytics import job
    except ImportError as error:
        raise click.ClickException(f"analytics needs the spark extra (pip install 'shardq[spark]'): {error}") from None
    argv = ["--endpoint", endpoint, "--queue", queue, "--out", str(out_dir)]
    if since:
        argv += ["--since", since]
    if master:
        argv += ["--master", master]
    for item in conf:
        argv += ["--conf", item]
    code = job.main(argv)
    if code:
        sys.exit(code)
    click.echo(f"report: {out_dir / 'report.html'}", err=True)


def _load_plugins() -> None:
    for entry_point in importlib.metadata.entry_points(group="shardq.cli"):
        try:
            command = entry_point.load()
        except ImportError as error:
            # The wheel registers every command, but `serve`, `local` and `operator` need
            # extras: without them, the client commands (and the analytics job, which
            # imports this module) must still work.
            command = _needs_an_extra(entry_point.name, error)
        main.add_command(command, entry_point.name)


def _needs_an_extra(name: str, error: ImportError) -> click.Command:
    missing = error.name or str(error)

    @click.command(
        name=name,
        help=f"Unavailable here: needs {missing} (pip install 'shardq[server,operator]').",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )
    def unavailable() -> None:
        raise click.ClickException(
            f"`shardq {name}` needs {missing}, which is not installed: pip install 'shardq[server,operator]'"
        )

    return unavailable


_load_plugins()
