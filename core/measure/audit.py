"""The losslessness audit: do a method's samples follow the target's exact distribution?

For a prompt, a method and a temperature / top-p, :func:`run_audit` draws N independent
samples of the first K new tokens with the method (sample i decodes with seed ``seed + 2i``:
a run also uses ``seed + 1``, for its draft, so no two samples share a random stream), then
asks the target for its own distribution of those K tokens and runs chi-square
goodness-of-fit tests.

Each sample is a run of K tokens plus the method's deepest draft (:func:`deepest_draft`), ended
once it holds K: every step that decides a tested token drafts as deep as the method's settings
allow (a step may draft one token less than the run has left), its drafts sized against a flat
cost curve (:data:`FREE_VERIFICATION`) rather than cut to what pays on this machine. A draft
token judged at depth d in a step that starts after j tokens decides token j + d; the deepest
such d that falls within the K tested tokens is the record's ``deepest_verified``, the deepest
draft position the audit tests the verifier at.

The joint test. Every K-token sequence whose expected count N·P(s) reaches the minimum
(5, the usual rule) has a bin of its own; every other sequence shares one pooled bin, whose
probability is exactly what the named bins leave. The named sequences are found by walking
the target's distribution from the prompt, extending a prefix only while its own expected
count reaches the minimum, never from the samples, so the bins do not depend on the data.
Observed sequences are scored too (teacher forced): one the target cannot produce
(probability 0, e.g. outside the top-p nucleus) fails the audit whatever the counts. A pooled
bin under the minimum is merged into the smallest named bin.

The per-position tests. At position k the expected count of token v is the sum, over the
samples, of the target's p(v | prompt, the sample's own first k - 1 tokens): position 1 is the
exact marginal; later positions test each token given what came before it, which is what the
verifier decides at that depth. Past position 1 the counts are sums of independent draws from
different distributions, whose Pearson statistic has a mean at most its degrees of freedom:
the test is then conservative, never too eager.

Verdict: the K + 1 tests share a family-wise level α (Bonferroni): the method differs from
the target when a p-value is below α / (K + 1).

Power: for any distribution whose binned total-variation distance from the target's is δ,
the chi-square divergence is at least 4δ² (Cauchy-Schwarz), so Pearson's statistic has
noncentrality at least 4Nδ² (its usual large-sample law). The audit reports the smallest δ
the joint test detects with 80 % power at its level, and how many samples a given δ needs.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Iterable

import torch

from specplay.core.decoding.costmodel import CostCurve, pinned
from specplay.core.decoding.sampling import probabilities
from specplay.core.decoding.tree import ancestor_mask
from specplay.core.decoding.types import GenerationConfig, SamplingConfig, StopReason
from specplay.core.errors import ConfigError
from specplay.core.models.base import CausalLM, ForwardOutput
from specplay.core.progress import Progress

#: A prompt whose first answer tokens are spread over a few dozen likely openings at T = 1.
DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."
DEFAULT_SAMPLES = 600
DEFAULT_DEPTH = 3
MIN_EXPECTED = 5.0
#: Prefixes scored per target pass (each pass also reads the LM head for every one of them).
SCORE_CHUNK = 64
#: Total-variation distances the audit says the sample size for.
TV_EXAMPLES = (0.1, 0.05, 0.02)
POOLED = "(all others)"


# ----------------------------------------------------------------------------- chi-square laws
def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, x/2)."""
    if df <= 0:
        return 1.0
    if x <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_isf(alpha: float, df: int) -> float:
    """The critical value c with P(X >= c) = alpha for X ~ chi-square(df) (bisection; sf falls in x)."""
    lo, hi = 0.0, float(df) + 10.0
    while chi2_sf(hi, df) > alpha:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


