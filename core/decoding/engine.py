"""The decoding loop every method plugs into: propose -> verify -> commit -> observe.

:func:`generate` is a generator of :class:`~specplay.core.decoding.types.StepEvent`; its return value (the
``StopIteration`` value, or :func:`drain`'s result) is the :class:`~specplay.core.decoding.types.RunResult`.
It checks ``should_stop`` between steps, so a cancelled run returns what it produced.

It is a short loop over functions that each work on a :class:`RunState` and can be called
(and profiled) alone: :func:`start_run` checks the request and builds the state,
:func:`prefill` reads the prompt, :func:`decode_step` runs one step (:func:`verify_draft`,
:func:`commit`, the method's ``propose`` and ``observe`` around them) and builds its event,
:func:`should_end` checks for a stop between steps and :func:`finish` makes the result.

Invariant: the target's KV cache holds every token of the sequence except the last one,
which is the root of the next draft. A step runs [root, draft nodes..., aux tokens...] in
one forward pass, so the root's logits judge the first draft token and the logits of an
accepted node judge its children.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator

import torch

from specplay.core.decoding import costmodel
from specplay.core.decoding.costmodel import CorrectedCurve, CostCurve, cost_curve
from specplay.core.decoding.method import Method, RunContext, StepOutcome
from specplay.core.decoding.metrics import MetricsRecorder
from specplay.core.decoding.standdown import GateState, StandDownGate
from specplay.core.decoding.tree import ancestor_mask
from specplay.core.decoding.types import (Draft, Fate, GenerationConfig, RunResult, SamplingConfig, StepEvent,
                                          StepTiming, StopReason, TokenEvent, Verdict)
from specplay.core.decoding.verification import verify
from specplay.core.errors import ConfigError, is_out_of_memory
from specplay.core.models.base import CausalLM, ForwardOutput
from specplay.core.text import Detokenizer


def _forward_inputs(draft: Draft, root: int, base: int):
    """Tokens, positions and mask for [root, draft nodes, aux tokens] (None = plain causal chain)."""
    tokens = [root] + draft.tokens + draft.aux_tokens
    if draft.is_chain and not draft.aux_tokens:
        return tokens, None, None
    depths = draft.depths()
    positions = [base] + [base + d for d in depths] + list(draft.aux_positions)
    n = len(draft) + 1
    m = len(draft.aux_tokens)
    mask = torch.zeros(n + m, n + m, dtype=torch.bool)
    mask[:n, :n] = ancestor_mask(draft.parents)
    if m:
        mask[n:] = draft.aux_mask
    return tokens, torch.tensor(positions), mask


def _token_events(draft: Draft, verdict: Verdict, committed: list[int], pieces: list[str],
                  detok: Detokenizer, source: str = "") -> list[TokenEvent]:
    """Committed tokens in order, with the rejected candidates tried at a position placed before it.

    ``source`` names the proposer of the draft's nodes (``{depth}`` filled in per node); the
    target's own token is the ``bonus`` after a fully accepted draft, else the ``target``'s."""
    depths = draft.depths()
    q_tok = draft.q_token or [None] * len(draft)
    path = verdict.accepted
    last = path[-1] if path else -1
    tried_at_end = [i for i, p in enumerate(draft.parents) if p == last and verdict.fates[i] is Fate.REJECTED]
    if draft.is_chain:
        tried_at_end = [i for i in range(len(draft)) if verdict.fates[i] is Fate.REJECTED]

    def node_event(i: int, text: str) -> TokenEvent:
        return TokenEvent(token_id=draft.tokens[i], text=text, fate=verdict.fates[i], depth=depths[i], node=i,
                          p=verdict.p[i], q=q_tok[i], u=verdict.u[i], accept_prob=verdict.accept_prob[i],
                          rule=verdict.rule[i], source=source.format(depth=depths[i]) if source else None)

    events = []
    for k, tok in enumerate(committed):
        if k < len(path):
            events.append(node_event(path[k], pieces[k]))
            continue
        for i in tried_at_end:
            events.append(node_event(i, detok.piece(draft.tokens[i])))
        events.append(TokenEvent(token_id=tok, text=pieces[k], fate=verdict.next_fate, depth=0, node=-1,
                                 p=verdict.next_p, source="bonus" if verdict.next_fate is Fate.BONUS else "target"))
    return events


def _truncate(new: list[int], eos: set[int], remaining: int) -> tuple[list[int], StopReason | None]:
    """A step's committed tokens cut at the first end-of-sequence token and at the token budget."""
    for k, tok in enumerate(new):
        if tok in eos:
            return new[: k + 1], StopReason.EOS
    if len(new) >= remaining:
        return new[:remaining], StopReason.MAX_TOKENS
    return new, None


