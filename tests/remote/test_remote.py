"""Remote engines: metric parsers on engine output, and streaming against servers on 127.0.0.1."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specplay.core.errors import ConfigError
from specplay.core.records.runlog import LOCAL_ONLY, RunRecord
from specplay.core.remote import transport
from specplay.core.remote.endpoint import Endpoint, RemoteError, api_key
from specplay.core.remote.metrics import llamacpp_spec_stats, parse_prometheus, sglang_spec_stats, vllm_spec_stats
from specplay.core.remote.runs import compare_endpoints, format_remote_table, remote_record, stream_completion

FIXTURES = Path(__file__).parents[1] / "fixtures" / "remote"


# ----------------------------------------------------------------------------------- parsers
def test_vllm_counters_give_this_runs_acceptance_and_per_position_rates():
    before = parse_prometheus((FIXTURES / "vllm_metrics_before.txt").read_text())
    after = parse_prometheus((FIXTURES / "vllm_metrics_after.txt").read_text())
    s = vllm_spec_stats(before, after)
    # 40 drafts, 120 draft tokens, 90 accepted during the run
    assert (s.drafted, s.accepted) == (120, 90)
    assert s.mean_accepted == pytest.approx(1 + 90 / 40)
    assert s.acceptance_rate == pytest.approx(0.75)
    assert s.by_position == pytest.approx([36 / 40, 30 / 40, 24 / 40])
    assert s.source == "vllm-metrics"


def test_sglang_gauges_and_llamacpp_timings_are_read():
    s = sglang_spec_stats(parse_prometheus((FIXTURES / "sglang_metrics.txt").read_text()))
    assert (s.mean_accepted, s.acceptance_rate, s.source) == (3.12, 0.53, "sglang-metrics")
    chunk = json.loads((FIXTURES / "llamacpp_chunk.json").read_text())
    s = llamacpp_spec_stats(chunk["timings"])
    assert (s.drafted, s.accepted) == (48, 36)
    assert s.acceptance_rate == pytest.approx(0.75)
    assert s.mean_accepted == pytest.approx(64 / (64 - 36))  # 28 target steps made 64 tokens
    assert llamacpp_spec_stats({"predicted_n": 64}) is None  # no drafting: nothing claimed


def test_an_engine_without_speculation_metrics_is_said_so():
    assert vllm_spec_stats({}, parse_prometheus("vllm:num_requests_running 0\n")) is None
    assert sglang_spec_stats(parse_prometheus("sglang:gen_throughput 1.0\n")) is None


def test_endpoint_specs_parse_and_bad_ones_are_refused():
    ep = Endpoint.parse("http://127.0.0.1:8000/v1,model=qwen,name=spec on,timeout=5,deadline=60")
    assert (ep.url, ep.model, ep.name, ep.timeout_s, ep.deadline_s) == ("http://127.0.0.1:8000/v1", "qwen", "spec on",
                                                                        5.0, 60.0)
    for bad in ("", "ftp://x/v1", "http://h:1/v1,colour=red", "http://h:1/v1,timeout=soon"):
        with pytest.raises(ConfigError):
            Endpoint.parse(bad)


@pytest.mark.parametrize("spec", ["http://127.0.0.1:99999/v1", "http://127.0.0.1:abc/v1", "http://127.0.0.1:0/v1",
                                  "http://127.0.0.1:8000/v1,timeout=inf", "http://127.0.0.1:8000/v1,timeout=nan",
                                  "http://127.0.0.1:8000/v1,timeout=1e999", "http://127.0.0.1:8000/v1,deadline=inf",
                                  "http://127.0.0.1:8000/v1,deadline=0", "http://127.0.0.1:8000/my models/v1",
                                  "http://exämple.org:8000/v1", "http://[::1:8000/v1"])
def test_bad_ports_timeouts_and_urls_are_refused_in_one_line(spec):
    with pytest.raises(ConfigError) as caught:
        Endpoint.parse(spec)
    assert "\n" not in str(caught.value)


def test_a_bad_port_on_the_command_line_is_a_message_not_a_traceback(capsys):
    from specplay.core.cli import main

    assert main(["run", "--engine", "http://127.0.0.1:99999/v1", "--prompt", "x"]) == 1
    assert "port" in capsys.readouterr().err


# ------------------------------------------------------------------------- a fake OpenAI server
class FakeEngine:
    """An OpenAI-compatible server on 127.0.0.1 that streams a fixed answer word by word.

    ``mode``: "ok", "drop" (closes the stream half-way), "stall" (stops sending half-way),
    ``spec``: "vllm" (Prometheus counters that grow with each request) or "llamacpp" (timings).
    """

    def __init__(self, mode="ok", spec="vllm", words=12, model="qwen-test", delay=0.002):
        self.mode, self.spec, self.words, self.model, self.delay = mode, spec, words, model, delay
        self.requests = 0
        self.auth: list[str | None] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body, ctype="application/json"):
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                if self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": engine.model}]}))
                elif self.path == "/metrics" and engine.spec == "vllm":
                    n = engine.requests
                    self._send(200, "\n".join([
                        f'vllm:spec_decode_num_drafts_total{{engine="0"}} {4.0 * n}',
                        f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {12.0 * n}',
                        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {8.0 * n}',
                        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="0"}} {4.0 * n}',
                        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="1"}} {3.0 * n}',
                        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="2"}} {1.0 * n}',
                    ]) + "\n", "text/plain")
                else:
                    self._send(404, json.dumps({"error": {"message": "not found"}}))

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.auth.append(self.headers.get("Authorization"))
                if body.get("model") != engine.model:
                    self._send(404, json.dumps({"error": {"message": f"The model `{body.get('model')}` does not exist."}}))
                    return
                engine.requests += 1
                n = min(engine.words, body["max_tokens"])
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(n):
                    if engine.mode in ("drop", "stall") and i == n // 2:
                        if engine.mode == "stall":
                            time.sleep(3)
                        self.wfile.flush()
                        self.connection.close()
                        return
                    piece = f"w{i} "
                    choice = {"delta": {"content": piece}} if self.path.endswith("/chat/completions") else {"text": piece}
                    chunk = {"choices": [{"index": 0, **choice, "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(engine.delay)
                last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                        "usage": {"completion_tokens": n}}
                if engine.spec == "llamacpp":
                    last["timings"] = {"predicted_n": n, "draft_n": 9, "draft_n_accepted": 6}
                self.wfile.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_a_streamed_run_is_timed_and_its_speculation_read_from_the_counters(monkeypatch):
    monkeypatch.setenv("SPECPLAY_TEST_KEY", "sk-secret")
    with FakeEngine(spec="vllm") as engine:
        ep = Endpoint(engine.url, key_env="SPECPLAY_TEST_KEY")
        seen = []
        run = stream_completion(ep, "say words", max_tokens=10, on_text=lambda piece, t: seen.append(piece))
    assert run.error is None and run.text == "".join(seen) == "".join(f"w{i} " for i in range(10))
    assert run.new_tokens == 10 and run.model == "qwen-test"  # the server's first model, asked for
    assert 0 < run.time_to_first_token <= run.wall_time and run.inter_token_latency > 0
    assert run.speculation.mean_accepted == pytest.approx(1 + 8 / 4) and run.speculation.by_position == [1.0, 0.75, 0.25]
    assert engine.auth == ["Bearer sk-secret"]
    record = remote_record(run, max_new_tokens=10, temperature=0.0, top_p=1.0, seed=0)
    assert "sk-secret" not in json.dumps(record)  # the key never reaches a record
    assert record["method"].startswith("remote:") and record["choices"][0]["turns"] == [run.text]
    assert all(isinstance(a, int) for a in record["choices"][0]["accept_lengths"])  # Spec-Bench's flat list
    assert record["acceptance_by_position"] == [1.0, 0.75, 0.25] and record["spec_source"] == "vllm-metrics"
    # An endpoint's record carries its own keys and none of a local run's; it reads back as written.
    assert {"engine", "inter_token_latency"} <= record.keys() and not record.keys() & LOCAL_ONLY
    assert RunRecord.from_dict(record).to_dict() == record and list(RunRecord.from_dict(record).to_dict()) == list(record)


class FakeKeyring:
    """The ``keyring`` package's one call SpecPlay makes, over a dict of (service, user) -> key."""

    def __init__(self, entries: dict):
        self.entries = entries

    def get_password(self, service, user):
        return self.entries.get((service, user))