def ncx2_sf(x: float, df: int, nc: float) -> float:
    """P(X >= x) for X ~ noncentral chi-square(df, nc): a Poisson(nc/2) mixture of central laws
    with df + 2j degrees of freedom."""
    half = nc / 2
    terms = int(half + 12 * math.sqrt(half) + 30)
    j = torch.arange(terms, dtype=torch.float64)
    weights = torch.exp(j * math.log(half) - half - torch.lgamma(j + 1)) if half > 0 else (j == 0).double()
    tails = torch.special.gammaincc(df / 2 + j, torch.full_like(j, x / 2))
    return float((weights * tails).sum())


def noncentrality_for_power(df: int, alpha: float, power: float = 0.8) -> float:
    """The noncentrality at which a level-alpha chi-square(df) test rejects with probability ``power``."""
    c = chi2_isf(alpha, df)
    lo, hi = 0.0, 16.0
    while ncx2_sf(c, df, hi) < power:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ncx2_sf(c, df, mid) < power else (lo, mid)
    return (lo + hi) / 2


def detectable_tv(samples: int, df: int, alpha: float, power: float = 0.8) -> float | None:
    """The smallest binned total-variation distance seen with ``power`` at ``samples`` (chi² >= 4 TV²)."""
    if df <= 0 or samples <= 0:
        return None
    return min(1.0, math.sqrt(noncentrality_for_power(df, alpha, power) / samples) / 2)


def samples_needed(tv: float, df: int, alpha: float, power: float = 0.8) -> int | None:
    """Samples for a binned total-variation distance ``tv`` to be seen with ``power`` (the same bins)."""
    if df <= 0:
        return None
    return math.ceil(noncentrality_for_power(df, alpha, power) / (4 * tv * tv))


# ----------------------------------------------------------------------------- the test
@dataclass
class Bin:
    """One bin of a test: a sequence (or token), or the pool of everything else (``key`` None)."""

    label: str
    observed: int
    expected: float
    key: tuple | None = None


@dataclass
class GoodnessOfFit:
    """Pearson's chi-square test of observed counts against the target's expected counts."""

    statistic: float
    df: int
    p_value: float
    bins: list[Bin]
    outside_support: int = 0  # samples the target gives probability 0

    def to_dict(self) -> dict:
        return {"statistic": self.statistic, "df": self.df, "p_value": self.p_value,
                "outside_support": self.outside_support,
                "bins": [[b.label, b.observed, b.expected] for b in self.bins]}


def pearson_test(named: dict[Hashable, float], observed: Counter, total: int, outside_support: int = 0,
                 min_expected: float = MIN_EXPECTED, label: Callable[[Hashable], str] = str) -> GoodnessOfFit:
    """Chi-square goodness of fit with bins chosen before looking at the data.

    ``named``: the expected count of each outcome given a bin of its own (each at least
    ``min_expected``); every other outcome falls into one pooled bin, expected to hold what
    the named bins leave of ``total``. ``observed``: counts of every outcome seen.
    ``outside_support``: samples the target gives probability 0, which decide the test alone.
    Bins under ``min_expected`` are merged into the next smallest until none is.
    """
    bins = [Bin(label(k), observed.get(k, 0), e, k) for k, e in named.items()]
    bins.sort(key=lambda b: -b.expected)
    rest_observed = total - sum(b.observed for b in bins)
    rest_expected = max(0.0, total - sum(b.expected for b in bins))
    if rest_expected > 0 or rest_observed > 0:
        bins.append(Bin(POOLED, rest_observed, rest_expected))
    tested = sorted(([b.observed, b.expected] for b in bins), key=lambda b: b[1])
    while len(tested) > 1 and tested[0][1] < min_expected:
        small = tested.pop(0)
        tested[0] = [tested[0][0] + small[0], tested[0][1] + small[1]]
        tested.sort(key=lambda b: b[1])
    df = len(tested) - 1
    statistic = sum((o - e) ** 2 / e for o, e in tested if e > 0)
    if outside_support or any(o > 0 and e <= 0 for o, e in tested):
        p = 0.0
    else:
        p = chi2_sf(statistic, df)
    return GoodnessOfFit(statistic=statistic, df=df, p_value=p, bins=bins, outside_support=outside_support)


