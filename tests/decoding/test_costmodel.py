"""The verification cost curve and the size choice built on it."""

import pytest
import torch

from specplay.core.decoding.costmodel import CostCurve, best_size, cost_curve, measure
from tiny import native_from_hf, tiny_hf_model


def test_curve_interpolates_and_extrapolates():
    c = CostCurve((1, 2, 4, 8), (1.0, 1.1, 1.2, 1.6))
    assert c(1) == 1.0 and c(3) == pytest.approx(1.15) and c(6) == pytest.approx(1.4)
    assert c(12) == pytest.approx(2.0)  # the last slope, 0.1 per token
    assert CostCurve.linear(0.05)(11) == pytest.approx(1.5)


def test_best_size_weighs_acceptance_against_cost():
    free = CostCurve.linear(0.0)
    cpu = CostCurve.linear(0.05)
    chain = lambda a, k: [a ** i for i in range(1, k + 1)]  # noqa: E731
    assert best_size(chain(0.9, 10), free) == 10  # free verification: propose everything
    assert best_size(chain(0.9, 10), cpu) == 10
    assert best_size(chain(0.2, 10), cpu) == 1  # weak guesses: one token
    assert best_size(chain(0.02, 10), cpu) == 0  # hopeless guesses: plain decoding
    assert 1 < best_size(chain(0.6, 10), CostCurve.linear(0.1)) < 10
    assert best_size(chain(0.9, 10), cpu, cap=3) == 3
    # Fading candidates: a curve that turns steep past 8 tokens stops at the bend (7 + the root).
    fading = [0.6 * 0.8 ** i for i in range(16)]
    assert best_size(fading, CostCurve((1, 8, 16), (1.0, 1.2, 2.0))) == 7
    assert best_size(fading, CostCurve.linear(0.02)) == 11
    assert best_size(fading, CostCurve.linear(0.0)) == 16


def test_block_sizes_take_turns_and_each_keeps_its_fastest_pass(monkeypatch):
    """A slow spell of the machine touches every size once instead of inflating the one it fell on."""
    from specplay.core.decoding import costmodel

    clock = [0.0]
    order = []

    class Fake:
        info = type("Info", (), {"vocab_size": 50})()

        def reset(self):
            pass

        def forward_chain(self, tokens):
            pass

        def forward(self, block):
            n = len(block)
            order.append(n)
            slow = 100.0 if len(order) in (2, 3) else 0.0  # a spell over two consecutive passes
            clock[0] += n + slow

    monkeypatch.setattr(costmodel.time, "perf_counter", lambda: clock[0])
    assert costmodel.time_passes(Fake(), (1, 8, 16), repeats=3) == [1.0, 8.0, 16.0]
    assert order == [1, 8, 16] * 3
    # Within a budget: the first round always, a further one only while the time spent is under it.
    order.clear()
    assert costmodel.time_passes(Fake(), (1, 8, 16), repeats=3, budget=200.0) == [1.0, 108.0, 116.0]
    assert order == [1, 8, 16]  # the first round took 225 "seconds"
    order.clear()
    assert costmodel.time_passes(Fake(), (1, 8, 16), repeats=3, budget=250.0) == [1.0, 8.0, 16.0]
    assert order == [1, 8, 16] * 2


def test_measured_curve_is_nondecreasing_cached_and_leaves_the_cache_empty():
    model = native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32))
    curve = measure(model, sizes=(1, 2, 4, 8), context=8, repeats=2)
    assert curve.relative[0] == 1.0
    assert all(b >= a for a, b in zip(curve.relative, curve.relative[1:]))
    assert model.cache_len == 0
    assert cost_curve(model) is cost_curve(model)


