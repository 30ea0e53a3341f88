"""Simulated τ: the mean accepted length a head's draft tree would reach on held-out answers.

Top-1 accuracy per level says little about a tree: what decoding gains is the length of the
longest tree path the target accepts, plus its own token. At temperature 0 on the target's
own greedy answers that length can be replayed exactly, without the target: at a root r of a
held-out answer, the target would accept a path as long as its tokens are the target's argmax
labels r, r+1, ... (the answer's own next tokens). So τ_sim is that length plus one, averaged
over roots spread across the answers (never inside a prompt: decoding drafts only answers),
with the tree the method grows at inference but of a fixed size (the number of nodes the
cost model keeps moves with the machine; here it is fixed so runs compare): EAGLE's dynamic
tree (:func:`specplay.core.methods.eagle.grow_tree`) and Medusa's static tree of the most valuable paths
by held-out accuracy (:func:`specplay.core.decoding.tree.choose_tree`).
"""

from __future__ import annotations

import statistics

import torch

from specplay.core.decoding.tree import TreeSpec, choose_tree
from specplay.core.kernels.linear import Storage
from specplay.core.training.teacher import TeacherSet

EAGLE_TREE = {"depth": 5, "top_k": 4, "total_tokens": 16}  # docs/benchmarks.md measures τ at 16 nodes too
MEDUSA_NODES = 8  # about what pays for its verification on a two-core CPU
MEDUSA_TOP_K = 10  # the method's default candidates per head


