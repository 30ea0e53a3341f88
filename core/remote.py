"""Remote engines: an OpenAI-compatible endpoint (vLLM, SGLang, llama.cpp's server, TGI, ...)
run and measured the way local methods are.

A run streams one completion (server-sent events), timing every chunk as it arrives: time to
first token, inter-token latency, tokens per second. Speculative decoding is read from each
engine's own documented surface, where it has one:

- **vLLM**: its Prometheus counters ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
  ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (label ``position``),
  read from ``/metrics`` before and after the run; the difference is this run's (on a server
  nobody else uses at the time).
- **SGLang**: the gauges ``sglang:spec_accept_length`` and ``sglang:spec_accept_rate`` from
  ``/metrics`` after the run (the server's recent average).
- **llama.cpp's server**: ``timings.draft_n`` and ``timings.draft_n_accepted`` in the response.

Where an engine exposes none of these, the run says so (``spec_source`` is None). An API key
is sent only where the endpoint has one of its own: the environment variable its ``key-env=``
names, or the OS keyring entry for its URL (service ``specplay``, user = the base URL); never
over plain http:// to another machine, and never written to a record, a log or the history.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import math
import os
import re
import socket
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

from specplay.core.errors import ConfigError, SpecPlayError
from specplay.core.records.runlog import COMPARISON_ONLY, LOCAL_ONLY, RunRecord
from specplay.core.decoding.types import Fate, StepEvent, StepTiming, TokenEvent

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_DEADLINE_S = 3600.0  # an hour: a long answer from a slow CPU server, with room to spare
MAX_WAIT_S = 86400.0  # the longest timeout or deadline accepted: a day
# A streamed event carries one chunk (a few hundred bytes) and a whole answer is a few MiB of
# them, so these only stop a server that never ends a line or a body from filling the memory.
MAX_LINE_BYTES = 4 * 2**20
MAX_BODY_BYTES = 64 * 2**20
READ_BYTES = 64 * 2**10  # at most this much per read, so that Stop and the deadline are checked between reads


class RemoteError(SpecPlayError):
    """An endpoint could not be reached or answered with an error (the message says which)."""


def _seconds(option: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"endpoint {option} must be a number of seconds, got {text!r}") from None


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: ``url`` is its API base (``http://host:port/v1``)."""

    url: str
    model: str = ""  # sent as "model"; empty: the first model the server lists
    name: str = ""  # label in tables and records (default: host:port and model)
    key_env: str = ""  # the environment variable holding this server's API key; empty: none
    timeout_s: float = DEFAULT_TIMEOUT_S  # per read: a server silent this long ends the run
    deadline_s: float = DEFAULT_DEADLINE_S  # per run, from its first request: however the server paces its bytes

    def __post_init__(self) -> None:
        # Checked on every construction, not only when parsed, so that no caller can build one
        # that fails later with a traceback.
        self.check()

    @staticmethod
    def parse(text: str) -> "Endpoint":
        """``URL[,model=NAME][,name=LABEL][,key-env=VAR][,timeout=SECONDS][,deadline=SECONDS]`` (the
        command line's form)."""
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise ConfigError("an endpoint needs a URL, e.g. http://127.0.0.1:8000/v1")
        url, fields_ = parts[0], {}
        for p in parts[1:]:
            key, sep, value = p.partition("=")
            if not sep or key not in ("model", "name", "key-env", "timeout", "deadline"):
                raise ConfigError(f"endpoint option '{p}' is not model=, name=, key-env=, timeout= or deadline=")
            fields_[key.replace("-", "_")] = value
        for option in ("timeout", "deadline"):
            seconds = fields_.pop(option, "")
            if seconds:
                fields_[f"{option}_s"] = _seconds(option, seconds)
        return Endpoint(url=url, **fields_)

    def check(self) -> None:
        """Refuse, in one line, what the connection would otherwise fail on with a traceback, or
        what would put a secret in records (the messages never repeat one)."""
        try:
            u = urllib.parse.urlsplit(self.url)
        except ValueError:  # an unclosed or invalid [IPv6] host
            raise ConfigError("endpoint URL has a malformed [IPv6] host") from None
        # The URL goes into records, logs and the history: a secret in it would too.
        if "@" in u.netloc or u.query or u.fragment:
            raise ConfigError(f"endpoint URL must not carry credentials, a query string or a fragment "
                              f"({_redacted(u)}): name the key's variable with key-env= or store it in the keyring")
        # http.client sends the URL as ASCII and rejects spaces and control characters mid-request.
        if not self.url.isascii() or any(c.isspace() or not c.isprintable() for c in self.url):
            raise ConfigError(f"endpoint URL must be ASCII without spaces (an international host name in its "
                              f"xn-- form), got {self.url!r}")
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"endpoint URL must be http(s)://host[:port]/..., got {self.url!r}")
        try:
            port = u.port
        except ValueError:
            port = 0
        if port == 0:
            raise ConfigError(f"endpoint port must be a number from 1 to 65535, got {self.url!r}")
        for option, seconds in (("timeout", self.timeout_s), ("deadline", self.deadline_s)):
            # NaN fails the comparison; beyond a day, socket timeouts overflow on some platforms.
            if not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_WAIT_S:
                raise ConfigError(f"endpoint {option} must be more than 0 and at most {MAX_WAIT_S:g} seconds, "
                                  f"got {seconds!r}")
        if self.key_env and not _ENV_NAME.fullmatch(self.key_env):
            raise ConfigError(f"key-env= must name an environment variable, got {self.key_env!r}")
        if self.key_env and not _may_carry_key(u):
            raise ConfigError(_clear_text_key(u))

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        u = urllib.parse.urlsplit(self.url)
        return f"{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}" + (f"/{self.model}" if self.model else "")

    def describe(self) -> dict:
        """What a record keeps of the endpoint: never the key."""
        return {"url": self.url, "model": self.model, "name": self.label}