def test_a_curve_is_measured_once_per_machine_and_model_and_read_back_in_a_later_start(monkeypatch, tmp_path):
    """A later start of a one-shot command does not time the model again: the curve is kept with
    the machine's measurements, keyed by the model, its storage and the code that runs it."""
    from specplay.core.decoding import costmodel

    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path))
    first = native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32))
    measured = cost_curve(first)
    monkeypatch.setattr(costmodel, "measure", lambda *a, **k: pytest.fail("measured again"))
    again = native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32))  # another process's load, as it were
    assert cost_curve(again).kept == measured.kept
    other = native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32, hidden=64))
    with pytest.raises(pytest.fail.Exception, match="measured again"):
        cost_curve(other)


def test_a_corrected_curve_follows_the_passes_timed_since():
    from specplay.core.decoding.costmodel import CorrectedCurve

    true = CostCurve.linear(0.25)
    steep = CorrectedCurve(CostCurve.linear(0.5))  # kept 2x too steep
    for _ in range(3):
        steep.observe(6, 0.010 * true(6))
    assert steep(6) == pytest.approx(3.5)  # without a timed one-token pass the kept ratio stands
    assert steep.step_seconds() == pytest.approx(0.010 * true(6) / 3.5)
    for _ in range(3):
        steep.observe(1, 0.010)
    assert steep(6) == pytest.approx(true(6))
    assert steep(3) == pytest.approx(true(3))  # elsewhere too: the extra cost a row, corrected
    assert steep(12) == pytest.approx(true(12))
    assert steep.step_seconds() == pytest.approx(0.010)
    assert steep.relative[0] == 1.0 and steep.to_dict()["2"] == pytest.approx(true(2))
    # A machine that slows down at every size: the ratio stays, the step's seconds move within a few passes.
    for _ in range(6):
        steep.observe(1, 0.020)
        steep.observe(6, 0.020 * true(6))
    assert steep.step_seconds() == pytest.approx(0.020, rel=0.05)
    assert steep(6) == pytest.approx(true(6), rel=0.01)


#: What each row past the first adds to a target pass on the clock below, in one-row passes.
PER_ROW = 0.15


