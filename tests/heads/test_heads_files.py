"""Heads files: a draft vocabulary that is missing or does not name distinct target tokens is refused,
naming the file."""

from pathlib import Path

import pytest
import torch

from specplay.core.errors import ModelError
from specplay.core.heads import EagleHead, MedusaHeads, head_config, read_manifest, save_heads
from specplay.core.heads.files import FINGERPRINT_TOLERANCE, feature_fingerprint
from specplay.core.methods import build_method
from specplay.core.methods.eagle import EagleConfig
from specplay.core.methods.medusa import MedusaConfig
from tiny import loaded, native_from_hf, tiny_hf_model

VOCAB = 64


@pytest.fixture(scope="module")
def target():
    return loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64)))


def heads_file(path, vocab_ids):
    tensors = dict(MedusaHeads(32, 2).state_dict(), vocab_ids=vocab_ids)
    save_heads(path, tensors, {"kind": "medusa", "target": "tiny", "hidden_size": 32, "vocab_size": VOCAB,
                               "num_heads": 2, "accuracy": [[0.5, 0.1], [0.3, 0.1]]})
    return path


@pytest.mark.parametrize("vocab_ids", [
    torch.tensor([], dtype=torch.long),  # crashed on max() of an empty tensor
    torch.tensor([-1, 4, 5]),  # indexed the LM head from its end, drafted token -1
    torch.tensor([4, 5, 5, 6]),  # drafted token 5 twice over
    torch.tensor([4, VOCAB]),  # beyond the vocabulary
])
def test_a_draft_vocabulary_of_anything_but_distinct_target_ids_is_refused(tmp_path, target, vocab_ids):
    path = heads_file(tmp_path / "bad-heads.safetensors", vocab_ids)
    with pytest.raises(ModelError, match=r"bad-heads\.safetensors: .*draft vocabulary"):
        build_method("medusa", MedusaConfig(heads=str(path)), target)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_a_heads_file_without_a_draft_vocabulary_is_refused_naming_the_file(tmp_path, target, kind):
    """It was a KeyError 'vocab_ids' that named neither the file nor what is wrong with it."""
    path = tmp_path / "no-vocab.safetensors"
    if kind == "medusa":
        save_heads(path, dict(MedusaHeads(32, 2).state_dict()),
                   {"kind": "medusa", "target": "tiny", "hidden_size": 32, "vocab_size": VOCAB, "num_heads": 2,
                    "accuracy": [[0.5, 0.1], [0.3, 0.1]]})
        config = MedusaConfig(heads=str(path))
    else:
        save_heads(path, dict(EagleHead(head_config(target.model.cfg, 48)).state_dict()),
                   {"kind": "eagle", "target": "tiny", "hidden_size": 32, "vocab_size": VOCAB,
                    "intermediate_size": 48})
        config = EagleConfig(head=str(path))
    with pytest.raises(ModelError, match=r"no-vocab\.safetensors has no draft vocabulary"):
        build_method(kind, config, target)


def test_a_manifest_is_read_without_the_tensors_and_a_file_that_lacks_one_is_named(tmp_path):
    """The reader the methods' loader and compare_recipes' judge share: the manifest as saved, its kind
    checked where one is asked for; a missing file, bytes that are no heads file, a safetensors file
    without a manifest and one whose manifest names no kind of heads are each refused, naming the file
    (the judge's own reader had taken a file without a manifest for EAGLE heads)."""
    path = heads_file(tmp_path / "m.safetensors", torch.tensor([4, 5]))
    assert read_manifest(path)["num_heads"] == 2 and read_manifest(path, "medusa")["kind"] == "medusa"
    with pytest.raises(ModelError, match=r"m\.safetensors holds medusa heads, not eagle heads"):
        read_manifest(path, "eagle")
    with pytest.raises(ModelError, match="heads file not found: .*none"):
        read_manifest(tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    with pytest.raises(ModelError, match=r"junk\.safetensors is not a readable heads file"):
        read_manifest(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "bare.safetensors"))
    with pytest.raises(ModelError, match=r"bare\.safetensors has no SpecPlay manifest"):
        read_manifest(tmp_path / "bare.safetensors")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "odd.safetensors"), metadata={"specplay": '{"kind": "lora"}'})
    with pytest.raises(ModelError, match=r"odd\.safetensors holds lora heads, not Medusa or EAGLE heads"):
        read_manifest(tmp_path / "odd.safetensors")


def test_a_draft_vocabulary_of_distinct_target_ids_in_any_order_loads(tmp_path, target):
    path = heads_file(tmp_path / "heads.safetensors", torch.tensor([9, 2, 63, 0]))
    assert build_method("medusa", MedusaConfig(heads=str(path)), target).vocab_ids.tolist() == [9, 2, 63, 0]


def test_a_shipped_variant_is_chosen_by_name_and_a_missing_one_is_named(tmp_path, monkeypatch):
    """``--heads classic`` reads the classic heads shipped beside the default ones; a file of that
    name in the working folder still wins, and a variant that does not ship is said so."""
    from specplay.core.heads import files

    (tmp_path / "heads").mkdir()
    monkeypatch.setattr(files, "assets_dir", lambda: tmp_path)
    default = heads_file(tmp_path / "heads" / "medusa-tiny.safetensors", torch.arange(VOCAB))
    classic = heads_file(tmp_path / "heads" / "medusa-classic-tiny.safetensors", torch.arange(VOCAB))
    assert files.resolve_heads_path("", "medusa", "models/tiny") == default
    assert files.resolve_heads_path("classic", "medusa", "tiny") == classic
    with pytest.raises(ModelError, match="no classic eagle heads ship for 'tiny'"):
        files.resolve_heads_path("classic", "eagle", "tiny")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "classic").write_bytes(b"")
    assert files.resolve_heads_path("classic", "medusa", "tiny") == Path("classic")


