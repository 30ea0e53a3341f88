"""Medusa: trees, exactness with trained heads, training, and bad heads files."""

import json

import pytest
import torch

from specplay.core.decoding.engine import drain, generate
from specplay.core.errors import Cancelled, ConfigError, ModelError
from specplay.core.heads import load_heads, save_heads
from specplay.core.methods import build_method
from specplay.core.heads import MedusaHeads
from specplay.core.methods.medusa import MedusaConfig
from specplay.core.training.common import TrainSettings
from specplay.core.training.medusa import MedusaObjective, train_medusa
from specplay.core.decoding.tree import TreeSpec, ancestor_mask, choose_tree, path_to
from specplay.core.decoding.types import GenerationConfig, SamplingConfig
from tiny import (assert_drafts_accepted, greedy_continuations, loaded, native_from_hf, sgd_steps_lower,
                  target_features, tiny_hf_model)

PROMPT = [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7]
ACC = [[0.6, 0.15, 0.05, 0.03], [0.4, 0.12, 0.05, 0.02], [0.3, 0.1, 0.04, 0.02], [0.2, 0.08, 0.03, 0.01]]


def make_heads_file(path, hidden=32, vocab=64, num_heads=4, seed=0, scale=0.3):
    torch.manual_seed(seed)
    heads = MedusaHeads(hidden, num_heads)
    for b in heads.blocks:
        torch.nn.init.normal_(b.linear.weight, std=scale)
    tensors = {k: v for k, v in heads.state_dict().items()}
    tensors["vocab_ids"] = torch.arange(vocab)
    save_heads(path, tensors, {"kind": "medusa", "target": "tiny", "hidden_size": hidden, "vocab_size": vocab,
                               "num_heads": num_heads, "accuracy": ACC})
    return path


@pytest.fixture(scope="module")
def target():
    return loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def knowing_heads(target, tmp_path_factory):
    """PROMPT's greedy answer (50 tokens), and four heads trained briefly on it (a second answer
    held out): their drafts are mostly accepted there. The manifest's accuracy is ACC, not the
    held-out accuracy training measures, which would rightly size "auto" a one-node tree."""
    model = target.model
    answers = greedy_continuations(target, [PROMPT, PROMPT[::-1]], 50)
    heads, _, _ = train_medusa(target_features(model, answers), model.lm_head_weight(), torch.arange(64), 64, 4,
                               TrainSettings(steps=300, batch_size=64, lr=3e-3, eval_every=300, warmup=10))
    tensors = dict(heads.state_dict())
    tensors["vocab_ids"] = torch.arange(64)
    path = tmp_path_factory.mktemp("medusa") / "knowing.safetensors"
    save_heads(path, tensors, {"kind": "medusa", "target": "tiny", "hidden_size": 32, "vocab_size": 64,
                               "num_heads": 4, "accuracy": ACC})
    return answers[0][len(PROMPT):], path


# ------------------------------------------------------------------------------ trees
def test_tree_spec_mask_and_retrieve_match_brute_force():
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (2, 3)]
    spec = TreeSpec.from_paths(paths)
    assert len(spec) == len(paths)
    for i, p in enumerate(spec.paths):
        # Brute force: node j is visible from node i iff j's path is a prefix of i's path.
        for j, q in enumerate(spec.paths):
            assert bool(spec.mask[i + 1, j + 1]) == (p[:len(q)] == q)
        assert spec.mask[i + 1, 0]
        assert spec.depth_of[i] == len(p) and spec.ranks[i] == p[-1]
        assert [spec.paths[k] for k in path_to(spec.parents, i)] == [p[:d] for d in range(1, len(p) + 1)]
    leaves = {p for p in spec.paths if not any(q[:-1] == p for q in spec.paths)}
    got = {spec.paths[int(row[row >= 0][-1])] for row in spec.retrieve}
    assert got == leaves
    for row in spec.retrieve:
        nodes = [int(x) for x in row if x >= 0]
        assert [spec.paths[n] for n in nodes] == [spec.paths[nodes[-1]][:d] for d in range(1, len(nodes) + 1)]
    assert torch.equal(spec.mask, ancestor_mask(spec.parents))


def test_tree_spec_rejects_orphans():
    with pytest.raises(ValueError, match="no parent"):
        TreeSpec.from_paths([(0,), (1, 0)])


def test_choose_tree_takes_the_most_probable_paths():
    # Path values: (0,) .6, (0,0) .24, (1,) .15, (0,0,0) .072, (0,1) .072, (1,0) .06, (2,) .05, ...
    tree = choose_tree(ACC, 6)
    assert set(tree) == {(0,), (0, 0), (1,), (0, 0, 0), (0, 1), (1, 0)}
    assert all(len(p) == 1 or p[:-1] in tree for p in tree)  # closed under parents
    assert set(tree) <= set(choose_tree(ACC, 20))


