"""A slow stage's progress: its fraction, and the time left once the pace means something."""

from specplay.core.progress import counting_down


def test_a_stage_reports_its_fraction_and_the_time_left_from_its_pace():
    now = [100.0]
    seen = []
    report = counting_down(lambda stage, fraction: seen.append((stage, fraction)), "Fitting the draft",
                           clock=lambda: now[0])
    report(0.0)
    now[0] += 1.0
    report(0.5)  # a second in: too early to say
    now[0] += 3.0
    report(0.8)  # 4 s for 80%: 1 s left
    now[0] += 60.0
    report(0.81)  # 64 s for 81%: 15 s left
    report(1.0)
    assert seen == [("Fitting the draft", 0.0), ("Fitting the draft", 0.5),
                    ("Fitting the draft: about 1 s left", 0.8), ("Fitting the draft: about 15 s left", 0.81),
                    ("Fitting the draft", 1.0)]
    slow = counting_down(lambda stage, fraction: seen.append(stage), "Assembling", clock=lambda: now[0])
    now[0] += 600.0
    slow(0.1)
    assert seen[-1] == "Assembling: about 90 min left"


def test_reading_a_models_matrices_counts_their_bytes_not_their_number():
    """A draft's embedding is a quarter of its bytes and takes a quarter of its fitting: the fraction
    read follows the bytes, so the time left said from it stays honest."""
    from types import SimpleNamespace

    import numpy as np

    from specplay.core.weights.gguf_blocks import CountedReads

    tensors = {"token_embd.weight": np.zeros(300, np.uint8), "output_norm.weight": np.zeros(100, np.uint8)}
    reader = SimpleNamespace(tensors={k: SimpleNamespace(data=v) for k, v in tensors.items()},
                             get=lambda name: None if name == "missing" else name)
    seen = []
    counted = CountedReads(reader, seen.append)
    assert counted.get("model.embed_tokens.weight") == "model.embed_tokens.weight"
    counted.get("missing")
    counted.get("model.norm.weight")
    assert seen == [0.75, 1.0]