def _find_stop(text: str, pieces: list[str], stop_strings: tuple[str, ...]) -> tuple[int, int] | None:
    """Where the first stop string completes among a step's new tokens.

    ``text`` is the run's text so far, ``pieces`` the text each new token adds. Returns
    (index of the token that completes a stop string, character offset in the run's text
    where that stop string starts), or None. Scanning token by token makes the cut the same
    whichever method produced the tokens, one per step or many.
    """
    longest = max(len(s) for s in stop_strings)
    tail_from = max(0, len(text) - longest + 1)
    window = text[tail_from:]
    for k, piece in enumerate(pieces):
        window += piece
        hits = [window.find(s) for s in stop_strings if s in window]
        if hits:
            return k, tail_from + min(hits)
    return None


def _cut_at_stop_string(new: list[int], pieces: list[str], text: str,
                        stop_strings: tuple[str, ...]) -> tuple[list[int], list[str], str, str, bool]:
    """A step's tokens and text, cut where a stop string completes.

    Returns (tokens, their pieces, the step's text, the run's text before this step's text,
    whether a stop string was hit). On a hit the committed tokens end at the one that
    completes the stop string (every metric follows) and the text ends right before the
    stop string; it may straddle steps, so text streamed earlier can already show its first
    characters (the run's text is cut back too).
    """
    cut = _find_stop(text, pieces, stop_strings) if stop_strings else None
    if cut is None:
        return new, pieces, "".join(pieces), text, False
    end_token, end_char = cut
    pieces = pieces[: end_token + 1]
    return new[: end_token + 1], pieces, "".join(pieces)[: max(0, end_char - len(text))], text[:end_char], True


def _unrepeatable(method: Method, config: GenerationConfig) -> str | None:
    """Why the seed would not repeat a sampled run: it fixes the draws, not where drafts end; when
    timings move those ends (or the gate's plain steps), the same draws meet other decisions."""
    if config.sampling.greedy:
        return None
    if method.timing_sized:
        return method.timing_sized
    if config.stand_down and method.name != "autoregressive":
        return "plain steps follow timings where drafting stands down (--no-stand-down repeats it)"
    return None


def _stood_down_note(state: GateState) -> str:
    """Why this step was plain: the drafting rate it fell below, for the X-ray and the run log."""
    if state.first_step:
        return "the first token is the target's alone: it comes as soon as plain decoding's would"
    fmt = lambda r: "?" if r is None else f"{r:.1f}"  # noqa: E731
    return (f"drafting stood down: {fmt(state.draft_rate)} tokens/s drafting against {fmt(state.plain_rate)} "
            f"plain; {state.standing_down_for} plain steps before the next probe")