def api_key(endpoint: Endpoint) -> str | None:
    """The endpoint's own key: from the variable its ``key-env=`` names, else from the OS keyring
    entry for its URL, else None. A key set for one server (``$OPENAI_API_KEY``) never goes to
    another, and none crosses a network in clear text (plain http:// off this machine)."""
    key = (os.environ.get(endpoint.key_env) if endpoint.key_env else None) or _keyring_key(endpoint.url)
    u = urllib.parse.urlsplit(endpoint.url)
    if key and not _may_carry_key(u):
        raise RemoteError(_clear_text_key(u))
    return key


def _keyring_key(url: str) -> str | None:
    try:
        import keyring  # optional
    except ImportError:
        return None
    try:
        return keyring.get_password("specplay", url)
    except Exception:  # no usable keyring backend
        return None


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _may_carry_key(u: urllib.parse.SplitResult) -> bool:
    """Whether a key may go to this URL: encrypted, or to this machine (localhost or a loopback
    address; other names are not resolved, as a resolver could point them anywhere)."""
    if u.scheme == "https" or u.hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(u.hostname).is_loopback
    except ValueError:
        return False


def _clear_text_key(u: urllib.parse.SplitResult) -> str:
    return (f"refusing to send an API key over plain http:// to {u.hostname}, which is not this machine: "
            "use https:// or drop key-env= and the keyring entry")


def _redacted(u: urllib.parse.SplitResult) -> str:
    """The URL without user info, query or fragment, for messages about them."""
    return f"{u.scheme}://{u.netloc.rpartition('@')[2]}{u.path}"


# ------------------------------------------------------------------------------------ HTTP
class _Connection:
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
        """The body as it arrives, a read at a time; more than ``MAX_BODY_BYTES`` is an error."""
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
            total += len(piece)
            if total > MAX_BODY_BYTES:
                raise RemoteError(f"{self.endpoint.label} sent more than {MAX_BODY_BYTES / 2**20:g} MiB in one answer")
            yield piece

    def close(self) -> None:
        if self.resp is not None:
            self.resp.close()
        self.conn.close()


