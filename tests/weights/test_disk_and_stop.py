"""A full disk after a draft's fit costs only the fitting again; Stop during tune's predictor stops it."""

import logging

import pytest
import torch

from conftest import require_or_skip
from specplay.core.kernels import kquant


def test_a_full_disk_after_the_drafts_fit_still_loads_it_and_fits_again_next_time(tmp_path, monkeypatch, caplog):
    """The disk fills while the fitted blocks are written: the draft loads on the blocks just fitted,
    nothing half-written is kept, and a warning says why."""
    if kquant.unavailable() is not None:
        require_or_skip("SPECPLAY_REQUIRE_KERNEL", f"no k-quant kernel: {kquant.unavailable()}")
    import errno
    import io

    from specplay.core.models import loader
    from specplay.core.weights import gguf_blocks
    from specplay.core.weights.cache import KQUANT_DRAFT_WEIGHTS, check_weights
    from tiny import tiny_hf_model, write_tiny_gguf

    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_hf_model(seed=3, dtype=torch.float32, vocab=64, hidden=32, inter=64), path)

    class FullDisk(io.FileIO):
        def write(self, data):
            super().write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf_blocks, "open", lambda name, mode="r": FullDisk(name, mode) if "w" in mode else open(name, mode),
                        raising=False)
    with caplog.at_level(logging.WARNING):
        draft = loader.load_model(str(path), dtype="int8", role="draft", backend="native")
    assert draft.model.storage == "kquant-draft"
    assert draft.model.forward(torch.tensor([4, 5, 6])).logits.shape == (3, 64)
    assert not (draft.path / KQUANT_DRAFT_WEIGHTS).exists() and check_weights(draft.path, "kquant-draft") == "missing"
    assert not [p for p in draft.path.iterdir() if "tmp" in p.name]
    assert "made again at the next load" in caplog.text and "No space left" in caplog.text


def test_a_full_disk_while_storing_an_int4_drafts_layers_is_a_safetensors_error_too(tmp_path, monkeypatch, caplog):
    import safetensors.torch
    from safetensors import SafetensorError

    from specplay.core.weights import cache
    from test_model_cache import TOKENS, draft_logits, int8_cache_folder

    folder = int8_cache_folder(tmp_path)

    def full_disk(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with caplog.at_level(logging.WARNING):
        assert draft_logits(folder, monkeypatch).shape[0] == len(TOKENS)
    assert cache.check_weights(folder, "int4-draft") == "missing" and "packed again at the next load" in caplog.text


@pytest.fixture(scope="module")
def pair():
    from tiny import loaded, native_from_hf, perturbed_copy, tiny_hf_model

    hf = tiny_hf_model(seed=0, dtype=torch.float64)
    return loaded(native_from_hf(hf)), loaded(native_from_hf(perturbed_copy(hf, scale=0.02)), model_id="draft")


# Where Stop comes, in model passes after the predictor began: speculative's are its draft's replay (passes
# 1-41 here), its timings of the draft (42-67), of the handover (68-104) and of the target (105-140).
@pytest.mark.parametrize("method,stop_at", [("speculative", 1), ("speculative", 45), ("speculative", 80),
                                            ("speculative", 115), ("prompt_lookup", 10), ("eagle", 1),
                                            ("eagle", 60)])
def test_stop_during_the_predictor_is_honoured_within_a_pass_and_no_proof_runs(pair, tmp_path, monkeypatch, method,
                                                                               stop_at):
    """The predictor times and replays for many passes before the proof's runs: Stop pressed during
    any of them (here: after pass ``stop_at``) ends the tune with ``Cancelled`` at the next pass
    (EAGLE: once the tree being grown is done), and no proof run starts."""
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.errors import Cancelled
    from specplay.core.heads.eagle import EagleDrafter
    from specplay.core.measure import tune as tuning
    from specplay.core.methods.eagle import EagleConfig
    from test_eagle import make_head_file

    target, draft = pair
    config = EagleConfig(head=str(make_head_file(tmp_path / "eagle.safetensors", target.model, scale=0.05))) \
        if method == "eagle" else None
    state = {"predicting": False, "passes": 0, "stopped": False}

    def counted(fn):
        def run(*args, **kw):
            if state["predicting"]:
                state["passes"] += 1
                state["stopped"] |= state["passes"] >= stop_at
            return fn(*args, **kw)
        return run

    monkeypatch.setattr(target.model, "forward", counted(target.model.forward))
    monkeypatch.setattr(draft.model, "forward", counted(draft.model.forward))
    monkeypatch.setattr(EagleDrafter, "run", counted(EagleDrafter.run))
    stages = []

    def on_stage(text, fraction):
        stages.append(text)
        state["predicting"] = text.startswith("Timing this machine")

    with pytest.raises(Cancelled):
        tuning.tune(target, draft, method, config, [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7, 9, 10, 4, 5],
                    GenerationConfig(max_new_tokens=40, stop_at_eos=False), warmup_tokens=0,
                    should_stop=lambda: state["stopped"], on_stage=on_stage)
    assert state["stopped"] and stages[-1].startswith("Timing this machine")  # no proof run began
    assert state["passes"] - stop_at <= (tuning.EAGLE_DEPTH if method == "eagle" else 1)
