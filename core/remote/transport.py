"""HTTP to an endpoint with the standard library: one connection with a deadline, bounded reads,
its models listed, server-sent events read line by line and their fields checked."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from typing import Iterator

from specplay.core.remote.endpoint import Endpoint, RemoteError, api_key

# A streamed event carries one chunk (a few hundred bytes) and a whole answer is a few MiB of
# them, so these only stop a server that never ends a line or a body from filling the memory.
MAX_LINE_BYTES = 4 * 2**20
MAX_BODY_BYTES = 64 * 2**20
READ_BYTES = 64 * 2**10  # at most this much per read, so that Stop and the deadline are checked between reads


class Connection:
    """One request to an endpoint. Every read of the answer waits at most the endpoint's read
    timeout and never past the run's deadline, so no pace of bytes keeps a run alive forever."""

    def __init__(self, endpoint: Endpoint, deadline: float):
        self.endpoint, self.deadline = endpoint, deadline
        u = urllib.parse.urlsplit(endpoint.url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self.conn = cls(u.hostname, u.port, timeout=endpoint.timeout_s)
        self.base = u.path.rstrip("/")
        self.root = f"{u.scheme}://{u.netloc}"
        self.sock: socket.socket | None = None
        self.resp: http.client.HTTPResponse | None = None

    def _wait(self) -> tuple[float, bool]:
        """How long the next read may wait, and whether the deadline (not the timeout) sets it."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RemoteError(self._late())
        return min(self.endpoint.timeout_s, left), left < self.endpoint.timeout_s

    def _late(self) -> str:
        return f"{self.endpoint.label} did not finish within its {self.endpoint.deadline_s:g} s deadline"

    def request(self, method: str, path: str, body: dict | None = None) -> http.client.HTTPResponse:
        headers = {"Accept": "text/event-stream, application/json"}
        key = api_key(self.endpoint)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        where = f"{self.root}{path}"
        wait, late = self._wait()
        self.conn.timeout = wait
        try:
            self.conn.request(method, path, body=data, headers=headers)
            # Kept for the reads: a response that ends with the connection takes its socket over.
            self.sock = self.conn.sock
            self.resp = self.conn.getresponse()
            return self.resp
        except TimeoutError:  # socket.timeout since Python 3.10
            raise RemoteError(self._late() if late else f"{where} did not answer within {wait:g} s") from None
        except (ConnectionError, socket.gaierror, OSError) as exc:
            raise RemoteError(f"cannot reach {where}: {getattr(exc, 'strerror', None) or exc}") from None
        except http.client.HTTPException as exc:
            raise RemoteError(f"{where} did not answer in HTTP: {exc!r}") from None

    def pieces(self) -> Iterator[bytes]:
        """The body as it arrives, a read at a time; more than ``MAX_BODY_BYTES`` is an error, raised
        once the bytes up to the cap are given (however the server's writes were split into reads)."""
        total = 0
        while True:
            wait, late = self._wait()
            self.sock.settimeout(wait)
            try:
                piece = self.resp.read1(READ_BYTES)
            except TimeoutError:  # socket.timeout since Python 3.10
                raise RemoteError(self._late() if late else
                                  f"{self.endpoint.label} sent nothing for {wait:g} s (timed out)") from None
            except (http.client.HTTPException, OSError) as exc:
                raise RemoteError(f"{self.endpoint.label} dropped the connection: {exc!r}") from None
            if not piece:
                return
            if total + len(piece) > MAX_BODY_BYTES:
                if total < MAX_BODY_BYTES:
                    yield piece[:MAX_BODY_BYTES - total]
                raise RemoteError(f"{self.endpoint.label} sent more than {MAX_BODY_BYTES / 2**20:g} MiB in one answer")
            total += len(piece)
            yield piece

    def close(self) -> None:
        if self.resp is not None:
            self.resp.close()
        self.conn.close()


def deadline_of(endpoint: Endpoint, deadline: float | None) -> float:
    """The ``time.monotonic()`` by which a run must end: the one given, or a new one from now."""
    return time.monotonic() + endpoint.deadline_s if deadline is None else deadline


def _head(pieces: Iterator[bytes], size: int) -> bytes:
    """The first ``size`` bytes of a body, leaving the rest unread."""
    out = bytearray()
    for piece in pieces:
        out += piece
        if len(out) >= size:
            break
    return bytes(out[:size])


def error_message(conn: Connection, where: str) -> str:
    resp = conn.resp
    try:
        raw = _head(conn.pieces(), 4096).decode("utf-8", "replace")
    except RemoteError:  # the status says enough
        raw = ""
    try:
        doc = json.loads(raw)
        err = doc.get("error", doc)
        detail = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError, RecursionError):
        detail = raw.strip()[:300]
    return f"{where} answered {resp.status} {resp.reason}: {detail or 'no details'}"


def http_get(endpoint: Endpoint, path: str, deadline: float, absolute: bool = False) -> tuple[int, str]:
    c = Connection(endpoint, deadline)
    try:
        resp = c.request("GET", path if absolute else c.base + path)
        return resp.status, b"".join(c.pieces()).decode("utf-8", "replace")
    finally:
        c.close()


def list_models(endpoint: Endpoint, deadline: float | None = None) -> list[str]:
    """The model ids the server lists (``deadline``: a ``time.monotonic()`` to finish by)."""
    status, body = http_get(endpoint, "/models", deadline_of(endpoint, deadline))
    if status != 200:
        raise RemoteError(f"{endpoint.url}/models answered {status}")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # deep nesting is valid JSON that Python cannot parse
        doc = None
    models = doc.get("data", []) if isinstance(doc, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in models):
        raise RemoteError(f"{endpoint.url}/models is not an OpenAI-compatible model list")
    return [m["id"] for m in models]


def _lines(pieces: Iterator[bytes], label: str) -> Iterator[bytes | None]:
    """The lines of a body, without their newline, and None for a piece that ends none, so that
    the reader hears of every arrival however the server splits its lines."""
    buf = bytearray()
    for piece in pieces:
        start = len(buf)
        buf += piece
        if buf.find(b"\n", start) < 0:
            yield None
        else:
            *lines, rest = buf.split(b"\n")
            buf = bytearray(rest)
            for line in lines:
                _check_line(len(line), label)
                yield bytes(line)
        _check_line(len(buf), label)
    if buf:
        yield bytes(buf)


def _check_line(size: int, label: str) -> None:
    if size > MAX_LINE_BYTES:
        raise RemoteError(f"{label} sent a line longer than {MAX_LINE_BYTES / 2**20:g} MiB")


def sse_events(pieces: Iterator[bytes], label: str) -> Iterator[dict | None]:
    """The JSON objects of a server-sent event stream, up to ``data: [DONE]``, and None for each
    arrival that completes no event (a keep-alive comment, part of a line), so that the caller
    checks Stop on every one. A data line that is not a JSON object is a malformed reply."""
    for line in _lines(pieces, label):
        if line is None or not line.startswith(b"data:"):
            yield None
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        try:
            event = json.loads(payload.decode("utf-8", "replace"))
        except (ValueError, RecursionError):  # deep nesting is valid JSON that Python cannot parse
            raise malformed(label, "an event that is not JSON") from None
        if not isinstance(event, dict):
            raise malformed(label, f"an event that is {kind_of(event)}, not an object")
        yield event


def malformed(label: str, what: str) -> RemoteError:
    return RemoteError(f"{label} sent a malformed reply: {what}")


def kind_of(value) -> str:
    """A JSON value's type in JSON's words, for messages."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
             dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def typed_field(obj: dict, key: str, kind: type, label: str):
    """``obj[key]`` if it is of ``kind``, None if absent or null; a malformed reply otherwise."""
    value = obj.get(key)
    # bool is an int to Python, not a count to anyone
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise malformed(label, f"'{key}' is {kind_of(value)}, not {kind_of(kind())}")


def count_field(obj: dict, key: str, label: str) -> int | None:
    value = typed_field(obj, key, int, label)
    if value is not None and value < 0:
        raise malformed(label, f"'{key}' is negative ({value})")
    return value
