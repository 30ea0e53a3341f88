"""The decoding step and the loop that runs it.

One step is propose → verify → commit → observe: a method (:mod:`specplay.core.decoding.method`
is the contract every method implements) proposes a draft, the target verifies it in one pass
(:mod:`~specplay.core.decoding.verification`: only the verifier accepts tokens; the samplers in
:mod:`~specplay.core.decoding.sampling`, the trees and their masks in
:mod:`~specplay.core.decoding.tree`), the engine (:mod:`~specplay.core.decoding.engine`) commits the
accepted tokens, and the method observes the outcome. Beside them: the run's types, its metrics,
the stand-down gate and the machine's cost curve (:mod:`~specplay.core.decoding.costmodel`).

May import: the helpers in ``specplay.core``, :mod:`specplay.core.models` and :mod:`specplay.core.heads`.
"""
