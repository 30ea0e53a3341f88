"""Hydra heads (Medusa heads that read the tokens drafted before theirs): shapes, training,
drafting equal to training, exactness beside the classic heads, τ_sim."""

import pytest
import torch

from specplay.core.decoding.engine import drain, generate
from specplay.core.errors import ConfigError
from specplay.core.heads import load_heads, save_heads
from specplay.core.heads.hydra import HydraHeads
from specplay.core.methods import build_method
from specplay.core.methods.medusa import MedusaConfig
from specplay.core.training.common import TrainSettings
from specplay.core.training.medusa import HydraObjective, train_hydra
from specplay.core.training.tau import medusa_tau
from specplay.core.decoding.tree import TreeSpec
from specplay.core.decoding.types import GenerationConfig
from test_eagle3 import teacher_set
from test_medusa import ACC
from tiny import assert_drafts_accepted, greedy_continuations, loaded, native_from_hf, sgd_steps_lower, tiny_hf_model

PROMPT = [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7]


def random_heads(num_heads=4, seed=0, scale=0.3) -> HydraHeads:
    torch.manual_seed(seed)
    heads = HydraHeads(32, num_heads)
    for b in heads.blocks:
        torch.nn.init.normal_(b.weight, std=scale)
    return heads


def save_hydra(path, heads, accuracy=ACC):
    tensors = dict(heads.state_dict())
    tensors["vocab_ids"] = torch.arange(64)
    save_heads(path, tensors, {"kind": "medusa", "recipe": "hydra", "target": "tiny", "hidden_size": 32,
                               "vocab_size": 64, "num_heads": len(heads.blocks), "accuracy": accuracy})
    return path


@pytest.fixture(scope="module")
def target():
    return loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def knowing_heads(target, tmp_path_factory):
    """PROMPT's greedy answer (50 tokens), and four Hydra heads trained briefly on it (a second
    answer held out): their drafts are mostly accepted there."""
    model = target.model
    answers = greedy_continuations(target, [PROMPT, PROMPT[::-1]], 50)
    data = teacher_set(model, [a[:-1] for a in answers], prompt_lens=[len(PROMPT)] * 2, layers=())
    heads, _, _ = train_hydra(data, model.embed, model.lm_head_weight(), torch.arange(64), 64, 4,
                              TrainSettings(steps=300, batch_size=64, lr=3e-3, eval_every=300, warmup=10))
    return answers[0][len(PROMPT):], save_hydra(tmp_path_factory.mktemp("hydra") / "knowing.safetensors", heads)


def _run(target, name, config=None, n=50, prompt=PROMPT):
    gen = GenerationConfig(max_new_tokens=n, stop_at_eos=False, stand_down=False)  # every step drafts
    return drain(generate(target.model, target.tokenizer, build_method(name, config, target), prompt, gen))


def test_shapes_and_a_fresh_head_is_the_lm_head():
    heads = HydraHeads(32, 3)
    hidden, embeds = torch.randn(5, 32), torch.randn(3, 5, 32)
    states = heads(hidden, embeds)
    assert states.shape == (3, 5, 32)
    assert torch.equal(states, hidden.expand(3, 5, 32))  # zero blocks: each head starts as the LM head on h_t


def test_a_short_training_run_lowers_the_loss(target):
    model = target.model
    g = torch.Generator().manual_seed(0)
    data = teacher_set(model, [torch.randint(3, 64, (30,), generator=g).tolist() for _ in range(4)], layers=())
    heads = random_heads(3, scale=0.01)
    pos = torch.arange(data.num_tokens)
    for teacher_weight in (1.0, 0.5):
        obj = HydraObjective(heads, data, model.embed, model.lm_head_weight().float(), torch.arange(64), 64,
                             teacher_weight)
        assert sgd_steps_lower(lambda: obj.loss(pos), heads.parameters(), lr=0.5)


