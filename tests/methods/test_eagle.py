"""EAGLE: exactness (chain and dynamic tree) with a trained head, draft-cache rollback, sampling, training."""

import pytest
import torch

from specplay.core.decoding.engine import drain, generate
from specplay.core.errors import ModelError
from specplay.core.heads import EagleHead, head_config, save_heads
from specplay.core.methods import build_method
from specplay.core.methods.eagle import EagleConfig
from specplay.core.training.common import TrainSettings
from specplay.core.training.eagle import EagleObjective, train_eagle
from specplay.core.decoding.types import GenerationConfig
from tiny import (assert_drafts_accepted, greedy_continuations, loaded, native_from_hf, sgd_steps_lower,
                  target_features, tiny_hf_model)

PROMPT = [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7]


def make_head_file(path, native, seed=0, scale=0.2, intermediate=48, hidden=None, vocab=None):
    torch.manual_seed(seed)
    head = EagleHead(head_config(native.cfg, intermediate))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.add_(torch.randn_like(p) * scale)
    tensors = dict(head.state_dict())
    tensors["vocab_ids"] = torch.arange(native.info.vocab_size)
    save_heads(path, tensors, {"kind": "eagle", "target": "tiny", "hidden_size": hidden or native.info.hidden_size,
                               "vocab_size": vocab or native.info.vocab_size, "intermediate_size": intermediate})
    return path


@pytest.fixture(scope="module")
def target():
    return loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def knowing_head(target, tmp_path_factory):
    """PROMPT's greedy answer (50 tokens), and a head trained briefly on it (a second answer held
    out): its drafts are mostly accepted there."""
    model = target.model
    answers = greedy_continuations(target, [PROMPT, PROMPT[::-1]], 50)
    head = EagleHead(head_config(model.cfg, 48))
    train_eagle(target_features(model, answers), head, model.embed, model.lm_head_weight(), torch.arange(64), 64,
                TrainSettings(steps=300, batch_size=8, lr=3e-3, eval_every=300, warmup=10), window=32)
    tensors = dict(head.state_dict())
    tensors["vocab_ids"] = torch.arange(64)
    path = tmp_path_factory.mktemp("eagle") / "knowing.safetensors"
    save_heads(path, tensors, {"kind": "eagle", "target": "tiny", "hidden_size": 32, "vocab_size": 64,
                               "intermediate_size": 48})
    return answers[0][len(PROMPT):], path


def _run(target, name, config=None, n=50, prompt=PROMPT):
    gen = GenerationConfig(max_new_tokens=n, stop_at_eos=False, stand_down=False)
    return drain(generate(target.model, target.tokenizer, build_method(name, config, target), prompt, gen))


@pytest.mark.parametrize("cfg", [EagleConfig(tree="chain", depth=1), EagleConfig(tree="chain", depth=6),
                                 EagleConfig(tree="dynamic"), EagleConfig(tree="dynamic", depth=3, top_k=2,
                                                                         total_tokens=5),
                                 EagleConfig(tree="dynamic", depth=8, top_k=6, total_tokens=60),
                                 EagleConfig(tree="dynamic", window=3), EagleConfig(tree="chain", depth=4, window=1)])
def test_eagle_greedy_equals_autoregressive(target, knowing_head, cfg):
    answer, head = knowing_head
    method = build_method("eagle", EagleConfig(**{**cfg.to_dict(), "head": str(head)}), target)
    res = drain(generate(target.model, target.tokenizer, method, PROMPT,
                         GenerationConfig(max_new_tokens=50, stop_at_eos=False, stand_down=False)))
    assert res.token_ids == answer
    # The head's cache: the prompt's last pairs it read (all with no window), then the answer's up to
    # the last step that drafted.
    read = min(cfg.window, len(PROMPT) - 1) if cfg.window else len(PROMPT) - 1
    assert read + 40 < method.drafter.len <= read + 50 - 1
    assert target.model.cache_len == len(PROMPT) + 50 - 1
    assert_drafts_accepted(res, 1.5)


