"""From logits to the distributions the verifier compares: temperature, then top-p."""

from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Softmax of ``logits / temperature`` restricted to the top-p nucleus, renormalised.

    Works on ``[..., vocab]``; keeps float64 inputs in float64, computes others in float32.
    Temperature 0 gives the one-hot distribution of the argmax.
    """
    x = logits if logits.dtype == torch.float64 else logits.float()
    if temperature == 0:
        out = torch.zeros_like(x)
        out.scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
        return out
    probs = torch.softmax(x / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def align_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    """``[..., vocab]`` logits of a draft resized to the target's vocabulary of ``size`` rows.

    Models that share a tokenizer may pad their embedding matrices to different sizes. Rows
    the draft lacks get -inf (q = 0: never drafted); draft rows past the target's are dropped
    (tokens the target cannot emit are never drafted). Either way the verifier sees a q over
    the target's vocabulary, and stays lossless.
    """
    have = logits.shape[-1]
    if have == size:
        return logits
    if have > size:
        return logits[..., :size]
    pad = logits.new_full((*logits.shape[:-1], size - have), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def token_probability(logits_row: torch.Tensor, token: int) -> float:
    """Plain softmax probability of ``token`` (temperature 1), for display at greedy decoding."""
    x = logits_row if logits_row.dtype == torch.float64 else logits_row.float()
    return float(torch.exp(x[token] - torch.logsumexp(x, dim=-1)))


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a ``[vocab]`` distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))


def uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))
