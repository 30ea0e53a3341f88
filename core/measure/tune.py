"""Tune: the fastest setting of a method's size knobs for one prompt on this machine, predicted, then proved.

How much to draft (speculative decoding's γ, prompt lookup's length, EAGLE's tree) decides
whether speculation pays, and the answer moves with the prompt and the machine. Running every
setting would take minutes; at temperature 0 one run is enough to predict them all:

1. ``autoregressive`` gives the greedy answer (every lossless method's output) and the cost
   of a plain step; the method's run **as configured** gives its drafting cost and prefill.
2. **Acceptance of every setting, replayed without the target.** Along the greedy answer the
   target accepts a draft path exactly as far as its tokens are the answer's next tokens, so
   acceptance follows from the drafter alone, fed the true prefix: one teacher-forced pass of
   the draft model gives its greedy chain's run of matches from every position (every γ and
   the adaptive schedule at once); EAGLE's dynamic tree is grown once per position at the
   deepest setting from the target's own features (one teacher-forced pass of the target),
   and every smaller depth and budget is a part of it; prompt lookup replays its own index
   (:mod:`specplay.core.measure.replay`).
3. **The cost of each step from this machine's measurements**, timed here at the prompt's
   context: drafting per token (or per tree level, with a draft's first pass over what its
   cache lacks), the target's pass over every block size a setting verifies, the handover
   between a draft model and the target, bookkeeping per step as ``autoregressive`` recorded;
   a setting's tokens/s is the answer's length over the prefill plus its steps.
4. **Proof**: the default and the predicted best run twice each, taking turns; each is
   reported measured (the mean of its runs) beside its prediction, and every run is checked
   token for token against ``autoregressive``.

The runs are timed with the stand-down gate off, so each measures its setting. What a
prediction assumes is listed in :data:`ASSUMPTIONS` and in every result.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace
from typing import Callable

import torch

from specplay.core.decoding.costmodel import CostCurve, cost_curve, time_passes
from specplay.core.decoding.engine import WARMUP_TOKENS, run_to_end
from specplay.core.decoding.method import MethodConfig
from specplay.core.decoding.types import GenerationConfig
from specplay.core.errors import Cancelled, ConfigError
from specplay.core.measure.replay import (EAGLE_TOTALS, Replay, StepCosts, eagle_trees, match_runs, new_lookup,
                                          replay_eagle, replay_lookup, replay_speculative)
from specplay.core.methods import build_method, get_spec
from specplay.core.methods.prompt_lookup import PromptLookupConfig
from specplay.core.records.runlog import RunRecord

ASSUMPTIONS = (
    "temperature 0: acceptance is replayed along autoregressive's answer, which every setting reproduces",
    "a step costs its drafting (a draft token, tree level or lookup as timed here; a draft model's first pass "
    "of a step over what its cache lacks, as timed) plus the target's pass over "
    "the root and the draft's nodes (timed here at this prompt's context, the answer half written, median of "
    "five; interpolated between the sizes timed) plus autoregressive's bookkeeping per step, plus, with a draft "
    "model, the handover: what each model's pass loses right after the other's (timed against back to back)",
    "the prefill is autoregressive's plus what the method adds (the draft model's own pass over the prompt)",
    "the machine runs as fast during the proof (two runs of each setting, taking turns) as while it was timed: "
    "on a shared machine this is the weakest",
    "the stand-down gate is off in the proof's runs, so each measures its own setting",
)

#: What a method's replay leaves out, where its configuration uses it.
_METHOD_ASSUMPTIONS = {
    "speculative": lambda c: ["a confidence threshold's early stops are not replayed: every draft runs to γ"]
    if c.confidence else [],
    "eagle": lambda c: [] if c.tree == "dynamic" else ["the settings are of the dynamic tree (EAGLE-2)"],
    "prompt_lookup": lambda c: [],
}

#: The knobs each method is tuned over (the first is the one the chart runs along).
KNOBS = {
    "speculative": ("gamma", "adaptive", "cost_sized", "lookup_ngram"),
    "prompt_lookup": ("num_tokens", "max_ngram", "adaptive"),
    "eagle": ("total_tokens", "depth", "auto_size"),
}


@dataclass
class Setting:
    params: dict
    predicted_tokens_per_s: float
    predicted_tau: float
    predicted_steps: int

    def to_dict(self) -> dict:
        return {"params": self.params, "predicted_tokens_per_s": round(self.predicted_tokens_per_s, 3),
                "predicted_tau": round(self.predicted_tau, 3), "predicted_steps": self.predicted_steps}


@dataclass
class Trial:
    """A setting that was run: its prediction beside what it measured."""

    params: dict
    predicted_tokens_per_s: float
    predicted_tau: float
    measured_tokens_per_s: float
    measured_tau: float
    identical: bool  # every run's output is autoregressive's
    record: dict  # the first run's record (core/records/runlog.py)
    measured_runs: list[float] = field(default_factory=list)  # each run's tokens/s (measured: their mean)

    @property
    def error(self) -> float:
        """(predicted − measured) / measured."""
        return (self.predicted_tokens_per_s - self.measured_tokens_per_s) / self.measured_tokens_per_s \
            if self.measured_tokens_per_s else math.inf

    def to_dict(self, with_record: bool = False) -> dict:
        out = {"params": self.params, "predicted_tokens_per_s": round(self.predicted_tokens_per_s, 3),
               "measured_tokens_per_s": round(self.measured_tokens_per_s, 3),
               "prediction_error": round(self.error, 4), "predicted_tau": round(self.predicted_tau, 3),
               "measured_tau": round(self.measured_tau, 3), "identical": self.identical,
               "measured_runs": [round(t, 3) for t in self.measured_runs]}
        if with_record:
            out["record"] = self.record
        return out


@dataclass
class TuneResult:
    method: str
    knobs: tuple[str, ...]
    base_params: dict  # the method's configuration as given: every setting changes only the knobs
    prompt: str | None
    prompt_tokens: int
    new_tokens: int
    autoregressive: dict  # the baseline's record
    default: Trial
    best: Trial
    settings: list[Setting]
    costs: StepCosts
    best_config: dict = field(default_factory=dict)  # the method's whole configuration the best ran with
    assumptions: tuple[str, ...] = ASSUMPTIONS
    seconds: float = 0.0
    baseline: str = "autoregressive"  # what ``autoregressive`` (the record speedups are over) ran
    same_as: str = "autoregressive"  # whose answer every proof run's is checked against
    command: str | None = None  # an engine's command line with the best setting, where it is one (llama-server)
    notes: tuple[str, ...] = ()  # what a reader of the verdict should know besides (the baseline beat every setting)

    @property
    def baseline_tokens_per_s(self) -> float:
        return self.autoregressive["tokens_per_s"]

    def to_dict(self, with_records: bool = False) -> dict:
        out = {"kind": "tune", "method": self.method, "knobs": list(self.knobs), "base_params": self.base_params,
               "prompt": self.prompt, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
               "autoregressive_tokens_per_s": round(self.baseline_tokens_per_s, 3),
               "default": self.default.to_dict(with_records), "best": self.best.to_dict(with_records),
               "best_is_default": self.best.params == self.default.params, "best_config": self.best_config,
               "settings": [s.to_dict() for s in self.settings], "costs": self.costs.to_dict(),
               "assumptions": list(self.assumptions), "seconds": round(self.seconds, 2), "baseline": self.baseline,
               "same_as": self.same_as}
        if self.command is not None:
            out["command"] = self.command
        if self.notes:
            out["notes"] = list(self.notes)
        if with_records:
            out["autoregressive"] = self.autoregressive
        return out


# ------------------------------------------------------------------------------ replays
def draft_matches(method, prompt_ids: list[int], answer: list[int], vocab: int,
                  check: Callable[[], None] = lambda: None) -> tuple[list[int], float]:
    """For every answer position j, how many of the answer's tokens from j on the draft model's greedy
    chain matches, fed the true prefix token by token as the method feeds it (its window, vocabulary
    and engine, llama.cpp's included, which gives the last token's logits only); and the seconds
    the method's start (the draft's pass over the prompt) took. ``check`` runs before each pass (it
    raises to stop)."""
    check()
    started = time.perf_counter()
    method.draft_model.reset()  # a fresh read: nothing kept from a run before
    method.start(SimpleNamespace(tokens=list(prompt_ids)))
    method.read_prompt(list(prompt_ids))
    prefill = time.perf_counter() - started
    guess = []
    try:
        for t in [prompt_ids[-1]] + list(answer[:-1]):
            check()
            guess.append(int(method._next_logits(method._readable([t]), vocab).argmax()))
    finally:
        method.draft_model.reset()
    return match_runs(guess, answer), prefill


@contextmanager
def _draft_timer(method, context_ids: list[int], vocab: int, check: Callable[[], None]):
    """The method's draft started on ``context_ids``; yields the seconds of one pass over the last n of
    them (``timed(n)``, after ``check``), run as the method runs it (its engine and head), its cache
    cropped back after."""
    check()
    method.draft_model.reset()
    method.start(SimpleNamespace(tokens=list(context_ids)))
    method.read_prompt(list(context_ids))
    dm = method.draft_model
    kept = dm.cache_len

    def timed(n: int) -> float:
        check()
        block = method._readable(list(context_ids[-n:]))
        started = time.perf_counter()
        method._next_logits(block, vocab)
        took = time.perf_counter() - started
        dm.crop(kept)
        return took

    try:
        yield timed
    finally:
        dm.reset()


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def draft_passes(method, context_ids: list[int], sizes: tuple[int, ...], vocab: int, repeats: int = 5,
                 check: Callable[[], None] = lambda: None) -> list[float]:
    """Median seconds of the draft's pass over n new tokens after ``context_ids``, run as the method runs
    it (its engine and head), the sizes taking turns as in :func:`specplay.core.decoding.costmodel.time_passes`
    (``check`` before each pass)."""
    times: list[list[float]] = [[] for _ in sizes]
    with _draft_timer(method, context_ids, vocab, check) as timed:
        for _ in range(repeats):
            for i, n in enumerate(sizes):
                times[i].append(timed(n))
    return [_median(t) for t in times]


def time_handover(method, target_model, context_ids: list[int], vocab: int, repeats: int = 7,
                  check: Callable[[], None] = lambda: None) -> float:
    """Seconds a speculative step loses to its two models taking turns: a one-token pass of each right
    after the other model's, against one right after its own, timed in the same rounds (so a drift of
    the machine touches both). On a CPU the models share the cores and the caches, and a draft on
    another engine (llama.cpp) brings its own threads, so neither model's back-to-back timing holds.
    ``check`` runs before each pass."""
    token = torch.tensor(list(context_ids[-1:]), dtype=torch.long)

    def target() -> float:
        check()
        started = time.perf_counter()
        target_model.forward(token)  # left pending: the next pass overwrites it
        return time.perf_counter() - started

    after = {"draft after draft": [], "target after target": [], "draft after target": [], "target after draft": []}
    check()
    target_model.reset()
    target_model.forward_chain(torch.tensor(list(context_ids), dtype=torch.long))
    try:
        with _draft_timer(method, context_ids, vocab, check) as draft:
            for _ in range(repeats):
                draft(1)
                after["draft after draft"].append(draft(1))
                after["target after draft"].append(target())
                after["target after target"].append(target())
                after["draft after target"].append(draft(1))
    finally:
        target_model.reset()
    med = {k: _median(v) for k, v in after.items()}
    return (max(0.0, med["draft after target"] - med["draft after draft"])
            + max(0.0, med["target after draft"] - med["target after target"]))


def _speculative_settings(base) -> list[dict]:
    lookups = sorted({0, base.lookup_ngram or 3})
    sizings = ({"adaptive": False, "cost_sized": False}, {"adaptive": True, "cost_sized": False},
               {"adaptive": False, "cost_sized": True})
    return [{"gamma": g, **sized, "lookup_ngram": n} for n in lookups for sized in sizings for g in range(1, 13)]


def _lookup_settings(base) -> list[dict]:
    return [{"num_tokens": k, "max_ngram": m, "adaptive": a} for a in (True, False) for m in range(1, 6)
            for k in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)]


def _eagle_settings(base) -> list[dict]:
    return [{"total_tokens": t, "depth": d, "auto_size": a} for a in (True, False) for d in range(2, 9)
            for t in EAGLE_TOTALS]


def _key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


_SETTINGS = {"speculative": _speculative_settings, "prompt_lookup": _lookup_settings, "eagle": _eagle_settings}


def _default_params(method: str, base) -> dict:
    return {k: getattr(base, k) for k in KNOBS[method]}


def _config_with(method: str, base, params: dict):
    if method == "prompt_lookup":
        params = {**params, "min_ngram": min(base.min_ngram, params["max_ngram"])}
    if method == "speculative" and (params.get("adaptive") or params.get("cost_sized")):
        params = {**params, "max_gamma": max(base.max_gamma, params["gamma"])}
    if method == "eagle":
        params = {**params, "tree": "dynamic"}
    return replace(base, **params)


#: Runs of the default and of the best each (in turns) behind a measured figure: their mean.
PROOF_ROUNDS = 2

#: The least predicted gain over the default for which a setting is proposed: about what the predictions
#: miss by on a shared two-core machine (docs/benchmarks.md), so a proposed change is a real one.
MARGIN = 0.05

#: Block sizes the target's pass is timed at, per method (the largest any of its settings verifies).
_SIZES = {"speculative": (1, 2, 3, 4, 6, 8, 13), "prompt_lookup": (1, 2, 3, 4, 6, 8, 12, 17),
          "eagle": (1, 2, 3, 4, 6, 8, 12, 16, 24, 33, 49, 65)}
EAGLE_DEPTH = 8  # the deepest tree the settings grow


class _Predictor:
    """Every setting's replay for one method, one prompt and answer, and what its drafting costs here.
    ``check`` runs before each of its model passes (it raises :class:`Cancelled` to stop the tune)."""

    def __init__(self, method_name: str, method, target, base, prompt_ids: list[int], answer: list[int],
                 check: Callable[[], None]):
        self.name, self.base, self.target = method_name, base, target
        self.prompt_ids, self.answer = prompt_ids, answer
        context = len(prompt_ids) + len(answer) // 2
        context_ids = (list(prompt_ids) + list(answer))[:context]
        self.extra_prefill, self.handover = 0.0, 0.0
        vocab = target.model.info.vocab_size
        if method_name == "speculative":
            self.runs, self.extra_prefill = draft_matches(method, prompt_ids, answer, vocab, check)
            sizes = (1, 2, 4, 8, 16)
            passes = draft_passes(method, context_ids, sizes, vocab, check=check)
            self.unit = passes[0]
            self.catch_up = CostCurve(sizes, tuple(t / passes[0] for t in passes))
            self.handover = time_handover(method, target.model, context_ids, vocab, check=check)
        elif method_name == "eagle":
            self.curve = cost_curve(target.model)  # what auto-sizing settings size by, as the method does
            totals = tuple(sorted({*EAGLE_TOTALS, base.total_tokens}))
            self.trees, self.unit, self.first = eagle_trees(method, target.model, prompt_ids, answer, EAGLE_DEPTH,
                                                            totals, check)
        else:
            started = time.perf_counter()
            rep = replay_lookup(base, target.model, prompt_ids, answer)
            self.unit = (time.perf_counter() - started) / max(len(rep.steps), 1)
        sizes = _SIZES[method_name]
        self.verify = CostCurve(sizes, tuple(time_passes(target.model, sizes, context, repeats=5, median=True,
                                                         check=check)))

    def replay(self, params: dict) -> Replay:
        c = _config_with(self.name, self.base, params)
        if self.name == "speculative":
            lookup = None
            if c.lookup_ngram:
                n = c.lookup_ngram
                lookup = new_lookup(PromptLookupConfig(min_ngram=n, max_ngram=max(n, 3)), self.target.model,
                                     self.prompt_ids)
            one = self.verify(1)
            sizing = (self.unit / one, lambda n: self.verify(n) / one) if c.sized else None
            return replay_speculative(self.runs, self.answer, self.prompt_ids, c.gamma, c.adaptive, c.max_gamma,
                                      lookup, self.catch_up, sizing)
        if self.name == "prompt_lookup":
            return replay_lookup(c, self.target.model, self.prompt_ids, self.answer)
        trees = self.trees[c.total_tokens if c.auto_size else None]
        return replay_eagle(trees, len(self.answer), c.depth, c.total_tokens, c.top_k,
                            self.curve if c.auto_size else None, self.first)


def _run(target, draft, name: str, config: MethodConfig | None, ids: list[int], gen: GenerationConfig,
         prompt, warmup_tokens: int, should_stop):
    method = build_method(name, config, target, draft)
    result = run_to_end(target.model, target.tokenizer, method, ids, gen, warmup_tokens=warmup_tokens,
                        should_stop=should_stop)
    if result.error:
        raise ConfigError(f"{name}: {result.error}")
    return result, RunRecord.of_run(result, target=target, draft=draft, prompt=prompt)


def tune(target, draft, method: str, base: MethodConfig | None, prompt_ids: list[int], config: GenerationConfig,
         *, prompt: str | None = None, warmup_tokens: int = WARMUP_TOKENS,
         should_stop: Callable[[], bool] | None = None,
         on_stage: Callable[[str, float], None] | None = None) -> TuneResult:
    """Predict every setting of ``method``'s knobs from one run, then run the predicted best (see the module doc)."""
    if method not in KNOBS:
        raise ConfigError(f"tune predicts {', '.join(KNOBS)}; {method} is not predicted yet "
                          "(lookahead's drafts depend on the target's own outputs over its window)")
    if not config.sampling.greedy:
        raise ConfigError("tune predicts greedy runs (temperature 0); set the temperature to 0")
    base = base if base is not None else get_spec(method).config_class()
    # The method whose parts the replay uses, built first: a missing draft or head is said before any run.
    replayed = build_method(method, replace(base, auto_size=True, tree="dynamic") if method == "eagle" else base,
                            target, draft)
    should_stop = should_stop or (lambda: False)
    stage = on_stage or (lambda text, fraction: None)
    started = time.perf_counter()
    gen = replace(config, stand_down=False)

    stopped = "stopped before the proof: nothing was tuned"

    def check() -> None:  # the predictor's timings and replays take many passes: Stop is honoured at the next
        if should_stop():
            raise Cancelled(stopped)

    def run(name, cfg, what, fraction):
        stage(what, fraction)
        out = _run(target, draft, name, cfg, prompt_ids, gen, prompt, warmup_tokens, should_stop)
        if out[0].cancelled:
            raise Cancelled(stopped)
        return out

    ar, ar_record = run("autoregressive", None, "Running autoregressive (the greedy answer)", 0.0)
    answer = ar.token_ids
    stage("Timing this machine and replaying every setting along the answer", 0.3)
    predictor = _Predictor(method, replayed, target, base, prompt_ids, answer, check)
    costs = StepCosts(verify=predictor.verify, draft_unit=predictor.unit,
                      other=ar.metrics.other_s / max(ar.metrics.steps, 1),
                      prefill=ar.metrics.prefill_time + predictor.extra_prefill, handover=predictor.handover)
    default_params = _default_params(method, base)
    table = {_key(p): p for p in [default_params] + _SETTINGS[method](base)}
    settings = []
    for params in table.values():
        check()
        rep = predictor.replay(params)
        settings.append(Setting(params, len(answer) / rep.seconds(costs), rep.tau, len(rep.steps)))
    predicted_default = next(s for s in settings if s.params == default_params)
    pick = max(settings, key=lambda s: s.predicted_tokens_per_s)
    if pick.predicted_tokens_per_s < predicted_default.predicted_tokens_per_s * (1 + MARGIN):
        pick = predicted_default  # a gain smaller than the predictions' error is not worth a change

    def trial(setting: Setting, runs: list) -> Trial:
        results = [res for res, _ in runs]
        return Trial(setting.params, setting.predicted_tokens_per_s, setting.predicted_tau,
                     sum(r.metrics.tokens_per_s for r in results) / len(results),
                     sum(r.metrics.mean_accepted for r in results) / len(results),
                     all(r.token_ids == answer for r in results), runs[0][1].to_dict(),
                     [r.metrics.tokens_per_s for r in results])

    best_config = base if pick.params == default_params else _config_with(method, base, pick.params)
    proofs: dict[str, list] = {"default": [], "best": []}
    for i in range(PROOF_ROUNDS):  # taking turns: a slow spell of a shared machine touches both
        result, record = run(method, base, f"Running {method} as configured (the default), {i + 1} of "
                                              f"{PROOF_ROUNDS}", 0.5 + 0.25 * i / PROOF_ROUNDS)
        proofs["default"].append((result, record))
        if pick.params != default_params:
            result, record = run(method, best_config, f"Running the predicted best, {i + 1} of {PROOF_ROUNDS}",
                                    0.5 + 0.25 * (2 * i + 1) / (2 * PROOF_ROUNDS))
            proofs["best"].append((result, record))
    default = trial(predicted_default, proofs["default"])
    best = trial(pick, proofs["best"]) if proofs["best"] else default
    stage("Tuned", 1.0)
    return TuneResult(method=method, knobs=KNOBS[method], base_params=asdict(base), prompt=prompt,
                      prompt_tokens=len(prompt_ids), new_tokens=len(answer), autoregressive=ar_record.to_dict(),
                      default=default, best=best, settings=settings, costs=costs, best_config=asdict(best_config),
                      assumptions=ASSUMPTIONS + tuple(_METHOD_ASSUMPTIONS[method](base)),
                      seconds=time.perf_counter() - started)


