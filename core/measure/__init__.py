"""The tools that measure: the benchmark (:mod:`~specplay.core.measure.bench`), the losslessness audit,
methods side by side (:mod:`~specplay.core.measure.compare`), why a method runs at its speed
(:mod:`~specplay.core.measure.whyspeed`) and the tune of a method's knobs (:mod:`~specplay.core.measure.tune`,
which predicts from the steps :mod:`~specplay.core.measure.replay` replays along a known answer).

May import everything below the interfaces: the helpers, models, heads, the decoding step, the
methods, records, remote engines and training.
"""
