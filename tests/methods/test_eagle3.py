"""EAGLE-3 heads: shapes, training, the training step equal to the drafting step, exactness, τ_sim."""

import statistics

import pytest
import torch

from specplay.core.decoding.engine import drain, generate
from specplay.core.errors import ModelError
from specplay.core.heads import head_config, load_heads, save_heads
from specplay.core.heads.eagle3 import Eagle3Head
from specplay.core.methods import build_method
from specplay.core.methods.eagle import EagleConfig
from specplay.core.models.base import ForwardOutput
from specplay.core.training.eagle import Eagle3Objective
from specplay.core.training.tau import accepted_length, answer_roots, eagle_tau, standard_error
from specplay.core.training.teacher import TeacherSet, read_teacher
from specplay.core.decoding.types import GenerationConfig
from tiny import assert_drafts_accepted, greedy_continuations, loaded, native_from_hf, sgd_steps_lower, tiny_hf_model

PROMPT = [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7]
LAYERS = (0, 1, 2)  # the tiny target has three layers here: all of them are fused


def teacher_set(model, sequences, prompt_lens=None, layers=LAYERS) -> TeacherSet:
    """The target's view of ``sequences``, kept in its own precision (float64) so that replays match runs."""
    rows = [read_teacher(model, s, layers, top_k=4, dtype=torch.float64) for s in sequences]
    return TeacherSet(**{k: torch.cat([r[k] for r in rows]) for k in rows[0]},
                      starts=torch.tensor([0] + [len(s) for s in sequences]).cumsum(0),
                      prompt_lens=torch.tensor(prompt_lens or [0] * len(sequences)))


def random_head(cfg, seed=0, scale=0.2) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(head_config(cfg, 48))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * scale)
    return head


def save_head(path, head, native, layers=LAYERS):
    tensors = dict(head.state_dict())
    tensors["vocab_ids"] = torch.arange(native.info.vocab_size)
    save_heads(path, tensors, {"kind": "eagle", "recipe": "eagle3", "target": "tiny", "layers": list(layers),
                               "hidden_size": native.info.hidden_size, "vocab_size": native.info.vocab_size,
                               "intermediate_size": head.cfg.intermediate_size})
    return path


@pytest.fixture(scope="module")
def target():
    return loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64, layers=3)))


@pytest.fixture(scope="module")
def knowing_head(target, tmp_path_factory):
    """PROMPT's greedy answer (50 tokens), and a head trained briefly on it (a second answer held
    out): its drafts are mostly accepted there."""
    from specplay.core.training.common import TrainSettings
    from specplay.core.training.eagle import train_eagle3

    model = target.model
    answers = greedy_continuations(target, [PROMPT, PROMPT[::-1]], 50)
    data = teacher_set(model, [a[:-1] for a in answers], prompt_lens=[len(PROMPT)] * 2)
    head = Eagle3Head(head_config(model.cfg, 48))
    train_eagle3(data, head, model.embed, model.lm_head_weight(), torch.arange(64), 64,
                 TrainSettings(steps=300, batch_size=8, lr=3e-3, eval_every=300, warmup=10), window=32, depth=2)
    return answers[0][len(PROMPT):], save_head(tmp_path_factory.mktemp("eagle3") / "knowing.safetensors", head, model)


def _run(target, name, config=None, n=50, prompt=PROMPT):
    gen = GenerationConfig(max_new_tokens=n, stop_at_eos=False, stand_down=False)  # every step drafts
    return drain(generate(target.model, target.tokenizer, build_method(name, config, target), prompt, gen))


def test_shapes(target):
    cfg = target.model.cfg
    head = Eagle3Head(head_config(cfg, 48))
    layers, embeds = torch.randn(2, 9, 3, 32), torch.randn(2, 9, 32)
    feats = head.fused(layers)
    assert feats.shape == (2, 9, 32)
    torch.testing.assert_close(feats, layers[:, :, -1])  # it starts by passing the highest layer through
    states = head.unrolled(embeds, feats, 4)
    assert len(states) == 4 and all(s.shape == (2, 9, 32) for s in states)
    assert head.logits(states[0], torch.randn(20, 32)).shape == (2, 9, 20)


def test_a_head_started_from_the_target_predicts_as_the_target_does():
    """Started from the target's last layer and final norm, the head reads the high layer (the
    last layer's input) and computes the target's own logits: training starts from the target."""
    from specplay.core.training.teacher import default_layers

    native = native_from_hf(tiny_hf_model(seed=3, layers=3), dtype=torch.float32)
    layers = default_layers(3)
    assert layers[-1] == 1
    head = Eagle3Head(head_config(native.cfg))
    head.init_from_target(native)
    seq = [4, 9, 12, 3, 30, 7, 7, 21]
    native.reset()
    out = native.forward(torch.tensor(seq), layers=layers)
    native.reset()
    fused = head.fused(torch.stack([out.layers[i] for i in layers], 1)[None])
    logits = head.logits(head(torch.randn(1, 8, 32), fused), native.lm_head_weight())
    torch.testing.assert_close(logits[0], out.logits, rtol=1e-4, atol=1e-4)