def _params_text(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def tune_record(result: TuneResult, *, target, extra: dict | None = None) -> dict:
    """The tune as the history and the exports keep it: the result with its three runs' records, and the
    keys a run's summary line shows (the best run's measured speed and τ, the verdict)."""
    best, default = result.best, result.default
    if best.params == default.params:
        verdict = "the default is best"
    else:
        ratio = best.measured_tokens_per_s / default.measured_tokens_per_s
        verdict = f"{_params_text(best.params)}: {ratio:.2f}× the default"
    doc = result.to_dict(with_records=True)
    doc.update({"tstamp": time.time(), "model_id": target.model_id, "temperature": 0.0,
                "tokens_per_s": best.measured_tokens_per_s, "mean_accepted": best.measured_tau,
                "speedup": best.measured_tokens_per_s / result.baseline_tokens_per_s, "verdict": verdict,
                "text": f"Tune of {result.method}: {verdict}", **(extra or {})})
    return doc


def format_tune(result: TuneResult) -> str:
    """The tune as text: the two runs, predicted beside measured, and the best few settings."""
    base = result.baseline_tokens_per_s
    fmt = _params_text
    lines = [f"{result.method} on {result.prompt_tokens} prompt tokens, {result.new_tokens} new; "
             f"{result.baseline} {base:.2f} tok/s", "",
             f"{'':8} {'setting':44} {'predicted':>10} {'measured':>9} {'error':>7} {'τ pred':>7} "
             f"{'τ meas':>7}  same"]
    for label, t in (("default", result.default), ("best", result.best)):
        lines.append(f"{label:8} {fmt(t.params):44} {t.predicted_tokens_per_s:10.2f} {t.measured_tokens_per_s:9.2f} "
                     f"{t.error:+7.1%} {t.predicted_tau:7.2f} {t.measured_tau:7.2f}  {'✓' if t.identical else '✗'}")
    lines += ["", f"best predicted settings of {len(result.settings)} (tok/s, × {result.baseline}):"]
    for s in sorted(result.settings, key=lambda s: -s.predicted_tokens_per_s)[:5]:
        lines.append(f"  {fmt(s.params):44} {s.predicted_tokens_per_s:7.2f}  {s.predicted_tokens_per_s / base:5.2f}×"
                     f"  τ {s.predicted_tau:.2f}")
    lines += ["", "assumes: " + "; ".join(result.assumptions)]
    if result.command:
        lines += ["", "the best as a command:", f"  {result.command}"]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)
