"""How far a drafter's own confidence holds in this run: the tree methods' acceptance, measured.

A tree method sizes its draft by each node's chance of acceptance, and it reads that chance off
its own head: EAGLE's and a dynamic Medusa tree's softmax, a static Medusa tree's accuracies
measured when the heads were trained. Neither is this run's: a head trained on another storage's
features (the int8 target's, drafting for the GGUF target) is confident where the target disagrees,
and on text unlike its training data (a translation, an extraction) a head right 70% of the time
on code is right 10% of the time. Sized by its word, such a draft grows nodes that are verified
for nothing.

:class:`Calibration` compares, level by level, what a draft predicted with what the verifier
did: where the accepted path reached a node, the chances its children in the draft were given
(their sum: they are exclusive) against whether one of them was accepted. Its :attr:`factor`
is the run's realized acceptance over the predicted one (decayed, newer steps weighing more,
starting from half the drafter's word), and :meth:`values` gives each node's calibrated chance of
being accepted: the product, along its path, of its conditional chances times the factor (each
at most 1). A child's value never exceeds its parent's, so the sizing's ordered prefixes stay
closed under parents.

Before the run has shown anything, the drafter's word counts half (:data:`PRIOR_FACTOR`): the two
ways of being wrong cost unequally. A tree sized by a head confident off its home ground is
verified for nothing, and on a CPU each node costs a share of a step: the first drafting step of a
run read 32 nodes, none accepted, at T(33)/T(1) of a step, on a reasoning question of 12 tokens.
A tree sized too small where the head is right loses only the tokens its missing nodes would have
added at one step, and the first verdicts restore the head's word (one step of a three-node chain
accepted whole brings the factor from 0.5 to about 1). A tree sized to nothing must still bring a
verdict, or a factor that fell below what any node needs stays there for the rest of the run: EAGLE
observes its look's likeliest token against the step's own as a one-node draft.
"""

from __future__ import annotations

from typing import Sequence

#: Weight of each step's evidence after a newer step's: a memory of about ten drafting steps.
DECAY = 0.9
#: Pseudo-levels of evidence the run starts with, and the factor they say: half the drafter's own word.
PRIOR, PRIOR_FACTOR = 1.0, 0.5


class Calibration:
    """The run's measured acceptance against a drafter's predicted one (see the module)."""

    def __init__(self):
        self._predicted = 0.0
        self._realized = 0.0

    @property
    def factor(self) -> float:
        """Realized over predicted acceptance per level; :data:`PRIOR_FACTOR` before any evidence."""
        return (self._realized + PRIOR * PRIOR_FACTOR) / (self._predicted + PRIOR)

    def values(self, parents: Sequence[int], chances: Sequence[float]) -> list[float]:
        """Each node's calibrated chance of acceptance: along its path (``parents``, -1 the root;
        a parent before its children), the product of ``chances`` (each node's chance given its
        parent's acceptance) scaled by :attr:`factor`, each term at most 1."""
        f = self.factor
        out: list[float] = []
        for parent, chance in zip(parents, chances):
            out.append(min(1.0, f * chance) * (out[parent] if parent >= 0 else 1.0))
        return out

    def observe(self, parents: Sequence[int], chances: Sequence[float], accepted: Sequence[int]) -> None:
        """One verified draft: its nodes' ``parents`` and the conditional ``chances`` it was sized by,
        and the accepted path (node indices from the root). Each level the path reached counts: the
        chances of the reached node's children against whether the path went on through one."""
        predicted = realized = 0.0
        reached = -1
        for depth in range(len(accepted) + 1):
            offered = sum(c for p, c in zip(parents, chances) if p == reached)
            if offered <= 0.0:
                break  # a leaf: the draft offered nothing further along the path
            predicted += offered
            if depth < len(accepted):
                realized += 1.0
                reached = accepted[depth]
        self._predicted = self._predicted * DECAY + predicted
        self._realized = self._realized * DECAY + realized

    def observe_look(self, chance: float, right: bool) -> None:
        """A step that drafted nothing, its drafter's likeliest next token given ``chance``: judged as a
        one-node draft would have been, ``right`` whether the step's own token was that one."""
        self.observe([-1], [chance], [0] if right else [])
