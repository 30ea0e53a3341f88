"""Tune llama-server's own draft size for this pair of models on this machine, and give the command.

What SpecPlay's tune does for its own methods (:mod:`specplay.core.measure.tune`), done for the engine a
CPU user runs: ``llama-server -md`` drafts ``--spec-draft-n-max`` tokens a step (3 unless told), and
whether that pays moves with the machine's verify curve. At temperature 0 one pass predicts every size:

1. **llama.cpp's own greedy answer** (the target's GGUF file through llama.cpp, as the server runs it)
   and its draft's greedy guess after every prefix of it (one teacher-forced pass of the draft's GGUF):
   from each position, the run of guesses that match is what any draft size accepts there (the same
   replay as ``speculative``'s, :func:`specplay.core.measure.replay.replay_speculative`).
2. **llama.cpp's own costs**, timed here at the prompt's context: the target's pass over n tokens with
   every row's logits (as a verifying pass computes them), the draft's one-token pass, and its pass over
   the block the target verified (the server feeds the draft every block the target decodes); the
   server's own prefill and cost per plain step from a run without a draft.
3. **Proof**: the server as it starts by default and with the predicted best draft size, two runs each
   taking turns, each reported measured beside its prediction.

The result is the winner's ``llama-server`` command line for these two files.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from specplay.core.decoding.costmodel import CostCurve
from specplay.core.errors import Cancelled, ConfigError, ModelError
from specplay.core.measure.replay import Replay, StepCosts, match_runs, replay_speculative
from specplay.core.measure.tune import MARGIN, PROOF_ROUNDS, Setting, Trial, TuneResult

NAME = "llamacpp_speculative"
KNOBS = ("n_max",)
DRAFT_SIZES = tuple(range(1, 13))
_SIZES = (1, 2, 3, 4, 6, 8, 13)  # block sizes timed (the largest a setting verifies: 12 drafted + 1)
SERVER_ASSUMPTIONS = (
    "temperature 0: acceptance is replayed along llama.cpp's own greedy answer, which every draft size "
    "reproduces up to llama.cpp's numerics (its passes are not batch-invariant)",
    "a step costs the draft's passes (one per drafted token, the first over the last accepted token), the "
    "draft's pass over the block the target verified, and the target's pass over that block with every "
    "row's logits, each timed here through llama.cpp at this prompt's context (median of five), plus what "
    "a plain step of the server costs beyond its pass (HTTP, sampling; from its run without a draft)",
    "the prefill is the server's own without a draft (its time to first token) plus the draft's pass over "
    "the prompt",
    "the draft's confidence threshold (--spec-draft-p-min) is at its default 0: every draft runs to n_max",
    "the machine runs as fast during the proof (two runs of each setting, taking turns) as while it was timed",
)


@dataclass(frozen=True)
class ServerStepCosts(StepCosts):
    """A server step: :class:`StepCosts` plus the draft's pass over the block the target verified."""

    draft_block: CostCurve | None = None

    def step(self, nodes: int, draft_units: float) -> float:
        return draft_units * self.draft_unit + self.draft_block(1 + nodes) + self.verify(1 + nodes) + self.other

    def to_dict(self) -> dict:
        return {**super().to_dict(), "draft_block_ms": {str(n): round(t * 1e3, 3) for n, t in
                                                         zip(self.draft_block.sizes, self.draft_block.relative)}}


def tune_title(method: str) -> str:
    """How a tune's subject is named to people: a method's title, or llama-server's draft."""
    from specplay.core.methods import method_title

    return "llama-server's draft (llamacpp_speculative)" if method == NAME else method_title(method)


def default_n_max(help_text: str) -> int:
    """The draft size llama-server uses unless told, as its ``--help`` says."""
    m = re.search(r"--spec-draft-n-max N\s+number of tokens to draft[^\n]*\(default: (\d+)\)", help_text)
    if not m:
        raise ModelError("llama-server's --help names no default for --spec-draft-n-max (its options changed?)")
    return int(m.group(1))


def _greedy_answer(session, prompt_ids: list[int], max_new: int, eos: set[int], check) -> tuple[list[int], float]:
    """llama.cpp's greedy answer, and the seconds of its prefill."""
    started = time.perf_counter()
    logits = session.eval(list(prompt_ids), 0)
    prefill = time.perf_counter() - started
    answer: list[int] = []
    while len(answer) < max_new:
        check()
        answer.append(int(np.argmax(logits)))
        if answer[-1] in eos:
            break
        logits = session.eval(answer[-1:], session.length)
    return answer, prefill