def fit_known(samples: list[Hashable], probs: dict[Hashable, float],
              min_expected: float = MIN_EXPECTED) -> GoodnessOfFit:
    """:func:`pearson_test` of ``samples`` against a fully known distribution (outcome -> probability)."""
    n = len(samples)
    named = {k: n * p for k, p in probs.items() if n * p >= min_expected}
    counts = Counter(samples)
    impossible = sum(c for k, c in counts.items() if probs.get(k, 0.0) <= 0.0)
    return pearson_test(named, counts, n, impossible, min_expected)


# ----------------------------------------------------------------------------- the target's side
def _conditionals(target, root: int, base: int, prefixes: list[tuple], sampling: SamplingConfig,
                  chunk: int = SCORE_CHUNK) -> Iterable[tuple[tuple, torch.Tensor]]:
    """The target's next-token distribution after the prompt and each prefix, teacher forced.

    The prompt but its last token (``root``) is in the target's cache at ``base`` tokens. Each
    pass runs the root and a tree of the chunk's prefixes, every node seeing only its
    ancestors (as a draft tree is verified); nothing is committed, so the next pass
    overwrites it. Distributions are the verifier's (temperature and top-p), in float64.
    """
    for start in range(0, len(prefixes), chunk):
        part = prefixes[start:start + chunk]
        nodes: dict[tuple, int] = {}
        tokens, parents = [], []
        for prefix in part:
            for j in range(1, len(prefix) + 1):
                if prefix[:j] not in nodes:
                    nodes[prefix[:j]] = len(tokens)
                    tokens.append(prefix[j - 1])
                    parents.append(nodes[prefix[:j - 1]] if j > 1 else -1)
        positions = torch.tensor([base] + [base + len(key) for key in nodes])
        rows = [nodes[p] + 1 if p else 0 for p in part]
        out = target.forward(torch.tensor([root] + tokens), positions, ancestor_mask(parents), logit_rows=rows)
        for prefix, logits in zip(part, out.logits):
            probs = probabilities(logits, sampling.temperature, sampling.top_p).double()
            yield prefix, probs / probs.sum()


@dataclass
class TargetView:
    """What the target says about the samples: the joint and per-position expected counts."""

    joint_named: dict[tuple, float]  # sequences with N·P(s) >= the minimum -> N·P(s)
    joint_impossible: int  # samples whose sequence has probability 0
    position_named: list[dict[int, float]]  # per position: token -> expected count (those at the minimum)
    position_impossible: list[int]