def test_draft_cache_rolls_back_to_the_accepted_path(target, tmp_path):
    """After each step the head's cache holds exactly the pairs of committed tokens with true features."""
    from specplay.core.decoding.costmodel import CostCurve

    head = make_head_file(tmp_path / "eagle.safetensors", target.model)
    method = build_method("eagle", EagleConfig(head=str(head), tree="dynamic"), target)
    # Verification pinned free: every step keeps its whole tree, whatever this machine's curve and
    # however little the run bears the random head out, so partial acceptances happen.
    method.cost = CostCurve.linear(0.0)
    gen = GenerationConfig(max_new_tokens=30, stop_at_eos=False, stand_down=False)
    accepted_some = 0
    for event in generate(target.model, target.tokenizer, method, PROMPT, gen):
        # Pairs (f_i, x_{i+1}) exist only for true features; no draft-time entry survives a step.
        assert method.drafter.len <= method.n_features
        accepted_some += 0 < event.num_accepted < event.num_drafted
    assert accepted_some > 0  # rollbacks after partial acceptance happened
    # The cache content equals a fresh head run over the true features.
    root = len(PROMPT) + 30 - 1
    fresh = build_method("eagle", EagleConfig(head=str(head)), target)
    fresh.drafter.run(method.features[:method.drafter.len],
                      (PROMPT + _run(target, "autoregressive", n=30).token_ids)[1:method.drafter.len + 1],
                      torch.arange(method.drafter.len))
    n = method.drafter.len
    assert n > len(PROMPT) and n <= root
    assert torch.allclose(method.drafter.kv[:, :, :n], fresh.drafter.kv[:, :, :n], atol=1e-5)


def test_trained_head_accepts_more_than_one_token_per_step(target):
    model = target.model
    seqs = []
    for s in range(16):
        prompt = [(5 * s + i) % 60 + 3 for i in range(6)]
        seqs.append(prompt + _run(target, "autoregressive", n=40, prompt=prompt).token_ids)
    data = target_features(model, seqs)
    head = EagleHead(head_config(model.cfg, 64))
    acc, _ = train_eagle(data, head, model.embed, model.lm_head_weight(), torch.arange(64), 64,
                         TrainSettings(steps=300, batch_size=8, lr=3e-3, eval_every=300, warmup=10), window=32)
    assert acc["top1"] > 0.3
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "h.safetensors"
        tensors = dict(head.state_dict())
        tensors["vocab_ids"] = torch.arange(64)
        save_heads(path, tensors, {"kind": "eagle", "target": "tiny", "hidden_size": 32, "vocab_size": 64,
                                   "intermediate_size": 64})
        # the tree at its full size: sized by this machine's timed curve, how much it accepts would
        # depend on the machine's load
        res = _run(target, "eagle", EagleConfig(head=str(path), auto_size=False), n=40, prompt=seqs[0][:6])
    assert res.token_ids == seqs[0][6:]
    assert res.metrics.mean_accepted > 1.5


@pytest.mark.parametrize("unroll", [1, 3])
def test_a_training_step_lowers_the_loss(target, unroll):
    model = target.model
    g = torch.Generator().manual_seed(0)
    data = target_features(model, [torch.randint(3, 64, (40,), generator=g).tolist() for _ in range(4)])
    head = EagleHead(head_config(model.cfg, 48))
    obj = EagleObjective(head, data, model.embed, model.lm_head_weight().float(), torch.arange(64), 64, window=16,
                         noise=0.0, unroll=unroll)
    starts = obj.window_starts[:8]
    assert sgd_steps_lower(lambda: obj.loss(starts), head.parameters(), lr=0.05)
    acc = obj.accuracy(starts)
    assert len(acc["top1_by_level"]) == 3 and acc["top1_by_level"][0] == acc["top1"]


def test_auto_size_grows_only_levels_that_can_pay(target, tmp_path, monkeypatch):
    """With the tree sized by the verify cost, a level whose nodes are too unlikely to pay is not
    grown: nothing past the first when verifying is dear (and nothing kept: the step is plain, the
    tokens greedy decoding's), every level when it is free, and on a costly (convex) curve the same
    draft as growing every level, from fewer drafter passes."""
    from specplay.core.decoding.costmodel import CostCurve

    head = make_head_file(tmp_path / "eagle.safetensors", target.model)
    cfg = EagleConfig(head=str(head), tree="dynamic", depth=5, top_k=3, total_tokens=40)

    def steps(curve, prune=True, level_cost=0.0):
        method = build_method("eagle", cfg, target)
        method.cost = curve
        monkeypatch.setattr(method, "level_cost", lambda: level_cost)
        if not prune:
            monkeypatch.setattr(method, "_worth_adding", lambda values: 0.0)
        gen = GenerationConfig(max_new_tokens=30, stop_at_eos=False, stand_down=False)
        events = list(generate(target.model, target.tokenizer, method, PROMPT, gen))
        drafted = [(e.tree, e.internals) for e in events if "levels_grown" in e.internals]
        assert len(drafted) > len(events) // 2
        assert [t for e in events for t in e.committed] == greedy[:30]
        return drafted

    greedy = greedy_continuations(target, [PROMPT], 30)[0][len(PROMPT):]

    free = steps(CostCurve.linear(0.0))
    assert all(i["levels_grown"] == i["depth"] for _, i in free)  # the depth the step allowed
    assert {i["nodes_grown"] for _, i in free if i["depth"] == 5} == {3 + 4 * 3 * 3}
    dear = steps(CostCurve.linear(10.0))
    assert {(i["levels_grown"], i["nodes_grown"], i["kept"]) for _, i in dear} == {(1, 3, 0)}
    assert not any(t for t, _ in dear)
    costly, everything = steps(CostCurve.linear(0.2)), steps(CostCurve.linear(0.2), prune=False)
    assert [t for t, _ in costly] == [t for t, _ in everything] and any(t.get("tokens") for t, _ in costly)
    assert all(i["levels_grown"] == i["depth"] for _, i in everything)
    assert any(i["levels_grown"] < i["depth"] for _, i in costly)
    # A level's own drafting is priced too: where growing one costs a whole step, verifying for free
    # does not pay for a second level.
    assert {i["levels_grown"] for _, i in steps(CostCurve.linear(0.0), level_cost=1.0)} == {1}


