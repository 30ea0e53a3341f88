"""End to end: sampling with any method draws sequences from the target's own distribution.

A tiny float64 model with an 8-token vocabulary generates 2-token continuations thousands of
times per method; the empirical distribution of the 64 possible pairs is compared with the
exact one, computed from the target by enumeration (temperature and top-p applied).
"""

import pytest
import torch

from core.engine import drain, generate
from core.methods import build_method
from core.methods.lookahead import LookaheadConfig
from core.methods.prompt_lookup import PromptLookupConfig
from core.methods.speculative import SpeculativeConfig
from core.sampling import probabilities
from core.types import GenerationConfig, SamplingConfig
from stats import chi_square_pvalue
from tiny import loaded, native_from_hf, perturbed_copy, tiny_hf_model

VOCAB = 8
PROMPT = [4, 5, 6, 4, 5]
SAMPLING = dict(temperature=0.8, top_p=0.9)
TRIALS = 2500


@pytest.fixture(scope="module")
def target_model():
    return tiny_hf_model(seed=11, vocab=VOCAB, dtype=torch.float64)


def exact_pairs(native) -> dict:
    probs = {}
    native.reset()
    p1 = probabilities(native.forward(torch.tensor(PROMPT)).logits[-1], **SAMPLING)
    for a in range(VOCAB):
        if p1[a] == 0:
            continue
        native.reset()
        p2 = probabilities(native.forward(torch.tensor(PROMPT + [a])).logits[-1], **SAMPLING)
        for b in range(VOCAB):
            probs[(a, b)] = float(p1[a] * p2[b])
    return probs


def sample_pairs(target, method) -> list:
    out = []
    for seed in range(TRIALS):
        gen = GenerationConfig(max_new_tokens=2, stop_at_eos=False, sampling=SamplingConfig(seed=seed, **SAMPLING))
        res = drain(generate(target.model, target.tokenizer, method, PROMPT, gen))
        out.append(tuple(res.token_ids))
    return out


@pytest.mark.parametrize("name,draft_kind,config", [
    ("autoregressive", None, None),
    ("speculative", "near", SpeculativeConfig(gamma=3)),
    ("speculative", "bad", SpeculativeConfig(gamma=2)),
    ("prompt_lookup", None, PromptLookupConfig(max_ngram=2, num_tokens=3)),
    ("lookahead", None, LookaheadConfig(window=3, ngram=3, guesses=3)),
])
def test_method_samples_the_target_distribution(target_model, name, draft_kind, config):
    target = loaded(native_from_hf(target_model))
    draft = None
    if draft_kind == "near":
        draft = loaded(native_from_hf(perturbed_copy(target_model, 0.1)))
    elif draft_kind == "bad":
        draft = loaded(native_from_hf(tiny_hf_model(seed=99, vocab=VOCAB, layers=1, dtype=torch.float64)))
    method = build_method(name, config, target, draft)
    exact = exact_pairs(native_from_hf(target_model))
    pvalue = chi_square_pvalue(sample_pairs(target, method), exact)
    assert pvalue > 1e-3, f"{name}: p = {pvalue:.2e}"
