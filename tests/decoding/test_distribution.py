"""End to end: sampling with any method draws sequences from the target's own distribution.

A tiny float64 model with an 8-token vocabulary generates 4-token continuations thousands of
times per method, so the first step verifies drafts three tokens deep and later steps depend
on what earlier ones accepted (adaptive γ, n-gram pools, draft caches). The empirical
distribution of the sequences is compared with the exact one, enumerated from the target
(temperature and top-p applied), by a chi-square test.
"""

import pytest
import torch

from specplay.core.decoding.engine import drain, generate
from specplay.core.methods import build_method
from specplay.core.methods.lookahead import LookaheadConfig
from specplay.core.methods.prompt_lookup import PromptLookupConfig
from specplay.core.methods.speculative import SpeculativeConfig
from specplay.core.models.llamacpp_draft import LlamaCppDraft
from specplay.core.decoding.sampling import probabilities
from specplay.core.decoding.types import Draft, GenerationConfig, SamplingConfig
from stats import chi_square_pvalue
from tiny import loaded, native_from_hf, need_llama_cpp, perturbed_copy, tiny_hf_model, tiny_tokenizer, write_tiny_gguf

VOCAB = 8
PROMPT = [4, 5, 6, 4, 5]
SAMPLING = dict(temperature=0.8, top_p=0.8)
LENGTH = 4
TRIALS = 3000


@pytest.fixture(autouse=True)
def _steady_proposal_lengths(monkeypatch):
    """Prompt lookup sizes its proposals by a timing of the target: on a loaded machine a tiny
    target's timing could keep them short, and no draft would be verified three tokens deep."""
    import specplay.core.methods.prompt_lookup as prompt_lookup
    from specplay.core.decoding.costmodel import CostCurve

    monkeypatch.setattr(prompt_lookup, "cost_curve", lambda model: CostCurve.linear(0.05))


@pytest.fixture(scope="module")
def target_model():
    return tiny_hf_model(seed=11, vocab=VOCAB, dtype=torch.float64)


def exact_sequences(native, length: int = LENGTH) -> dict:
    """Probability of every continuation of PROMPT of ``length`` tokens (its support only)."""
    probs: dict = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == len(PROMPT) + length:
            probs[tuple(prefix[len(PROMPT):])] = prob
            return
        native.reset()
        p = probabilities(native.forward(torch.tensor(prefix)).logits[-1], **SAMPLING)
        for token in torch.nonzero(p).flatten().tolist():
            walk(prefix + [token], prob * float(p[token]))

    walk(list(PROMPT), 1.0)
    native.reset()
    return probs


def sample_sequences(target, method, length: int = LENGTH, trials: int = TRIALS) -> tuple[list, int]:
    """``trials`` sampled continuations, and the deepest draft any step verified."""
    out, deepest = [], 0
    for seed in range(trials):
        gen = GenerationConfig(max_new_tokens=length, stop_at_eos=False, stand_down=False, sampling=SamplingConfig(seed=seed, **SAMPLING))
        res = drain(generate(target.model, target.tokenizer, method, PROMPT, gen))
        out.append(tuple(res.token_ids))
        deepest = max([deepest] + [max(Draft(e.tree["tokens"], e.tree["parents"]).depths())
                                    for e in res.events if e.tree])
    return out, deepest


def assert_samples_the_target(target, method, native, min_depth: int = 3) -> None:
    samples, deepest = sample_sequences(target, method)
    assert deepest >= min_depth, f"drafts reached depth {deepest} only: the test would not exercise deep verification"
    pvalue = chi_square_pvalue(samples, exact_sequences(native))
    assert pvalue > 1e-3, f"{method.name}: p = {pvalue:.2e}"


