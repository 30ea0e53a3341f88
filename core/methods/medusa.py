"""Medusa (Cai et al. 2024): extra decoding heads on the target's last hidden state.

Head k (1-based) reads the final-norm hidden state h_t of the last accepted position and
predicts the token k + 1 positions ahead (the target's own LM head gives the next one).
Each head is a residual block (h + SiLU(W h + b)) followed by the target's frozen LM head.

Output layer: shared and frozen, restricted to a draft vocabulary. A head with its own
output layer over 151,936 tokens would carry 233 M parameters (1,536 x 151,936), i.e. a
second target-sized LM head per head; sharing the target's (frozen) and restricting it to
the most frequent tokens the target predicts (the heads file lists them) keeps the heads
small (2.4 M parameters each) and makes drafting and training cheap on a CPU. Tokens
outside the draft vocabulary are never drafted; the target still produces them.

Candidates: each depth's top-k tokens from its head form a static tree declared as paths
of ranks (:class:`specplay.core.decoding.tree.TreeSpec`). The default tree takes the paths with the highest
estimated acceptance (the product of the heads' measured accuracies), as many as pay for
their verification on this machine (:mod:`specplay.core.decoding.costmodel`): a handful on a CPU, dozens on
a GPU. It is sized each step, the accuracies scaled by how far this run's verdicts bear them out
(:mod:`specplay.core.decoding.calibration`): heads trained on code that meet a translation keep one
node. The target verifies the tree in one pass;
candidates are deterministic, so verification is exact (and lossless at temperature > 0).
Medusa's typical acceptance is available as an option and is labelled lossy.

Heads trained with the Hydra recipe (``"recipe": "hydra"`` in their manifest,
:mod:`specplay.core.heads.hydra`) read the tokens drafted before theirs: the tree's candidates are
then drawn depth by depth along each path, each head fed its parent's state and token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specplay.core.decoding.calibration import Calibration
from specplay.core.decoding.costmodel import CostCurve, best_size, cost_curve
from specplay.core.decoding.method import Method, MethodConfig, RunContext, StepOutcome, param
from specplay.core.decoding.tree import TreeSpec, choose_tree
from specplay.core.decoding.types import Draft
from specplay.core.errors import ConfigError, ModelError
from specplay.core.heads import MedusaHeads, draft_lm_rows, features_warning, load_heads, resolve_heads_path
from specplay.core.heads.hydra import HydraHeads
from specplay.core.kernels.linear import drafter_dtype

NAMED_TREES = {"auto": "the most valuable paths by measured accuracy, as many as pay for their verification here "
                       "(each step, by how far the run's target bears the accuracies out)",
               "dynamic": "chosen afresh each step by the heads' confidence, as many as pay for their verification "
                          "(likewise)",
               "chain": "top-1 of every head", "small": "the 8 most valuable paths", "large": "the 32 most valuable paths"}
_BUDGETS = {"small": 8, "large": 32}
_AUTO_MAX = 64


@dataclass(frozen=True)
class MedusaConfig(MethodConfig):
    heads: str = param("", "Medusa heads file (.safetensors); empty = the heads shipped for the target; "
                       "'classic' = the shipped classic residual heads, where other heads are the default",
                       label="heads file", kind="file", cli="--heads")
    tree: str = param("auto", "Candidate tree: auto (sized to this machine's verification cost), dynamic (chosen "
                      "each step from the heads' confidence, sized likewise), small, large, chain, or a JSON file "
                      "with a list of rank paths", label="tree", cli="--tree")
    top_k: int = param(10, "Candidates considered per head when choosing a tree (auto, dynamic, small, large): paths "
                       "through a lower-ranked candidate are left out", label="top-k", minimum=1, maximum=64,
                       cli="--medusa-top-k")
    typical: bool = param(False, "Medusa's typical acceptance at temperature > 0 (LOSSY: output no longer follows "
                          "the target distribution)", label="typical acceptance", lossy=True, cli="--typical")
    posterior_threshold: float = param(0.09, "Typical acceptance: probability threshold", label="threshold",
                                       minimum=0.0, maximum=1.0, lossy=True, cli="--posterior-threshold")
    posterior_alpha: float = param(0.3, "Typical acceptance: entropy factor (about sqrt(threshold))", label="alpha",
                                   minimum=0.0, maximum=1.0, lossy=True, cli="--posterior-alpha")


def path_parents(paths: list[tuple[int, ...]]) -> list[int]:
    """Each rank path's parent among ``paths`` (-1 for a first-level path); parents come first."""
    at = {p: i for i, p in enumerate(paths)}
    return [at[p[:-1]] if len(p) > 1 else -1 for p in paths]