def _deadline(endpoint: Endpoint, deadline: float | None) -> float:
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


def _error_message(conn: _Connection, where: str) -> str:
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


def _get(endpoint: Endpoint, path: str, deadline: float, absolute: bool = False) -> tuple[int, str]:
    c = _Connection(endpoint, deadline)
    try:
        resp = c.request("GET", path if absolute else c.base + path)
        return resp.status, b"".join(c.pieces()).decode("utf-8", "replace")
    finally:
        c.close()


def list_models(endpoint: Endpoint, deadline: float | None = None) -> list[str]:
    """The model ids the server lists (``deadline``: a ``time.monotonic()`` to finish by)."""
    status, body = _get(endpoint, "/models", _deadline(endpoint, deadline))
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


def _sse_events(pieces: Iterator[bytes], label: str) -> Iterator[dict | None]:
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
            raise _malformed(label, "an event that is not JSON") from None
        if not isinstance(event, dict):
            raise _malformed(label, f"an event that is {_kind(event)}, not an object")
        yield event


def _malformed(label: str, what: str) -> RemoteError:
    return RemoteError(f"{label} sent a malformed reply: {what}")


def _kind(value) -> str:
    """A JSON value's type in JSON's words, for messages."""
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
             dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _field(obj: dict, key: str, kind: type, label: str):
    """``obj[key]`` if it is of ``kind``, None if absent or null; a malformed reply otherwise."""
    value = obj.get(key)
    # bool is an int to Python, not a count to anyone
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise _malformed(label, f"'{key}' is {_kind(value)}, not {_kind(kind())}")


def _count(obj: dict, key: str, label: str) -> int | None:
    value = _field(obj, key, int, label)
    if value is not None and value < 0:
        raise _malformed(label, f"'{key}' is negative ({value})")
    return value


# ------------------------------------------------------------------------------- metrics
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of Prometheus' text format: (name, sorted labels) -> value."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if not math.isfinite(value):  # NaN and ±Inf are allowed in the format but say nothing of a run
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = value
    return out


def _total(samples: dict, name: str) -> float | None:
    """The sum of a metric over its label sets (engines, ranks), or None if absent."""
    values = [v for (n, _), v in samples.items() if n == name]
    return sum(values) if values else None


@dataclass
class SpecStats:
    """Speculative decoding as an engine reports it; any field may be unknown (None)."""

    source: str  # "vllm-metrics", "sglang-metrics", "llamacpp-timings"
    mean_accepted: float | None = None  # tokens per step, the bonus token included (τ)
    acceptance_rate: float | None = None  # accepted / drafted
    drafted: int | None = None
    accepted: int | None = None
    by_position: list[float] | None = None  # acceptance at draft position 1, 2, ...