@dataclass
class RunState:
    """What a run carries from one step to the next (the method keeps its own drafting state).

    ``ctx`` is the run as the method sees it (prompt + committed tokens); ``text`` the output
    so far; ``stop`` is set by the step that ends the run, ``error`` where it ended in error.
    """

    ctx: RunContext
    verify_generator: torch.Generator
    eos: set[int]
    detok: Detokenizer
    gate: StandDownGate
    #: What a plain step costs against a drafting step's verification pass (None: the gate is off).
    curve: "CorrectedCurve | CostCurve | None"
    metrics: MetricsRecorder = field(default_factory=MetricsRecorder)
    events: list[StepEvent] = field(default_factory=list)
    text: str = ""
    stop: StopReason | None = None
    error: str | None = None
    started: float = 0.0
    prefill_s: float = 0.0

    @property
    def remaining(self) -> int:
        """Tokens the run may still add."""
        return self.ctx.config.max_new_tokens - self.ctx.new_tokens


def start_run(target_lm: CausalLM, tokenizer, method: Method, prompt_ids: list[int],
              config: GenerationConfig) -> RunState:
    """A run's state before its prefill, after checking that the prompt and the output fit the model.

    With the stand-down gate on, this measures the target's cost curve once per model (about a
    second on a CPU); it runs before the prefill since measuring empties the cache."""
    if not prompt_ids:
        raise ConfigError("the prompt is empty")
    needed = len(prompt_ids) + config.max_new_tokens + method.max_draft_nodes + 1
    if needed > target_lm.info.max_positions:
        raise ConfigError(
            f"prompt ({len(prompt_ids)} tokens) + max new tokens ({config.max_new_tokens}) exceeds the model's "
            f"context of {target_lm.info.max_positions} tokens"
        )
    eos = set(target_lm.info.eos_token_ids) if config.stop_at_eos else set()
    seed = config.sampling.seed
    ctx = RunContext(target_lm=target_lm, tokens=list(prompt_ids), prompt_len=len(prompt_ids), config=config,
                     draft_generator=torch.Generator().manual_seed(seed + 1), eos_token_ids=tuple(eos))
    gate = StandDownGate(enabled=config.stand_down and method.name != "autoregressive")
    curve = cost_curve(target_lm) if gate.enabled else None
    return RunState(ctx=ctx, verify_generator=torch.Generator().manual_seed(seed), eos=eos,
                    detok=Detokenizer(tokenizer), gate=gate, curve=curve, started=time.perf_counter())


def prefill(target_lm: CausalLM, method: Method, state: RunState) -> None:
    """Fill the target's cache with every prompt token but the last (the first step's root), then
    start the method on it. Ends the run with an error if the prompt does not fit in memory."""
    prompt_ids = state.ctx.tokens
    try:
        target_lm.reset()
        if len(prompt_ids) > 1:
            # Every prompt row's logits would go unread: the last token is the next step's root.
            read = time.perf_counter()
            state.ctx.prefill = target_lm.forward_chain(prompt_ids[:-1], hidden=method.needs_hidden,
                                                        layers=method.feature_layers, logit_rows=[], prefill=True)
            state.ctx.prefill_s = time.perf_counter() - read
        method.start(state.ctx)
        state.prefill_s = time.perf_counter() - state.started
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        state.stop = StopReason.ERROR
        state.error = f"out of memory while reading the prompt ({len(prompt_ids)} tokens)"


def verify_draft(target_lm: CausalLM, method: Method, draft: Draft, state: RunState) -> tuple[ForwardOutput, Verdict]:
    """One target pass over [root, draft nodes, aux tokens]; the verifier decides which nodes are accepted."""
    tokens, positions, mask = _forward_inputs(draft, state.ctx.tokens[-1], target_lm.cache_len)
    logit_rows = None
    if draft.aux_tokens and draft.aux_logit_rows is not None:
        n_verify = len(draft) + 1
        logit_rows = list(range(n_verify)) + [n_verify + a for a in draft.aux_logit_rows]
    out = target_lm.forward(tokens, positions, mask, hidden=method.needs_hidden, layers=method.feature_layers,
                            logit_rows=logit_rows)
    return out, verify(draft, out.logits, state.ctx.config.sampling, state.verify_generator, typical=method.typical)


