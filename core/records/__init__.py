"""What a run leaves behind: its record (:mod:`~specplay.core.records.runlog`, one schema for every
tool), the history of saved runs (:mod:`~specplay.core.records.history`), and the machine a record
was made on (:mod:`~specplay.core.records.environment`).

May import: the helpers in ``specplay.core``, :mod:`specplay.core.models` and :mod:`specplay.core.decoding`.
"""