def test_level_cost_is_the_runs_own_timing_over_its_step(target, tmp_path):
    """A grown level's cost in steps: the prior before anything is timed, then the levels' timing over
    the corrected curve's one-token pass, newer timings weighing more."""
    from specplay.core.decoding.costmodel import CorrectedCurve, CostCurve

    head = make_head_file(tmp_path / "eagle.safetensors", target.model)
    method = build_method("eagle", EagleConfig(head=str(head)), target)
    method.cost = CorrectedCurve(CostCurve.linear(0.1))
    assert method.level_cost() == method.LEVEL_PRIOR
    method.cost.observe(1, 0.040)
    assert method.level_cost() == method.LEVEL_PRIOR  # no level timed yet
    method._time_levels(0.006, 3)
    assert method.level_cost() == pytest.approx(0.002 / 0.040)
    method._time_levels(0.012, 3)  # the newest weighs LEVEL_NEWEST
    assert method.level_cost() == pytest.approx((0.002 + method.LEVEL_NEWEST * 0.002) / 0.040)


def test_the_heads_read_of_the_prompt_is_not_held_against_drafting(target, knowing_head, monkeypatch):
    """The head reads its window of the prompt once, inside the first step that drafts. On a clock only
    the passes advance, where that read costs 40 plain steps and the head's later passes nothing, the
    stand-down gate judges drafting without it and never stands down (it had stood down after two
    drafting steps, the first of them holding the read)."""
    from types import SimpleNamespace

    from specplay.core.decoding import costmodel
    from specplay.core.decoding.costmodel import CostCurve
    from specplay.core.methods import eagle
    from tiny import on_a_clock

    clock = on_a_clock(monkeypatch, {target.model: lambda n: 0.010 * (1 + 0.25 * (n - 1))})
    monkeypatch.setattr(eagle, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve.linear(0.25))
    method = build_method("eagle", EagleConfig(head=str(knowing_head[1]), tree="chain", depth=3), target)
    head_run = method.drafter.run

    def run(feats, tokens, positions, mask=None):
        clock[0] += 0.4 if int(positions[0]) == 0 else 0.0  # the prompt's pairs start at position 0
        return head_run(feats, tokens, positions, mask)

    monkeypatch.setattr(method.drafter, "run", run)
    res = drain(generate(target.model, target.tokenizer, method, PROMPT,
                         GenerationConfig(max_new_tokens=40, stop_at_eos=False)))  # the gate on, as by default
    assert res.token_ids == knowing_head[0][:40]
    assert res.events[1].num_drafted and res.metrics.wall_time > 0.4  # the read happened, in step 2
    assert res.metrics.stood_down_steps == 0


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_eagle_sampling_is_lossless(tmp_path, shape):
    from test_distribution import assert_samples_the_target

    model = tiny_hf_model(seed=11, vocab=8, dtype=torch.float64)
    t = loaded(native_from_hf(model))
    head = make_head_file(tmp_path / "h8.safetensors", t.model)
    # Without auto-sizing: it sizes each tree by this machine's measured cost curve, so under load
    # (or on a CPU that verifies steeply) the trees stayed too shallow for the test's depth 3.
    method = build_method("eagle", EagleConfig(head=str(head), tree=shape, depth=3, top_k=2, total_tokens=6,
                                               auto_size=False), t)
    assert_samples_the_target(t, method, native_from_hf(model))


def test_heads_for_another_model_or_corrupt_files_are_clear_errors(target, tmp_path):
    wrong = make_head_file(tmp_path / "w.safetensors", target.model, hidden=64)
    with pytest.raises(ModelError, match="hidden size 64"):
        build_method("eagle", EagleConfig(head=str(wrong)), target)
    corrupt = tmp_path / "c.safetensors"
    corrupt.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(ModelError, match="not a readable heads file|no SpecPlay manifest"):
        build_method("eagle", EagleConfig(head=str(corrupt)), target)
    from test_medusa import make_heads_file

    medusa = make_heads_file(tmp_path / "m.safetensors")
    with pytest.raises(ModelError, match="holds medusa heads"):
        build_method("eagle", EagleConfig(head=str(medusa)), target)