def _clocked_speculative_run(curve, monkeypatch):
    """A cost-sized speculative run of a tiny pair on a clock that only the passes advance: the target's
    pass of n rows takes 10 ms x (1 + PER_ROW (n - 1)), a draft pass 1 ms. Returns (the run, its rate on
    that clock over the second half of its steps, the curve held after it)."""
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method
    from specplay.core.methods.speculative import SpeculativeConfig
    from tiny import loaded, on_a_clock, perturbed_copy

    base = tiny_hf_model(seed=0, dtype=torch.float64)
    target, draft = loaded(native_from_hf(base)), loaded(native_from_hf(perturbed_copy(base, 0.01)))
    on_a_clock(monkeypatch, {target.model: lambda n: 0.010 * (1 + PER_ROW * (n - 1)), draft.model: lambda n: 0.001})
    monkeypatch.setitem(costmodel._CURVES, target.model, curve)
    method = build_method("speculative", SpeculativeConfig(gamma=4, cost_sized=True, max_gamma=8), target, draft)
    gen = GenerationConfig(max_new_tokens=160, stop_at_eos=False)
    res = drain(generate(target.model, target.tokenizer, method, [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7], gen))
    late = res.events[len(res.events) // 2:]
    seconds = late[-1].elapsed_s - res.events[len(res.events) // 2 - 1].elapsed_s
    return res, sum(len(e.committed) for e in late) / seconds, costmodel._CURVES[target.model]


def test_a_run_whose_kept_curve_is_twice_too_steep_recovers_its_speed_within_the_run(monkeypatch):
    from specplay.core.decoding.costmodel import CorrectedCurve

    true, steep = CostCurve.linear(PER_ROW), CostCurve.linear(2 * PER_ROW)
    right, right_rate, _ = _clocked_speculative_run(true, monkeypatch)
    stuck, stuck_rate, _ = _clocked_speculative_run(steep, monkeypatch)  # held as kept: never corrected
    fixed, fixed_rate, held = _clocked_speculative_run(CorrectedCurve(steep), monkeypatch)
    assert right.token_ids == stuck.token_ids == fixed.token_ids
    # The clock is deterministic: any difference is the sizing's. Rates near the best γ are flat, so
    # drafting γ = 1 where 3 is right costs only a percent or so here, but it must cost something.
    assert stuck_rate < 0.995 * right_rate, "the steep curve must cost speed, or this test shows nothing"
    assert fixed_rate >= 0.98 * right_rate

    def late_gamma(run):  # the γ the second half's drafting steps chose most
        gammas = [e.internals["gamma"] for e in run.events[len(run.events) // 2:] if e.num_drafted]
        return max(set(gammas), key=gammas.count)

    assert late_gamma(fixed) == late_gamma(right) > late_gamma(stuck)
    seen = [n for n in held.observed if n > 1]
    assert seen and all(held(n) == pytest.approx(true(n), rel=0.02) for n in seen)


@pytest.mark.parametrize("answer, reads", [(40, 32), (100, 62), (400, 90)])
def test_the_draft_reads_as_much_of_a_long_prompt_as_the_answer_pays_for(monkeypatch, answer, reads):
    """By default the draft reads the prompt's last tokens it reads in a tenth of the answer's plain
    decoding time, on a clock the passes advance: a 90-token prompt, the target's 1-row pass 10 ms and its
    89-row read 0.142 s (1.6 ms a token), a draft of the target's size. A 40-token answer (0.4 s of plain
    steps) pays for 25 tokens of read, so the draft reads the fewest, 32; a 100-token one for 62; a
    400-token one for 250, so all 90 (the first step's token is then the root)."""
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.costmodel import CorrectedCurve
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method
    from specplay.core.methods.speculative import MIN_READ, SpeculativeConfig
    from tiny import loaded, on_a_clock, perturbed_copy

    base = tiny_hf_model(seed=0, dtype=torch.float64)
    target, draft = loaded(native_from_hf(base)), loaded(native_from_hf(perturbed_copy(base, 0.01)))
    on_a_clock(monkeypatch, {target.model: lambda n: 0.010 * (1 + PER_ROW * (n - 1)), draft.model: lambda n: 0.001})
    monkeypatch.setitem(costmodel._CURVES, target.model, CorrectedCurve(CostCurve.linear(PER_ROW)))
    prompt = [4 + (7 * i) % 50 for i in range(90)]
    gen = GenerationConfig(max_new_tokens=answer, stop_at_eos=False)
    method = build_method("speculative", SpeculativeConfig(), target, draft)
    res = drain(generate(target.model, target.tokenizer, method, prompt, gen))
    first = next(e for e in res.events if e.num_drafted)
    assert first.internals["read_prompt"] == reads and MIN_READ == 32
    plain = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target), prompt, gen))
    assert res.token_ids == plain.token_ids


def test_a_conversations_next_turn_finds_the_drafts_read_done(monkeypatch):
    """A run whose prompt continues the last one (its prompt, its answer, five new tokens) reads only what
    the draft's cache lacks: the new tokens and the answer's tail, not a window of 32. The same prompt
    again reads afresh (a rerun or a warm-up must not find its read done), and so does a turn after
    someone emptied the draft's cache. Every run's tokens are plain decoding's."""
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.costmodel import CorrectedCurve
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method
    from specplay.core.methods import speculative
    from specplay.core.methods.speculative import _HELD, MIN_READ, SpeculativeConfig
    from tiny import loaded, on_a_clock, perturbed_copy

    base = tiny_hf_model(seed=0, dtype=torch.float64)
    target, draft = loaded(native_from_hf(base)), loaded(native_from_hf(perturbed_copy(base, 0.01)))
    on_a_clock(monkeypatch, {target.model: lambda n: 0.010 * (1 + PER_ROW * (n - 1)), draft.model: lambda n: 0.001})
    monkeypatch.setitem(costmodel._CURVES, target.model, CorrectedCurve(CostCurve.linear(PER_ROW)))
    gen = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    method = build_method("speculative", SpeculativeConfig(), target, draft)

    class Forgetful(dict):
        """No run recalls the last one's gain (on this clock drafting gains about 1%, and a run that recalled
        it would not read, nor draft: the next test's case): each reads as a first run does."""

        def setdefault(self, key, default=None):
            return speculative._Recall()

    monkeypatch.setattr(speculative, "_RECALL", Forgetful())

    def run(prompt):
        res = drain(generate(target.model, target.tokenizer, method, prompt, gen))
        plain = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target),
                               prompt, gen))
        assert res.token_ids == plain.token_ids
        return res, next(e for e in res.events if e.num_drafted).internals["read_prompt"]

    first = [4 + (7 * i) % 50 for i in range(90)]
    answer, read = run(first)
    assert read == MIN_READ
    second = first + answer.token_ids + [5, 9, 13, 17, 21]
    held = _HELD[draft.model]  # the first run's context up to where the draft last drafted
    assert held.tokens == second[held.offset:held.offset + len(held.tokens)]
    _, read = run(second)
    # What it lacks of the prompt, and the first (plain) step's token, the last one being the root.
    assert read == len(second) - held.offset - len(held.tokens) < MIN_READ
    assert run(second)[1] == MIN_READ  # the same prompt again
    answer, _ = run(first)
    draft.model.reset()  # someone else's use of the draft
    assert run(first + answer.token_ids + [5, 9, 13, 17, 21])[1] == MIN_READ


