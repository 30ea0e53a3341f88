"""Standing down: plain steps while drafting does not pay, probed again later.

Speculation pays only when the tokens a drafting step adds outrun its cost; where acceptance is low
(a draft model off its home ground, an n-gram pool that never hits) a drafting method runs slower
than plain decoding. The gate measures the run itself: the rate of its recent drafting steps (tokens
per second; each drafting step, and each plain step the gate imposes, leaves what came before it
:data:`DECAY` of its weight) against the time of a plain step: the median of the run's newest plain
steps, or what the drafting steps' own verification passes say one takes over the cost curve, where
that is clearly less (plain steps are timed only while drafting stands down, so those may date from
a busier moment) or there is no plain step yet. A step the method was let draft and drafted nothing
in (no match for a lookup, no node that pays for a sized tree) adds its look to drafting's seconds
and ages nothing: a method that finds a guess one step in five is judged on its last ten guesses, as
one that drafts every step is, not on the last one or two; where a look costs a share of a plain
step that matters (:data:`DEAR_LOOK`), it is judged as a drafting step is, so a head that looks at
every step and never finds a node worth verifying stands down too. When plain steps are faster, and
drafting has lost a whole plain step's time since it last gained one back (a dear draft's failed
chain loses that in a step or two, a lookup's one-token guess in tens of them, so a lookup that
misses at an answer's start is still drafting when its copies begin), it stands down for a while,
then lets one drafting step probe again; each stand-down that the probe confirms lasts twice as long
as the last, but no longer than makes what the probe lost against a plain step a hundredth of it: a
run that never gains from drafting loses at most about 1% of its time to probes (a dear probe, a
draft model's, comes back after a hundred steps or more), a cheap one (a one-token guess) comes back
within a few tens of steps, so an answer that starts repeating itself late is still caught, and a
run that drafts well never stands down. Pure arithmetic on measured durations: the engine feeds it,
a test can feed it a deterministic cost model.

A run's first step is always plain where the gate is on: its token then comes as soon as plain
decoding's would (a draft model's read of the prompt, a tree's wider pass, wait for the second
step), and the gate has a plain step of the run's own, timed, to judge drafting against.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

#: Drafting steps measured before the gate may first stand down.
FIRST_DECISION = 2
#: Plain steps of the first stand-down; each one a probe confirms lasts twice as long, up to the cap.
FIRST_BACKOFF, MAX_BACKOFF = 8, 256
#: A stand-down lasts no more plain steps (nor fewer than FIRST_BACKOFF) than make what drafting lost
#: against plain steps since its last drafting step, looks included, this share of them.
PROBE_SHARE = 0.01
#: What drafting must have lost against plain steps, in plain steps, since it last gained more than that,
#: before the gate may stand it down: a dear draft (a draft model's chain, a tree of several nodes) loses
#: that in one or two failed steps, a one-token guess that costs a few percent of a step in tens of them,
#: so a lookup that misses at an answer's start is still drafting when its copies begin to match.
LOSS_TO_STAND_DOWN = 1.0
#: The least share of a plain step a look that finds nothing to draft must cost for looks alone to stand
#: drafting down: a method that looks at every step and never drafts then loses no more than this to its
#: looks (an EAGLE head's first level, 3-5 ms of a 24 ms step on the AMD EPYC model 17, looked at every
#: step of a translation and kept no node: 0.90x plain decoding), while a lookup's search for a match,
#: a fraction of that, keeps looking every step and catches a copy at its first token.
DEAR_LOOK = 0.02
#: Plain steps whose median is a plain step's time.
PLAIN_STEPS = 5
#: How far below the plain steps' time the drafting steps' passes must put a plain step for the gate to
#: judge by the passes: by more than the steps' own jitter (2-4% on the AMD EPYC model 17), so that the
#: lower of two estimates of the same time, which is low by about that jitter, does not become the rule.
STALE_PLAIN = 0.9
#: Weight of a drafting step's measurement after each newer drafting step or plain step the gate
#: imposed: a memory of about ten drafting steps. One fully rejected draft among good ones must not
#: stand a paying draft down (at 0.5 a draft accepted 90% of the time per token lost a tenth of its
#: speed to stand-downs after single misses, in a seeded simulation), and after a stand-down the
#: probe is judged mostly on its own.
DECAY = 0.9


@dataclass
class GateState:
    """What the X-ray and the run log show of the gate at one step."""

    drafting: bool
    first_step: bool  # the run's first step, plain so its token comes as plain decoding's would
    draft_rate: float | None  # tokens/s of recent drafting steps
    plain_rate: float | None  # tokens/s of a plain step
    standing_down_for: int  # plain steps left before the next probe


class StandDownGate:
    """Decides before each step whether the method drafts or a plain step runs."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._tokens = 0.0  # decayed sums over drafting steps
        self._seconds = 0.0
        self._looked_s = 0.0  # looks that drafted nothing since the last drafting step
        self._lost = 0.0  # plain steps drafting lost since it last gained them back (never below 0)
        self._drafting_steps = 0
        self._plain_s: float | None = None  # a plain step's time: measured, else estimated
        self._recent_plain: list[float] = []  # the newest plain steps' times (none: not measured yet)
        self._passes_s: float | None = None  # a plain step's time by the drafting steps' passes (decayed mean)
        self._left = 0  # plain steps still to take
        self._backoff = FIRST_BACKOFF
        self._first = enabled  # the run's first step is still to come
        self.stood_down_steps = 0

    def drafting(self) -> bool:
        """Whether this step drafts (False: the method is asked for nothing, a plain step runs)."""
        return self._left <= 0 and not self._first

    def record(self, drafted: bool, new_tokens: int, seconds: float,
               plain_estimate: Callable[[], float | None] | None = None, looked_s: float = 0.0) -> None:
        """One finished step: whether it drafted, the tokens it added and its time. For a drafting
        step, ``plain_estimate()`` says what a plain step would have cost (its verification pass over
        the cost curve), used until the run has timed a plain step of its own. ``looked_s``: of a step
        the gate let draft and whose method drafted nothing, the seconds it took to decide so (a head's
        first level whose nodes could not pay, a lookup that found no match). That is drafting's cost
        with no token to show for it, so it joins the drafting steps' seconds, and the rest of the step
        is a plain step's time: drafting then pays when its tokens over its seconds, looks included,
        beat a plain step's rate, which is when the whole run beats plain steps."""
        imposed = self._first or self._left > 0  # a plain step of the gate's, not the method's choice
        self._first = False
        if not drafted:
            if imposed:
                self._tokens *= DECAY
                self._seconds *= DECAY
            self._seconds += looked_s
            self._looked_s += looked_s
            self._plain_step(seconds - looked_s)
            if looked_s and self._plain_s:
                self._lost += looked_s / self._plain_s
                # Looks dear enough to matter are judged as drafting steps are: a method that looks at
                # every step and never finds a draft worth verifying would otherwise never be judged.
                if self.enabled and looked_s / self._plain_s >= DEAR_LOOK:
                    self._judge(self._looked_s / self._plain_s)
            return
        looks, self._looked_s = self._looked_s, 0.0
        self._tokens = self._tokens * DECAY + new_tokens
        self._seconds = self._seconds * DECAY + seconds
        self._drafting_steps += 1
        estimate = plain_estimate() if plain_estimate is not None else None
        if estimate:
            # What the drafting steps' own passes say a plain step takes, weighed as their rate is.
            self._passes_s = estimate if self._passes_s is None else (
                DECAY * self._passes_s + (1 - DECAY) * estimate)
            if not self._recent_plain or self._passes_s < STALE_PLAIN * self._plain_s:
                # Plain steps are timed only while drafting stands down: one through a busy moment had
                # kept a plain step's time high for every drafting step after it (a one-node tree
                # accepted a quarter of the time drafted on for 24 steps at 0.9x plain steps' speed).
                self._plain_s = self._passes_s
        if self._plain_s:
            self._lost = max(0.0, self._lost + seconds / self._plain_s - new_tokens)
        if not self.enabled or self._drafting_steps < FIRST_DECISION:
            return
        if self._plain_s is None:  # nothing to compare with: time one plain step
            self._left = 1
            return
        # What drafting lost to plain steps since the last drafting step, its looks included, in plain steps.
        self._judge((looks + seconds) / self._plain_s - new_tokens)

    def _judge(self, lost: float) -> None:
        """Stand drafting down, or not, after a step it took part in, which with the looks before it lost
        ``lost`` plain steps' time to plain steps (negative: gained)."""
        rate = self._tokens / self._seconds
        if rate < 1.0 / self._plain_s and self._lost >= LOSS_TO_STAND_DOWN:
            # A probe that costs little (a one-token guess) is worth making often, so the stand-down lasts
            # no longer than makes what this step lost PROBE_SHARE of it. A probe after it is judged on its
            # own: losing anything then stands drafting down again.
            self._left = min(self._backoff, max(FIRST_BACKOFF, math.ceil(max(0.0, lost) / PROBE_SHARE)))
            self._backoff = min(2 * self._backoff, MAX_BACKOFF)
            self._lost = LOSS_TO_STAND_DOWN
        elif rate >= 1.0 / self._plain_s and lost <= 0.0:
            # A probe that paid for itself and the looks before it: the next stand-down starts short again.
            self._backoff = FIRST_BACKOFF

    def _plain_step(self, seconds: float) -> None:
        if self._left > 0:
            self._left -= 1
            self.stood_down_steps += 1
        # The middle of the newest plain steps: a run's plain step slows as its context grows, and one
        # step that shared the machine with another program says little of the next.
        self._recent_plain = (self._recent_plain + [seconds])[-PLAIN_STEPS:]
        self._plain_s = statistics.median(self._recent_plain)

    def state(self) -> GateState:
        return GateState(drafting=self.drafting(), first_step=self._first,
                         draft_rate=self._tokens / self._seconds if self._seconds else None,
                         plain_rate=1.0 / self._plain_s if self._plain_s else None,
                         standing_down_for=self._left)