def test_tree_drafting_reads_the_path_as_training_does():
    """A node's candidates come from the head state its path gives in training (teacher forcing
    with the path's tokens), whatever branch of the tree it is on."""
    # float64: the batched tree and the step-by-step replay multiply in other shapes, whose float32
    # rounding differs by more than the comparison allows on some CPUs (an Intel Xeon with AMX).
    heads = random_heads(3, seed=2).double()
    emb_table = torch.randn(64, 32, dtype=torch.float64)
    lm = torch.randn(64, 32, dtype=torch.float64)
    spec = TreeSpec.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 1, 0), (1, 0, 2)])
    hidden, root = torch.randn(2, 32, dtype=torch.float64), torch.tensor([5, 9])
    with torch.no_grad():  # a failed assertion must not leave gradients off for the tests after it
        index, prob = heads.draft_tree(hidden, emb_table[root], spec.parents, spec.ranks, spec.depth_of,
                                       lambda s: s @ lm.T, lambda i: emb_table[i])
        for b in range(2):
            for node, path in enumerate(spec.paths):
                chain = [node]
                while spec.parents[chain[0]] >= 0:
                    chain.insert(0, spec.parents[chain[0]])
                tokens = [int(root[b])] + [int(index[b, n]) for n in chain[:-1]]
                state = hidden[b]
                for k, t in enumerate(tokens):  # teacher forcing along the node's path
                    state = heads.step(k, state, emb_table[t])
                probs = torch.softmax(state @ lm.T, -1)
                want = probs.topk(path[-1] + 1).indices[-1]
                assert int(index[b, node]) == int(want)
                assert float(prob[b, node]) == pytest.approx(float(probs[want]), rel=1e-5)


@pytest.mark.parametrize("tree", ["auto", "chain", "small", "large"])
def test_hydra_greedy_equals_autoregressive(target, knowing_heads, tree):
    answer, path = knowing_heads
    res = _run(target, "medusa", MedusaConfig(heads=str(path), tree=tree))
    assert res.token_ids == answer
    assert any(e.tree for e in res.events)
    assert_drafts_accepted(res, 1.5)


def test_hydra_heads_with_a_dynamic_tree_are_refused(target, tmp_path):
    path = save_hydra(tmp_path / "hydra.safetensors", random_heads())
    with pytest.raises(ConfigError, match="Hydra"):
        build_method("medusa", MedusaConfig(heads=str(path), tree="dynamic"), target)


def test_hydra_sampling_is_lossless(tmp_path):
    from test_distribution import assert_samples_the_target

    model = tiny_hf_model(seed=11, vocab=8, dtype=torch.float64)
    t = loaded(native_from_hf(model))
    heads = random_heads(3)
    tensors = dict(heads.state_dict())
    tensors["vocab_ids"] = torch.arange(8)
    path = tmp_path / "h8.safetensors"
    save_heads(path, tensors, {"kind": "medusa", "recipe": "hydra", "target": "tiny", "hidden_size": 32,
                               "vocab_size": 8, "num_heads": 3, "accuracy": ACC})
    method = build_method("medusa", MedusaConfig(heads=str(path), tree="large"), t)
    assert_samples_the_target(t, method, native_from_hf(model))


def test_trained_hydra_heads_accept_deep_and_tau_sim_replays_decoding(target, tmp_path):
    """Heads trained on the target's own outputs accept several tokens a step, and at each step
    the tokens accepted are what τ_sim computes at that root on the same tree."""
    model = target.model
    seqs = []
    for s in range(12):
        prompt = [(7 * s + i) % 60 + 3 for i in range(6)]
        seqs.append(prompt + _run(target, "autoregressive", n=40, prompt=prompt).token_ids)
    data = teacher_set(model, [q[:-1] for q in seqs], prompt_lens=[6] * 12, layers=())
    heads, result, _ = train_hydra(data, model.embed, model.lm_head_weight(), torch.arange(64), 64, 3,
                                   TrainSettings(steps=300, batch_size=64, lr=3e-3, eval_every=300, warmup=10),
                                   tau_sim=lambda h, acc: medusa_tau(h, acc, data, model.embed,
                                                                      model.lm_head_weight(), torch.arange(64)))
    assert result["tau_sim"] > 1.3 and len(result["per_root"]) == result["tau_sim_roots"]  # untrained: about 1
    path = save_hydra(tmp_path / "trained.safetensors", heads, result["accuracy"])
    tensors, _ = load_heads(path, "medusa", model)
    heads.load_state_dict({k: v for k, v in tensors.items() if k.startswith("blocks.")})  # as the method reads them
    run = _run(target, "medusa", MedusaConfig(heads=str(path), tree="small"), n=40, prompt=seqs[0][:6])
    assert run.token_ids == seqs[0][6:]
    assert run.metrics.mean_accepted > 1.3
    roots, accepted, r = [], [], 5  # the first step's root is the prompt's last token
    for e in run.events:
        if r + 3 < len(seqs[0]) - 1:  # the tree's whole depth left in the token budget
            roots.append(r)
            accepted.append(1 + e.num_accepted)
        r += len(e.committed)
    sim = medusa_tau(heads, result["accuracy"], data, model.embed, model.lm_head_weight(), torch.arange(64),
                     roots=torch.tensor(roots))
    assert max(accepted) > 1 and sim["per_root"] == accepted