# ------------------------------------------------------------------------------ method
@pytest.mark.parametrize("tree", ["auto", "dynamic", "chain", "small", "large"])
def test_medusa_greedy_equals_autoregressive(target, knowing_heads, tree):
    answer, heads = knowing_heads
    gen = GenerationConfig(max_new_tokens=50, stop_at_eos=False, stand_down=False)
    method = build_method("medusa", MedusaConfig(heads=str(heads), tree=tree), target)
    res = drain(generate(target.model, target.tokenizer, method, PROMPT, gen))
    assert res.token_ids == answer
    assert target.model.cache_len == len(PROMPT) + 50 - 1
    assert any(e.tree for e in res.events)
    assert_drafts_accepted(res, 1.5)


def test_medusa_with_heads_that_know_the_answer_accepts_deep(target, tmp_path):
    """Heads trained briefly on the target's own outputs accept more than one token per step.

    The tree is named: "auto" sizes it from held-out accuracy, which is near zero for heads
    fitted to twelve toy sequences, so it would rightly pick a one-node tree here."""
    model = target.model
    seqs = []
    for s in range(12):
        prompt = [(7 * s + i) % 60 + 3 for i in range(6)]
        r = drain(generate(model, target.tokenizer, build_method("autoregressive", None, target), prompt,
                           GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)))
        seqs.append(prompt + r.token_ids)
    data = target_features(model, seqs)
    heads, acc, _ = train_medusa(data, model.lm_head_weight(), torch.arange(64), 64, 3,
                                 TrainSettings(steps=300, batch_size=64, lr=3e-3, eval_every=300, warmup=10))
    path = tmp_path / "trained.safetensors"
    tensors = dict(heads.state_dict())
    tensors["vocab_ids"] = torch.arange(64)
    save_heads(path, tensors, {"kind": "medusa", "target": "tiny", "hidden_size": 32, "vocab_size": 64,
                               "num_heads": 3, "accuracy": acc})
    gen = GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)
    res = drain(generate(model, target.tokenizer, build_method("medusa", MedusaConfig(heads=str(path), tree="large"), target),
                         seqs[0][:6], gen))
    assert res.token_ids == seqs[0][6:]
    assert res.metrics.mean_accepted > 1.5


def test_a_training_step_lowers_the_loss(target):
    model = target.model
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 64, (30,), generator=g).tolist() for _ in range(4)]
    data = target_features(model, seqs)
    heads = MedusaHeads(32, 2)
    obj = MedusaObjective(heads, data, model.lm_head_weight().float(), torch.arange(64), 64)
    pos = torch.arange(0, data.num_tokens)
    assert sgd_steps_lower(lambda: obj.loss(pos), heads.parameters(), lr=0.5)


def test_medusa_sampling_is_lossless(tmp_path):
    from test_distribution import assert_samples_the_target

    model = tiny_hf_model(seed=11, vocab=8, dtype=torch.float64)
    t = loaded(native_from_hf(model))
    heads = make_heads_file(tmp_path / "h8.safetensors", vocab=8, num_heads=3)
    method = build_method("medusa", MedusaConfig(heads=str(heads), tree="large"), t)
    assert_samples_the_target(t, method, native_from_hf(model))


def test_typical_acceptance_is_labelled_lossy(target, tmp_path):
    heads = make_heads_file(tmp_path / "heads.safetensors")
    method = build_method("medusa", MedusaConfig(heads=str(heads), typical=True), target)
    assert method.lossy
    gen = GenerationConfig(max_new_tokens=20, stop_at_eos=False, stand_down=False, sampling=SamplingConfig(temperature=0.7, seed=1))
    res = drain(generate(target.model, target.tokenizer, method, PROMPT, gen))
    assert res.lossy and len(res.token_ids) == 20


# ------------------------------------------------------------------------------ bad files
def test_heads_for_another_model_or_corrupt_files_are_clear_errors(target, tmp_path):
    wrong_hidden = make_heads_file(tmp_path / "h.safetensors", hidden=48)
    with pytest.raises(ModelError, match="hidden size 48"):
        build_method("medusa", MedusaConfig(heads=str(wrong_hidden)), target)
    wrong_vocab = make_heads_file(tmp_path / "v.safetensors", vocab=100)
    with pytest.raises(ModelError, match="100-token vocabulary"):
        build_method("medusa", MedusaConfig(heads=str(wrong_vocab)), target)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(make_heads_file(tmp_path / "ok.safetensors").read_bytes()[:200])
    with pytest.raises(ModelError, match="not a readable heads file"):
        build_method("medusa", MedusaConfig(heads=str(corrupt)), target)
    with pytest.raises(ModelError, match="not found"):
        build_method("medusa", MedusaConfig(heads=str(tmp_path / "missing.safetensors")), target)


