"""SpecPlay's engine: models, decoding methods, verification, metrics, training and benchmarks.

Pure Python and torch; nothing here imports Qt (``tests/test_architecture.py`` enforces it).
"""

__version__ = "0.1.0"