def test_unrolled_levels_match_drafting_one_pair_at_a_time():
    """Level j of the unrolled pass at position t equals what drafting computes: the true
    pairs up to t-j+1, then j-1 pairs of (predicted feature, next token), one at a time."""
    torch.manual_seed(0)
    cfg = head_config(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64)).cfg, 48)
    head = EagleHead(cfg).double()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    embeds, feats = torch.randn(2, 9, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)
    outs = head.unrolled(embeds, feats, 3)
    assert torch.allclose(outs[0], head(embeds, feats))
    for level in (2, 3):
        for t in range(level - 1, 9):
            base = t - level + 1
            f, e = feats[:, : base + 1], embeds[:, : base + 1]
            pred = head(e, f)[:, -1:]
            for i in range(2, level + 1):
                f, e = torch.cat([f, pred], 1), torch.cat([e, embeds[:, base + i - 1: base + i]], 1)
                pred = head(e, f)[:, -1:]
            assert torch.allclose(outs[level - 1][:, t], pred[:, 0], atol=1e-10), (level, t)


def test_a_head_started_from_the_target_layer_computes_that_layer():
    """With the input projection passing the feature through, a head initialised from the
    target's last layer maps a sequence of features exactly as that layer does."""
    from specplay.core.heads.eagle import init_from_target_layer
    from specplay.core.models.layers import layer_forward

    native = native_from_hf(tiny_hf_model(seed=3), dtype=torch.float32)
    cfg = head_config(native.cfg)
    head = EagleHead(cfg)
    layer = native.layers[-1]
    init_from_target_layer(head, layer)
    feats = torch.randn(1, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    got = head(torch.randn(1, 7, cfg.hidden_size), feats)
    kv = torch.zeros(2, cfg.num_kv_heads, 7, cfg.head_dim)
    cos, sin = native.rope(torch.arange(7))  # the target computes in float32
    want = layer_forward(cfg, layer, feats[0], cos, sin, kv, 0, torch.ones(7, 7, dtype=torch.bool).tril()[None, None])
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


def test_auto_size_keeps_what_the_run_bears_out(target, knowing_head, tmp_path, monkeypatch):
    """The kept tree is sized by the head's confidence as the run's verdicts calibrate it: a random
    head's confident guesses, never accepted, shrink to one node; a head that knows the answer keeps
    a tree. The curve is pinned (5% a verified node), and a grown level costs nothing."""
    from specplay.core.decoding.costmodel import CostCurve

    def kept(head):
        method = build_method("eagle", EagleConfig(head=str(head), tree="dynamic", depth=4, top_k=3), target)
        method.cost = CostCurve.linear(0.05)
        monkeypatch.setattr(method, "level_cost", lambda: 0.0)
        gen = GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)
        return [(e.num_drafted, e.internals.get("calibration")) for e in
                generate(target.model, target.tokenizer, method, PROMPT, gen) if e.num_drafted]

    wrong = kept(make_head_file(tmp_path / "random.safetensors", target.model, scale=2.0))
    right = kept(knowing_head[1])
    assert wrong[0] == (3, 0.5) and right[0][1] == 0.5  # the first step: half the head's word
    assert {n for n, _ in wrong[5:]} == {1} and wrong[-1][1] < 0.2
    # The knowing head's first tree is small too, and from its first verdict on it keeps a tree.
    assert min(n for n, _ in right[1:]) > 2 and len(right) < len(wrong) / 2


def test_a_head_too_doubted_to_draft_is_judged_by_its_looks(target, knowing_head, monkeypatch):
    """A look whose nodes cannot pay still says whether the head's likeliest token was the target's: on a
    curve where a node pays only above a 0.6 chance, the run's prior (half the head's word) keeps every
    node of a head that knows the answer, confident as it is, below that; its looks' verdicts bring the
    calibration up and the run drafts (it looked for all 40 steps and never drafted before)."""
    from specplay.core.decoding.costmodel import CostCurve

    method = build_method("eagle", EagleConfig(head=str(knowing_head[1]), tree="dynamic", depth=3, top_k=2), target)
    method.cost = CostCurve.linear(0.6)
    monkeypatch.setattr(method, "level_cost", lambda: 0.0)
    gen = GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)
    events = list(generate(target.model, target.tokenizer, method, PROMPT, gen))
    first = next(e for e in events if "calibration" in e.internals)
    assert first.num_drafted == 0 and first.internals["calibration"] == 0.5
    drafted = [e for e in events if e.num_drafted]
    assert len(drafted) > 10 and sum(e.num_accepted for e in drafted) > 0.8 * sum(e.num_drafted for e in drafted)
    assert [t for e in events for t in e.committed] == list(knowing_head[0][:40])