def score_samples(target, prompt_ids: list[int], sequences: list[tuple], sampling: SamplingConfig,
                  min_expected: float = MIN_EXPECTED) -> TargetView:
    """Ask ``target`` for the exact probabilities the tests need (see the module doc).

    Level by level, the prefixes scored are the samples' own and those whose expected count
    reaches the minimum (found from the target's distributions alone); each one's distribution
    gives its children's probabilities and, weighted by how many samples share it, its
    position's expected counts.
    """
    n, depth = len(sequences), len(sequences[0])
    root, base = prompt_ids[-1], len(prompt_ids) - 1
    target.reset()
    if base:
        target.forward_chain(prompt_ids[:-1], logit_rows=[], prefill=True)
    seen = [Counter(s[:d] for s in sequences) for d in range(depth + 1)]
    prob = {(): 1.0}  # exact probability of each prefix scored or seen
    level = [()]
    position_named: list[dict[int, float]] = []
    position_impossible: list[int] = []
    for d in range(depth):
        seen_children: dict[tuple, list[int]] = {}
        for s in seen[d + 1]:
            seen_children.setdefault(s[:-1], []).append(s[-1])
        expected = None  # position d + 1: the sum over samples of p(. | the sample's own prefix)
        following: dict[tuple, None] = {}  # the next level's prefixes, in a stable order
        for prefix, p in _conditionals(target, root, base, level, sampling):
            if seen[d].get(prefix):
                expected = p * seen[d][prefix] if expected is None else expected.add_(p * seen[d][prefix])
            mass = prob[prefix] * p
            # Named children: expected count at the minimum, found from the target alone.
            for t in torch.nonzero(mass * n >= min_expected).flatten().tolist() + seen_children.get(prefix, []):
                following[prefix + (t,)] = None
                prob[prefix + (t,)] = float(mass[t])
        tokens_at = Counter(s[d] for s in sequences)
        position_named.append({t: float(expected[t])
                               for t in torch.nonzero(expected >= min_expected).flatten().tolist()})
        position_impossible.append(sum(c for t, c in tokens_at.items() if float(expected[t]) <= 0.0))
        level = list(following)
    joint_named = {s: n * prob[s] for s in level if n * prob[s] >= min_expected}
    joint_impossible = sum(c for s, c in seen[depth].items() if prob[s] <= 0.0)
    return TargetView(joint_named, joint_impossible, position_named, position_impossible)


# ----------------------------------------------------------------------------- the audit
@dataclass(frozen=True)
class AuditConfig:
    """N samples of the first K new tokens, the bins' minimum expected count, the family-wise level."""

    samples: int = DEFAULT_SAMPLES
    depth: int = DEFAULT_DEPTH
    min_expected: float = MIN_EXPECTED
    alpha: float = 0.01
    power: float = 0.8

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.samples) or self.samples < 10:
            raise ConfigError(f"an audit needs at least 10 samples, got {self.samples!r}")
        if not is_int(self.depth) or not 1 <= self.depth <= 8:
            raise ConfigError(f"the audited depth K must be an integer from 1 to 8, got {self.depth!r}")
        if not isinstance(self.min_expected, (int, float)) or not self.min_expected > 0:
            raise ConfigError(f"the minimum expected count must be > 0, got {self.min_expected!r}")
        for name in ("alpha", "power"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < 1:
                raise ConfigError(f"{name} must be in (0, 1), got {value!r}")


@dataclass
class AuditResult:
    """The samples, the tests and what they cost; ``sampling.seed`` is the first sample's seed."""

    method: str
    method_params: dict
    lossy: bool
    prompt_ids: list[int]
    sampling: SamplingConfig
    config: AuditConfig
    sequences: list[tuple[int, ...]]
    joint: GoodnessOfFit | None  # None when no sample was drawn
    positions: list[GoodnessOfFit] = field(default_factory=list)
    sample_time: float = 0.0
    score_time: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)
    decoded: int = 0  # tokens the samples' runs made, the K tested and those of their last steps past K
    deepest_draft: int = 0  # the deepest draft the method may propose (each sample's room past K)
    deepest_verified: int = 0  # the deepest draft position judged that decided a tested token
    drafted: int = 0
    accepted: int = 0
    cancelled: bool = False
    error: str | None = None

    @property
    def samples(self) -> int:
        return len(self.sequences)

    @property
    def level(self) -> float:
        """Each test's level: α shared by the joint and the K per-position tests (Bonferroni)."""
        return self.config.alpha / (self.config.depth + 1)

    @property
    def p_values(self) -> list[float]:
        return [t.p_value for t in self.positions]

    @property
    def verdict(self) -> str:
        if self.joint is None:
            return "no samples"
        return "differs" if min([self.joint.p_value] + self.p_values) < self.level else "consistent"

    @property
    def detectable_tv(self) -> float | None:
        return None if self.joint is None else detectable_tv(self.samples, self.joint.df, self.level,
                                                             self.config.power)


