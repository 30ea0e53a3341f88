"""A full disk after a draft's fit costs only the fitting again; Stop during tune's predictor stops it."""

import logging

import pytest
import torch

from specplay.core.models import kquant

needs_kernel = pytest.mark.skipif(kquant.unavailable() is not None,
                                  reason=f"no k-quant kernel: {kquant.unavailable()}")


@needs_kernel
def test_a_full_disk_after_the_drafts_fit_still_loads_it_and_fits_again_next_time(tmp_path, monkeypatch, caplog):
    """safetensors' ``save_file`` raises its own ``SafetensorError`` (not an OSError) when the disk fills:
    the draft loads on the blocks just fitted, nothing half-written is kept, and a warning says why."""
    import safetensors.torch
    from safetensors import SafetensorError

    from specplay.core.models import loader
    from specplay.core.models.cache import KQUANT_DRAFT_WEIGHTS, check_weights
    from tiny import tiny_hf_model, write_tiny_gguf

    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_hf_model(seed=3, dtype=torch.float32, vocab=64, hidden=32, inter=64), path)

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with caplog.at_level(logging.WARNING):
        draft = loader.load_model(str(path), dtype="int8", role="draft", backend="native")
    assert draft.model.storage == "kquant-draft"
    assert draft.model.forward(torch.tensor([4, 5, 6])).logits.shape == (3, 64)
    assert not (draft.path / KQUANT_DRAFT_WEIGHTS).exists() and check_weights(draft.path, "kquant-draft") == "missing"
    assert not [p for p in draft.path.iterdir() if "tmp" in p.name]
    assert "fitted again at the next load" in caplog.text and "No space left" in caplog.text


def test_a_full_disk_while_storing_an_int4_drafts_layers_is_a_safetensors_error_too(tmp_path, monkeypatch, caplog):
    import safetensors.torch
    from safetensors import SafetensorError

    from specplay.core.models import cache
    from test_model_cache import TOKENS, draft_logits, int8_cache_folder

    folder = int8_cache_folder(tmp_path)

    def full_disk(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with caplog.at_level(logging.WARNING):
        assert draft_logits(folder, monkeypatch).shape[0] == len(TOKENS)
    assert cache.check_weights(folder, "int4-draft") == "missing" and "packed again at the next load" in caplog.text