def tree_from_config(tree: str, accuracy: list[list[float]], num_heads: int, top_k: int) -> TreeSpec:
    if tree in ("chain", "dynamic"):  # for "dynamic", a placeholder as deep as the heads: each step chooses its own
        return TreeSpec.from_paths([(0,) * d for d in range(1, num_heads + 1)])
    accuracy = [row[:top_k] for row in accuracy]  # the chosen tree's nodes are each head's top-k candidates
    if tree in _BUDGETS:
        return TreeSpec.from_paths(choose_tree(accuracy, _BUDGETS[tree]))
    if tree == "auto":  # the paths it may take, best first: each step keeps as many as pay (Medusa.propose)
        return TreeSpec.from_paths(choose_tree(accuracy, _AUTO_MAX))
    path = Path(tree).expanduser()
    if not path.is_file():
        raise ConfigError(f"unknown tree '{tree}': use {', '.join(NAMED_TREES)} or a JSON file of rank paths")
    try:
        paths = json.loads(path.read_text(encoding="utf-8"))
        tree_spec = TreeSpec.from_paths(paths)
    except (json.JSONDecodeError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is not a valid tree (a JSON list of rank paths like [[0], [1], [0, 0]]): {exc}") \
            from None
    if tree_spec.max_depth > num_heads:
        raise ConfigError(f"tree {path} is {tree_spec.max_depth} deep but the heads predict {num_heads} positions")
    return tree_spec


class Medusa(Method):
    name = "medusa"
    draft_source = "Medusa head {depth}"
    needs_hidden = True

    @property
    def max_draft_depth(self) -> int:
        return self.tree.max_depth

    def __init__(self, config: MedusaConfig, target_lm, target_id: str):
        super().__init__(config)
        path = resolve_heads_path(config.heads, "medusa", target_id)
        tensors, manifest = load_heads(path, "medusa", target_lm)
        self.manifest = manifest
        self.warnings = tuple(w for w in (features_warning(manifest, target_lm, path),) if w)
        num_heads = manifest["num_heads"]
        self.hydra = manifest.get("recipe") == "hydra"
        if self.hydra and config.tree == "dynamic":
            raise ConfigError("the dynamic tree reads every head at once, which Hydra heads (each reading the token "
                              "drafted before its own) cannot do; use a static tree, or the classic heads "
                              "(--heads classic) with it")
        self.heads = (HydraHeads if self.hydra else MedusaHeads)(target_lm.info.hidden_size, num_heads)
        self.embed = target_lm.embed
        try:
            self.heads.load_state_dict({k: v for k, v in tensors.items() if k.startswith("blocks.")})
        except RuntimeError as exc:
            raise ModelError(f"{path}: weights do not fit {num_heads} Medusa heads: {exc}") from None
        device = torch.device(target_lm.info.device)
        # Each block is 9-19 MB in float32 (a Hydra block 0.82 ms a call, 0.24 in bfloat16, on the AMD EPYC model 17).
        self.heads.eval().to(device=device, dtype=drafter_dtype(device))
        self.vocab_ids = tensors["vocab_ids"].to(device)
        self.lm_rows = draft_lm_rows(target_lm, self.vocab_ids, path)
        self.tree = tree_from_config(config.tree, manifest["accuracy"], num_heads, config.top_k)
        self.max_draft_nodes = len(self.tree)
        self.cost: CostCurve | None = None
        # How far this run's target accepts what the heads' accuracies (or confidences) promise.
        self.calibration = Calibration()
        if config.tree == "auto":
            self.cost = cost_curve(target_lm)
            accuracy = [row[:config.top_k] for row in manifest["accuracy"]]
            self._paths = choose_tree(accuracy, _AUTO_MAX)  # the tree's paths, best first
            self._path_chances = [accuracy[len(p) - 1][p[-1]] for p in self._paths]
            self._path_parents = path_parents(self._paths)
            self._sized: dict[tuple[int, int], TreeSpec] = {}
        if config.tree == "dynamic":
            self.cost = cost_curve(target_lm)
            self.max_draft_nodes = _AUTO_MAX
        if config.tree in ("auto", "dynamic"):
            self.timing_sized = "the tree's size follows the measured verification cost"
        if config.typical:
            self.typical = (config.posterior_threshold, config.posterior_alpha)
        self._by_depth = [sum(1 for d in self.tree.depth_of if d <= k) for k in range(self.tree.max_depth + 1)]
        self.last_hidden: torch.Tensor | None = None

    def start(self, ctx: RunContext) -> None:
        self.last_hidden = None if ctx.prefill is None else ctx.prefill.hidden[-1]
        self.calibration = Calibration()

    def _step_tree(self, depth: int) -> tuple[TreeSpec, int, list[float] | None]:
        """This step's static tree, its nodes down to ``depth``, and each node's chance given its
        parent (None for a tree of fixed size). The auto tree keeps, of its paths within ``depth``,
        as many of the most valuable as pay for their verification by the run's calibrated chances."""
        if self.config.tree != "auto":
            return self.tree, self._by_depth[depth], None
        within = [i for i, p in enumerate(self._paths) if len(p) <= depth]
        index = {old: new for new, old in enumerate(within)}
        values = self.calibration.values([index.get(self._path_parents[i], -1) for i in within],
                                         [self._path_chances[i] for i in within])
        size = max(1, best_size(values, self.cost))
        key = (depth, size)
        if key not in self._sized:
            self._sized[key] = TreeSpec.from_paths([self._paths[i] for i in within[:size]])
        tree = self._sized[key]
        accuracy = self.manifest["accuracy"]
        return tree, len(tree), [accuracy[d - 1][r] for d, r in zip(tree.depth_of, tree.ranks)]

    @torch.inference_mode()
    def propose(self, ctx: RunContext, budget: int) -> Draft:
        if self.last_hidden is None or budget <= 0:
            return Draft()
        depth = min(budget, self.tree.max_depth)
        if self.hydra:
            return self._hydra(ctx.tokens[-1], depth)
        states = self.heads(self.last_hidden.float()[None])[:, 0]  # [K, hidden]
        logits = self.lm_rows(states[:depth]).float()  # [depth, V']
        probs = torch.softmax(logits, dim=-1)
        if self.config.tree == "dynamic":
            return self._dynamic(probs)
        tree, n, chances = self._step_tree(depth)
        max_rank = max(tree.ranks[:n]) + 1
        top_p, top_i = probs.topk(max_rank, dim=-1)
        ids = self.vocab_ids[top_i]
        tokens = [int(ids[d - 1, r]) for d, r in zip(tree.depth_of[:n], tree.ranks[:n])]
        q_token = [float(top_p[d - 1, r]) for d, r in zip(tree.depth_of[:n], tree.ranks[:n])]
        return Draft(tokens=tokens, parents=list(tree.parents[:n]), q_token=q_token, memo={"chances": chances},
                     shown=self._shown(n))

    def _shown(self, nodes: int, **more) -> dict:
        shown = {"tree_nodes": nodes, "heads": len(self.heads.blocks), **more}
        if self.cost is not None:
            shown["calibration"] = round(self.calibration.factor, 3)
        return shown

    def _hydra(self, root: int, depth: int) -> Draft:
        """The static tree's first nodes, down to ``depth``, drawn along each path (:meth:`HydraHeads.draft_tree`)."""
        t, n, chances = self._step_tree(depth)
        device = self.vocab_ids.device
        index, prob = self.heads.draft_tree(
            self.last_hidden.float()[None], self.embed(torch.tensor([root], device=device)).float(), t.parents[:n],
            t.ranks[:n], t.depth_of[:n], self._logits, lambda i: self.embed(self.vocab_ids[i]))
        return Draft(tokens=self.vocab_ids[index[0]].tolist(), parents=list(t.parents[:n]), q_token=prob[0].tolist(),
                     memo={"chances": chances}, shown=self._shown(n, recipe="hydra"))

    def _logits(self, states: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of states of any leading shape (the LM head rows take rows)."""
        return self.lm_rows(states.reshape(-1, states.shape[-1])).float().reshape(*states.shape[:-1], -1)

    def _dynamic(self, probs: torch.Tensor) -> Draft:
        """This step's tree: the paths whose heads are most confident (the product of each rank's
        probability stands for its chance of acceptance, as measured accuracy does for a static
        tree), as many as pay for their verification."""
        top_p, top_i = probs.topk(min(self.config.top_k, probs.shape[-1]), dim=-1)
        confidence = top_p.tolist()
        paths = choose_tree(confidence, _AUTO_MAX)
        values = self.calibration.values(path_parents(paths), [confidence[len(p) - 1][p[-1]] for p in paths])
        size = max(1, best_size(values, self.cost))
        tree_spec = TreeSpec.from_paths(paths[:size])
        ids = self.vocab_ids[top_i].tolist()
        nodes = list(zip(tree_spec.depth_of, tree_spec.ranks))
        q_token = [confidence[d - 1][r] for d, r in nodes]
        return Draft(tokens=[ids[d - 1][r] for d, r in nodes], parents=list(tree_spec.parents), q_token=q_token,
                     memo={"chances": q_token}, shown=self._shown(len(tree_spec)))

    def observe(self, ctx: RunContext, outcome: StepOutcome) -> None:
        self.last_hidden = outcome.target_out.hidden[outcome.kept_rows[-1]]
        chances = outcome.draft.memo.get("chances")
        if chances and len(outcome.draft):
            self.calibration.observe(outcome.draft.parents, chances, outcome.verdict.accepted)