class ReusedPrompt(CausalLM):
    """A model that reads the audit's prompt once: every later run starts from its cache, cropped back.

    A run starts with ``reset()`` and a prefill ``forward_chain`` over the prompt (the engine does
    this for the target, a draft-model method for its draft). Here ``reset()`` only marks the
    cache for a fresh start; a prefill of the same tokens with the same options then crops the
    cache back to them and returns a copy of what the first prefill returned. The prompt's keys
    and values are the ones that prefill computed, so each sample is exactly the run it would be
    without the reuse; reading the prompt was about two thirds of a K = 2 sample's time with the
    default models. Any other call after a ``reset()`` resets for real first. Only this wrapper
    may reset the model it wraps while in use.
    """

    def __init__(self, model: CausalLM):
        self.model = model
        self.info = model.info
        self._fresh = False  # reset() was asked for and not done yet
        self._prompt: tuple | None = None  # (tokens and options, its output, the cache length after it)

    @property
    def cache_len(self) -> int:
        return 0 if self._fresh else self.model.cache_len

    def reset(self) -> None:
        self._fresh = True

    def _start(self) -> None:
        if self._fresh:
            self.model.reset()
            self._fresh = False

    def forward_chain(self, tokens, **kwargs) -> ForwardOutput:
        key = (tuple(int(t) for t in torch.as_tensor(tokens).reshape(-1).tolist()), sorted(kwargs.items()))
        if not (self._fresh and kwargs.get("prefill")):
            self._start()
            return self.model.forward_chain(tokens, **kwargs)
        self._fresh = False
        if self._prompt is not None and self._prompt[0] == key and self.model.cache_len >= self._prompt[2]:
            self.model.crop(self._prompt[2])
        else:
            self.model.reset()
            self._prompt = (key, self.model.forward_chain(tokens, **kwargs), self.model.cache_len)
        out = self._prompt[1]  # a copy: a method may keep and change what its run's prefill gave it
        return ForwardOutput(logits=out.logits.clone(), hidden=None if out.hidden is None else out.hidden.clone(),
                             layers={k: v.clone() for k, v in out.layers.items()})

    def forward(self, tokens, positions=None, attn_mask=None, **kwargs) -> ForwardOutput:
        self._start()
        return self.model.forward(tokens, positions, attn_mask, **kwargs)

    def commit(self, keep) -> None:
        self._start()
        self.model.commit(keep)

    def crop(self, length: int) -> None:
        self._start()
        self.model.crop(length)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed(tokens)

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head_weight()

    def head_rows(self, rows):
        return self.model.head_rows(rows)


#: The cost curve the audited methods size their drafts by: verifying n tokens costs what one does, so
#: no draft is cut for its price. Each sample is a fresh run, whose sizing starts from half the
#: drafter's word (core.decoding.calibration): on a CPU's steep curve EAGLE's first trees at T = 1
#: were a node or two, and the verifier was judged at draft position 1 only. Which nodes a method
#: verifies is chosen from the run's past, never from the target's answer in the step, so the
#: largest drafts test the verifier on everything a sized run can give it.
FREE_VERIFICATION = CostCurve.linear(0.0)


def deepest_draft(method) -> int:
    """The deepest draft ``method`` proposes when its step's budget does not cut it."""
    return method.max_draft_depth


def deepest_judged(event, tested: int) -> int:
    """The deepest draft position the verifier judged in the step ``event`` whose token lies within
    the first ``tested`` tokens of the run (0: none)."""
    before = event.total_new_tokens - len(event.committed)
    return max((t.depth for t in event.tokens
                if t.depth and t.accept_prob is not None and before + t.depth <= tested), default=0)


