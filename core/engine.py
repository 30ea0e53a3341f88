"""The decoding loop every method plugs into: propose -> verify -> commit -> observe.

:func:`generate` is a generator of :class:`~specplay.core.types.StepEvent`; its return value (the
``StopIteration`` value, or :func:`drain`'s result) is the :class:`~specplay.core.types.RunResult`.
It checks ``should_stop`` between steps, so a cancelled run returns what it produced.

Invariant: the target's KV cache holds every token of the sequence except the last one,
which is the root of the next draft. A step runs [root, draft nodes..., aux tokens...] in
one forward pass, so the root's logits judge the first draft token and the logits of an
accepted node judge its children.
"""

from __future__ import annotations

import time
from typing import Callable, Generator

import torch

from specplay.core.costmodel import cost_curve
from specplay.core.errors import ConfigError, is_out_of_memory
from specplay.core.methods.base import Method, RunContext, StepOutcome
from specplay.core.metrics import MetricsRecorder
from specplay.core.models.base import CausalLM
from specplay.core.standdown import GateState, StandDownGate
from specplay.core.text import Detokenizer
from specplay.core.tree import ancestor_mask
from specplay.core.types import (Draft, Fate, GenerationConfig, RunResult, StepEvent, StepTiming, StopReason, TokenEvent,
                        Verdict)
from specplay.core.verification import verify


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
    fmt = lambda r: "?" if r is None else f"{r:.1f}"  # noqa: E731
    return (f"drafting stood down: {fmt(state.draft_rate)} tokens/s drafting against {fmt(state.plain_rate)} "
            f"plain; {state.standing_down_for} plain steps before the next probe")


