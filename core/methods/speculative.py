"""Speculative decoding with a small draft model (Leviathan et al. 2023; Chen et al. 2023).

The draft model proposes γ tokens autoregressively with its own KV cache; the target checks
them in one pass. At temperature > 0 the draft *samples* each token from its distribution
q, so the verifier can accept with min(1, p/q) and resample from the residual.

How many tokens a step drafts is priced by default (cost-sized γ): on a CPU the verifier is
compute-bound, so every drafted token costs a share of a target step, and a draft that is right
87% of the time still loses at γ = 5 where verifying 6 tokens costs 2.5 steps. Each step takes
the γ with the most expected tokens per unit of time, from this run's acceptance at each draft
position, the draft's measured cost per token and the target's verify curve, corrected by the
run's own passes (:class:`~specplay.core.decoding.costmodel.CorrectedCurve`); whether drafting
pays at all is the stand-down gate's to judge. A fixed γ (``cost_sized=False``) and
transformers' "heuristic" schedule (adaptive γ: a fully accepted draft grows γ by 2 and a
rejection shrinks it by 1) remain selectable. A confidence threshold stops a draft early when
the draft model's highest next-token probability drops below it. That stop is decided from
the draft distribution q alone, *before* a token is drawn from it: a token that was drawn is
always proposed, so every proposed token is distributed exactly as q and min(1, p/q) stays
lossless. (Dropping a drawn token because q(x) was small would propose from q restricted to
its likely tokens while accepting as if from q: biased.)

With ``lookup_ngram`` the method first looks for the last N tokens earlier in the prompt or
output and, when they occurred before, proposes a copy of what followed them (prompt
lookup, with its learnt, cost-sized lengths): free where text repeats, as in code edits and
completions. The draft model runs only when there is no such match, and then catches up
on the tokens it skipped in one pass.

The draft reads the prompt at the first step that drafts, off the first token's path, and by default
only its last tokens where the whole would cost more than it can earn back: as many as it reads in a
tenth of the answer's plain decoding time (:meth:`Speculative.read_window`, from this run's
timings). Where half of what drafting is expected to save, at the gain the last run with this draft
measured, does not pay for the fewest tokens worth reading, the run does not draft at all (plain
steps, as the stand-down gate's), and after four such runs of its length one drafts again to measure
the gain afresh. The draft then sees less context, which changes q only. A run that continues the
last one (a conversation's next turn: its prompt is the last prompt, then more) keeps what the
draft's cache holds of it and reads only the rest (:data:`_HELD`); the same prompt again, or
another, reads afresh, so a rerun or a warm-up never finds its read done.

With a draft vocabulary (``draft_vocab``) the draft computes only those rows of its LM head, a
quarter of a 0.5B draft's weights (FR-Spec; EAGLE-3's reduced vocabulary): the ids its target uses
most, ranked by how often they occur in the target's own answers the project ships
(:func:`ranked_vocabulary`), or, for a target without them, the first ids in merge order. Tokens
outside it get q = 0, which the verifier's rule handles as any q: lossless, and the audit checks it.
By default a draft on the CPU, where a pass reads its weights from memory and the head is a quarter
of them, drafts the :data:`AUTO_VOCAB` ids its target uses most; a GPU draft, whose head costs little
of its time, drafts them all. A run whose answer leaves the vocabulary more than it pays for (a
translation, prose in another script) drafts from the whole vocabulary for the rest of that run:
:class:`_VocabularyWatch` weighs the chain's expected speed as it is against the whole head's, whose
drafts are right where the answer's tokens lay outside and whose passes cost more.

A draft whose vocabulary differs in size from the target's (same tokenizer, padded
differently) is aligned to the target's: rows the draft lacks get q = 0, and draft rows the
target lacks are never drafted. A token the target emits from rows the draft lacks is read
by the draft as token 0: that changes only q, which the verifier sees as it is.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from specplay.core.decoding.costmodel import best_size, cost_curve, timed_step
from specplay.core.errors import ConfigError, ModelError
from specplay.core.decoding.method import Method, MethodConfig, RunContext, StepOutcome, param
from specplay.core.methods.prompt_lookup import PromptLookup, PromptLookupConfig
from specplay.core.models.base import CausalLM
from specplay.core.decoding.sampling import align_vocab, probabilities, sample
from specplay.core.decoding.types import Draft

log = logging.getLogger(__name__)

#: The share of the answer's plain decoding time the draft's read of the prompt may take by default:
#: speculation on a CPU saves a quarter to a third of that time at best, and a read that ate more than a
#: third of the saving would leave little (a 1,000-token RAG prompt read whole cost a 48-token answer
#: 0.81x plain decoding on the Intel Xeon).
READ_SHARE = 0.1
#: The fewest prompt tokens the draft reads by default: the last lines before the answer.
MIN_READ = 32
#: The share of what drafting is expected to save that must pay for the draft's read of :data:`MIN_READ`
#: tokens, drafting's gain taken from the last run with this draft that measured one (:class:`_Recall`):
#: a read that costs more than half the saving leaves too little of it to be worth the risk. Where it
#: does not, the run does not draft (a 48-token answer on the AMD EPYC model 17, where a 0.5B draft's
#: chain gained 1.02-1.06x and its read of 32-46 tokens cost 3-5 of the answer's steps).
READ_OF_SAVING = 0.5
#: How many times its own answer's budget the runs that skipped drafting on the last measured gain must
#: have had before a run drafts to measure it again (the fifth run of one length): the gain belongs to
#: the last prompt, and the next may be one the draft knows better.
MEASURE_EVERY = 4
#: The least answer budget of a run whose gain is recalled: a warm-up's 8 tokens measure little more
#: than the acceptance's prior.
RECALL_BUDGET = 32
#: The draft vocabulary of a CPU draft by default: the ids the target uses most. On the AMD EPYC model
#: 17 it made a 0.5B draft's pass 13% cheaper (its head 39 of 92 MB) and cost the draft 0.4 points of
#: agreement with the target's greedy tokens on code answers (89.4 to 89.0%); 32,000 ids saved 4 points
#: more of the pass and cost 1.6 points, 16,000 cost 4.6.
AUTO_VOCAB = 64_000


@dataclass(frozen=True)
class SpeculativeConfig(MethodConfig):
    gamma: int = param(3, "Draft tokens per step (the first step's when cost-sized or adaptive)", label="γ",
                       minimum=1, maximum=32)
    adaptive: bool = param(False, "Grow γ by 2 after a fully accepted draft, shrink it by 1 after a rejection",
                           label="adaptive γ", cli="--adaptive-gamma")
    cost_sized: bool = param(True, "Choose γ each step by the cost model: the most expected tokens per unit of time "
                             "from this run's acceptance at each draft position, the draft's cost per token and the "
                             "verification cost corrected by this run's passes (γ is the first step's, max γ the "
                             "bound; adaptive γ, where on, is used instead)", label="cost-sized γ",
                             cli="--cost-sized-gamma")
    max_gamma: int = param(16, "Upper bound for adaptive γ", label="max γ", minimum=1, maximum=64,
                          cli="--max-gamma")
    confidence: float = param(0.0, "Stop a draft when the draft model's highest next-token probability is below "
                              "this (0 = never)", label="confidence threshold", minimum=0.0, maximum=1.0)
    lookup_ngram: int = param(0, "Propose a copy of what followed the last N tokens where they occurred before in "
                              "the prompt or output (free), and run the draft model only when there is no such "
                              "match (0 = always the draft)", label="copy matches of n ≥", minimum=0, maximum=16,
                              cli="--lookup-ngram")
    draft_window: int = param(0, "Let the draft model read only the last N tokens of the prompt (0 = as many as it "
                              "reads in a tenth of the answer's plain decoding time, by this run's timings; a number "
                              "past the prompt's length = all of it): a long prompt's draft read then costs little, "
                              "the draft sees less context", label="draft reads last", minimum=0,
                              maximum=1_000_000, cli="--draft-window")
    draft_vocab: int = param(0, "Draft only the N token ids the target uses most, ranked by their count in its "
                             "shipped answers (the first N ids in merge order for a target without them; 0 = for a "
                             f"draft on the CPU the {AUTO_VOCAB:,} ranked ids, dropped for the rest of a cost-sized run "
                             "whose answer leaves them more than they save, and all for a GPU draft or a target without "
                             "a ranking; a number past the vocabulary = all); the target still emits any token",
                             label="draft vocabulary",
                             minimum=0, maximum=1_000_000, cli="--draft-vocab")

    def __post_init__(self):
        super().__post_init__()
        if (self.adaptive or self.cost_sized) and self.max_gamma < self.gamma:
            raise ConfigError(f"max γ ({self.max_gamma}) must be >= γ ({self.gamma})")

    @property
    def sized(self) -> bool:
        """Whether γ is chosen each step by the cost model (cost-sized, and adaptive γ not chosen instead)."""
        return self.cost_sized and not self.adaptive


class Speculative(Method):
    name = "speculative"
    draft_source = "draft model"

    def __init__(self, config: SpeculativeConfig, draft_model: CausalLM, target_lm: CausalLM | None = None,
                 ranking: Sequence[int] | None = None):
        super().__init__(config)
        self.draft_model = draft_model
        self.gamma = config.gamma
        self._offset = self._window_start = 0
        self._unread = True
        self._prompt: list[int] = []
        self.max_draft_nodes = config.max_gamma if (config.adaptive or config.sized) else config.gamma
        self.cost = cost_curve(target_lm) if (config.sized and target_lm is not None) else None
        # The draft's share of the target's multiply-adds: what its read of a token costs of the target's.
        self._read_share = (draft_model.info.num_parameters / target_lm.info.num_parameters
                            if target_lm is not None and target_lm.info.num_parameters else None)
        self._read_plan: tuple[float, int, int] | None = None  # (target's prompt read s, its tokens, answer budget)
        self._sizing = _SizingStats()
        self.gain: float | None = None  # what the cost-sized γ was chosen for: its expected speed over plain steps'
        self.draft_ids = self.head = self._watch = None
        if config.draft_vocab:
            ids = self._draft_ids(draft_model, target_lm, config.draft_vocab, ranking)
            if ids is not None:
                self.draft_ids, self.head = self._head_of(draft_model, ids)
        elif ranking and draft_model.info.device == "cpu":
            ids = self._draft_ids(draft_model, target_lm, AUTO_VOCAB, ranking)
            if ids is not None:
                kept = _AUTO_HEADS.get(draft_model)
                try:  # only a draft that can choose its head's rows; the others keep their whole head
                    head = (kept[1] if kept is not None and torch.equal(kept[0], ids)
                            else draft_model.head_rows(ids.tolist()))
                except (NotImplementedError, ModelError):
                    pass
                else:
                    _AUTO_HEADS[draft_model] = (ids, head)
                    self.draft_ids, self.head = ids, head
                    self._watch = _VocabularyWatch(ids, draft_model.info)
        self._whole = False  # this run dropped the draft vocabulary
        # Copies of earlier text, proposed with prompt lookup's learnt, cost-sized lengths.
        self.lookup = None
        if config.lookup_ngram:
            n = config.lookup_ngram
            self.lookup = PromptLookup(PromptLookupConfig(min_ngram=n, max_ngram=max(n, 3)), target_lm)
            self.max_draft_nodes = max(self.max_draft_nodes, self.lookup.max_draft_nodes)
        if self.cost is not None:
            self.timing_sized = "γ follows this run's timings"
        elif self.lookup is not None and self.lookup.timing_sized:
            self.timing_sized = "copy lengths follow the measured verification cost"

    @staticmethod
    def _draft_ids(draft_model: CausalLM, target_lm: CausalLM | None, size: int,
                   ranking: Sequence[int] | None) -> torch.Tensor | None:
        """The ``size`` ids the draft computes (``ranking``'s first, then the rest in id order), or None
        for its whole head. Only ids both models have: a draft row the target lacks is never drafted."""
        rows = draft_model.info.vocab_size
        if target_lm is not None:
            rows = min(rows, target_lm.info.vocab_size)
        if size == 0 or size >= rows:
            return None
        if not ranking:
            return torch.arange(size)
        ranked = list(dict.fromkeys(t for t in ranking if 0 <= t < rows))[:size]
        taken = set(ranked)
        ranked += [t for t in range(rows) if t not in taken][:size - len(ranked)]
        return torch.tensor(ranked)

    @staticmethod
    def _head_of(draft_model: CausalLM, ids: torch.Tensor):
        """(the ids drafted, the draft's LM head over them): ``ids``, or the first as many ids where the
        draft's storage can only cut a prefix (int4 layers keep no rows to choose from)."""
        size = int(ids.numel())
        if not torch.equal(ids, torch.arange(size)):
            try:
                return ids, draft_model.head_rows(ids.tolist())
            except NotImplementedError as e:
                log.warning("draft vocabulary: the first %d ids in merge order, not the ranked ones (%s)", size, e)
        return torch.arange(size), draft_model.head_rows(size)

    def _next_logits(self, tokens: list[int], vocab: int) -> torch.Tensor:
        """Feed ``tokens`` to the draft; its logits for the next token over the target's ``vocab``."""
        dm = self.draft_model
        if self.head is None or self._whole:
            return align_vocab(dm.forward_chain(tokens, logit_rows=[len(tokens) - 1]).logits[-1], vocab)
        hidden = dm.forward_chain(tokens, hidden=True, logit_rows=[]).hidden[-1:]
        logits = torch.full((vocab,), float("-inf"))
        logits[self.draft_ids] = self.head(hidden.float())[0].float()
        return logits

    def start(self, ctx: RunContext) -> None:
        self.gamma = self.config.gamma
        self._sizing = _SizingStats()
        self.gain = None
        self._whole = False
        if self._watch is not None:
            self._watch.start()
        if self.lookup is not None:
            self.lookup.start(ctx)
        # The draft's cache holds ctx.tokens from this offset on. It reads the prompt at the first step
        # that drafts (read_prompt): where the stand-down gate makes the first step plain, its read
        # never delays the first token.
        window = self.config.draft_window
        self._offset = self._window_start = max(0, len(ctx.tokens) - 1 - window) if window else 0
        self._unread = True
        self._prompt = list(ctx.tokens)
        self._keep_held(ctx.tokens)
        prefill_s, config = getattr(ctx, "prefill_s", None), getattr(ctx, "config", None)
        self._read_plan = (prefill_s, len(ctx.tokens) - 1, config.max_new_tokens) if (
            not window and prefill_s and config is not None) else None
        self._idle = False  # this run does not draft: the read it needs would cost more than drafting saves
        self._recalled = _RECALL.get(self.draft_model, _Recall()).gain  # before this run's own (see _Recall)

    def read_window(self) -> int | None:
        """How many of the prompt's last tokens the draft reads by default (None: all of them; 0: none, and
        the run does not draft): as many as it reads in :data:`READ_SHARE` of the answer's plain decoding
        time, its read of a token priced at the target's (timed in this run's prefill) times the draft's
        share of the multiply-adds, the answer's plain steps at the target's one-token pass (timed by this
        run's first step). None at all where a run with this draft measured drafting's gain and
        :data:`READ_OF_SAVING` of what drafting saves at that gain buys fewer than :data:`MIN_READ`
        tokens, until the runs that read none had :data:`MEASURE_EVERY` times this answer's budget (this
        one then reads, and measures again)."""
        step = timed_step(self.cost)
        if self._read_plan is None or not step or not self._read_share:
            return None
        prefill_s, read, answer = self._read_plan
        per_token = prefill_s / read * self._read_share
        window = max(MIN_READ, int(READ_SHARE * answer * step / per_token))
        recall = _RECALL.setdefault(self.draft_model, _Recall())
        if recall.gain is None:
            return window
        # Not a read cut to what is affordable: its draft would see less, gain less, and the next run
        # afford less still (a code answer's read fell from whole prompts to 40 tokens within 8 runs).
        affordable = int(READ_OF_SAVING * answer * step * max(0.0, 1 - 1 / recall.gain) / per_token)
        if affordable >= MIN_READ:
            return window
        if recall.idle >= MEASURE_EVERY * answer:  # measure again; the count restarts once it is measured
            return window
        recall.idle += answer
        return 0

    def _keep_held(self, prompt: list[int]) -> None:
        """Start the run on what the draft's cache holds where ``prompt`` continues the last run's (see
        :data:`_HELD`): its offset, and its tokens up to where they and the prompt part; else empty."""
        dm, held = self.draft_model, _HELD.get(self.draft_model)
        if held is None:
            dm.reset()
            return
        kept = held.tokens
        if (dm.cache_len != len(kept) or len(prompt) <= len(held.prompt)
                or prompt[:len(held.prompt)] != held.prompt):
            dm.reset()
            return
        readable = self._readable(prompt[held.offset:-1])
        same = 0
        for a, b in zip(self._readable(kept), readable):
            if a != b:
                break
            same += 1
        dm.crop(same)
        self._offset = held.offset
        self._note_held(prompt, held.offset + same)

    def _note_held(self, context: list[int], end: int, drafted: Sequence[int] = ()) -> None:
        """Record what the draft's cache now holds: its first ``cache_len`` of ``context[offset:end]``
        then ``drafted``. ``context`` is kept by reference (a run's context only grows) and read only when
        the next run starts, so a step pays for no copy of it."""
        _HELD[self.draft_model] = _Held(context, self._offset, end, tuple(drafted),
                                        self.draft_model.cache_len, self._prompt)

    def read_prompt(self, tokens: list[int]) -> int:
        """Once a run, ``tokens`` from the window's start on, all but the last (the next pass feeds that
        one), as one prefill after what the draft's cache kept of them; returns the tokens read."""
        if not self._unread:
            return 0
        self._unread = False
        dm = self.draft_model
        window = self.read_window()
        if window == 0:
            self._idle = True
            return 0
        start = max(0, len(tokens) - 1 - window) if window is not None else self._window_start
        if dm.cache_len and self._offset + dm.cache_len < start:  # what it kept ends before the window
            dm.reset()
        if not dm.cache_len:
            self._offset = start
        return self._feed_unseen(tokens, prefill=True)

    def _catch_up(self, tokens: list[int]) -> int:
        """The tokens the draft did not see while plain steps ran (a stand-down, or copies proposed in its
        stead), all but the last, as one read after the prompt's; returns the tokens read. A drafting
        step leaves at most one such token (the bonus after its last draft): more means a pause, which
        drafting pays for once on resuming, as it pays for the prompt's read, so the stand-down gate and
        the sizing judge drafting without it (a probe after 8 plain steps fed 9 tokens in its first
        draft pass, 34 ms against 14 for one on the AMD EPYC model 17, and the gate stood a draft right
        87% of the time down for the rest of the answer)."""
        if len(tokens) - 1 - (self._offset + self.draft_model.cache_len) < 2:
            return 0
        return self._feed_unseen(tokens, prefill=False)  # a decoding pass, as the pass it was split from

    def _feed_unseen(self, tokens: list[int], prefill: bool) -> int:
        """Feed the draft, in one pass, the tokens it has not seen of ``tokens`` but the last (the next
        pass feeds that one); returns how many."""
        lacking = tokens[self._offset + self.draft_model.cache_len:-1]
        if lacking:
            self.draft_model.forward_chain(self._readable(lacking), logit_rows=[], prefill=prefill)
        self._note_held(tokens, len(tokens) - 1)
        return len(lacking)

    def _readable(self, tokens: list[int]) -> list[int]:
        """Tokens as the draft can embed them (ids past its rows become 0; see the module doc)."""
        rows = self.draft_model.info.vocab_size
        return [t if t < rows else 0 for t in tokens]

    def propose(self, ctx: RunContext, budget: int) -> Draft:
        k = min(self.gamma, budget)
        if k <= 0:
            return Draft()
        if self.lookup is not None:
            copy = self.lookup.propose(ctx, budget)
            if len(copy):
                copy.shown["source"] = copy.source = "copy"
                copy.memo["copied"] = True
                return copy
        dm = self.draft_model
        sampling = ctx.config.sampling
        vocab = ctx.target_lm.info.vocab_size
        reading = time.perf_counter()
        read = self.read_prompt(ctx.tokens)
        if self._idle:  # shown in the step's internals: why this run's steps are plain
            gain = _RECALL.get(self.draft_model, _Recall()).gain
            return Draft(shown={"not drafting": f"its read would cost more than half of what drafting saves at "
                                                f"the last run's gain ({gain:.2f}x)"})
        caught_up = self._catch_up(ctx.tokens)
        started = time.perf_counter()
        # Feed what the draft cache lacks: the root, and any token the target added last step.
        logits = self._next_logits(self._readable(ctx.tokens[self._offset + dm.cache_len:]), vocab)
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        q_token: list[float] = []
        stopped_early = False
        forwards = 1
        for j in range(k):
            if sampling.greedy:
                # q of the argmax, without a full softmax: exp(max - logsumexp).
                token = int(logits.argmax())
                top = float(torch.exp(logits[token] - torch.logsumexp(logits, -1)))
            else:
                probs = probabilities(logits.cpu(), sampling.temperature, sampling.top_p)
                top = float(probs.max())
            # The stop looks at q only, never at the token about to be drawn (see the module doc).
            if j > 0 and top < self.config.confidence:
                stopped_early = True
                break
            if not sampling.greedy:
                token = sample(probs, ctx.draft_generator)
                q_rows.append(probs)
            tokens.append(token)
            q_token.append(top if sampling.greedy else float(probs[token]))
            if j < k - 1:
                logits = self._next_logits([token], vocab)
                forwards += 1
        self._sizing.drafted(time.perf_counter() - started, forwards)
        self._note_held(ctx.tokens, len(ctx.tokens), tokens)
        return Draft.chain(tokens, sampled=not sampling.greedy, q=torch.stack(q_rows) if q_rows else None,
                           q_token=q_token, shown={"source": "draft", "gamma": self.gamma, "drafted": len(tokens),
                                                   "stopped_early": stopped_early, "gain": self.gain,
                                                   **({"vocabulary": "all" if self._whole else len(self.draft_ids)}
                                                      if self.head is not None else {}),
                                                   **({"read_prompt": read, "prompt_from": self._offset} if read else {}),
                                                   **({"caught_up": caught_up} if caught_up else {})},
                           setup_s=started - reading)

    def observe(self, ctx: RunContext, outcome: StepOutcome) -> None:
        if outcome.draft.memo.get("copied"):
            # The draft model ran nothing this step; its next propose feeds what it lacks.
            self.lookup.observe(ctx, outcome)
            return
        accepted = len(outcome.verdict.accepted)
        drafted = len(outcome.draft)
        # The draft cache holds the old context plus every drafted token but the last; keep
        # the old context plus the accepted ones. The next propose feeds what is missing.
        old_len = len(ctx.tokens) - len(outcome.new_tokens) - self._offset
        self.draft_model.crop(min(self.draft_model.cache_len, old_len + accepted))
        self._note_held(ctx.tokens, len(ctx.tokens))
        if self.config.adaptive and drafted:
            if accepted == drafted:
                self.gamma = min(self.gamma + 2, self.config.max_gamma)
            else:
                self.gamma = max(self.gamma - 1, 1)
        if self.cost is not None and drafted:
            self._sizing.verified(self.cost(1 + drafted), drafted, accepted)
            if self._watch is not None and not self._whole:
                self._watch.saw(drafted, accepted, outcome.new_tokens)
                if self._watch.whole_pays_more(self._sizing, self.cost, self.config.max_gamma):
                    self._whole = True
                    self._sizing.draft_s /= 1 - self._watch.saving  # its passes timed so far, priced whole
            sized = self._sizing.best_gamma(self.cost, self.config.max_gamma)
            if sized is not None:
                self.gamma, gain = sized
                self.gain = round(gain, 3)
                if ctx.config.max_new_tokens >= RECALL_BUDGET:
                    _RECALL[self.draft_model] = _Recall(gain=gain if self._recalled is None
                                                        else (self._recalled + gain) / 2)


@dataclass(frozen=True)
class _Held:
    """What a draft model's cache holds as the last speculative run left it: :attr:`tokens`, from its
    context's ``offset`` on, the context starting with that run's ``prompt``."""

    context: list[int]
    offset: int
    end: int  # the context's tokens up to here were read, then the ``drafted`` ones
    drafted: tuple[int, ...]
    cache_len: int
    prompt: list[int]

    @property
    def tokens(self) -> list[int]:
        """The tokens the draft's cache holds (ids as in the context: past the draft's rows too)."""
        return (self.context[self.offset:self.end] + list(self.drafted))[:self.cache_len]


@dataclass
class _Recall:
    """What the runs with a draft model measured for the next to size its read by: drafting's expected
    gain over plain steps, as the last run that drafted sized it (not a warm-up: :data:`RECALL_BUDGET`)
    averaged with what was recalled before that run, so each earlier run weighs half the one after it;
    and the tokens of answer budget the runs since then did not draft for it. One run's gain alone had
    one prompt the draft knew badly (48 drafts in 88 steps on the AMD EPYC model 17) stop the next three
    code prompts from drafting at all (a bench's `speculative` 1.17x; 1.23x and 1.26x in the two runs
    after this change); a draft that gains nothing in two runs running still stops."""

    gain: float | None = None
    idle: int = 0


#: Each draft model's :class:`_Recall`.
_RECALL: "weakref.WeakKeyDictionary[CausalLM, _Recall]" = weakref.WeakKeyDictionary()

#: Each draft model's head over its default vocabulary, with the ids it computes: made once (a 0.5B
#: draft's takes 60 ms to cut), not at every run's method.
_AUTO_HEADS: "weakref.WeakKeyDictionary[CausalLM, tuple[torch.Tensor, object]]" = weakref.WeakKeyDictionary()

#: Each draft model's :class:`_Held`, written by the run that used it last. A run whose prompt is
#: that run's prompt and more (a conversation's next turn: the last answer, a new question) keeps it
#: where the draft's cache is still that long; any other run, or a cache someone else changed, reads
#: afresh.
_HELD: "weakref.WeakKeyDictionary[CausalLM, _Held]" = weakref.WeakKeyDictionary()


class ChainAcceptance:
    """A chain's acceptance at each draft position, counted in the run: α_j, the chance that draft
    token j is accepted once the ones before it were.

    A position counts the drafts verified there (accepted ones, plus the first rejected one: those
    after it were never judged). Each position's α leans on the chain's pooled α with the weight of
    :data:`PRIOR_WEIGHT` drafts, and the pooled α on a prior of :data:`PRIOR_ALPHA`, so a position
    seldom reached takes the chain's figure until it has its own.
    """

    PRIOR_ALPHA, PRIOR_WEIGHT = 0.7, 4.0

    def __init__(self):
        self.accepted: list[int] = []
        self.judged: list[int] = []

    def add(self, drafted: int, accepted: int) -> None:
        """A verified chain of ``drafted`` tokens of which the first ``accepted`` were accepted."""
        for j in range(min(accepted + 1, drafted)):
            self.judge(j, j < accepted)

    def judge(self, position: int, accepted: bool) -> None:
        """One draft judged at ``position`` (0 the first)."""
        while len(self.judged) <= position:
            self.accepted.append(0)
            self.judged.append(0)
        self.judged[position] += 1
        self.accepted[position] += int(accepted)

    def alphas(self, n: int) -> list[float]:
        """α_1 .. α_n."""
        w = self.PRIOR_WEIGHT
        pooled = (sum(self.accepted) + self.PRIOR_ALPHA * w) / (sum(self.judged) + w)
        return [(self.accepted[j] + pooled * w) / (self.judged[j] + w) if j < len(self.judged) else pooled
                for j in range(n)]

    def best_gamma(self, c: float, curve, max_gamma: int) -> tuple[int, float]:
        """:func:`best_gamma` at this run's acceptance by position, and its :func:`chain_gain`."""
        return best_chain(self.alphas(max_gamma), c, curve)


class _SizingStats:
    """What a cost-sized γ is chosen from, measured during the run: the acceptance at each draft
    position (:class:`ChainAcceptance`) and c, the measured drafting time per draft forward over
    T(1), T(1) being the measured time from proposal to observation over the cost curve's
    T(1 + γ)/T(1) at each step's size."""

    def __init__(self):
        self.draft_s = self.verify_s = self.verify_units = 0.0
        self.forwards = 0
        self.acceptance = ChainAcceptance()
        self.proposed_at: float | None = None

    def drafted(self, seconds: float, forwards: int) -> None:
        self.draft_s += seconds
        self.forwards += forwards
        self.proposed_at = time.perf_counter()

    def verified(self, relative_cost: float, drafted: int, accepted: int) -> None:
        if self.proposed_at is not None:
            self.verify_s += time.perf_counter() - self.proposed_at
            self.verify_units += relative_cost
            self.proposed_at = None
        self.acceptance.add(drafted, accepted)

    def draft_cost(self) -> float | None:
        """c, or None before anything was timed."""
        if not (self.forwards and self.verify_units and self.verify_s > 0):
            return None
        return (self.draft_s / self.forwards) / (self.verify_s / self.verify_units)

    def best_gamma(self, curve, max_gamma: int) -> tuple[int, float] | None:
        """The γ with the most expected tokens per unit of time and that speed over plain steps', or None
        before anything was timed."""
        c = self.draft_cost()
        return None if c is None else self.acceptance.best_gamma(c, curve, max_gamma)


class _VocabularyWatch:
    """Whether a run's default draft vocabulary still pays, judged from the run's drafts.

    Where the target's token at a judged draft position lies outside the vocabulary (a share r of the
    positions), the vocabulary's draft was surely wrong; the whole head's would have been right as often
    as where the token lies inside (α_in, counted over those positions). So each position's α with the
    whole head is the vocabulary's α + r α_in, and each of the whole head's passes costs more by the rows
    it adds: ``saving`` is their share of a pass's multiply-adds (the draft's parameters counted as a
    pass, its embedding as the head it is tied to; an untied draft's embedding makes the share smaller
    and the watch keep the vocabulary longer). r leans on none outside with the weight of
    :data:`PRIOR_POSITIONS` positions, so a rare token early in an answer does not drop the vocabulary.
    """

    PRIOR_POSITIONS = 32

    def __init__(self, ids: torch.Tensor, info):
        self.inside = torch.zeros(info.vocab_size, dtype=torch.bool)  # ids are draft rows (_draft_ids)
        self.inside[ids] = True
        cut = max(0, info.vocab_size - ids.numel()) * info.hidden_size
        self.saving = min(0.9, cut / info.num_parameters) if info.num_parameters else 0.0
        self.start()

    def start(self) -> None:
        self.judged = self.outside = 0
        self.where_inside = ChainAcceptance()  # the acceptance at positions whose target token lay inside

    def saw(self, drafted: int, accepted: int, tokens: Sequence[int]) -> None:
        """A verified chain: ``tokens`` the step's new ones (the accepted drafts, then the target's)."""
        for j, token in enumerate(tokens[:min(accepted + 1, drafted)]):
            self.judged += 1
            if token < self.inside.numel() and self.inside[token]:
                self.where_inside.judge(j, j < accepted)
            else:
                self.outside += 1

    def whole_pays_more(self, sizing: "_SizingStats", curve, max_gamma: int) -> bool:
        """Whether the whole head's chain is expected to be faster than this vocabulary's."""
        c = sizing.draft_cost()
        if c is None or not self.outside:
            return False
        r = self.outside / (self.judged + self.PRIOR_POSITIONS)
        alphas = sizing.acceptance.alphas(max_gamma)
        whole = [min(1.0, a + r * b) for a, b in zip(alphas, self.where_inside.alphas(max_gamma))]
        return best_chain(whole, c / (1 - self.saving), curve)[1] > best_chain(alphas, c, curve)[1]


def best_gamma(alphas: list[float], c: float, curve) -> int:
    """The chain length γ ≥ 1, up to ``len(alphas)``, with the most expected tokens per unit of time: a
    step of γ drafts yields 1 plus the chance each is reached and accepted (α_1 ⋯ α_j for draft j)
    and costs γ·c + T(1 + γ)/T(1) plain steps, c being the draft's cost per token."""
    values, reach = [], 1.0
    for alpha in alphas:
        reach *= alpha
        values.append(reach)
    return max(1, best_size(values, lambda n: curve(n) + (n - 1) * c))


def best_chain(alphas: list[float], c: float, curve) -> tuple[int, float]:
    """:func:`best_gamma` at ``alphas`` and its :func:`chain_gain`."""
    gamma = best_gamma(alphas, c, curve)
    return gamma, chain_gain(alphas[:gamma], c, curve)


def chain_gain(alphas: list[float], c: float, curve) -> float:
    """A chain of ``len(alphas)`` drafts' expected tokens per unit of time over a plain step's (1 token
    per T(1)), priced as in :func:`best_gamma`."""
    expected, reach = 1.0, 1.0
    for alpha in alphas:
        reach *= alpha
        expected += reach
    n = 1 + len(alphas)
    return expected / (curve(n) + (n - 1) * c)


@functools.lru_cache(maxsize=4)
def ranked_vocabulary(target_id: str) -> tuple[int, ...]:
    """The target's token ids by how often they occur in its answers the project ships
    (:func:`~specplay.core.paths.shipped_corpus`; prompts and answers alike), most frequent first;
    empty for a target without them."""
    from safetensors import SafetensorError, safe_open

    from specplay.core.paths import shipped_corpus

    path = shipped_corpus(target_id)
    if not path.is_file():
        return ()
    try:
        with safe_open(str(path), framework="pt") as f:
            tokens = f.get_tensor("tokens").to(torch.int64)
    except (OSError, SafetensorError, KeyError):
        return ()
    counts = torch.bincount(tokens[tokens >= 0])
    order = torch.argsort(counts, descending=True, stable=True)
    return tuple(order[counts[order] > 0].tolist())
