"""EAGLE (Li et al. 2024): draft at the feature level, grow the draft as a dynamic tree (EAGLE-2).

The head is a projection of [token embedding, feature] (2h -> h) followed by one decoder
layer shaped like the target's; it reuses the target's frozen embedding and LM head. From
the target's feature f_t (final-norm hidden state at position t) and the embedding of the
token x_{t+1} that follows, it predicts f_{t+1}; the LM head maps that to a distribution
over x_{t+2}. Drafting feeds its own predicted features back in.

Output layer: the target's LM head restricted to a draft vocabulary (the most frequent
tokens the target predicts, listed in the head file). Over 151,936 tokens the LM head
costs more than the head's decoder layer itself; restricted to 32,768 tokens it is ~4.6x
cheaper per draft step (measured in docs/benchmarks.md), and tokens outside it are rare.

Drafting: ``chain`` follows the top token for ``depth`` steps (EAGLE-1). ``dynamic``
(EAGLE-2) takes the ``top_k`` children of the root, then at each further level expands the
``top_k`` frontier nodes with the highest cumulative log-probability, and finally keeps the
best nodes of all levels for verification: at most ``total_tokens``, and with ``auto_size``
only as many as pay for their verification on this machine (:mod:`specplay.core.decoding.costmodel`),
none where not one does (the step is then plain, its first level the price of looking, and the
look's likeliest token against the step's own a verdict too), each node's chance being the head's
confidence as far as this run's verdicts bear it out (:mod:`specplay.core.decoding.calibration`); a
level whose nodes are all too unlikely to pay for their verification and the level's own drafting is
then not grown. The head keeps its own KV cache of (true feature, token) pairs across steps;
draft-time entries are cropped after each step and the accepted tokens re-enter with the target's
true features.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from specplay.core.decoding.calibration import Calibration
from specplay.core.decoding.costmodel import CostCurve, best_size, cost_curve, timed_step
from specplay.core.decoding.method import Method, MethodConfig, RunContext, StepOutcome, param
from specplay.core.decoding.types import Draft
from specplay.core.errors import ModelError
from specplay.core.heads import draft_lm_rows, features_warning, head_config, load_heads, resolve_heads_path
from specplay.core.heads.eagle import EagleDrafter
from specplay.core.kernels.linear import Storage, drafter_dtype, make_linear, storage_of
from specplay.core.models.layers import rms_norm


def grow_tree(drafter: EagleDrafter, log_probs: Callable[[torch.Tensor], torch.Tensor], vocab_ids: torch.Tensor,
              feat: torch.Tensor, root: int, depth: int, total: int, top_k: int, cost: CostCurve | None = None,
              worth_adding: Callable[[list[float]], float] | None = None, grown_only: bool = False,
              calibration: Calibration | None = None) -> Draft:
    """EAGLE-2's dynamic tree from the head's prediction ``feat`` at ``root`` (the drafter's cache
    holds the true pairs before it): drafting uses it, and so does training's simulated τ
    (:mod:`specplay.core.training.tau`). ``cost`` sizes the kept draft and, with ``worth_adding`` (the
    least chance one more node must have to pay), stops growing levels that cannot pay, each node's
    chance being the head's cumulative probability; ``calibration`` (the run's measured acceptance
    of the head's word, :mod:`specplay.core.decoding.calibration`) then sizes the kept draft. The growth
    stays the head's alone, so the tune replays every step of a run from trees grown beforehand.
    ``grown_only``: every node grown, none cut (the tune replays each smaller tree from one growth)."""
    k = top_k
    d = drafter
    true_pairs = d.len  # the drafter's cache before the tree: the true pairs up to the root's
    # Nodes: token, parent node (-1 root), cumulative log-prob, draft probability.
    tok: list[int] = []
    par: list[int] = []
    score: list[float] = []
    prob: list[float] = []
    slot: dict[int, int] = {}  # node -> its entry in the drafter cache, once expanded

    def add_children(parent: int, logp: torch.Tensor, base: float) -> list[int]:
        top = logp.topk(k)
        made = []
        for lp, idx in zip(top.values.tolist(), top.indices.tolist()):
            tok.append(int(vocab_ids[idx]))
            par.append(parent)
            score.append(base + lp)
            prob.append(float(torch.tensor(lp).exp()))
            made.append(len(tok) - 1)
        return made

    frontier = add_children(-1, log_probs(feat[None])[0], 0.0)
    parent_feat = {n: feat for n in frontier}
    levels = 1
    for level in range(1, depth):
        expand = sorted(frontier, key=lambda n: -score[n])[:k]
        if cost is not None:
            # A child is never likelier than its parent: where a parent's chance is below what one
            # more node must add to pay for its verification, its subtree would be grown for nothing.
            floor = worth_adding(sorted((math.exp(x) for x in score), reverse=True)[:total])
            expand = [n for n in expand if math.exp(score[n]) > floor]
            if not expand:
                break
        levels += 1
        base_len = d.len
        mask = torch.zeros(len(expand), base_len + len(expand), dtype=torch.bool)
        mask[:, :true_pairs] = True
        for row, node in enumerate(expand):
            mask[row, base_len + row] = True
            a = par[node]
            while a >= 0:
                mask[row, slot[a]] = True
                a = par[a]
        feats = torch.stack([parent_feat[n] for n in expand])
        outs = d.run(feats, [tok[n] for n in expand], torch.full((len(expand),), root + level - 1), mask)
        for row, node in enumerate(expand):
            slot[node] = base_len + row
        logps = log_probs(outs)
        frontier = []
        for row, node in enumerate(expand):
            kids = add_children(node, logps[row], score[node])
            for kid in kids:
                parent_feat[kid] = outs[row]
            frontier += kids
    # Keep the best nodes overall; a child never outscores its parent, and ties go to the
    # earlier (parent) node, so any top-ranked prefix is closed under parents.
    # Each node's chance of acceptance, as the kept draft's size reads it; a calibrated chance, too, is
    # never above its parent's.
    chance = [math.exp(x) for x in score] if calibration is None else calibration.values(par, prob)
    ranked = sorted(range(len(tok)), key=lambda n: (-(score[n] if calibration is None else chance[n]), n))
    ranked = ranked[:len(tok) if grown_only else total]
    if cost is not None and not grown_only:
        # None where even the likeliest node cannot pay for its verification: the step is then plain.
        ranked = ranked[:best_size([chance[n] for n in ranked], cost)]
    keep = sorted(ranked)
    new_index = {old: i for i, old in enumerate(keep)}
    parents = [new_index[par[n]] if par[n] >= 0 else -1 for n in keep]
    # A look that keeps nothing still names the head's likeliest next token and its word for it (node 0,
    # the root's first child): the step's own token then says whether the head was right.
    return Draft(tokens=[tok[n] for n in keep], parents=parents, q_token=[prob[n] for n in keep],
                 memo={} if keep else {"looked": (tok[0], prob[0])},
                 shown={"shape": "dynamic", "depth": depth, "levels_grown": levels, "nodes_grown": len(tok),
                        "kept": len(keep), **({} if calibration is None else {"calibration": round(calibration.factor, 3)})})


# ---------------------------------------------------------------------------------- method
@dataclass(frozen=True)
class EagleConfig(MethodConfig):
    head: str = param("", "EAGLE head file (.safetensors); empty = the head shipped for the target",
                      label="head file", kind="file", cli="--head")
    tree: str = param("dynamic", "chain: follow the top token (EAGLE-1); dynamic: grow a tree by confidence "
                      "(EAGLE-2)", label="draft shape", choices=("chain", "dynamic"), cli="--tree")
    depth: int = param(5, "Draft levels per step", label="depth", minimum=1, maximum=16, cli="--depth")
    top_k: int = param(4, "Children per expanded node and nodes expanded per level (dynamic)", label="top-k",
                       minimum=1, maximum=16, cli="--top-k")
    total_tokens: int = param(32, "Most draft nodes kept for verification (dynamic)", label="total tokens",
                              minimum=1, maximum=256, cli="--total-tokens")
    auto_size: bool = param(True, "Each step, keep only as many nodes as pay for their verification on this machine "
                            "(by the draft's confidence and the measured verification cost)", label="auto size",
                            cli="--auto-size")
    window: int = param(64, "Prompt tokens the head reads before its first draft (the target's features it reads "
                        "carry the whole prompt already); 0 = all", label="head's prompt window", minimum=0,
                        cli="--head-window")


class Eagle(Method):
    name = "eagle"
    draft_source = "EAGLE level {depth}"
    needs_hidden = True
    #: A grown level's cost in one-token target steps until the run has timed both (the tune's measure
    #: on the AMD EPYC model 17: 2.0 ms against a 37.6 ms step), and the newest level timing's weight.
    LEVEL_PRIOR, LEVEL_NEWEST = 0.05, 0.3

    @property
    def max_draft_depth(self) -> int:
        return self.config.depth

    def __init__(self, config: EagleConfig, target_lm, target_id: str):
        super().__init__(config)
        from specplay.core.models.native import NativeDecoder

        path = resolve_heads_path(config.head, "eagle", target_id)
        tensors, manifest = load_heads(path, "eagle", target_lm)
        if not isinstance(target_lm, NativeDecoder):
            raise ModelError("EAGLE needs the native Llama/Qwen2 path (the head copies the target's layer shape)")
        self.manifest = manifest
        self.warnings = tuple(w for w in (features_warning(manifest, target_lm, path),) if w)
        cfg = head_config(target_lm.cfg, manifest.get("intermediate_size"))
        try:
            self.drafter = EagleDrafter(cfg, tensors, storage_of(target_lm.info), target_lm.embed,
                                        target_lm.info.device)
        except (KeyError, RuntimeError) as exc:
            raise ModelError(f"{path}: weights do not fit an EAGLE head for '{target_id}': {exc}") from None
        self.vocab_ids = tensors["vocab_ids"].to(target_lm.info.device)
        self.lm_rows = draft_lm_rows(target_lm, self.vocab_ids, path)
        self.fuse, self.out_norm, self.feature_layers = self._eagle3_parts(tensors, manifest, target_lm, path)
        self.eps = target_lm.cfg.rms_norm_eps
        c = config
        self.max_draft_nodes = c.depth if c.tree == "chain" else c.total_tokens
        self.cost = cost_curve(target_lm) if (c.auto_size and c.tree == "dynamic") else None
        # How far this run's target accepts what the head is confident of (auto size reads it).
        self.calibration = Calibration()
        self._level_s: float | None = None  # seconds a grown level takes, as the trees grown so far timed it
        if self.cost is not None:
            self.timing_sized = "the tree's size follows the measured verification cost"
        self.features = torch.zeros(0, target_lm.info.hidden_size, device=target_lm.info.device)
        self.n_features = 0
        self._first = 0  # the position of the first feature kept (the head's window of the prompt)
        # EAGLE-3's layer features wait here until a step drafts, then are fused in one pass: fusing a
        # step's row alone read the fuse's 28 MB each plain step (1.3 ms of a 46 ms step on the Intel Xeon).
        self._unfused: list[torch.Tensor] = []
        self._prompt_unfused = False  # whether the prompt's rows are among them

    @staticmethod
    def _eagle3_parts(tensors: dict, manifest: dict, target_lm, path):
        """An EAGLE-3 head (:mod:`specplay.core.heads.eagle3`) reads the target's fused layers, not its final
        hidden state, and puts its states through its own norm before the LM head rows."""
        if manifest.get("recipe") != "eagle3":
            return None, None, ()
        layers = tuple(int(i) for i in manifest.get("layers", ()))
        if "fuse.weight" not in tensors or "out_norm" not in tensors or not layers \
                or any(not 0 <= i < target_lm.info.num_layers for i in layers):
            raise ModelError(f"{path}: an EAGLE-3 head needs fuse.weight, out_norm and the layers it fuses "
                             f"(within the target's {target_lm.info.num_layers})")
        device = target_lm.info.device
        # A floating kind whatever the target's storage: the int8 kernel quantizes each input row as a whole,
        # and the residual stream's few huge activations (thousands, against units) would flatten the rest.
        # bfloat16 (:func:`drafter_dtype`) keeps each value's own exponent: the fuse's 28 MB cost a drafting
        # step 3.1 ms in float32 and 0.4 ms in bfloat16 on the AMD EPYC model 17 (the head learnt it under
        # bfloat16 autocast).
        fuse = make_linear(tensors["fuse.weight"].to(device=device, dtype=drafter_dtype(device)), None, Storage.FLOAT)
        return fuse, tensors["out_norm"].float().to(device), layers

    # ------------------------------------------------------------------ feature bookkeeping
    def _stacked(self, out, rows=None) -> torch.Tensor:
        """EAGLE-3's feature layers side by side at a target pass's ``rows`` (all when None), in the fuse's dtype."""
        return torch.cat([out.layers[i] if rows is None else out.layers[i][rows] for i in self.feature_layers],
                         -1).to(self.fuse.weight.dtype)

    def _features_of(self, out, rows=None) -> torch.Tensor:
        """The head's first-level input features at a target pass's ``rows`` (all when None)."""
        if self.fuse is None:
            return out.hidden if rows is None else out.hidden[rows]
        return self.fuse(self._stacked(out, rows))

    def _keep_features(self, out, rows=None) -> None:
        """Keep the head's first-level input features at ``rows`` of a target pass: the last hidden
        state's at once, EAGLE-3's layers side by side, to fuse when a step drafts."""
        if self.fuse is None:
            self._add_features(self._features_of(out, rows))
        else:
            self._unfused.append(self._stacked(out, rows))

    def _fuse_kept(self) -> float:
        """Fuse the kept layer features into the head's inputs, in one pass; returns the seconds of the
        part that was the prompt's (a run's once-only work), 0 otherwise."""
        if not self._unfused:
            return 0.0
        started = time.perf_counter()
        self._add_features(self.fuse(torch.cat(self._unfused)))
        self._unfused = []
        prompt, self._prompt_unfused = self._prompt_unfused, False
        return time.perf_counter() - started if prompt else 0.0

    def _add_features(self, feats: torch.Tensor) -> None:
        need = self.n_features + feats.shape[0]
        if need > self.features.shape[0]:
            grown = torch.zeros(max(2 * self.features.shape[0], need, 256), feats.shape[1], device=self.features.device)
            grown[: self.n_features] = self.features[: self.n_features]
            self.features = grown
        self.features[self.n_features:need] = feats.float()
        self.n_features = need

    def start(self, ctx: RunContext) -> None:
        self.calibration = Calibration()
        self.drafter.crop(0)
        self.n_features = 0
        self._unfused, self._prompt_unfused = [], False
        rows = ctx.prompt_len - 1  # the prompt's pairs: its features, each with the token after it
        window = self.config.window
        self._first = max(0, rows - window) if window else 0
        if ctx.prefill is not None:
            self._keep_features(ctx.prefill, list(range(self._first, rows)) if self._first else None)
            self._prompt_unfused = bool(self._unfused)

    def observe(self, ctx: RunContext, outcome: StepOutcome) -> None:
        self._keep_features(outcome.target_out, outcome.kept_rows)
        draft = outcome.draft
        if len(draft) and draft.q_token is not None:
            self.calibration.observe(draft.parents, draft.q_token, outcome.verdict.accepted)
        elif "looked" in draft.memo:
            # A look whose nodes could not pay is evidence too, as a one-node draft would have been: without
            # it a run whose first verdicts missed kept a calibration too low to draft for good (a code
            # answer's 128 steps looked and never drafted again after its first node was rejected).
            token, chance = draft.memo["looked"]
            self.calibration.observe_look(chance, outcome.new_tokens[:1] == [token])

    # --------------------------------------------------------------------------- drafting
    def _log_probs(self, feats: torch.Tensor) -> torch.Tensor:
        if self.out_norm is not None:
            feats = rms_norm(feats.float(), self.out_norm, self.eps)
        return torch.log_softmax(self.lm_rows(feats).float(), dim=-1)

    @torch.inference_mode()
    def propose(self, ctx: RunContext, budget: int) -> Draft:
        c = self.config
        root = len(ctx.tokens) - 1  # pairs (f_i, x_{i+1}) exist for i < root
        if budget <= 0 or root == 0:
            return Draft()
        setup_s = self._fuse_kept()
        first = self._first  # the drafter's cache and the features start at this position
        if first + self.n_features < root:
            return Draft()
        d = self.drafter
        d.crop(min(d.len, root - first))
        start = first + d.len
        prompt = ctx.prompt_len - 1  # the pairs before it are the prompt's: the head reads them once
        if start < prompt:
            # The head's read of its window of the prompt, a run's once-only work as the prompt's fuse is
            # (15-18 ms of a 55-token prompt's first drafting step on the AMD EPYC model 17: timed as a
            # step, it could stand the head down before it had drafted twice).
            started = time.perf_counter()
            out = d.run(self.features[start - first:prompt - first], ctx.tokens[start + 1:prompt + 1],
                        torch.arange(start, prompt))
            setup_s += time.perf_counter() - started
            start = prompt
        if start < root:
            out = d.run(self.features[start - first:root - first], ctx.tokens[start + 1:root + 1],
                        torch.arange(start, root))
        depth = min(c.depth, budget)
        try:
            if c.tree == "chain":
                draft = self._chain(out[-1], root, depth)
            else:
                draft = self._dynamic(out[-1], root, depth, min(c.total_tokens, budget * c.top_k))
        finally:
            d.crop(root - first)
        draft.setup_s = setup_s
        return draft

    def _chain(self, feat: torch.Tensor, root: int, depth: int) -> Draft:
        tokens, q = [], []
        for level in range(depth):
            logp = self._log_probs(feat[None])[0]
            best = int(logp.argmax())
            tokens.append(int(self.vocab_ids[best]))
            q.append(float(logp[best].exp()))
            if level < depth - 1:
                feat = self.drafter.run(feat[None], [tokens[-1]], torch.tensor([root + level]))[0]
        return Draft.chain(tokens, q_token=q, shown={"shape": "chain", "depth": depth})

    def _dynamic(self, feat: torch.Tensor, root: int, depth: int, total: int) -> Draft:
        sized = self.cost is not None
        started = time.perf_counter()
        draft = grow_tree(self.drafter, self._log_probs, self.vocab_ids, feat, root, depth, total, self.config.top_k,
                          self.cost, self._worth_adding if sized else None,
                          calibration=self.calibration if sized else None)
        self._time_levels(time.perf_counter() - started, draft.shown["levels_grown"])
        return draft

    def _worth_adding(self, values: list[float]) -> float:
        """The least chance of acceptance v with which one more node pays for itself and for the level
        grown to offer it, given the nodes' chances so far (descending): (E + v) / (C(n + 2) + L) >
        E / C(n + 1), where the cost model keeps n nodes expecting E tokens, C(m) is the cost of
        verifying m tokens (the root's included) and L a grown level's (:meth:`level_cost`), all in
        one-token steps. Without L, levels were grown that no kept node came from: on the AMD EPYC
        model 17 three levels a drafting step for 2.2 nodes kept, 2 ms each against a 38 ms step."""
        n = best_size(values, self.cost)
        expected = 1.0 + sum(values[:n])
        return expected * (self.cost(n + 2) - self.cost(n + 1) + self.level_cost()) / self.cost(n + 1)

    def level_cost(self) -> float:
        """What growing one tree level costs, in one-token target steps: the levels this method has grown,
        as timed (newer weighing more), over the verify curve's one-token pass; :data:`LEVEL_PRIOR` before both."""
        step = timed_step(self.cost)
        if self._level_s is None or not step:
            return self.LEVEL_PRIOR
        return self._level_s / step

    def _time_levels(self, seconds: float, levels: int) -> None:
        per_level = seconds / max(levels, 1)
        before = self._level_s
        self._level_s = per_level if before is None else before + self.LEVEL_NEWEST * (per_level - before)
