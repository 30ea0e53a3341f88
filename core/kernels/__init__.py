"""Kernels: the linear kinds a model's matrices run on (torch's float and int8 rows, the draft's int4
layers, the exact k-quant kernel and its fused C decoder layer), compiling and loading the C library,
and what proves a kind exact on this CPU.

May import: the helpers in ``specplay.core`` only (the bottom room of the house).
"""