def generate(target: CausalLM, tokenizer, method: Method, prompt_ids: list[int], config: GenerationConfig,
             should_stop: Callable[[], bool] | None = None) -> Generator[StepEvent, None, RunResult]:
    """Decode ``prompt_ids`` with ``method``; yield one event per step, return the run."""
    if not prompt_ids:
        raise ConfigError("the prompt is empty")
    needed = len(prompt_ids) + config.max_new_tokens + method.max_draft_nodes + 1
    if needed > target.info.max_positions:
        raise ConfigError(
            f"prompt ({len(prompt_ids)} tokens) + max new tokens ({config.max_new_tokens}) exceeds the model's "
            f"context of {target.info.max_positions} tokens"
        )
    should_stop = should_stop or (lambda: False)
    eos = set(target.info.eos_token_ids) if config.stop_at_eos else set()
    seed = config.sampling.seed
    verify_gen = torch.Generator().manual_seed(seed)
    ctx = RunContext(target=target, tokens=list(prompt_ids), prompt_len=len(prompt_ids), config=config,
                     draft_generator=torch.Generator().manual_seed(seed + 1), eos_token_ids=tuple(eos))
    metrics = MetricsRecorder()
    detok = Detokenizer(tokenizer)
    events: list[StepEvent] = []

    def _step() -> StepEvent:
        """One propose -> verify -> commit -> observe step; sets ``stop`` when the run must end."""
        nonlocal stop, text
        remaining = config.max_new_tokens - ctx.new_tokens
        gate_state = gate.state()
        t0 = time.perf_counter()
        # propose: any number of draft nodes, as a tree; nothing while the gate stands down
        draft = method.propose(ctx, remaining - 1 if gate_state.drafting else 0)
        t1 = time.perf_counter()
        # verify: one target pass over the root and the draft; only the verifier accepts tokens
        tokens, positions, mask = _forward_inputs(draft, ctx.tokens[-1], target.cache_len)
        logit_rows = None
        if draft.aux_tokens and draft.aux_logit_rows is not None:
            n_verify = len(draft) + 1
            logit_rows = list(range(n_verify)) + [n_verify + a for a in draft.aux_logit_rows]
        out = target.forward(tokens, positions, mask, hidden=method.needs_hidden, layers=method.feature_layers,
                             logit_rows=logit_rows)
        verdict = verify(draft, out.logits, config.sampling, verify_gen, typical=method.typical)
        t2 = time.perf_counter()

        # commit: the target keeps the root and the accepted path; the step's tokens end at the
        # first end-of-sequence token, the token budget or a completed stop string
        kept_rows = [0] + [i + 1 for i in verdict.accepted]
        target.commit(kept_rows)
        new, stop = _truncate([draft.tokens[i] for i in verdict.accepted] + [verdict.next_token], eos, remaining)
        new, pieces, step_text, text, hit = _cut_at_stop_string(new, detok.add(new), text, config.stop_strings)
        if hit:
            stop = StopReason.STOP_STRING
        ctx.tokens.extend(new)
        text += step_text
        t3 = time.perf_counter()
        # observe: the method updates its drafting state (nothing to do once the run ends)
        notes = None
        if stop is None:
            notes = method.observe(ctx, StepOutcome(draft=draft, verdict=verdict, target_out=out, kept_rows=kept_rows,
                                                    new_tokens=new))
        t4 = time.perf_counter()

        accepted_len = min(len(verdict.accepted), len(new))
        timing = StepTiming(draft_s=(t1 - t0) + (t4 - t3), verify_s=t2 - t1, other_s=t3 - t2)
        drafted = len(draft) > 0 or bool(draft.aux_tokens)
        rows = len(tokens)
        gate.record(drafted, len(new), t4 - t0, plain_estimate=lambda: (t2 - t1) / curve(rows) if curve else None)
        depth = max(draft.depths(), default=0)
        metrics.add_step(len(new), len(draft), accepted_len, depth, timing.draft_s, timing.verify_s, timing.other_s)
        return StepEvent(
            step=step, tokens=_token_events(draft, verdict, new, pieces, detok, draft.source or method.draft_source),
            committed=new, text=step_text,
            num_drafted=len(draft), num_accepted=accepted_len, timing=timing,
            elapsed_s=time.perf_counter() - t_start, total_new_tokens=ctx.new_tokens,
            tree={"tokens": draft.tokens, "parents": draft.parents, "fates": [f.value for f in verdict.fates],
                  "accepted": verdict.accepted} if len(draft) else {},
            internals={**draft.shown, **notes} if notes else draft.shown,
            stood_down=None if gate_state.drafting else _stood_down_note(gate_state),
        )

    gate = StandDownGate(enabled=config.stand_down and method.name != "autoregressive")
    # What a plain step costs against a drafting step's verification pass: measured once per model
    # (about a second on a CPU), before the run, since measuring empties the cache.
    curve = cost_curve(target) if gate.enabled else None
    t_start = time.perf_counter()
    stop: StopReason | None = None
    error: str | None = None
    text = ""
    step = 0
    prefill_time = 0.0
    try:
        target.reset()
        if len(prompt_ids) > 1:
            # Every prompt row's logits would go unread: the last token is the next step's root.
            ctx.prefill = target.forward_chain(prompt_ids[:-1], hidden=method.needs_hidden,
                                               layers=method.feature_layers, logit_rows=[], prefill=True)
        method.start(ctx)
        prefill_time = time.perf_counter() - t_start
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        stop, error = StopReason.ERROR, f"out of memory while reading the prompt ({len(prompt_ids)} tokens)"
    while stop is None:
        if should_stop():
            stop = StopReason.CANCELLED
            break
        try:
            event = _step()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            stop, error = StopReason.ERROR, f"out of memory while generating (after {ctx.new_tokens} tokens)"
            break
        events.append(event)
        step += 1
        yield event

    wall = time.perf_counter() - t_start
    return RunResult(
        method=method.name, method_params=method.describe(), lossy=method.lossy, prompt_ids=list(prompt_ids),
        token_ids=ctx.tokens[ctx.prompt_len:], text=text, stop_reason=stop,
        metrics=metrics.finish(wall, prefill_time, events[0].elapsed_s if events else None, gate.stood_down_steps),
        config=config,
        events=events, error=error, unrepeatable=_unrepeatable(method, config),
    )


def drain(run: Generator[StepEvent, None, RunResult], on_event: Callable[[StepEvent], None] | None = None) -> RunResult:
    """Iterate a run to its end, passing each event to ``on_event``; return the result."""
    while True:
        try:
            event = next(run)
        except StopIteration as done:
            return done.value
        if on_event is not None:
            on_event(event)