@pytest.mark.parametrize("name,draft_kind,config", [
    ("autoregressive", None, None),
    ("speculative", "near", SpeculativeConfig(cost_sized=False, gamma=3)),
    ("speculative", "bad", SpeculativeConfig(cost_sized=False, gamma=3)),
    ("speculative", "bad", SpeculativeConfig(cost_sized=False, gamma=3, confidence=0.5)),
    ("speculative", "near", SpeculativeConfig(gamma=3, adaptive=True, max_gamma=6)),
    ("speculative", "smaller vocabulary", SpeculativeConfig(cost_sized=False, gamma=3)),
    ("speculative", "near", SpeculativeConfig(cost_sized=False, gamma=3, draft_vocab=VOCAB - 2)),
    ("speculative", "near", SpeculativeConfig(cost_sized=False, gamma=3, lookup_ngram=2)),
    ("speculative", "near", SpeculativeConfig(cost_sized=False, gamma=3, draft_window=2)),
    ("speculative", "near", SpeculativeConfig(gamma=3, cost_sized=True, max_gamma=6)),
    ("speculative", "near int4", SpeculativeConfig(cost_sized=False, gamma=3, draft_vocab=VOCAB - 2)),
    ("speculative", "near llama.cpp", SpeculativeConfig(cost_sized=False, gamma=3)),
    ("prompt_lookup", None, PromptLookupConfig(max_ngram=2, num_tokens=3, adaptive=False)),
    ("lookahead", None, LookaheadConfig(window=3, ngram=4, guesses=3, cost_sized=False)),
])
def test_method_samples_the_target_distribution(target_model, name, draft_kind, config, tmp_path):
    target = loaded(native_from_hf(target_model))
    draft = None
    if draft_kind == "near":
        draft = loaded(native_from_hf(perturbed_copy(target_model, 0.1)))
    elif draft_kind == "near int4":  # a draft model's storage of its own: int4 weights, bfloat16 activations
        draft = loaded(native_from_hf(perturbed_copy(target_model, 0.1), dtype=torch.float32, storage="int4-draft"))
    elif draft_kind == "near llama.cpp":  # another engine's numerics (float16 cache, its own kernels)
        need_llama_cpp()
        write_tiny_gguf(perturbed_copy(target_model, 0.1), tmp_path / "near.gguf")
        draft = loaded(LlamaCppDraft(tmp_path / "near.gguf", "near", target_model.config, (2,), threads=1))
    elif draft_kind == "bad":
        draft = loaded(native_from_hf(tiny_hf_model(seed=99, vocab=VOCAB, layers=1, dtype=torch.float64)))
    elif draft_kind == "smaller vocabulary":
        # Same tokenizer, an embedding padded to fewer rows than the target's (q = 0 past them).
        target = loaded(native_from_hf(target_model), tokenizer=tiny_tokenizer(VOCAB - 2))
        small = tiny_hf_model(seed=99, vocab=VOCAB - 2, layers=1, dtype=torch.float64)
        draft = loaded(native_from_hf(small), tokenizer=tiny_tokenizer(VOCAB - 2))
    method = build_method(name, config, target, draft)
    assert_samples_the_target(target, method, native_from_hf(target_model), min_depth=0 if draft_kind is None and
                              name == "autoregressive" else 3)


def test_a_confidence_stop_keeps_a_confident_draft_lossless():
    """p = (0.5, 0.5), q = (0.6, 0.4), threshold 0.5.

    Dropping each drawn token with q(x) < 0.5 (main before this test) proposes only the first
    token past the first draft position, accepts it with min(1, 0.5/0.6) as if it came from
    all of q, and so emits it there with probability 0.6 * 5/6 + 0.4 * 0.5 = 0.7, not 0.5.
    """
    from itertools import product

    from tiny import ConstantLM

    target = loaded(ConstantLM([0.5, 0.5, 0.0, 0.0]), tokenizer=tiny_tokenizer(4))
    draft = loaded(ConstantLM([0.6, 0.4, 0.0, 0.0], name="draft"), tokenizer=tiny_tokenizer(4))
    method = build_method("speculative", SpeculativeConfig(cost_sized=False, gamma=3, confidence=0.5), target, draft)
    samples = []
    for seed in range(TRIALS):
        gen = GenerationConfig(max_new_tokens=LENGTH, stop_at_eos=False, stand_down=False, sampling=SamplingConfig(temperature=1.0, seed=seed))
        samples.append(tuple(drain(generate(target.model, target.tokenizer, method, [3, 3], gen)).token_ids))
    exact = {seq: 0.5 ** LENGTH for seq in product([0, 1], repeat=LENGTH)}
    pvalue = chi_square_pvalue(samples, exact)
    assert pvalue > 1e-3, f"p = {pvalue:.2e}"