def test_bad_tree_files_are_clear_errors(target, tmp_path):
    heads = make_heads_file(tmp_path / "heads.safetensors")
    bad = tmp_path / "tree.json"
    bad.write_text("[[0], [1, 0, 0]]")
    with pytest.raises(ConfigError, match="not a valid tree"):
        build_method("medusa", MedusaConfig(heads=str(heads), tree=str(bad)), target)
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps([[0] * d for d in range(1, 7)]))
    with pytest.raises(ConfigError, match="6 deep"):
        build_method("medusa", MedusaConfig(heads=str(heads), tree=str(deep)), target)
    with pytest.raises(ConfigError, match="unknown tree"):
        build_method("medusa", MedusaConfig(heads=str(heads), tree="bushy"), target)


def test_cancelled_training_resumes_where_it_stopped(target, tmp_path):
    """A resumed run continues from the checkpoint (same batches, same weights as an
    uninterrupted run) and counts the seconds of the interrupted session."""
    model = target.model
    g = torch.Generator().manual_seed(1)
    data = target_features(model, [torch.randint(3, 64, (30,), generator=g).tolist() for _ in range(6)])
    settings = TrainSettings(steps=12, batch_size=16, lr=3e-3, eval_every=12, warmup=2, checkpoint_every=4)
    args = (data, model.lm_head_weight(), torch.arange(64), 64, 2, settings)
    straight, _, _ = train_medusa(*args)

    seen = []
    with pytest.raises(Cancelled, match="cancelled at step 5"):
        train_medusa(*args, workdir=tmp_path, progress=seen.append, should_cancel=lambda: len(seen) == 5)
    interrupted = seen[-1].elapsed_s
    seen.clear()
    resumed, _, steps = train_medusa(*args, workdir=tmp_path, progress=seen.append, resume=True)
    assert steps == 12 and [p.step for p in seen] == list(range(6, 13))
    assert seen[0].elapsed_s > interrupted
    for name, tensor in straight.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name