def _sample(model, tokenizer, method, prompt_ids: list[int], gen: GenerationConfig, tested: int,
            stop: Callable[[], bool]):
    """One sample's run, ended (as cancelled) once it holds ``tested`` tokens, or earlier by ``stop``;
    (the run, its deepest judged position within those tokens)."""
    from specplay.core.decoding.engine import run_to_end

    made, deepest = [0], [0]

    def seen(event) -> None:
        made[0] = event.total_new_tokens
        deepest[0] = max(deepest[0], deepest_judged(event, tested))

    run = run_to_end(model, tokenizer, method, prompt_ids, gen, should_stop=lambda: made[0] >= tested or stop(),
                     on_event=seen)
    return run, deepest[0]


def run_audit(target, draft, method_name: str, method_config, prompt_ids: list[int], sampling: SamplingConfig,
              config: AuditConfig = AuditConfig(), should_stop: Callable[[], bool] | None = None,
              progress: Progress | None = None) -> AuditResult:
    """Draw ``config.samples`` samples of ``config.depth`` tokens with the method and test them.

    ``target`` and ``draft`` are loaded models (:class:`~specplay.core.models.loader.LoadedModel`); the
    method is built here, over models that read the prompt once (:class:`ReusedPrompt`).
    Cancelled (``should_stop``), the samples drawn so far are tested. Every step of a sample drafts
    (no stand-down gate, so no plain first step either), and the method sizes its drafts against a
    flat cost curve (:data:`FREE_VERIFICATION`): the audit judges the drafts at every depth, and a
    sample never depends on how long a step took.
    """
    with pinned(target.model, FREE_VERIFICATION):
        return _audit(target, draft, method_name, method_config, prompt_ids, sampling, config,
                      should_stop or (lambda: False), progress)


def _audit(target, draft, method_name: str, method_config, prompt_ids: list[int], sampling: SamplingConfig,
           config: AuditConfig, stop: Callable[[], bool], progress: Progress | None) -> AuditResult:
    from specplay.core.methods import build_method

    reused_draft = None if draft is None else replace(draft, model=ReusedPrompt(draft.model))
    method = build_method(method_name, method_config, target, reused_draft)
    model = ReusedPrompt(target.model)
    sequences: list[tuple[int, ...]] = []
    result = AuditResult(method=method.name, method_params=method.describe(), lossy=method.lossy,
                         prompt_ids=list(prompt_ids), sampling=sampling, config=config, sequences=sequences,
                         joint=None, deepest_draft=deepest_draft(method))
    stage = f"Audit of {method.name}: {config.samples} samples of {config.depth} tokens"
    started = time.perf_counter()
    for i in range(config.samples):
        if stop():
            result.cancelled = True
            break
        gen = GenerationConfig(max_new_tokens=config.depth + result.deepest_draft, stop_at_eos=False, stand_down=False,
                               sampling=SamplingConfig(sampling.temperature, sampling.top_p, sampling.seed + 2 * i))
        run, deepest = _sample(model, target.tokenizer, method, prompt_ids, gen, config.depth, stop)
        if len(run.token_ids) < config.depth:  # cancelled, or ended in error, before its K tokens
            result.error = run.error if run.stop_reason is StopReason.ERROR else None
            result.cancelled = result.error is None
            break
        sequences.append(tuple(run.token_ids[:config.depth]))
        result.decoded += len(run.token_ids)
        result.deepest_verified = max(result.deepest_verified, deepest)
        result.accept_lengths += run.metrics.accept_lengths
        result.drafted += run.metrics.drafted
        result.accepted += run.metrics.accepted
        if progress is not None:
            progress(stage, (i + 1) / config.samples)
    result.sample_time = time.perf_counter() - started
    if not sequences:
        return result
    if progress is not None:
        progress("Audit: the target scores the samples", None)
    started = time.perf_counter()
    view = score_samples(target.model, prompt_ids, sequences, sampling, config.min_expected)
    n, m = len(sequences), config.min_expected

    def piece(t: int) -> str:
        return repr(target.tokenizer.decode([t]))

    result.joint = pearson_test(view.joint_named, Counter(sequences), n, view.joint_impossible, m,
                                lambda s: " ".join(piece(t) for t in s))
    result.positions = [pearson_test(view.position_named[k], Counter(s[k] for s in sequences), n,
                                     view.position_impossible[k], m, piece) for k in range(config.depth)]
    result.score_time = time.perf_counter() - started
    return result