def _manifested_heads(path, model, **manifest):
    """Medusa heads whose manifest says they learnt ``model``'s features (as every trainer writes it)."""
    from specplay.core.heads import heads_manifest

    vocab_ids = torch.arange(VOCAB)
    made = heads_manifest("medusa", "classic", target="tiny", model=model, vocab_ids=vocab_ids, coverage=1.0,
                          command="test", data={}, settings={}, num_heads=2, accuracy=[[0.5, 0.1], [0.3, 0.1]])
    save_heads(path, dict(MedusaHeads(32, 2).state_dict(), vocab_ids=vocab_ids), {**made, **manifest})
    return path


def test_heads_warn_on_a_target_whose_features_are_not_the_ones_they_learnt(tmp_path, target):
    """A manifest keeps the features' fingerprint: heads on the target they learnt load in silence, and on
    one whose features moved as rounding moves them; on a target whose features differ (a perturbed copy,
    as another storage of the same weights would be) the method warns, the run's record and its stats
    line carry it; a file of before the fingerprint warns by the storage it names."""
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.records.runlog import RunRecord, stats_line
    from tiny import perturbed_copy

    path = _manifested_heads(tmp_path / "mine.safetensors", target.model)
    assert build_method("medusa", MedusaConfig(heads=str(path)), target).warnings == ()
    # Features moved by about 1% (as a kernel's last bits moved the real target's, 2.8%) are the same.
    near = loaded(native_from_hf(perturbed_copy(tiny_hf_model(seed=0, dtype=torch.float64), scale=0.0005)))
    was, now = (torch.tensor(feature_fingerprint(m)["values"]) for m in (target.model, near.model))
    assert 1e-3 < float((was - now).norm() / now.norm()) < FINGERPRINT_TOLERANCE
    assert build_method("medusa", MedusaConfig(heads=str(path)), near).warnings == ()

    other = loaded(native_from_hf(perturbed_copy(tiny_hf_model(seed=0, dtype=torch.float64), scale=0.02)))
    method = build_method("medusa", MedusaConfig(heads=str(path)), other)
    assert len(method.warnings) == 1
    assert "mine.safetensors learnt the features of a target stored as float64" in method.warnings[0]
    assert "differ from them by" in method.warnings[0] and "specplay train medusa" in method.warnings[0]
    result = drain(generate(other.model, other.tokenizer, method, [4, 5, 6, 3], GenerationConfig(max_new_tokens=4)))
    record = RunRecord.of_run(result, target=other).to_dict()
    assert record["warnings"] == list(method.warnings)
    assert stats_line(record).endswith("warning: " + method.warnings[0])

    old = _manifested_heads(tmp_path / "old.safetensors", target.model, features=None, feature_dtype="int8")
    warned = build_method("medusa", MedusaConfig(heads=str(old)), target).warnings
    assert len(warned) == 1
    assert "learnt the features of the target stored as int8; this one runs on float64" in warned[0]


def test_an_eagle3_fuse_is_kept_in_float16_and_the_other_matrices_in_int8_rows(tmp_path, target):
    """The fuse reads the target's raw layer outputs, a few of whose values are thousands of times the
    rest: rounded to int8 rows, a fuse column that meets such a value moves the fused feature by far more
    than float16's rounding does (which keeps each weight's own exponent)."""
    from safetensors import safe_open

    from specplay.core.heads import load_heads
    from specplay.core.heads.eagle3 import Eagle3Head

    head = Eagle3Head(head_config(target.model.cfg, 48))
    torch.manual_seed(0)
    with torch.no_grad():
        head.fuse.weight.normal_(0, 0.02)
        head.fuse.weight[:, 0] = 1.0  # one large weight per row: int8 rows' step is then 1/127
    path = tmp_path / "e3.safetensors"
    save_heads(path, {**head.state_dict(), "vocab_ids": torch.arange(VOCAB)},
               {"kind": "eagle", "recipe": "eagle3", "target": "tiny", "hidden_size": 32, "vocab_size": VOCAB,
                "intermediate_size": 48, "layers": [0, 1, 1]})
    with safe_open(str(path), "pt") as f:
        assert f.get_slice("fuse.weight").get_dtype() == "F16" and "fuse.weight:row_scale" not in f.keys()
        assert f.get_slice("fc.weight").get_dtype() == "I8"
    weights, _ = load_heads(path, "eagle", target.model)
    layers = torch.randn(8, 3 * 32)
    layers[:, 5] = 3000.0  # a massive activation, as the residual stream carries
    exact = layers @ head.fuse.weight.detach().T
    error = ((layers @ weights["fuse.weight"].T - exact).norm() / exact.norm()).item()
    step = head.fuse.weight.detach().abs().amax(1, keepdim=True) / 127
    rows = torch.round(head.fuse.weight.detach() / step) * step
    assert error < 0.1 * ((layers @ rows.T - exact).norm() / exact.norm()).item()
