"""Self-distillation data: batched greedy answers with their features, resumable."""

from __future__ import annotations

import torch

from core.models.native import greedy_batch
from tests.tiny import tiny_pair


def plain_greedy(model, prompt, max_new, stop=(2,)):
    """One sequence at a time: tokens, final-norm features and argmax at every position."""
    model.reset()
    out = model.forward(torch.tensor(prompt), hidden=True)
    model.commit(len(prompt))
    feats, labels = [out.hidden], [out.logits.argmax(-1)]
    tokens = list(prompt) + [int(labels[-1][-1])]
    while tokens[-1] not in stop and len(tokens) - len(prompt) < max_new:
        out = model.forward(torch.tensor([tokens[-1]]), hidden=True)
        model.commit(1)
        feats.append(out.hidden)
        labels.append(out.logits.argmax(-1))
        tokens.append(int(labels[-1][-1]))
    model.reset()
    return tokens[:-1], torch.cat(feats), torch.cat(labels)


def test_greedy_batch_matches_one_sequence_at_a_time():
    """More prompts than slots, of different lengths, some stopping early: every sequence, its
    features and its labels are those of plain greedy decoding (float64, so no near-ties)."""
    model, _ = tiny_pair(dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    prompts = [(k, torch.randint(3, 64, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist())
               for k in range(7)]
    got = {}
    greedy_batch(model, prompts, max_new_tokens=9, stop_ids=(2, 5, 7), slots=3,
                 on_done=lambda key, gen: got.__setitem__(key, gen))
    assert sorted(got) == list(range(7))
    lengths = set()
    for key, prompt in prompts:
        tokens, feats, labels = plain_greedy(model, prompt, 9, stop=(2, 5, 7))
        gen = got[key]
        assert gen.tokens.tolist() == tokens
        assert gen.prompt_len == len(prompt)
        assert gen.labels.tolist() == labels.tolist()
        # Stored in float16: equal up to that format's rounding (one step: 2^-11 relative).
        torch.testing.assert_close(gen.features.double(), feats, rtol=2 ** -10, atol=1e-6)
        lengths.add(len(tokens) - len(prompt))
    assert len(lengths) > 1  # some answers stopped before others: slots were refilled mid-run


def chat_tokenizer():
    from tests.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


def sequences_of(data):
    """The set of token sequences in a FeatureSet (order-free: answers finish in any order)."""
    return sorted(tuple(data.tokens[a:b].tolist()) for a, b in zip(data.starts[:-1].tolist(), data.starts[1:].tolist()))


def test_answer_generation_resumes_after_a_cancel(tmp_path):
    """A cancelled generation keeps its finished answers on disk; the next run answers only the
    rest, and the result is the one an uninterrupted run gives."""
    import pytest

    from core.errors import Cancelled
    from core.training.data import generate_answers

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    prompts = ["ab cd", "xyz", "hello world", "q", "abc abc", "zz top", "m n o", "kk"]
    whole = generate_answers(model, tok, prompts, 6, tmp_path / "whole", slots=3, shard_size=2)

    calls = {"n": 0}

    def cancel_later():
        calls["n"] += 1
        return calls["n"] > 8

    with pytest.raises(Cancelled):
        generate_answers(model, tok, prompts, 6, tmp_path / "resumed", slots=3, shard_size=2,
                         should_cancel=cancel_later)
    kept = list((tmp_path / "resumed").glob("answers-*.safetensors"))
    assert kept, "finished answers were not kept"
    answered = []
    resumed = generate_answers(model, tok, prompts, 6, tmp_path / "resumed", slots=3, shard_size=2,
                               progress=lambda msg, frac: answered.append(msg))
    assert sequences_of(resumed) == sequences_of(whole)
    assert resumed.starts.numel() - 1 == len(prompts)
    assert resumed.features.shape == (resumed.num_tokens, model.info.hidden_size)
    assert len(answered) < len(prompts)  # the second run did not redo the kept answers


def test_fewer_prompts_take_their_answers_from_a_larger_earlier_run(tmp_path):
    """Data-size experiments reuse one generation: asking for the first n prompts returns just
    their answers, without generating anything."""
    from core.training.data import generate_answers

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    prompts = ["ab cd", "xyz", "hello world", "q", "abc abc", "zz top", "m n o", "kk"]
    whole = generate_answers(model, tok, prompts, 6, tmp_path, slots=3, shard_size=3)
    generated = []
    first = generate_answers(model, tok, prompts[:3], 6, tmp_path, slots=3, shard_size=3,
                             progress=lambda msg, frac: generated.append(msg))
    assert not generated and first.starts.numel() - 1 == 3
    alone = generate_answers(model, tok, prompts[:3], 6, tmp_path / "alone", slots=3, shard_size=3)
    assert sequences_of(first) == sequences_of(alone)
    assert set(sequences_of(first)) <= set(sequences_of(whole))


PROMPTS = ["ab cd", "xyz", "hello world", "q", "abc abc", "zz top", "m n o", "kk"]


def test_a_saved_corpus_stands_in_for_generating(tmp_path):
    """The token ids of finished answers, kept in a corpus file, give a fresh work folder the same
    data without generating: the target reads each answer once (teacher forcing), and its
    features and labels are those the generation kept."""
    from core.training.data import generate_answers, load_corpus, save_corpus

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    whole = generate_answers(model, tok, PROMPTS, 6, tmp_path / "made", slots=3, shard_size=3)
    assert save_corpus(tmp_path / "made", tmp_path / "corpus.safetensors", "tiny") == len(PROMPTS)
    corpus = load_corpus(tmp_path / "corpus.safetensors", "tiny")
    said = []
    again = generate_answers(model, tok, PROMPTS, 6, tmp_path / "fresh", slots=3, shard_size=3, corpus=corpus,
                             progress=lambda msg, frac: said.append(msg))
    assert said and all(m.startswith("Reading answers from the corpus") for m in said)
    by_seq = {}
    for data in (whole, again):
        for a, b in zip(data.starts[:-1].tolist(), data.starts[1:].tolist()):
            by_seq.setdefault(tuple(data.tokens[a:b].tolist()), []).append((data.features[a:b], data.labels[a:b]))
    assert len(by_seq) == len(PROMPTS) and all(len(v) == 2 for v in by_seq.values())
    for (f1, l1), (f2, l2) in by_seq.values():
        assert l1.tolist() == l2.tolist()
        torch.testing.assert_close(f1.double(), f2.double(), rtol=2 ** -10, atol=1e-6)


def test_a_corpus_answer_is_used_only_where_it_answers_that_prompt_in_full(tmp_path):
    """Answers cut short by a smaller length limit are generated again for a larger one (a cut
    answer is not the answer), used and cut for a smaller one; a corpus entry for another prompt
    is ignored; the corpus file grows, it is never replaced by a smaller one."""
    from core.training.data import generate_answers, load_corpus, save_corpus, usable_answer

    stop = {2}
    assert usable_answer([7, 8, 9, 10], [7, 8], 2, stop) == [7, 8, 9, 10]
    assert usable_answer([7, 8, 9, 10], [7, 8], 1, stop) == [7, 8, 9]
    assert usable_answer([7, 8, 9, 10], [7, 8], 3, stop) is None  # cut at 2: the third token is unknown
    assert usable_answer([7, 8, 9, 2], [7, 8], 5, stop) == [7, 8, 9, 2]  # it had ended
    assert usable_answer([7, 8, 9, 2], [7, 5], 5, stop) is None  # another prompt

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    path = tmp_path / "corpus.safetensors"
    generate_answers(model, tok, PROMPTS[:3], 6, tmp_path / "first", slots=3, shard_size=3)
    assert save_corpus(tmp_path / "first", path, "tiny") == 3
    whole = generate_answers(model, tok, PROMPTS, 6, tmp_path / "second", slots=3, shard_size=3)
    save_corpus(tmp_path / "first", path, "tiny")
    assert len(load_corpus(path, "tiny")) == 3
    assert save_corpus(tmp_path / "second", path, "tiny") == len(PROMPTS)
    assert save_corpus(tmp_path / "first", path, "tiny") == len(PROMPTS)  # merged, not replaced

    short = generate_answers(model, tok, PROMPTS, 3, tmp_path / "short", slots=3, shard_size=3)
    save_corpus(tmp_path / "short", tmp_path / "short.safetensors", "tiny")
    said = []
    longer = generate_answers(model, tok, PROMPTS, 6, tmp_path / "longer", slots=3, shard_size=3,
                              corpus=load_corpus(tmp_path / "short.safetensors", "tiny"),
                              progress=lambda msg, frac: said.append(msg))
    assert sequences_of(longer) == sequences_of(whole)
    assert any(m.startswith("Generating answers") for m in said)  # the cut answers were made again
    cut = generate_answers(model, tok, PROMPTS, 3, tmp_path / "cut", slots=3, shard_size=3,
                           corpus=load_corpus(path, "tiny"))
    assert sequences_of(cut) == sequences_of(short)


def test_an_unreadable_or_foreign_corpus_is_not_used(tmp_path, caplog):
    """A corpus of another target's answers, or a corrupt file, costs only the time it would have
    saved: it reads as empty, with a line in the log saying why."""
    import logging

    from core.training.data import generate_answers, load_corpus, save_corpus

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    generate_answers(model, tok, PROMPTS[:2], 4, tmp_path / "made", slots=2, shard_size=2)
    path = tmp_path / "corpus.safetensors"
    save_corpus(tmp_path / "made", path, "tiny")
    assert len(load_corpus(path, "tiny")) == 2
    with caplog.at_level(logging.INFO):
        assert load_corpus(path, "another-model") == {}
        assert "another-model" in caplog.text
        path.write_bytes(path.read_bytes()[:40])
        assert load_corpus(path, "tiny") == {}
        assert "cannot read the answer corpus" in caplog.text
    assert load_corpus(tmp_path / "missing.safetensors", "tiny") == {}