def vllm_spec_stats(before: dict, after: dict) -> SpecStats | None:
    """This run's speculation from vLLM's counters read before and after it."""
    def delta(name: str) -> float | None:
        a, b = _total(after, name), _total(before, name)
        return None if a is None else a - (b or 0.0)

    drafts = delta("vllm:spec_decode_num_drafts_total")
    drafted = delta("vllm:spec_decode_num_draft_tokens_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    if drafts is None or drafted is None or accepted is None:
        return None
    per_pos: dict[int, float] = {}
    for (name, labels), value in after.items():
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = dict(labels).get("position")
            if pos is not None and pos.isdigit():
                per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + value - before.get((name, labels), 0.0)
    return SpecStats(source="vllm-metrics", drafted=int(drafted), accepted=int(accepted),
                     mean_accepted=1 + accepted / drafts if drafts else None,
                     acceptance_rate=accepted / drafted if drafted else None,
                     by_position=[per_pos[k] / drafts for k in sorted(per_pos)] if per_pos and drafts else None)


def sglang_spec_stats(after: dict) -> SpecStats | None:
    length = _total(after, "sglang:spec_accept_length")
    if length is None:
        return None
    rates = [v for (n, _), v in after.items() if n == "sglang:spec_accept_rate"]
    return SpecStats(source="sglang-metrics", mean_accepted=length,
                     acceptance_rate=sum(rates) / len(rates) if rates else None)


def llamacpp_spec_stats(timings: dict | None) -> SpecStats | None:
    if not timings or not timings.get("draft_n"):
        return None
    drafted, accepted = int(timings["draft_n"]), int(timings.get("draft_n_accepted") or 0)
    generated = timings.get("predicted_n")
    steps = (generated - accepted) if generated else None
    return SpecStats(source="llamacpp-timings", drafted=drafted, accepted=accepted, acceptance_rate=accepted / drafted,
                     mean_accepted=generated / steps if steps else None)


def read_metrics(endpoint: Endpoint, deadline: float | None = None) -> dict:
    """The server's ``/metrics`` samples, or {} where it has none (not every engine does)."""
    try:
        status, body = _get(endpoint, "/metrics", _deadline(endpoint, deadline), absolute=True)
    except RemoteError:
        return {}
    return parse_prometheus(body) if status == 200 else {}


# ----------------------------------------------------------------------------------- runs
@dataclass
class RemoteRun:
    """One streamed completion. ``error`` set: the run ended early; what arrived is kept."""

    endpoint: Endpoint
    prompt: str
    text: str = ""
    chunks: list[tuple[float, str]] = field(default_factory=list)  # (seconds since the request, text)
    completion_tokens: int | None = None  # the server's count (usage), when it gives one
    finish_reason: str | None = None
    wall_time: float = 0.0
    speculation: SpecStats | None = None  # what the engine reported of its speculative decoding
    error: str | None = None
    cancelled: bool = False
    model: str = ""

    @property
    def new_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunks)

    @property
    def time_to_first_token(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def inter_token_latency(self) -> float | None:
        """Mean seconds between tokens after the first (chunks may carry several tokens)."""
        if self.new_tokens < 2 or len(self.chunks) < 2:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) / (self.new_tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0


def _apply_event(run: RemoteRun, event: dict, chat: bool, now: float,
                 on_text: Callable[[str, float], None] | None) -> dict | None:
    """Add one streamed event to ``run``; the llama.cpp timings it carries, if any. The whole
    event is checked before any of it is used: a field of the wrong type is a malformed reply
    (a RemoteError, so the run keeps its text), never a TypeError."""
    label = run.endpoint.label
    if event.get("error") is not None:
        err = event["error"]
        raise RemoteError(f"{label}: {err.get('message') if isinstance(err, dict) else err}")
    usage = _field(event, "usage", dict, label) or {}
    count = _count(usage, "completion_tokens", label)
    timings = _field(event, "timings", dict, label)
    for key in ("predicted_n", "draft_n", "draft_n_accepted"):  # what llamacpp_spec_stats reads
        _count(timings or {}, key, label)
    choices = [_choice(c, chat, label) for c in _field(event, "choices", list, label) or []]
    if count is not None:
        run.completion_tokens = count
    for piece, finish in choices:
        if piece:
            run.chunks.append((now, piece))
            run.text += piece
            if on_text:
                on_text(piece, now)
        run.finish_reason = finish or run.finish_reason
    return timings


def _choice(choice, chat: bool, label: str) -> tuple[str | None, str | None]:
    """A streamed choice's text and finish reason, checked."""
    if not isinstance(choice, dict):
        raise _malformed(label, f"a choice that is {_kind(choice)}, not an object")
    if chat:
        piece = _field(_field(choice, "delta", dict, label) or {}, "content", str, label)
    else:
        piece = _field(choice, "text", str, label)
    return piece, _field(choice, "finish_reason", str, label)


def stream_completion(endpoint: Endpoint, prompt: str, *, max_tokens: int, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int | None = 0, chat: bool = True,
                      on_text: Callable[[str, float], None] | None = None,
                      should_stop: Callable[[], bool] = lambda: False) -> RemoteRun:
    """Stream one completion from ``endpoint``. A failure (unreachable, refused, dropped, timed
    out, past the endpoint's deadline, too long) does not raise: the run carries the message and
    the text received so far. ``should_stop`` is asked whenever bytes arrive, keep-alives included."""
    if not prompt.strip():
        raise ConfigError("the prompt is empty")
    run = RemoteRun(endpoint=endpoint, prompt=prompt, model=endpoint.model)
    deadline = _deadline(endpoint, None)
    try:
        run.model = endpoint.model or (list_models(endpoint, deadline) or [""])[0]
    except RemoteError as exc:
        run.error = str(exc)
        return run
    model = run.model
    before = read_metrics(endpoint, deadline)
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                  "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    conn = _Connection(endpoint, deadline)
    path = conn.base + ("/chat/completions" if chat else "/completions")
    timings = None
    start = time.perf_counter()
    try:
        resp = conn.request("POST", path, body)
        if resp.status != 200:
            raise RemoteError(_error_message(conn, f"{conn.root}{path}"))
        for event in _sse_events(conn.pieces(), endpoint.label):
            if event is not None:
                timings = _apply_event(run, event, chat, time.perf_counter() - start, on_text) or timings
            if should_stop():
                run.cancelled = True
                break
        else:
            if run.finish_reason is None:
                run.error = f"{endpoint.label} closed the stream before the answer ended"
    except RemoteError as exc:
        run.error = str(exc)
    finally:
        run.wall_time = time.perf_counter() - start
        conn.close()
    if run.error is None or run.chunks:
        run.speculation = llamacpp_spec_stats(timings)
        if run.speculation is None and before:
            after = read_metrics(endpoint, deadline)
            run.speculation = vllm_spec_stats(before, after) or sglang_spec_stats(after)
    return run


def remote_record(run: RemoteRun, *, max_new_tokens: int, temperature: float, top_p: float,
                  seed: int | None) -> dict:
    """A run record in the same format as a local run's (:class:`specplay.core.records.runlog.RunRecord`)."""
    stats = run.speculation
    stop = ("cancelled" if run.cancelled else "error" if run.error else
            "eos" if run.finish_reason == "stop" else "max_tokens")
    steps = None
    if stats is not None and stats.mean_accepted:
        steps = max(1, round(run.new_tokens / stats.mean_accepted))
    return RunRecord(
        question_id=None, answer_id=uuid.uuid4().hex, model_id=run.model, tstamp=time.time(),
        method=f"remote:{run.endpoint.label}", params={"endpoint": run.endpoint.describe()}, lossy=False,
        engine={**run.endpoint.describe(), "served_model": run.model}, target=None, draft=None,
        prompt=run.prompt, prompt_tokens=None, text=run.text, token_ids=None,
        stop_reason=stop, cancelled=run.cancelled, error=run.error,
        temperature=temperature, top_p=top_p, seed=seed, max_new_tokens=max_new_tokens,
        new_tokens=run.new_tokens, wall_time=run.wall_time, accept_lengths=None,
        # Spec-Bench's shapes: no steps known, so no accept lengths and no decoding steps listed.
        choices=[{"index": 0, "turns": [run.text], "decoding_steps": [] if steps is None else [steps],
                  "new_tokens": [run.new_tokens], "wall_time": [run.wall_time], "accept_lengths": []}],
        steps=steps, tokens_per_s=run.tokens_per_s, prefill_time=None,
        time_to_first_token=run.time_to_first_token, inter_token_latency=run.inter_token_latency,
        mean_accepted=stats.mean_accepted if stats else None,
        mean_acceptance_length=stats.mean_accepted if stats else None,
        acceptance_rate=stats.acceptance_rate if stats else None,
        draft_acceptance_rate=stats.acceptance_rate if stats else None,
        drafted=stats.drafted if stats else None, accepted=stats.accepted if stats else None,
        acceptance_by_position=stats.by_position if stats else None, acceptance_histogram=None,
        spec_source=stats.source if stats else None, time_split=None, environment=None,
        absent=LOCAL_ONLY | COMPARISON_ONLY | {"events"},
    ).to_dict()


def compare_endpoints(endpoints: list[Endpoint], prompt: str, *, max_tokens: int, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int | None = 0, chat: bool = True, warmup_tokens: int = 8,
                      on_run: Callable[[RemoteRun], None] | None = None,
                      should_stop: Callable[[], bool] = lambda: False) -> list[dict]:
    """The same prompt on each endpoint in turn (each after a short untimed warm-up request);
    run records with ``speedup`` over the first endpoint and, at temperature 0,
    ``identical_to_baseline`` (the same text as the first endpoint's)."""
    records = []
    for ep in endpoints:
        if should_stop():
            break
        if warmup_tokens > 0:
            stream_completion(ep, prompt, max_tokens=warmup_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              chat=chat, should_stop=should_stop)
        run = stream_completion(ep, prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                chat=chat, should_stop=should_stop)
        if on_run:
            on_run(run)
        records.append(remote_record(run, max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed))
    annotate_remote(records, greedy=temperature == 0)
    return records


def annotate_remote(records: list[dict], greedy: bool) -> None:
    """Add ``speedup`` and ``identical_to_baseline`` (same text, at temperature 0) to remote run
    records, in place, against the first of them: endpoints are compared with each other (a
    local run's token ids and a server's text are not the same measure)."""
    remote = [(r, RunRecord.from_dict(r)) for r in records if r["method"].startswith("remote:")]
    if not remote:
        return
    base = remote[0][1]
    for r, run in remote:
        ok = base.tokens_per_s > 0 and not run.error
        r["speedup"] = run.tokens_per_s / base.tokens_per_s if ok else None
        r["identical_to_baseline"] = (run.text == base.text) if greedy and not run.error else None


def chunk_event(index: int, piece: str, elapsed: float, total_tokens: int) -> StepEvent:
    """A streamed chunk as a step event, so token views and charts show remote runs live."""
    return StepEvent(step=index, tokens=[TokenEvent(token_id=-1, text=piece, fate=Fate.TARGET, depth=0, node=-1)],
                     committed=[], text=piece, num_drafted=0, num_accepted=0, timing=StepTiming(0.0, 0.0, 0.0),
                     elapsed_s=elapsed, total_new_tokens=total_tokens)


def format_remote_table(records: list[dict]) -> str:
    """Endpoints side by side; '–' where an engine exposes no speculation metrics."""
    head = (f"{'endpoint':28s} {'tok/s':>7s} {'speedup':>8s} {'TTFT':>7s} {'ITL':>8s} {'τ':>5s} {'accept':>7s} "
            f"{'tokens':>6s}  {'identical':9s} speculation")
    lines = [head, "-" * len(head)]
    def num(v, fmt):
        return "–" if v is None else format(v, fmt)

    for r in map(RunRecord.from_dict, records):
        itl = None if r.inter_token_latency is None else r.inter_token_latency * 1000
        ident = {True: "✓", False: "✗ differs", None: "–"}[r.identical_to_baseline]
        source = r.spec_source or "not exposed"
        if r.acceptance_by_position:
            source += " · by position " + " ".join(f"{a:.0%}" for a in r.acceptance_by_position)
        if r.error:
            source = f"ERROR: {r.error}"
        name = r.method.removeprefix("remote:")
        lines.append(f"{name[:28]:28s} {r.tokens_per_s:7.2f} {num(r.speedup, '.2f') + 'x':>8s} "
                     f"{num(r.time_to_first_token, '.2f') + 's':>7s} {num(itl, '.1f') + 'ms':>8s} "
                     f"{num(r.mean_accepted, '.2f'):>5s} {num(r.acceptance_rate, '.0%'):>7s} "
                     f"{r.new_tokens:6d}  {ident:9s} {source}")
    return "\n".join(lines)