# ----------------------------------------------------------------------------- records and text
def verdict_text(result: AuditResult) -> str:
    """One sentence: the verdict, the deciding p-value and what the test could see."""
    if result.joint is None:
        return "No sample was drawn" + (f": {result.error}" if result.error else ".")
    p = min([result.joint.p_value] + result.p_values)
    if result.verdict == "differs":
        where = "outside the target's support" if any(t.outside_support for t in [result.joint] + result.positions) \
            else f"p = {p:.3g} < {result.level:.3g}"
        return f"DIFFERS from the target's distribution ({where}; N = {result.samples}, K = {result.config.depth})."
    if result.joint.df == 0:
        return (f"Consistent with the target: every sample is one the target can produce; the target leaves "
                f"too little room at N = {result.samples} for a chi-square test (one bin).")
    tv = result.detectable_tv
    return (f"Consistent with the target's distribution (every p-value >= {result.level:.3g}; joint "
            f"p = {result.joint.p_value:.3g}, N = {result.samples}, K = {result.config.depth}): a difference of total "
            f"variation >= {tv:.3f} would be seen with {result.config.power:.0%} power.")


def audit_record(result: AuditResult, *, target, draft=None, prompt: str | None = None,
                 extra: dict | None = None) -> dict:
    """The audit as a record beside run records (history, exports, ``--json``); ``kind`` is ``"audit"``.

    Run-record fields keep their meaning where they have one (``new_tokens`` are all the tokens
    the samples' runs made, ``max_new_tokens`` each run's limit: K plus the method's deepest
    draft), so run tables and CSV exports read it too.
    """
    from specplay.core.records.environment import environment
    from specplay.core.records.runlog import _model_entry

    s, c = result.sampling, result.config
    new_tokens = result.decoded
    joint = result.joint
    df = joint.df if joint is not None else 0
    record = {
        "kind": "audit", "answer_id": uuid.uuid4().hex, "tstamp": time.time(),
        "method": result.method, "params": result.method_params, "lossy": result.lossy,
        "model_id": target.model_id if target is not None else None,
        "target": _model_entry(target), "draft": _model_entry(draft),
        "prompt": prompt, "prompt_tokens": len(result.prompt_ids),
        "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed, "seeds": f"{s.seed} + 2i",
        "samples": result.samples, "samples_requested": c.samples, "depth": c.depth,
        "max_new_tokens": c.depth + result.deepest_draft, "deepest_draft": result.deepest_draft,
        "deepest_verified": result.deepest_verified,
        "min_expected": c.min_expected, "alpha": c.alpha, "level": result.level, "power": c.power,
        "p_value": joint.p_value if joint is not None else None, "p_values": result.p_values,
        "statistic": joint.statistic if joint is not None else None, "df": df,
        "verdict": result.verdict, "text": verdict_text(result),
        "detectable_tv": result.detectable_tv,
        "samples_needed": {str(tv): samples_needed(tv, df, result.level, c.power) for tv in TV_EXAMPLES},
        "tests": {"joint": joint.to_dict() if joint is not None else None,
                  "positions": [t.to_dict() for t in result.positions]},
        "new_tokens": new_tokens, "wall_time": result.sample_time + result.score_time,
        "sample_time": result.sample_time, "score_time": result.score_time,
        "tokens_per_s": new_tokens / result.sample_time if result.sample_time > 0 else 0.0,
        "steps": len(result.accept_lengths),
        "mean_accepted": sum(result.accept_lengths) / len(result.accept_lengths) if result.accept_lengths else None,
        "acceptance_rate": result.accepted / result.drafted if result.drafted else None,
        "drafted": result.drafted, "accepted": result.accepted,
        "stop_reason": (StopReason.CANCELLED if result.cancelled else StopReason.ERROR if result.error
                        else StopReason.MAX_TOKENS).value,
        "cancelled": result.cancelled, "error": result.error,
        "environment": environment(target, draft),
    }
    if extra:
        record.update(extra)
    return record