def test_the_global_openai_key_goes_only_to_an_endpoint_that_names_it(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-global")
    monkeypatch.setitem(sys.modules, "keyring", None)  # no keyring: only the variable could give a key
    with FakeEngine(spec="none") as engine:
        stream_completion(Endpoint(engine.url), "say words", max_tokens=2)
        stream_completion(Endpoint(engine.url, key_env="OPENAI_API_KEY"), "say words", max_tokens=2)
    assert engine.auth == [None, "Bearer sk-global"]


def test_a_keyring_entry_goes_to_its_own_url_only(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with FakeEngine(spec="none") as mine, FakeEngine(spec="none") as other:
        monkeypatch.setitem(sys.modules, "keyring", FakeKeyring({("specplay", mine.url): "sk-mine"}))
        stream_completion(Endpoint(mine.url), "say words", max_tokens=2)
        stream_completion(Endpoint(other.url), "say words", max_tokens=2)
    assert (mine.auth, other.auth) == (["Bearer sk-mine"], [None])


def test_a_key_never_crosses_the_network_in_clear_text(monkeypatch):
    monkeypatch.setenv("SPECPLAY_TEST_KEY", "sk-secret")
    for ok in ("https://192.0.2.7/v1", "http://localhost:8000/v1", "http://127.0.0.2:8000/v1", "http://[::1]:8000/v1"):
        assert Endpoint.parse(f"{ok},key-env=SPECPLAY_TEST_KEY").key_env == "SPECPLAY_TEST_KEY"
    with pytest.raises(ConfigError, match="https"):
        Endpoint.parse("http://192.0.2.7:8000/v1,key-env=SPECPLAY_TEST_KEY")
    lan = "http://192.0.2.7:8000/v1"  # TEST-NET: nothing answers there, and nothing is sent
    monkeypatch.setitem(sys.modules, "keyring", FakeKeyring({("specplay", lan): "sk-stored"}))
    with pytest.raises(RemoteError, match="plain http"):
        api_key(Endpoint(lan))
    run = stream_completion(Endpoint(lan, timeout_s=1), "hi", max_tokens=2)
    assert "refusing to send an API key" in run.error and "sk-stored" not in run.error


@pytest.mark.parametrize("url", ["http://user:sk-pw@127.0.0.1:8000/v1", "http://sk-pw@127.0.0.1:8000/v1",
                                 "http://127.0.0.1:8000/v1?api_key=sk-pw", "http://127.0.0.1:8000/v1#sk-pw"])
def test_credentials_in_the_url_are_refused_without_repeating_them(url):
    with pytest.raises(ConfigError, match="credentials") as caught:
        Endpoint.parse(url)
    assert "sk-pw" not in str(caught.value)


def test_two_endpoints_compare_side_by_side():
    with FakeEngine(spec="none", delay=0.004) as plain, FakeEngine(spec="llamacpp", delay=0.001) as fast:
        records = compare_endpoints([Endpoint(plain.url, name="plain"), Endpoint(fast.url, name="with draft")],
                                    "say words", max_tokens=12, warmup_tokens=2)
    assert [r["method"] for r in records] == ["remote:plain", "remote:with draft"]
    assert records[0]["speedup"] == 1.0 and records[1]["identical_to_baseline"] is True
    assert records[0]["spec_source"] is None and records[1]["spec_source"] == "llamacpp-timings"
    table = format_remote_table(records)
    assert "not exposed" in table.splitlines()[2] and "llamacpp-timings" in table.splitlines()[3]


def test_bad_endpoints_give_clear_messages_and_keep_what_arrived():
    with FakeEngine() as engine:
        wrong = stream_completion(Endpoint(engine.url, model="no-such-model"), "hi", max_tokens=4)
        assert "no-such-model" in wrong.error and "does not exist" in wrong.error
    with FakeEngine(mode="drop", words=10) as engine:
        dropped = stream_completion(Endpoint(engine.url), "hi", max_tokens=10)
    assert dropped.text == "w0 w1 w2 w3 w4 " and "closed the stream" in dropped.error
    with FakeEngine(mode="stall", words=10) as engine:
        slow = stream_completion(Endpoint(engine.url, timeout_s=0.5), "hi", max_tokens=10)
    assert slow.text == "w0 w1 w2 w3 w4 " and "timed out" in slow.error
    with FakeEngine() as engine:
        port = engine.server.server_address[1]
    gone = stream_completion(Endpoint(f"http://127.0.0.1:{port}/v1"), "hi", max_tokens=4)
    assert "cannot reach" in gone.error and gone.text == ""
    record = remote_record(gone, max_new_tokens=4, temperature=0.0, top_p=1.0, seed=0)
    assert record["stop_reason"] == "error" and record["new_tokens"] == 0
    with pytest.raises(ConfigError, match="empty"):
        stream_completion(Endpoint(f"http://127.0.0.1:{port}/v1"), "  ", max_tokens=4)


def test_compare_and_run_from_the_command_line(tmp_path, capsys):
    from specplay.core.cli import main

    log = tmp_path / "runs.jsonl"
    with FakeEngine(spec="none") as plain, FakeEngine(spec="vllm") as spec:
        rc = main(["compare", "--engine", f"{plain.url},name=plain", "--engine", f"{spec.url},name=eagle",
                   "--prompt", "say words", "--max-new-tokens", "8", "--log", str(log)])
        out = capsys.readouterr().out
        assert rc == 0 and "plain" in out and "eagle" in out and "vllm-metrics" in out
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert [r["method"] for r in records] == ["remote:plain", "remote:eagle"]
        assert records[1]["mean_accepted"] == pytest.approx(3.0)
        rc = main(["run", "--engine", spec.url, "--prompt", "say words", "--max-new-tokens", "5"])
        captured = capsys.readouterr()
        assert rc == 0 and captured.out.startswith("w0 w1 w2 w3 w4") and "τ 3.00" in captured.err
    assert main(["compare", "--engine", plain.url, "--prompt", "x"]) != 0  # the server is gone: a message, no trace
    assert "cannot reach" in capsys.readouterr().err


# ------------------------------------------------------------------------- servers that misbehave
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


def sse(event) -> bytes:
    """One server-sent event: ``event`` as JSON, or as it is if it is already text."""
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()


def word(i: int) -> bytes:
    return sse({"choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]})


def every(seconds: float, data: bytes):
    """``data`` again and again, ``seconds`` apart (the server stops it)."""
    while True:
        yield data
        time.sleep(seconds)


class RawServer:
    """A server on 127.0.0.1 whose answers are raw bytes, for what no real engine should send.

    ``routes`` maps "METHOD /path" to a function returning the bytes to send, status line and
    headers included, as an iterable (sent piece by piece); other paths get a 404. Whatever a
    route yields, sending stops after ``max_s`` seconds or when the test leaves the ``with``
    block, so a client that never gives up cannot hang the suite.
    """

    def __init__(self, routes: dict, max_s: float = 5.0):
        self.routes, self.max_s = routes, max_s
        self.closing = threading.Event()
        raw = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                route = raw.routes.get(f"{self.command} {self.path}")
                pieces = route() if route else [b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"]
                end = time.monotonic() + raw.max_s
                try:
                    for data in pieces:
                        if raw.closing.is_set() or time.monotonic() > end:
                            return
                        self.wfile.write(data)
                        self.wfile.flush()
                except OSError:  # the client hung up, as it should on garbage
                    pass

            do_GET = do_POST = answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


def streaming(*parts, path="/v1/chat/completions") -> dict:
    """Routes for a stream made of ``parts`` (bytes, or iterables of bytes, sent in order)."""
    def answer():
        yield SSE_HEAD
        for part in parts:
            yield from [part] if isinstance(part, bytes) else part
    return {f"POST {path}": answer}


FINISH = sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
WRONG_SHAPES = {
    "a number": "1", "a string": '"w2 "', "an array": "[]", "not JSON": "{w2",
    "nested too deep for Python": "[" * 100_000 + "]" * 100_000,
    "choices an object": {"choices": {"0": {"delta": {"content": "w2 "}}}},
    "a choice a string": {"choices": ["w2 "]},
    "a string delta": {"choices": [{"index": 0, "delta": "w2 "}]},
    "a number content": {"choices": [{"index": 0, "delta": {"content": 5}}]},
    "a number finish reason": {"choices": [{"index": 0, "delta": {}, "finish_reason": 3}]},
    "a string count": {"choices": [], "usage": {"completion_tokens": "12"}},
    "a negative count": {"choices": [], "usage": {"completion_tokens": -1}},
    "a boolean count": {"choices": [], "usage": {"completion_tokens": True}},
    "usage an array": {"choices": [], "usage": [12]},
    "timings a string": {"choices": [], "timings": "fast"},
    "a string draft count": {"choices": [], "timings": {"predicted_n": 3, "draft_n": "9"}},
}


@pytest.mark.parametrize("bad", WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_json_of_the_wrong_shape_is_a_malformed_reply_and_the_text_is_kept(bad):
    with RawServer(streaming(word(0), word(1), sse(bad), word(2), FINISH)) as server:
        run = stream_completion(Endpoint(server.url, model="m"), "hi", max_tokens=8)
    assert "malformed reply" in run.error and run.text == "w0 w1 "
    record = remote_record(run, max_new_tokens=8, temperature=0.0, top_p=1.0, seed=0)
    assert record["stop_reason"] == "error" and record["text"] == "w0 w1 "


def test_a_completion_of_the_wrong_shape_is_a_message_on_the_command_line(capsys):
    from specplay.core.cli import main

    bad = sse({"choices": [{"index": 0, "text": ["w2 "]}]})
    with RawServer(streaming(sse({"choices": [{"index": 0, "text": "w0 "}]}), bad, FINISH,
                             path="/v1/completions")) as server:
        rc = main(["run", "--engine", f"{server.url},model=m", "--prompt", "hi", "--no-chat-template"])
    captured = capsys.readouterr()
    assert rc == 1 and captured.out.startswith("w0 ") and "malformed reply: 'text' is an array" in captured.err


@pytest.mark.parametrize("body", [b'{"data": [{"id": 5}]}', b'{"data": {"id": "m"}}', b"[1]", b"[" * 100_000])
def test_a_model_list_of_the_wrong_shape_is_refused(body):
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    with RawServer({"GET /v1/models": lambda: [head + body]}) as server:
        run = stream_completion(Endpoint(server.url), "hi", max_tokens=8)
    assert "not an OpenAI-compatible model list" in run.error


def test_metrics_that_are_not_finite_numbers_claim_nothing():
    counters = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                "vllm:spec_decode_num_accepted_tokens_total")
    after = parse_prometheus("".join(f"{name} {value}\n" for name, value in zip(counters, ("NaN", "+Inf", "4"))))
    assert vllm_spec_stats({}, after) is None
    assert sglang_spec_stats(parse_prometheus("sglang:spec_accept_length NaN\n")) is None


def test_a_line_that_never_ends_is_cut_at_the_cap_and_the_text_kept(monkeypatch):
    monkeypatch.setattr(transport, "MAX_LINE_BYTES", 2**16)
    endless = (b"x" * 2**16 for _ in range(256))  # 16 MiB without a newline
    with RawServer(streaming(word(0), word(1), b"data: ", endless)) as server:
        run = stream_completion(Endpoint(server.url, model="m"), "hi", max_tokens=8)
    assert "line longer than" in run.error and run.text == "w0 w1 "


def test_a_body_past_the_cap_ends_the_run_and_the_text_is_kept(monkeypatch):
    monkeypatch.setattr(transport, "MAX_BODY_BYTES", 2**16)
    many = (word(i) for i in range(2000))  # about 180 kB of well-formed events
    with RawServer(streaming(many, sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))) as server:
        run = stream_completion(Endpoint(server.url, model="m"), "hi", max_tokens=8)
    assert "more than" in run.error and run.text.startswith("w0 w1 ") and len(run.chunks) < 2000


def test_a_body_past_the_cap_keeps_every_event_within_the_cap_however_the_reads_fall(monkeypatch):
    """The whole body in one write (a server's writes coalesce on a loaded machine): the events in
    its first MAX_BODY_BYTES are all kept, whichever read crosses the cap."""
    monkeypatch.setattr(transport, "MAX_BODY_BYTES", 2**16)
    body = b"".join(word(i) for i in range(2000))
    within = body[:2**16].count(b"\n\n")  # the events complete within the cap
    with RawServer(streaming(body)) as server:
        run = stream_completion(Endpoint(server.url, model="m"), "hi", max_tokens=8)
    assert "more than" in run.error and run.text == "".join(f"w{i} " for i in range(within))


def trickle():
    """An event that never ends, a byte every 50 ms: each read is quick, the line never complete."""
    yield b"data: {"
    yield from every(0.05, b" ")


@pytest.mark.parametrize("pace", [lambda: every(0.05, b": keep-alive\n\n"), trickle],
                         ids=["keep-alive comments", "a byte at a time"])
def test_a_server_that_keeps_sending_nothing_useful_ends_at_the_deadline(pace):
    with RawServer(streaming(word(0), pace())) as server:
        t0 = time.monotonic()
        run = stream_completion(Endpoint(server.url, model="m", timeout_s=2, deadline_s=1), "hi", max_tokens=8)
    assert "deadline" in run.error and run.text == "w0 " and time.monotonic() - t0 < 3


def test_stop_is_heard_between_keep_alive_comments():
    t0 = time.monotonic()
    with RawServer(streaming(word(0), every(0.05, b": keep-alive\n\n"))) as server:
        run = stream_completion(Endpoint(server.url, model="m"), "hi", max_tokens=8,
                                should_stop=lambda: time.monotonic() - t0 > 0.3)
    assert run.cancelled and run.error is None and run.text == "w0 " and time.monotonic() - t0 < 3


def test_a_stalled_body_times_out_with_a_message():
    def stalled(head: bytes):
        def answer():
            yield head + b'{"data": ['
            yield from every(0.05, b"")
        return answer

    json_head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    with RawServer({"GET /v1/models": stalled(json_head)}) as server:
        run = stream_completion(Endpoint(server.url, timeout_s=0.5), "hi", max_tokens=8)
    assert "timed out" in run.error and run.text == ""
    text_head = json_head.replace(b"application/json", b"text/plain")
    finish = sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    routes = {"GET /metrics": stalled(text_head), **streaming(word(0), finish)}
    with RawServer(routes) as server:  # metrics are optional: a stalled /metrics only loses them
        run = stream_completion(Endpoint(server.url, model="m", timeout_s=0.5), "hi", max_tokens=8)
    assert run.error is None and run.text == "w0 " and run.speculation is None
    with RawServer(streaming(word(0), every(0.05, b""))) as server:
        run = stream_completion(Endpoint(server.url, model="m", timeout_s=0.5), "hi", max_tokens=8)
    assert "timed out" in run.error and run.text == "w0 "


# ------------------------------------------------------------------ a real server: llama.cpp's
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaCppServer:
    """``python -m llama_cpp.server`` on the default GGUF, on 127.0.0.1, two threads; verbose, its
    log (llama.cpp's counts of each request's target passes among it) written to ``log``."""

    def __init__(self, gguf: Path, draft: bool, log: Path):
        import subprocess
        import sys

        self.port = _free_port()
        self.log = log
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(self.port), "--n_threads", "2", "--n_ctx", "1024", "--verbose", "True"]
        if draft:
            cmd += ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", "8"]
        with open(log, "wb") as out:  # a file, not a pipe: nobody reads the log until the server ends
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self):
        from specplay.core.remote.endpoint import RemoteError
        from specplay.core.remote.transport import list_models

        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the llama.cpp server exited: {self.log.read_text(errors='replace')[-2000:]}")
            try:
                if list_models(Endpoint(self.url, timeout_s=5)):
                    return self
            except RemoteError:
                time.sleep(0.5)
        raise RuntimeError("the llama.cpp server did not start within 180 s")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def last_request_passes(self) -> tuple[int, int]:
        """What llama.cpp logged for the last request: (the tokens it counts as prompt evaluation, the
        prompt's and every batch a draft made; its passes of one token)."""
        import re

        text = self.log.read_text(errors="replace")
        batched = re.findall(r"prompt eval time =.*?/\s*(\d+) tokens", text)
        single = re.findall(r"\beval time =.*?/\s*(\d+) runs", text)
        assert batched and single, f"no llama.cpp timings in the server's log {self.log}"
        return int(batched[-1]), int(single[-1])


@pytest.mark.real_model
def test_llamacpp_server_with_and_without_its_draft(tmp_path):
    import importlib.util

    from conftest import require_or_skip

    missing = [m for m in ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")
               if importlib.util.find_spec(m) is None]
    if missing:
        require_or_skip("SPECPLAY_REQUIRE_PEERS", f"llama-cpp-python's server is not installed ({', '.join(missing)} "
                        "missing): pip install -e \".[peers]\"")
    from specplay.core.weights.catalog import CATALOG, DEFAULT_TARGET
    from specplay.core.weights.prepare import catalog_gguf

    if not CATALOG[DEFAULT_TARGET].installed():
        require_or_skip("SPECPLAY_REQUIRE_REAL_MODELS", "the default target is not installed")
    gguf = catalog_gguf(CATALOG[DEFAULT_TARGET])
    from specplay.core.models.llamacpp import defaults_unsafe

    why = defaults_unsafe(gguf, 2)  # the server opens models with llama.cpp's defaults: try them in a child first
    if why:
        pytest.skip(f"llama-cpp-python's server would die on this CPU ({why}): see docs/remote.md")
    prompt = "Repeat this line exactly three times: the quick brown fox jumps over the lazy dog."
    records, passes = [], []
    for draft in (False, True):
        with LlamaCppServer(gguf, draft, tmp_path / f"server-{draft}.log") as server:
            records += compare_endpoints([Endpoint(server.url, name="draft" if draft else "plain")], prompt,
                                         max_tokens=32, warmup_tokens=2)
        passes.append(server.last_request_passes())
    for r in records:
        assert r["error"] is None and r["new_tokens"] > 0 and r["text"].strip()
        assert r["time_to_first_token"] > 0 and r["tokens_per_s"] > 0
        assert r["spec_source"] is None  # llama-cpp-python's server reports no draft counts
    # llama.cpp's log counts each request's passes. For the same 32 tokens, what the drafting server
    # evaluated in batches beyond the plain one's (the prompt) are drafted tokens and the token each
    # draft followed: drafts were verified, in at most half that many passes. Fewer passes in all
    # than the plain server's: drafted tokens were accepted.
    (plain_batched, plain_single), (draft_batched, draft_single) = passes
    drafted = draft_batched - plain_batched
    assert drafted > 0, passes
    assert draft_single + drafted / 2 < plain_single, passes
    print(format_remote_table(records))


def test_an_endpoint_is_benchmarked_beside_local_methods(tmp_path):
    import torch

    from specplay.core.measure.bench import BenchSpec, run_bench
    from specplay.core.measure.prompts import Question
    from tiny import loaded, tiny_pair

    target = loaded(tiny_pair(dtype=torch.float64)[0])
    with FakeEngine(spec="vllm") as engine:
        ep = Endpoint(engine.url, name="fake")
        spec = BenchSpec(methods=["autoregressive", "remote:fake"], endpoints={"remote:fake": ep}, max_new_tokens=6,
                         chat_template=False, warmup=0)
        questions = [Question(1, "code", ("ab cd",)), Question(2, "code", ("xy",))]
        result = run_bench(target, None, questions, spec, tmp_path, log=lambda m: None)
    remote = result["summary"]["remote:fake"]["overall"]
    assert remote["failures"] == 0 and remote["tokens_per_s"] > 0 and remote["time_to_first_token"] > 0
    assert remote["acceptance_rate"] == pytest.approx(8 / 12)  # from the server's counters
    answers = [json.loads(line) for line in (tmp_path / "remote-fake.jsonl").read_text().splitlines()]
    assert answers[0]["choices"][0]["turns"] == ["w0 w1 w2 w3 w4 w5 "]