def test_a_run_does_not_draft_where_its_read_would_cost_more_than_drafting_saves(monkeypatch):
    """The draft's read may cost half of what drafting is expected to save, at the gain the last run with
    this draft measured. On the clock of the tests above (a 90-token prompt, the draft's read 1.6 ms a
    token), a draft that disagrees with its target measures a gain below 1 in its first run, so the next
    runs' 40-token answers run plain steps from the first to the last, until four of them have: the
    next reads and drafts again; a draft that agrees with its target, gaining about half again over a 400-token answer
    on this clock, reads the whole prompt in every run. Every run's tokens are plain decoding's."""
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.costmodel import CorrectedCurve
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method
    from specplay.core.methods.speculative import _RECALL, MEASURE_EVERY, MIN_READ, SpeculativeConfig, _Recall
    from tiny import loaded, on_a_clock, perturbed_copy

    base = tiny_hf_model(seed=0, dtype=torch.float64)
    target = loaded(native_from_hf(base))
    prompt = [4 + (7 * i) % 50 for i in range(90)]

    def reads(draft, runs: int, answer: int) -> list[int | None]:
        """Each run's read of the prompt (None: the run drafted nothing)."""
        on_a_clock(monkeypatch, {target.model: lambda n: 0.010 * (1 + PER_ROW * (n - 1)),
                                 draft.model: lambda n: 0.001})
        monkeypatch.setitem(costmodel._CURVES, target.model, CorrectedCurve(CostCurve.linear(PER_ROW)))
        gen = GenerationConfig(max_new_tokens=answer, stop_at_eos=False)
        plain = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target),
                               prompt, gen)).token_ids
        method = build_method("speculative", SpeculativeConfig(), target, draft)
        seen = []
        for _ in range(runs):
            res = drain(generate(target.model, target.tokenizer, method, prompt, gen))
            assert res.token_ids == plain
            read = next((e.internals["read_prompt"] for e in res.events if e.num_drafted), None)
            # A run that does not draft says why in every step it was let draft (the X-ray's internals).
            assert read is not None or "not drafting" in res.events[1].internals
            seen.append(read)
        return seen

    stranger = loaded(native_from_hf(tiny_hf_model(seed=7, dtype=torch.float64)))
    assert reads(stranger, 2 + MEASURE_EVERY, 40) == [MIN_READ] + [None] * MEASURE_EVERY + [MIN_READ]
    assert _RECALL[stranger.model].gain < 1
    kin = loaded(native_from_hf(perturbed_copy(base, 0.01)))
    assert reads(kin, 3, 400) == [90] * 3
    assert _RECALL[kin.model].gain > 1.3
    # Where half the saving at the recalled gain pays for more than 32 tokens but fewer than the answer's
    # window (45 of 62 for a 100-token answer at 1.17x), the draft reads the window: a read cut to 45 would
    # make the draft see less, gain less, and the next run afford less still.
    _RECALL[kin.model] = _Recall(gain=1.17)
    assert reads(kin, 1, 100) == [62]
    # A draft that had gained well (1.4x) and meets a prompt it knows badly: its next run still reads and
    # drafts (the recall is that run's gain averaged with the 1.4x), the run after a second such one
    # does not.
    _RECALL[stranger.model] = _Recall(gain=1.4)
    assert reads(stranger, 3, 100) == [62, 62, None]
    assert _RECALL[stranger.model].gain < 1.17


