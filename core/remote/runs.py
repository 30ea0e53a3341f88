"""A run against an endpoint: one streamed completion timed chunk by chunk, its record (the schema
of local runs), several endpoints compared on one prompt, and their table."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from specplay.core.errors import ConfigError
from specplay.core.records.runlog import COMPARISON_ONLY, LOCAL_ONLY, RunRecord
from specplay.core.remote.endpoint import Endpoint, RemoteError
from specplay.core.remote.transport import (Connection, count_field, deadline_of, error_message, kind_of, list_models,
                                       malformed, sse_events, typed_field)
from specplay.core.remote.metrics import SpecStats, llamacpp_spec_stats, read_metrics, sglang_spec_stats, vllm_spec_stats
from specplay.core.decoding.types import Fate, StepEvent, StepTiming, TokenEvent

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
    usage = typed_field(event, "usage", dict, label) or {}
    count = count_field(usage, "completion_tokens", label)
    timings = typed_field(event, "timings", dict, label)
    for key in ("predicted_n", "draft_n", "draft_n_accepted"):  # what llamacpp_spec_stats reads
        count_field(timings or {}, key, label)
    choices = [_choice(c, chat, label) for c in typed_field(event, "choices", list, label) or []]
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
        raise malformed(label, f"a choice that is {kind_of(choice)}, not an object")
    if chat:
        piece = typed_field(typed_field(choice, "delta", dict, label) or {}, "content", str, label)
    else:
        piece = typed_field(choice, "text", str, label)
    return piece, typed_field(choice, "finish_reason", str, label)


def stream_completion(endpoint: Endpoint, prompt: str, *, max_tokens: int, temperature: float = 0.0,
                      top_p: float = 1.0, seed: int | None = 0, chat: bool = True,
                      prompt_tokens: list[int] | None = None, fields: dict | None = None,
                      on_text: Callable[[str, float], None] | None = None,
                      should_stop: Callable[[], bool] = lambda: False) -> RemoteRun:
    """Stream one completion from ``endpoint``. A failure (unreachable, refused, dropped, timed
    out, past the endpoint's deadline, too long) does not raise: the run carries the message and
    the text received so far. ``should_stop`` is asked whenever bytes arrive, keep-alives included.

    ``prompt_tokens`` (completions only) sends the prompt as token ids, as the OpenAI API allows, so
    a server of the same model reads exactly those (``prompt`` is then what the record shows);
    ``fields`` adds an engine's own request fields (llama.cpp's samplers, say)."""
    if prompt_tokens is not None and chat:
        raise ConfigError("a prompt of token ids goes through the completions API, not chat")
    if not (prompt_tokens if prompt_tokens is not None else prompt.strip()):
        raise ConfigError("the prompt is empty")
    run = RemoteRun(endpoint=endpoint, prompt=prompt, model=endpoint.model)
    deadline = deadline_of(endpoint, None)
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
    body.update(fields or {})
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = list(prompt_tokens) if prompt_tokens is not None else prompt
    conn = Connection(endpoint, deadline)
    path = conn.base + ("/chat/completions" if chat else "/completions")
    timings = None
    start = time.perf_counter()
    try:
        resp = conn.request("POST", path, body)
        if resp.status != 200:
            raise RemoteError(error_message(conn, f"{conn.root}{path}"))
        for event in sse_events(conn.pieces(), endpoint.label):
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
