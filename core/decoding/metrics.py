"""Run metrics, in the field's terms.

* τ (mean accepted tokens, Spec-Bench's #MAT): tokens added per step, i.e. accepted draft
  tokens + 1 for the target's own token, averaged over steps. Plain decoding gives 1.00.
* acceptance rate: accepted draft tokens / drafted tokens (for trees, drafted = all nodes).
* acceptance by position: for draft depth k, the share of steps that drafted depth k in
  which depth k was accepted.
* tokens/s: new tokens / wall time, prefill included (as Spec-Bench).
* time to first token: from the start of the run (prefill included) to the end of the first
  step, when the first tokens are committed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunMetrics:
    new_tokens: int = 0
    wall_time: float = 0.0
    prefill_time: float = 0.0
    time_to_first_token: float | None = None
    tokens_per_s: float = 0.0
    steps: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    mean_accepted: float = 0.0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float | None = None
    acceptance_by_position: list[float] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    #: Steps that drafted, and for each draft position how many of them had it accepted (vLLM's
    #: ``num_drafts`` and ``num_accepted_tokens_per_pos``).
    num_drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    #: Plain steps taken because drafting did not pay (core/decoding/standdown.py).
    stood_down_steps: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class MetricsRecorder:
    def __init__(self):
        self.m = RunMetrics()
        self._pos_tried: list[int] = []
        self._pos_hit: list[int] = []

    def add_step(self, added: int, drafted: int, accepted: int, draft_depth: int, draft_s: float, verify_s: float,
                 other_s: float) -> None:
        m = self.m
        m.steps += 1
        m.accept_lengths.append(added)
        m.new_tokens += added
        m.drafted += drafted
        m.accepted += accepted
        m.draft_s += draft_s
        m.verify_s += verify_s
        m.other_s += other_s
        if drafted:
            m.num_drafts += 1
            while len(m.accepted_per_position) < accepted:
                m.accepted_per_position.append(0)
            for k in range(accepted):
                m.accepted_per_position[k] += 1
        while len(self._pos_tried) < draft_depth:
            self._pos_tried.append(0)
            self._pos_hit.append(0)
        for k in range(draft_depth):
            self._pos_tried[k] += 1
            if k < accepted:
                self._pos_hit[k] += 1

    def finish(self, wall_time: float, prefill_time: float, time_to_first_token: float | None = None,
               stood_down_steps: int = 0) -> RunMetrics:
        m = self.m
        m.stood_down_steps = stood_down_steps
        m.wall_time = wall_time
        m.prefill_time = prefill_time
        m.time_to_first_token = time_to_first_token
        m.tokens_per_s = m.new_tokens / wall_time if wall_time > 0 else 0.0
        m.mean_accepted = sum(m.accept_lengths) / m.steps if m.steps else 0.0
        m.acceptance_rate = m.accepted / m.drafted if m.drafted else None
        m.acceptance_by_position = [h / t for h, t in zip(self._pos_hit, self._pos_tried)]
        return m