def answer_roots(data: TeacherSet, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` root positions drawn (without replacement, reproducibly) from the answers of
    ``data``: positions r whose token belongs to the answer and that have at least one label after them."""
    pools = []
    for i, (s, e) in enumerate(zip(data.starts[:-1].tolist(), data.starts[1:].tolist())):
        first = s + max(int(data.prompt_lens[i]), 1)
        if first < e - 1:
            pools.append(torch.arange(first, e - 1))
    if not pools:
        return torch.zeros(0, dtype=torch.long)
    pool = torch.cat(pools)
    pick = torch.randperm(pool.numel(), generator=torch.Generator().manual_seed(seed))[:count]
    return pool[pick].sort().values


def _mean(lengths: list[int]) -> float | None:
    return sum(lengths) / len(lengths) if lengths else None  # None: no answer to replay


def standard_error(lengths: list[int]) -> float | None:
    """The standard error of τ_sim, the mean of ``lengths`` (one accepted length per root), as an estimate
    of the mean over every held-out root: about 0.055 at 600 roots. Heads judged on the same roots differ
    by less noise than their two errors add up to, since they share the roots."""
    return statistics.stdev(lengths) / len(lengths) ** 0.5 if len(lengths) > 1 else None


def accepted_length(parents: list[int], tokens: list[int], wanted: list[int]) -> int:
    """Longest tree path whose level-j token is ``wanted[j - 1]``, for nodes ordered parents first."""
    depth = [0] * len(parents)
    best = 0
    for i, p in enumerate(parents):
        level = 1 if p < 0 else depth[p] + 1 if depth[p] > 0 else 0
        ok = level > 0 and level <= len(wanted) and tokens[i] == wanted[level - 1]
        depth[i] = level if ok else 0
        best = max(best, depth[i])
    return best


@torch.no_grad()
def eagle_tau(head, data: TeacherSet, embed, lm_rows: torch.Tensor, vocab_ids: torch.Tensor, count: int = 400,
              roots: torch.Tensor | None = None, depth: int = EAGLE_TREE["depth"], top_k: int = EAGLE_TREE["top_k"],
              total_tokens: int = EAGLE_TREE["total_tokens"], storage: Storage = Storage.FLOAT) -> dict:
    """τ_sim of an EAGLE head (classic :class:`~specplay.core.heads.eagle.EagleHead` or EAGLE-3), drafting
    with the method's own drafter in float32 from the target's features of ``data``, at ``count``
    answer roots (:func:`answer_roots`) or at the ``roots`` given (sorted); ``per_root`` lists
    each root's accepted length, the bonus token included. ``storage``: the drafter's layers
    (int8 drafts as the method does on an int8 target)."""
    from specplay.core.heads.eagle import EagleDrafter
    from specplay.core.heads.eagle3 import Eagle3Head
    from specplay.core.methods.eagle import grow_tree

    was_training = head.training
    head.eval()
    drafter = EagleDrafter.from_head(head, storage, embed)
    lm_rows = lm_rows.float()
    eagle3 = isinstance(head, Eagle3Head)

    def log_probs(states: torch.Tensor) -> torch.Tensor:
        logits = head.logits(states, lm_rows) if eagle3 else states @ lm_rows.T
        return torch.log_softmax(logits.float(), dim=-1)

    roots = answer_roots(data, count) if roots is None else roots
    seq_of = torch.bucketize(roots, data.starts, right=True) - 1
    lengths = {}
    for seq in seq_of.unique().tolist():
        s, e = int(data.starts[seq]), int(data.starts[seq + 1])
        feats = head.fused(data.layers[s:e].float()) if eagle3 else data.final[s:e].float()
        tokens = data.tokens[s:e].tolist()
        labels = data.labels[s:e].tolist()
        drafter.crop(0)
        out = drafter.run(feats[:-1], tokens[1:], torch.arange(e - s - 1))  # out[i]: from pair (f_i, x_{i+1})
        # Latest root first: a tree is drafted past its root, over cache entries no earlier root reads.
        for r in sorted((roots[seq_of == seq] - s).tolist(), reverse=True):
            drafter.crop(r)
            draft = grow_tree(drafter, log_probs, vocab_ids, out[r - 1], r, depth, total_tokens, top_k)
            lengths[s + r] = 1 + accepted_length(draft.parents, draft.tokens, labels[r:r + depth])
    head.train(was_training)
    per_root = [lengths[r] for r in roots.tolist()]
    return {"tau_sim": _mean(per_root), "tau_sim_se": standard_error(per_root), "tau_sim_roots": len(per_root),
            "per_root": per_root,
            "tau_sim_tree": {"shape": "dynamic", **EAGLE_TREE, "depth": depth, "top_k": top_k,
                             "total_tokens": total_tokens}}


@torch.no_grad()
def medusa_tau(heads, accuracy: list[list[float]], data: TeacherSet, embed, lm_rows: torch.Tensor,
               vocab_ids: torch.Tensor, count: int = 2000, roots: torch.Tensor | None = None,
               nodes: int = MEDUSA_NODES, top_k: int = MEDUSA_TOP_K) -> dict:
    """τ_sim of Medusa heads (classic :class:`~specplay.core.heads.medusa.MedusaHeads` or Hydra) on the
    static tree of the ``nodes`` most valuable paths by their held-out ``accuracy``, at ``count``
    answer roots or the ``roots`` given; ``per_root`` as for :func:`eagle_tau`."""
    from specplay.core.heads.hydra import HydraHeads

    was_training = heads.training
    heads.eval()
    lm_rows = lm_rows.float()
    spec = TreeSpec.from_paths(choose_tree([row[:top_k] for row in accuracy], nodes))
    roots = answer_roots(data, count) if roots is None else roots
    hidden = data.final[roots - 1].float()  # decoding drafts from the last position the target processed
    if isinstance(heads, HydraHeads):
        index, _ = heads.draft_tree(hidden, embed(data.tokens[roots].long()).float(), spec.parents, spec.ranks,
                                    spec.depth_of, lambda s: s @ lm_rows.T, lambda i: embed(vocab_ids[i]).float())
    else:
        top = (heads(hidden) @ lm_rows.T).topk(max(spec.ranks) + 1, dim=-1).indices  # [K, B, R]
        index = torch.stack([top[d - 1, :, r] for d, r in zip(spec.depth_of, spec.ranks)], 1)
    drafted = vocab_ids[index].tolist()
    last = data.num_tokens - 1
    lengths = []
    for b, r in enumerate(roots.tolist()):
        end = int(data.starts[torch.bucketize(torch.tensor(r), data.starts, right=True)])
        wanted = data.labels[r:min(r + spec.max_depth, end, last + 1)].tolist()
        lengths.append(1 + accepted_length(list(spec.parents), drafted[b], wanted))
    heads.train(was_training)
    return {"tau_sim": _mean(lengths), "tau_sim_se": standard_error(lengths), "tau_sim_roots": len(lengths),
            "per_root": lengths,
            "tau_sim_tree": {"shape": "static", "nodes": len(spec), "paths": [list(p) for p in spec.paths]}}