def commit(target_lm: CausalLM, draft: Draft, verdict: Verdict, state: RunState) -> tuple[list[int], list[str], str]:
    """Keep the root and the accepted path in the target's cache; add the step's tokens to the run.

    The step's tokens end at the first end-of-sequence token, the token budget or a completed
    stop string (which sets ``state.stop``). Returns (the tokens added, the text each adds,
    the text the step adds)."""
    target_lm.commit(kept_rows(verdict))
    new = [draft.tokens[i] for i in verdict.accepted] + [verdict.next_token]
    new, state.stop = _truncate(new, state.eos, state.remaining)
    new, pieces, step_text, state.text, hit = _cut_at_stop_string(new, state.detok.add(new), state.text,
                                                                  state.ctx.config.stop_strings)
    if hit:
        state.stop = StopReason.STOP_STRING
    state.ctx.tokens.extend(new)
    state.text += step_text
    return new, pieces, step_text


def kept_rows(verdict: Verdict) -> list[int]:
    """The forward rows a step commits to the target's cache: row 0 (the root), then the accepted path."""
    return [0] + [i + 1 for i in verdict.accepted]


def decode_step(target_lm: CausalLM, method: Method, state: RunState) -> StepEvent:
    """One propose -> verify -> commit -> observe step; sets ``state.stop`` when the run must end."""
    gate_state = state.gate.state()
    t0 = time.perf_counter()
    # propose: any number of draft nodes, as a tree; nothing while the gate stands down
    draft = method.propose(state.ctx, state.remaining - 1 if gate_state.drafting else 0)
    t1 = time.perf_counter()
    # verify: one target pass over the root and the draft; only the verifier accepts tokens
    out, verdict = verify_draft(target_lm, method, draft, state)
    t2 = time.perf_counter()
    # commit: the target keeps the root and the accepted path
    new, pieces, step_text = commit(target_lm, draft, verdict, state)
    t3 = time.perf_counter()
    # observe: the method updates its drafting state (nothing to do once the run ends)
    notes = None
    if state.stop is None:
        notes = method.observe(state.ctx, StepOutcome(draft=draft, verdict=verdict, target_out=out,
                                                      kept_rows=kept_rows(verdict), new_tokens=new))
    t4 = time.perf_counter()

    timing = StepTiming(draft_s=(t1 - t0) + (t4 - t3), verify_s=t2 - t1, other_s=t3 - t2)
    accepted_len = min(len(verdict.accepted), len(new))
    rows = 1 + len(draft) + len(draft.aux_tokens)
    costmodel.observe(target_lm, rows, t2 - t1)  # the kept curve, corrected by what this pass took
    curve = state.curve
    drafted = len(draft) > 0 or bool(draft.aux_tokens)
    # A method let draft that drafted nothing still spent its look (a tree none of whose nodes pay).
    looked = max(0.0, t1 - t0 - draft.setup_s) if gate_state.drafting and not drafted else 0.0
    state.gate.record(drafted, len(new), t4 - t0 - draft.setup_s, looked_s=looked,
                      plain_estimate=lambda: (t2 - t1) / curve(rows) + (t3 - t2) if curve else None)
    state.metrics.add_step(len(new), len(draft), accepted_len, max(draft.depths(), default=0), timing.draft_s,
                           timing.verify_s, timing.other_s)
    event = StepEvent(
        step=len(state.events), tokens=_token_events(draft, verdict, new, pieces, state.detok,
                                                     draft.source or method.draft_source),
        committed=new, text=step_text, num_drafted=len(draft), num_accepted=accepted_len, timing=timing,
        elapsed_s=time.perf_counter() - state.started, total_new_tokens=state.ctx.new_tokens,
        tree=_tree_of(draft, verdict), internals={**draft.shown, **notes} if notes else draft.shown,
        stood_down=None if gate_state.drafting else _stood_down_note(gate_state),
    )
    state.events.append(event)
    return event