def test_heads_files_store_matrices_in_int8_with_row_scales(tmp_path):
    """Matrices are stored as int8 plus a per-row scale (half the bytes of float16); loading
    restores them to within half a quantisation step of each row, vectors exactly as float16."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different scale
    bias = torch.randn(48, generator=g)
    path = tmp_path / "h.safetensors"
    save_heads(path, {"w": w, "b": bias, "vocab_ids": torch.arange(5)},
               {"kind": "medusa", "target": "tiny", "hidden_size": 32, "vocab_size": 64})
    info = type("Info", (), {"hidden_size": 32, "vocab_size": 64, "name": "tiny"})
    loaded_tensors, _ = load_heads(path, "medusa", type("T", (), {"info": info})())
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((loaded_tensors["w"] - w).abs() <= step * 0.5 + step * 1e-3).all()
    assert torch.equal(loaded_tensors["b"], bias.half().float())
    assert torch.equal(loaded_tensors["vocab_ids"], torch.arange(5))
    assert set(loaded_tensors) == {"w", "b", "vocab_ids"}


def test_top_k_limits_the_candidates_each_head_contributes_to_the_tree(target, tmp_path):
    heads = make_heads_file(tmp_path / "heads.safetensors")
    wide = build_method("medusa", MedusaConfig(heads=str(heads), tree="large"), target).tree
    narrow = build_method("medusa", MedusaConfig(heads=str(heads), tree="large", top_k=2), target).tree
    assert max(wide.ranks) >= 2
    assert max(narrow.ranks) == 1 and len(narrow) < len(wide)


def test_draft_vocabulary_coverage_is_measured_on_held_out_sequences(target, tmp_path, monkeypatch):
    """Held-out labels half of which never occur in training: the manifest must not claim 100%."""
    import specplay.core.training.recipes as recipes
    from specplay.core.training.common import split_sequences
    from specplay.core.training.data import DataSettings
    from specplay.core.training.recipes import train_heads

    model = target.model
    g = torch.Generator().manual_seed(0)
    data = target_features(model, [torch.randint(3, 64, (24,), generator=g).tolist() for _ in range(10)])
    settings = TrainSettings(steps=1, batch_size=8, eval_every=1, warmup=1, eval_fraction=0.2)
    train_pos, eval_pos = split_sequences(data, settings.eval_fraction)
    data.labels[train_pos] = torch.randint(3, 30, (train_pos.numel(),), generator=g)
    data.labels[eval_pos] = torch.where(torch.arange(eval_pos.numel()) % 2 == 0, 10, 50)  # 50: never trained on
    monkeypatch.setattr(recipes, "prepare_data", lambda *a: (data, {}))
    monkeypatch.setattr(recipes, "target_key", lambda *a: "tiny")  # the tiny target is in memory, not a folder

    _, manifest = train_heads("medusa", target, DataSettings(), settings, num_heads=2, workdir=tmp_path,
                              out=tmp_path / "heads.safetensors")
    assert manifest["draft_vocab_coverage"] == pytest.approx(0.5)


def test_resume_continues_only_a_checkpoint_of_the_same_target(target, tmp_path, monkeypatch, caplog):
    """Two targets training in one work folder: --resume does not continue the other target's
    checkpoint (it starts from step 0, with a warning), and does continue its own."""
    import specplay.core.training.recipes as recipes
    from specplay.core.training.data import DataSettings
    from specplay.core.training.recipes import train_heads

    g = torch.Generator().manual_seed(0)
    data = target_features(target.model, [torch.randint(3, 64, (24,), generator=g).tolist() for _ in range(10)])
    monkeypatch.setattr(recipes, "prepare_data", lambda *a: (data, {}))
    settings = TrainSettings(steps=6, batch_size=8, eval_every=6, warmup=1, checkpoint_every=1)
    seen = []

    def steps_trained(key, **kw):
        seen.clear()
        monkeypatch.setattr(recipes, "target_key", lambda *a: key)
        train_heads("medusa", target, DataSettings(), settings, num_heads=2, workdir=tmp_path,
                    out=tmp_path / f"{key}.safetensors", resume=True, on_step=seen.append, **kw)
        return [p.step for p in seen]

    with pytest.raises(Cancelled):
        steps_trained("target-a", should_cancel=lambda: len(seen) == 3)
    with pytest.raises(Cancelled):
        steps_trained("target-b", should_cancel=lambda: len(seen) == 2)
    assert [p.step for p in seen] == [1, 2]
    assert "made with another target" in caplog.text
    assert steps_trained("target-b") == [3, 4, 5, 6]


def test_the_dynamic_tree_follows_the_heads_confidence_and_the_verify_cost(target, tmp_path):
    """Each step's tree goes deep where the heads are sure and wide where they are not, and holds
    only as many nodes as pay for their verification: one node when verifying is dear."""
    from specplay.core.decoding.costmodel import CostCurve

    heads = make_heads_file(tmp_path / "heads.safetensors")
    method = build_method("medusa", MedusaConfig(heads=str(heads), tree="dynamic"), target)
    vocab = method.vocab_ids.numel()

    def probs(*tops):  # one row per head: the top token gets p, the runner-up what is left
        rows = torch.zeros(len(tops), vocab)
        for d, p in enumerate(tops):
            rows[d, d + 1], rows[d, d + 10] = p, 1 - p
        return rows

    method.cost = CostCurve.linear(0.02)
    sure = method._dynamic(probs(0.99, 0.98, 0.97))
    assert sure.parents == [-1, 0, 1]  # the chain of top-1 candidates; runner-ups at 1-2% do not pay
    assert sure.tokens == [int(method.vocab_ids[i]) for i in (1, 2, 3)]
    unsure = method._dynamic(probs(0.5, 0.5, 0.5))
    assert unsure.parents[:2] == [-1, -1]  # both candidates at depth 1, then both under each
    assert unsure.tokens[:2] == [int(method.vocab_ids[i]) for i in (1, 10)]
    method.cost = CostCurve.linear(10.0)
    assert len(method._dynamic(probs(0.99, 0.98, 0.97)).tokens) == 1


def test_the_auto_tree_keeps_what_the_run_bears_out(target, knowing_heads, tmp_path):
    """Sized each step by the manifest's accuracies as the run's verdicts calibrate them: heads that
    are never right shrink to one node within a few steps; heads that know the answer keep a tree.
    (Both manifests claim the same accuracies; the curve is pinned, 5% a verified node.)"""
    from specplay.core.decoding.costmodel import CostCurve

    def nodes(heads):
        method = build_method("medusa", MedusaConfig(heads=str(heads), tree="auto"), target)
        method.cost = CostCurve.linear(0.05)
        gen = GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)
        return [e.num_drafted for e in generate(target.model, target.tokenizer, method, PROMPT, gen)]

    wrong, right = nodes(make_heads_file(tmp_path / "random.safetensors")), nodes(knowing_heads[1])
    assert wrong[0] == right[0] > 2  # the first step: the manifest's word alone
    assert set(wrong[5:20]) == {1}
    assert min(right[1:8]) > 1