def test_a_draft_resuming_after_plain_steps_reads_what_they_added_as_setup(monkeypatch):
    """After plain steps (a stand-down), the draft reads what they added, all but the last token, in one
    pass before it drafts, and the gate judges that step without the read, as it judges the prompt's:
    on a clock where a draft pass costs 1 ms a token, the step after 8 plain ones reads 8 tokens and the
    gate records it as long as a drafting step that read nothing. The tokens are plain decoding's."""
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.costmodel import CorrectedCurve
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.standdown import StandDownGate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method
    from specplay.core.methods.speculative import SpeculativeConfig
    from tiny import loaded, on_a_clock, perturbed_copy

    base = tiny_hf_model(seed=0, dtype=torch.float64)
    target, draft = loaded(native_from_hf(base)), loaded(native_from_hf(perturbed_copy(base, 0.01)))
    on_a_clock(monkeypatch, {target.model: lambda n: 0.010, draft.model: lambda n: 0.001 * n})
    monkeypatch.setitem(costmodel._CURVES, target.model, CorrectedCurve(CostCurve.linear(PER_ROW)))
    plan = [False] + [True] * 3 + [False] * 8 + [True] * 40  # the first step is plain, as the gate's is
    recorded = []
    monkeypatch.setattr(StandDownGate, "drafting", lambda self: plan[len(recorded)])
    monkeypatch.setattr(StandDownGate, "record", lambda self, drafted, tokens, seconds, **timings:
                        recorded.append((drafted, seconds)))
    prompt = [4 + (7 * i) % 50 for i in range(40)]
    gen = GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    method = build_method("speculative", SpeculativeConfig(gamma=1, cost_sized=False), target, draft)
    res = drain(generate(target.model, target.tokenizer, method, prompt, gen))
    plain = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target), prompt, gen))
    assert res.token_ids == plain.token_ids
    drafting = [e for e in res.events if e.num_drafted]
    resumed, before = res.events[12], res.events[3]
    # Unfed: what the last drafting step left (its accepted draft and bonus, or its resampled token),
    # then the 8 plain tokens; the drafting pass feeds the last.
    unfed = (2 if before.num_accepted == before.num_drafted else 1) + 8
    assert resumed.num_drafted and resumed.internals["caught_up"] == unfed - 1
    assert not any("caught_up" in e.internals for e in drafting if e is not resumed)
    # Every γ = 1 drafting step feeds the draft 1 or 2 tokens, then verifies 2 rows: the resumed one too,
    # once its read is set aside; its draft time as shown holds the read.
    assert recorded[12][1] == pytest.approx(recorded[2][1], abs=0.0011)
    assert resumed.timing.draft_s == pytest.approx(0.001 * (resumed.internals["caught_up"] + 1))