def test_a_short_training_run_lowers_the_loss(target):
    model = target.model
    g = torch.Generator().manual_seed(0)
    data = teacher_set(model, [torch.randint(3, 64, (40,), generator=g).tolist() for _ in range(4)])
    head = Eagle3Head(head_config(model.cfg, 48))
    for teacher_weight in (1.0, 0.5):
        obj = Eagle3Objective(head, data, model.embed, model.lm_head_weight().float(), torch.arange(64), 64,
                              window=16, depth=3, teacher_weight=teacher_weight)
        starts = obj.window_starts[:8]
        assert sgd_steps_lower(lambda: obj.loss(starts), head.parameters(), lr=0.05)
    acc = obj.accuracy(starts)
    assert len(acc["top1_by_level"]) == 3 and acc["top1_by_level"][0] == acc["top1"]


def test_the_drafting_step_equals_the_unrolled_training_step(target, tmp_path):
    """What the method computes when it drafts (its drafter, the target's layers fused as they
    arrive, its own states fed back one level at a time) is what training computes for the same
    level: the unrolled pass over the same true tokens."""
    model = target.model
    seq = PROMPT + _run(target, "autoregressive", n=20).token_ids
    data = teacher_set(model, [seq])
    path = save_head(tmp_path / "e3.safetensors", random_head(model.cfg), model)
    tensors, _ = load_heads(path, "eagle", model)
    head = Eagle3Head(head_config(model.cfg, 48))  # the weights the file holds, as the method reads them
    head.load_state_dict({k: v for k, v in tensors.items() if k != "vocab_ids"})
    method = build_method("eagle", EagleConfig(head=str(path)), target)
    embeds = model.embed(torch.tensor(seq[1:])).float()[None]
    dtype = method.fuse.weight.dtype  # bfloat16 where the CPU multiplies it natively, as training's autocast does
    head.fuse.to(dtype)
    levels = head.unrolled(embeds, head.fused(data.layers[:-1].to(dtype)).float()[None], 3)
    assert method.feature_layers == LAYERS

    d = method.drafter
    for base in (5, 12, 20):  # true pairs (f_i, x_{i+1}) for i < base, then the head's own states
        d.crop(0)
        fused = method._features_of(ForwardOutput(logits=torch.zeros(0),
                                                  layers={i: data.layers[:, n] for n, i in enumerate(LAYERS)}))
        state = d.run(fused[:base], seq[1:base + 1], torch.arange(base))[-1]
        for j in range(3):  # level j + 1 at position base - 1 + j
            t = base - 1 + j
            torch.testing.assert_close(state, levels[j][0, t], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(method._log_probs(state[None])[0],
                                       torch.log_softmax(head.logits(levels[j][0, t], method.lm_rows.weight.float()), -1),
                                       rtol=1e-4, atol=1e-4)
            state = d.run(state[None], [seq[t + 2]], torch.tensor([t + 1]))[0]


@pytest.mark.parametrize("cfg", [EagleConfig(tree="chain", depth=1), EagleConfig(tree="chain", depth=6),
                                 EagleConfig(tree="dynamic"), EagleConfig(tree="dynamic", depth=3, top_k=2,
                                                                         total_tokens=5),
                                 EagleConfig(tree="dynamic", depth=8, top_k=6, total_tokens=60)])
def test_eagle3_greedy_equals_autoregressive(target, knowing_head, cfg, monkeypatch):
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.costmodel import CostCurve

    # The auto-sized trees on a pinned curve (5% a node), not one timed on the machine the test runs on:
    # where no node pays, a step keeps none.
    monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve.linear(0.05))
    answer, path = knowing_head
    res = _run(target, "eagle", EagleConfig(**{**cfg.to_dict(), "head": str(path)}))
    assert res.token_ids == answer
    assert all(e.num_drafted for e in res.events[:-1])  # every step drafted (the last has no budget left)
    assert_drafts_accepted(res, 1.5)


def test_a_trained_eagle3_head_accepts_several_tokens_a_step_exactly(target, tmp_path):
    from specplay.core.training.common import TrainSettings
    from specplay.core.training.eagle import train_eagle3

    model = target.model
    seqs = []
    for s in range(16):
        prompt = [(5 * s + i) % 60 + 3 for i in range(6)]
        seqs.append(prompt + _run(target, "autoregressive", n=40, prompt=prompt).token_ids)
    data = teacher_set(model, [q[:-1] for q in seqs], prompt_lens=[6] * 16)
    head = Eagle3Head(head_config(model.cfg, 64))
    acc, _ = train_eagle3(data, head, model.embed, model.lm_head_weight(), torch.arange(64), 64,
                          TrainSettings(steps=300, batch_size=8, lr=3e-3, eval_every=300, warmup=10), window=32, depth=2)
    assert acc["top1"] > 0.3
    path = save_head(tmp_path / "trained.safetensors", head, model)
    for cfg in (EagleConfig(head=str(path), tree="chain"), EagleConfig(head=str(path))):
        res = _run(target, "eagle", cfg, n=40, prompt=seqs[0][:6])
        assert res.token_ids == seqs[0][6:]
        assert res.metrics.mean_accepted > 1.5