def _tree_of(draft: Draft, verdict: Verdict) -> dict:
    """The whole draft with each node's fate, for tree views (empty when nothing was drafted)."""
    if not len(draft):
        return {}
    return {"tokens": draft.tokens, "parents": draft.parents, "fates": [f.value for f in verdict.fates],
            "accepted": verdict.accepted}


def should_end(state: RunState, should_stop: Callable[[], bool]) -> bool:
    """Whether the run ends before another step: a step ended it, or the caller cancels it."""
    if state.stop is None and should_stop():
        state.stop = StopReason.CANCELLED
    return state.stop is not None


def finish(method: Method, state: RunState) -> RunResult:
    """The run as a result: its tokens, text, why it stopped and its metrics."""
    ctx, events = state.ctx, state.events
    wall = time.perf_counter() - state.started
    metrics = state.metrics.finish(wall, state.prefill_s, events[0].elapsed_s if events else None,
                                   state.gate.stood_down_steps)
    return RunResult(
        method=method.name, method_params=method.describe(), lossy=method.lossy,
        prompt_ids=ctx.tokens[:ctx.prompt_len], token_ids=ctx.tokens[ctx.prompt_len:], text=state.text,
        stop_reason=state.stop, metrics=metrics, config=ctx.config, events=events, error=state.error,
        unrepeatable=_unrepeatable(method, ctx.config), warnings=list(method.warnings),
    )


def generate(target_lm: CausalLM, tokenizer, method: Method, prompt_ids: list[int], config: GenerationConfig,
             should_stop: Callable[[], bool] | None = None) -> Generator[StepEvent, None, RunResult]:
    """Decode ``prompt_ids`` with ``method``; yield one event per step, return the run."""
    should_stop = should_stop or (lambda: False)
    state = start_run(target_lm, tokenizer, method, prompt_ids, config)
    prefill(target_lm, method, state)
    while not should_end(state, should_stop):
        try:
            event = decode_step(target_lm, method, state)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            state.stop = StopReason.ERROR
            state.error = f"out of memory while generating (after {state.ctx.new_tokens} tokens)"
            break
        yield event
    return finish(method, state)


def drain(run: Generator[StepEvent, None, RunResult], on_event: Callable[[StepEvent], None] | None = None) -> RunResult:
    """Iterate a run to its end, passing each event to ``on_event``; return the result."""
    while True:
        try:
            event = next(run)
        except StopIteration as done:
            return done.value
        if on_event is not None:
            on_event(event)


#: Tokens of the untimed warm-up before a timed run (a comparison's, the tune's, the app's Run).
WARMUP_TOKENS = 8


def warm_up(target_lm: CausalLM, tokenizer, method: Method, prompt_ids: list[int], sampling: SamplingConfig,
            tokens: int = WARMUP_TOKENS, should_stop: Callable[[], bool] | None = None) -> None:
    """A short run whose result is discarded: what a timed run should not pay for the first time
    (allocations, a kernel's first calls, a method's one-time calibration)."""
    if tokens > 0:
        warm = GenerationConfig(max_new_tokens=tokens, sampling=sampling)
        drain(generate(target_lm, tokenizer, method, prompt_ids, warm, should_stop))


def run_to_end(target_lm: CausalLM, tokenizer, method: Method, prompt_ids: list[int], config: GenerationConfig, *,
               warmup_tokens: int = 0, should_stop: Callable[[], bool] | None = None,
               on_event: Callable[[StepEvent], None] | None = None) -> RunResult:
    """Run ``method`` on ``prompt_ids`` to its end, each step's event to ``on_event``: what the command
    line, the app, a comparison, the bench, the tune and the audit run. ``warmup_tokens`` first runs
    that many tokens untimed (:func:`warm_up`), unless the run is already stopped."""
    if warmup_tokens > 0 and not (should_stop and should_stop()):
        warm_up(target_lm, tokenizer, method, prompt_ids, config.sampling, warmup_tokens, should_stop)
    return drain(generate(target_lm, tokenizer, method, prompt_ids, config, should_stop), on_event)