def largest_bins(bins: list[list], count: int) -> list[list]:
    """Of a test's ``[label, observed, expected]`` bins, the ``count`` named ones with the largest
    observed or expected count (a lossy method may pile its samples on a bin the target expects
    little in), then the pooled bin."""
    named = sorted((b for b in bins if b[0] != POOLED), key=lambda b: -max(b[1], b[2]))
    return named[:count] + [b for b in bins if b[0] == POOLED]


def _bar(observed: int, expected: float, scale: float, width: int) -> str:
    """Observed count as a bar of blocks, the expected count marked with '|' on it."""
    cells = [" "] * (width + 1)
    for i in range(min(width, round(observed * scale))):
        cells[i] = "█"
    cells[min(width, round(expected * scale))] = "|"
    return "".join(cells).rstrip()


def verified_text(record: dict) -> str:
    """What depth of draft the audit tested the verifier at (``deepest_verified``), against how deep
    the method drafts."""
    deepest = record["deepest_verified"]
    if not deepest:
        return (f"The verifier judged no draft token within the {record['depth']} tested tokens: the audit tested "
                "the method's plain path.")
    return (f"The verifier judged draft positions down to {deepest} within the {record['depth']} tested tokens "
            f"(the method drafts up to {record['deepest_draft']} deep).")


def format_audit(record: dict, rows: int = 12, width: int = 40) -> str:
    """The audit as text: the tests, the verdict, the power, and observed against expected counts."""
    lossy = " (LOSSY options on)" if record.get("lossy") else ""
    lines = [f"audit of {record['method']}{lossy} at temperature {record['temperature']:g}, top-p "
             f"{record['top_p']:g}: {record['samples']} samples of the first {record['depth']} tokens "
             f"({record['sample_time']:.0f} s sampling, {record['score_time']:.1f} s scoring)",
             verified_text(record)]
    tests = record["tests"]
    named = [("joint", tests["joint"])] + [(f"position {k + 1}", t) for k, t in enumerate(tests["positions"])]
    for name, t in named:
        if t is None:
            continue
        extra = f", {t['outside_support']} sample(s) the target cannot produce" if t["outside_support"] else ""
        lines.append(f"  {name:11s} chi2 = {t['statistic']:9.2f}  df = {t['df']:3d}  p = {t['p_value']:.3g}{extra}")
    lines.append(record["text"])
    needed = [f"{tv} needs N = {n:,}" for tv, n in record["samples_needed"].items() if n is not None]
    if needed:
        lines.append(f"power ({record['power']:.0%}, level {record['level']:.3g}, the same bins): a total-variation "
                     "difference of " + ", ".join(needed))
    if tests["joint"] is not None:
        bins = tests["joint"]["bins"]
        shown = largest_bins(bins, rows)
        top = max(max(b[1], b[2]) for b in shown) or 1
        label_width = min(36, max(len(b[0]) for b in shown))
        lines.append("observed against expected (joint; bar = observed, | = expected):")

        def row(label: str, observed: int, expected: float) -> str:
            return (f"  {label[:label_width]:{label_width}s} {observed:6d} {expected:8.1f}  "
                    f"{_bar(observed, expected, width / top, width)}")

        lines += [row(*b) for b in shown if b[0] != POOLED]
        rest = [b for b in bins if b not in shown]
        if rest:
            lines.append(f"  ({len(rest)} more sequences: {sum(b[1] for b in rest)} observed, "
                         f"{sum(b[2] for b in rest):.1f} expected)")
        lines += [row(*b) for b in shown if b[0] == POOLED]
    return "\n".join(lines)