def test_eagle3_sampling_is_lossless(tmp_path):
    from test_distribution import assert_samples_the_target

    model = tiny_hf_model(seed=11, vocab=8, dtype=torch.float64, layers=3)
    t = loaded(native_from_hf(model))
    head = random_head(t.model.cfg)
    with torch.no_grad():
        head.out_norm.mul_(4)  # confident drafts, so that trees grow deep enough to test deep verification
    path = save_head(tmp_path / "h8.safetensors", head, t.model)
    # The tree at its full size, as the classic head's sampling test has it: sized by this machine's
    # timed curve and levels, its shape (and so its depth and samples) depended on the machine's load.
    method = build_method("eagle", EagleConfig(head=str(path), tree="dynamic", depth=3, top_k=2, total_tokens=6,
                                               auto_size=False), t)
    assert_samples_the_target(t, method, native_from_hf(model))


def test_an_eagle3_file_without_its_layers_is_a_clear_error(target, tmp_path):
    path = save_head(tmp_path / "bad.safetensors", random_head(target.model.cfg), target.model, layers=(0, 7, 2))
    with pytest.raises(ModelError, match="layers it fuses"):
        build_method("eagle", EagleConfig(head=str(path)), target)


def test_accepted_length_is_the_longest_matching_path():
    # root -> a(0) -> c(2) ; root -> b(1) -> d(3) -> e(4)
    parents, tokens = [-1, -1, 0, 1, 3], [10, 11, 12, 13, 14]
    assert accepted_length(parents, tokens, [11, 13, 14]) == 3
    assert accepted_length(parents, tokens, [11, 13, 99]) == 2
    assert accepted_length(parents, tokens, [10, 13, 14]) == 1  # 13 is not under 10
    assert accepted_length(parents, tokens, [99, 12]) == 0
    assert accepted_length(parents, tokens, [11]) == 1  # the answer ends


def test_tau_sim_replays_what_decoding_accepts(target, tmp_path):
    """At each step of a real greedy run with a fixed-size dynamic tree, the tokens accepted are
    what τ_sim computes at that root from the target's teacher-forced features."""
    model = target.model
    head = random_head(model.cfg, seed=1, scale=0.1)
    path = save_head(tmp_path / "e3.safetensors", head, model)
    tensors, _ = load_heads(path, "eagle", model)
    head.load_state_dict({k: v for k, v in tensors.items() if k != "vocab_ids"})
    cfg = EagleConfig(head=str(path), tree="dynamic", depth=4, top_k=3, total_tokens=10, auto_size=False)
    run = _run(target, "eagle", cfg, n=60)
    seq = PROMPT + run.token_ids
    data = teacher_set(model, [seq[:-1]], prompt_lens=[len(PROMPT)])
    roots, accepted, r = [], [], len(PROMPT) - 1  # the first step's root is the prompt's last token
    for e in run.events:
        if r >= len(PROMPT) and r + 4 < len(seq) - 1:  # past the prompt, with the whole tree's depth left
            roots.append(r)
            accepted.append(1 + e.num_accepted)
        r += len(e.committed)
    assert len(roots) > 5 and max(accepted) > 1
    sim = eagle_tau(head, data, model.embed, model.lm_head_weight(), torch.arange(64), roots=torch.tensor(roots),
                    depth=4, top_k=3, total_tokens=10)
    assert sim["per_root"] == accepted
    assert sim["tau_sim"] == pytest.approx(sum(accepted) / len(accepted))
    assert sim["tau_sim_se"] == pytest.approx(statistics.stdev(accepted) / len(accepted) ** 0.5)


def test_the_standard_error_of_tau_sim_is_its_roots_spread_over_their_count():
    assert standard_error([1, 2, 3, 4]) == pytest.approx(1.2909944 / 2)  # sample deviation over sqrt(4)
    assert standard_error([2, 2, 2]) == 0.0
    assert standard_error([3]) is None and standard_error([]) is None  # one root says nothing of the spread


def test_answer_roots_are_drawn_from_answers_only():
    data = TeacherSet(tokens=torch.zeros(30, dtype=torch.int32), labels=torch.zeros(30, dtype=torch.int32),
                      final=torch.zeros(30, 4), layers=torch.zeros(30, 3, 4), top_ids=torch.zeros(30, 2),
                      top_logp=torch.zeros(30, 2), starts=torch.tensor([0, 10, 30]), prompt_lens=torch.tensor([6, 15]))
    roots = answer_roots(data, 100)
    assert roots.tolist() == [6, 7, 8] + list(range(25, 29))

