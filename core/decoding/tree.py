"""Draft trees: attention masks, positions and path retrieval.

A tree is stored as a parent array (see :class:`specplay.core.decoding.types.Draft`). Forward row 0 is the
root (the last committed token); row ``i + 1`` is node ``i``. A node may attend to the
committed cache, the root, its ancestors and itself; its position is the root's plus its
depth. Static trees (Medusa) are declared as data, a list of paths of candidate ranks, and
their masks and indices are derived once by :class:`TreeSpec` and reused every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """Boolean ``[n + 1, n + 1]`` mask over (root, nodes): True where a row may attend."""
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        row = i + 1
        mask[row, row] = True
        if p >= 0:
            mask[row] |= mask[p + 1]
    return mask


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node of a tree given as parent indices (-1: the root): 1 for the root's children."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@dataclass(frozen=True)
class TreeSpec:
    """A static candidate tree declared as paths of ranks, e.g. ``[(0,), (1,), (0, 0)]``.

    Path ``(0, 1)`` is: the top-1 candidate at depth 1, then the top-2 candidate at depth 2
    under it. Nodes are ordered by depth then path, so parents precede children.
    """

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    ranks: tuple[int, ...]  # candidate rank of each node at its depth
    depth_of: tuple[int, ...]
    mask: torch.Tensor  # [n + 1, n + 1] ancestor mask over (root, nodes)
    retrieve: torch.Tensor  # [leaves, max_depth] node indices of each root-to-leaf path, -1 padded

    @staticmethod
    def from_paths(paths: Sequence[Sequence[int]]) -> "TreeSpec":
        uniq = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if not uniq:
            raise ValueError("a tree needs at least one path")
        index = {p: i for i, p in enumerate(uniq)}
        parents = []
        for p in uniq:
            if not p or any(r < 0 for r in p):
                raise ValueError(f"invalid tree path {list(p)}: ranks must be >= 0 and paths non-empty")
            if len(p) > 1 and p[:-1] not in index:
                raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
            parents.append(-1 if len(p) == 1 else index[p[:-1]])
        has_child = {q for q in parents if q >= 0}
        leaves = [i for i in range(len(uniq)) if i not in has_child]
        max_depth = max(len(p) for p in uniq)
        retrieve = torch.full((len(leaves), max_depth), -1, dtype=torch.long)
        for row, leaf in enumerate(leaves):
            nodes = path_to(parents, leaf)
            retrieve[row, : len(nodes)] = torch.tensor(nodes)
        return TreeSpec(
            paths=tuple(uniq), parents=tuple(parents), ranks=tuple(p[-1] for p in uniq),
            depth_of=tuple(len(p) for p in uniq), mask=ancestor_mask(parents), retrieve=retrieve,
        )

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(self.depth_of)


def build_trie(sequences: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """Merge token sequences that hang off the same root into a tree (shared prefixes once).

    Returns (tokens, parents, nodes of each sequence); parents precede children.
    """
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    paths = []
    for seq in sequences:
        node, path = -1, []
        for tok in seq:
            key = (node, int(tok))
            if key not in index:
                index[key] = len(tokens)
                tokens.append(int(tok))
                parents.append(node)
            node = index[key]
            path.append(node)
        paths.append(path)
    return tokens, parents, paths


def choose_tree(accuracy: Sequence[Sequence[float]], budget: int) -> list[tuple[int, ...]]:
    """The static tree of at most ``budget`` nodes with the largest expected accepted length.

    ``accuracy[d][r]`` is the measured probability that the rank-``r`` candidate at depth
    ``d + 1`` is the right token. Treating depths as independent, a node's chance of being
    on the accepted path is the product of its ranks' accuracies, and the expected number
    of accepted tokens is the sum of that over nodes. A node's value never exceeds its
    parent's, so taking the ``budget`` most valuable paths (best-first from the root) is
    optimal and always yields a tree closed under parents.
    """
    import heapq

    chosen: list[tuple[int, ...]] = []
    heap = [(-float(accuracy[0][r]), (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(heap)
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        if -neg <= 0:
            break
        chosen.append(path)
        depth = len(path)
        if depth < len(accuracy):
            for r in range(len(accuracy[depth])):
                heapq.heappush(heap, (neg * float(accuracy[depth][r]), path + (r,)))
    return chosen