def _draft_guesses(session, prompt_ids: list[int], answer: list[int], check) -> tuple[list[int], float]:
    """The draft's greedy guess after the prompt and every prefix of the answer, and its prompt's pass."""
    started = time.perf_counter()
    logits = session.eval(list(prompt_ids), 0)
    prefill = time.perf_counter() - started
    guesses = [int(np.argmax(logits))]
    for t in answer[:-1]:
        check()
        guesses.append(int(np.argmax(session.eval([t], session.length))))
    return guesses, prefill


def _timed_blocks(session, context_ids: list[int], sizes: tuple[int, ...], every_row: bool, check,
                  repeats: int = 5) -> CostCurve:
    """Median seconds of ``session``'s pass over n tokens after ``context_ids``, the sizes taking turns."""
    session.eval(list(context_ids), 0)
    keep = len(context_ids)
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for i, n in enumerate(sizes):
            check()
            block = list(context_ids[-n:])
            started = time.perf_counter()
            session.eval(block, keep, every_row=every_row)
            times[i].append(time.perf_counter() - started)
    return CostCurve(sizes, tuple(statistics.median(t) for t in times))


def _server_run(server, prompt_ids: list[int], max_tokens: int, warmup_tokens: int, stop):
    from specplay.core.remote.endpoint import Endpoint
    from specplay.core.remote.llama_server import REQUEST_FIELDS
    from specplay.core.remote.runs import stream_completion

    ep = Endpoint(server.url, name=NAME)
    kwargs = dict(chat=False, prompt_tokens=list(prompt_ids), fields=REQUEST_FIELDS, should_stop=stop)
    if warmup_tokens > 0:
        stream_completion(ep, "tune", max_tokens=warmup_tokens, **kwargs)
    run = stream_completion(ep, "tune", max_tokens=max_tokens, **kwargs)
    if run.cancelled:
        raise Cancelled("stopped during the proof: nothing was tuned")
    if run.error:
        raise ModelError(f"llama-server failed while tuning: {run.error}")
    return run


def tune_llamacpp_speculative(target, draft, prompt_ids: list[int], config, *, prompt: str | None = None,
                              warmup_tokens: int = 4, should_stop: Callable[[], bool] | None = None,
                              on_stage: Callable[[str, float], None] | None = None) -> TuneResult:
    """Predict llama-server's speed at every draft size for this prompt, then run its default and the best."""
    from specplay.core.measure.peers import gguf_file
    from specplay.core.models.llamacpp import LlamaCppSession, available, describe, fastest_safe, usable_settings
    from specplay.core.remote.llama_server import LlamaServer, command_line, server_args, server_help, why_unavailable
    from specplay.core.remote.runs import remote_record

    if not config.sampling.greedy:
        raise ConfigError("tune predicts greedy runs (temperature 0); set the temperature to 0")
    why = why_unavailable() or available()
    if why:
        raise ConfigError(why)
    if draft is None:
        raise ConfigError(f"{NAME} needs a draft model")
    should_stop = should_stop or (lambda: False)
    stage = on_stage or (lambda text, fraction: None)

    def check() -> None:
        if should_stop():
            raise Cancelled("stopped before the proof: nothing was tuned")

    started = time.perf_counter()
    threads = torch.get_num_threads()
    target_file, draft_file = gguf_file(target), gguf_file(draft)
    _, probes = usable_settings(target_file, threads)
    settings = fastest_safe(probes)
    if settings is None:
        raise ModelError(f"llama.cpp is unsafe on this CPU ({describe(probes)})")
    default = default_n_max(server_help())
    eos = set(target.model.info.eos_token_ids)
    n_ctx = len(prompt_ids) + config.max_new_tokens + 32

    stage("llama.cpp's greedy answer and its draft's replay along it", 0.05)
    t_session = LlamaCppSession(target_file, n_ctx, threads, settings)
    d_session = LlamaCppSession(draft_file, n_ctx, threads, settings)
    try:
        answer, _ = _greedy_answer(t_session, prompt_ids, config.max_new_tokens, eos, check)
        guesses, draft_prefill = _draft_guesses(d_session, prompt_ids, answer, check)
        stage("Timing llama.cpp's passes at this prompt's context", 0.25)
        context_ids = (list(prompt_ids) + answer)[: len(prompt_ids) + len(answer) // 2]
        verify = _timed_blocks(t_session, context_ids, _SIZES, True, check)
        draft_block = _timed_blocks(d_session, context_ids, _SIZES, False, check)
    finally:
        t_session.close()
        d_session.close()
    runs = match_runs(guesses, answer)

    base_args = server_args(target_file, threads, settings, draft=draft_file)
    plain_args = server_args(target_file, threads, settings)

    def sized(n: int) -> list[str]:
        return base_args if n == default else base_args + ["--spec-draft-n-max", str(n)]

    stage("llama-server without a draft (its prefill and plain step)", 0.35)
    with LlamaServer(plain_args) as server:
        plain = _server_run(server, prompt_ids, len(answer), warmup_tokens, should_stop)
    plain_step = (plain.wall_time - plain.time_to_first_token) / max(plain.new_tokens - 1, 1)
    costs = ServerStepCosts(verify=verify, draft_unit=draft_block(1), other=max(0.0, plain_step - verify(1)),
                            prefill=plain.time_to_first_token + draft_prefill, draft_block=draft_block)
    settings_list = []
    for n in DRAFT_SIZES:
        rep: Replay = replay_speculative(runs, answer, prompt_ids, n, False, n, None)
        settings_list.append(Setting({"n_max": n}, len(answer) / rep.seconds(costs), rep.tau, len(rep.steps)))
    predicted_default = next(s for s in settings_list if s.params["n_max"] == default)
    pick = max(settings_list, key=lambda s: s.predicted_tokens_per_s)
    if pick.predicted_tokens_per_s < predicted_default.predicted_tokens_per_s * (1 + MARGIN):
        pick = predicted_default

    answer_text = target.tokenizer.decode(answer, skip_special_tokens=True)
    proofs: dict[str, list] = {"default": [], "best": []}
    servers = {"default": LlamaServer(sized(default))}
    if pick is not predicted_default:
        servers["best"] = LlamaServer(sized(pick.params["n_max"]))
    try:
        for server in servers.values():
            check()
            server.start(should_stop)
        for i in range(PROOF_ROUNDS):  # taking turns: a slow spell of a shared machine touches both
            for j, (which, server) in enumerate(servers.items()):
                stage(f"Running llama-server with the {which} draft size, {i + 1} of {PROOF_ROUNDS}",
                      0.5 + 0.45 * (i * len(servers) + j) / (PROOF_ROUNDS * len(servers)))
                proofs[which].append(_server_run(server, prompt_ids, len(answer), warmup_tokens if i == 0 else 0,
                                                 should_stop))
    finally:
        for server in servers.values():
            server.stop()

    def trial(setting: Setting, runs_: list) -> Trial:
        record = remote_record(runs_[0], max_new_tokens=len(answer), temperature=0.0, top_p=1.0, seed=0)
        taus = [r.speculation.mean_accepted for r in runs_ if r.speculation and r.speculation.mean_accepted]
        return Trial(setting.params, setting.predicted_tokens_per_s, setting.predicted_tau,
                     statistics.fmean(r.tokens_per_s for r in runs_), statistics.fmean(taus) if taus else 1.0,
                     all(r.text == answer_text for r in runs_), record, [r.tokens_per_s for r in runs_])

    default_trial = trial(predicted_default, proofs["default"])
    best_trial = trial(pick, proofs["best"]) if proofs["best"] else default_trial
    stage("Tuned", 1.0)
    baseline = remote_record(plain, max_new_tokens=len(answer), temperature=0.0, top_p=1.0, seed=0)
    notes = ()
    if plain.tokens_per_s > best_trial.measured_tokens_per_s:
        notes = (f"llama-server without a draft was faster still ({plain.tokens_per_s:.2f} against "
                 f"{best_trial.measured_tokens_per_s:.2f} tok/s): on this machine its draft does not pay for this "
                 f"prompt; drop -md to run it plain: {command_line(plain_args)}",)
    return TuneResult(method=NAME, knobs=KNOBS, base_params={"n_max": default}, prompt=prompt,
                      prompt_tokens=len(prompt_ids), new_tokens=len(answer), autoregressive=baseline,
                      default=default_trial, best=best_trial, settings=settings_list, costs=costs,
                      best_config={"n_max": best_trial.params["n_max"]}, assumptions=SERVER_ASSUMPTIONS,
                      seconds=time.perf_counter() - started, baseline="plain llama-server",
                      same_as="llama.cpp's greedy answer",
                      command=command_line(sized(best_trial.params["n_max"])), notes=notes)
