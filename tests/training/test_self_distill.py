"""Self-distillation data: batched greedy answers with their features, resumable."""

from __future__ import annotations

import torch

from specplay.core.training.batched import greedy_batch
from tiny import tiny_pair

KEY = "sha256 of the tiny target's weights"


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
    from tiny import tiny_tokenizer

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

    from specplay.core.errors import Cancelled
    from specplay.core.training.data import generate_answers

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    prompts = ["ab cd", "xyz", "hello world", "q", "abc abc", "zz top", "m n o", "kk"]
    whole = generate_answers(model, tok, prompts, 6, tmp_path / "whole", target_key=KEY, slots=3, shard_size=2)

    calls = {"n": 0}

    def cancel_later():
        calls["n"] += 1
        return calls["n"] > 8

    with pytest.raises(Cancelled):
        generate_answers(model, tok, prompts, 6, tmp_path / "resumed", target_key=KEY, slots=3, shard_size=2,
                         should_cancel=cancel_later)
    kept = list((tmp_path / "resumed").glob("answers-*.safetensors"))
    assert kept, "finished answers were not kept"
    answered = []
    resumed = generate_answers(model, tok, prompts, 6, tmp_path / "resumed", target_key=KEY, slots=3, shard_size=2,
                               progress=lambda msg, frac: answered.append(msg))
    assert sequences_of(resumed) == sequences_of(whole)
    assert resumed.starts.numel() - 1 == len(prompts)
    assert resumed.features.shape == (resumed.num_tokens, model.info.hidden_size)
    assert len(answered) < len(prompts)  # the second run did not redo the kept answers


def test_only_the_prompts_asked_for_are_answered_and_no_corpus_answer_is_read(tmp_path, monkeypatch):
    """``only``: the prompts at those indices are answered as a whole run answers them; the others are
    neither generated nor read from the corpus (adding answers to a corpus costs the new ones alone)."""
    from specplay.core.training import data

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    prompts = PROMPTS[:8]
    whole = data.generate_answers(model, tok, prompts, 6, tmp_path / "whole", target_key=KEY, slots=3)
    corpus = {0: sequences_of(whole)[0]}

    def read_once(*args):
        raise AssertionError("a corpus answer was read")

    monkeypatch.setattr(data, "read_once", read_once)
    part = data.generate_answers(model, tok, prompts, 6, tmp_path / "part", target_key=KEY, slots=3, corpus=corpus,
                                 only=[1, 4, 6])
    asked = [data.chat_prompt_ids(tok, prompts[k]) for k in (1, 4, 6)]
    want = [s for s in sequences_of(whole) if any(list(s[:len(p)]) == p for p in asked)]
    assert len(want) == 3 and sequences_of(part) == want


def test_the_corpus_agreement_finds_where_an_answer_leaves_the_targets_greedy_path(monkeypatch):
    """compare_recipes' agreement stage: the target's own greedy answers never leave its path; an answer
    with its third token changed leaves it there, and the share of differing positions counts it."""
    from types import SimpleNamespace

    from specplay.core.training import data
    from specplay.core.training.compare_recipes import greedy_agreement

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    monkeypatch.setattr(data, "instruction_prompts", lambda n, seed=0: PROMPTS[:n])
    corpus = {}
    for k in (0, 2, 3):
        tokens, _, labels = plain_greedy(model, data.chat_prompt_ids(tok, PROMPTS[k]), 8, stop=())
        corpus[k] = tokens + [int(labels[-1])]
    target = SimpleNamespace(model=model, tokenizer=tok)
    own = greedy_agreement(target, corpus, range(5))
    assert own["answers"] == 3 and own["whole_answers"] == 3 and own["differing_share"] == 0
    assert own["answer_tokens"] == 3 * 8
    start = len(data.chat_prompt_ids(tok, PROMPTS[2]))
    corpus[2][start + 2] = (corpus[2][start + 2] + 1) % model.info.vocab_size
    changed = greedy_agreement(target, corpus, range(5))
    assert changed["whole_answers"] == 2 and changed["first_difference"] == [2] and changed["differing_share"] > 0


def test_fewer_prompts_take_their_answers_from_a_larger_earlier_run(tmp_path):
    """Data-size experiments reuse one generation: asking for the first n prompts returns just
    their answers, without generating anything."""
    from specplay.core.training.data import generate_answers

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    prompts = ["ab cd", "xyz", "hello world", "q", "abc abc", "zz top", "m n o", "kk"]
    whole = generate_answers(model, tok, prompts, 6, tmp_path, target_key=KEY, slots=3, shard_size=3)
    generated = []
    first = generate_answers(model, tok, prompts[:3], 6, tmp_path, target_key=KEY, slots=3, shard_size=3,
                             progress=lambda msg, frac: generated.append(msg))
    assert not generated and first.starts.numel() - 1 == 3
    alone = generate_answers(model, tok, prompts[:3], 6, tmp_path / "alone", target_key=KEY, slots=3, shard_size=3)
    assert sequences_of(first) == sequences_of(alone)
    assert set(sequences_of(first)) <= set(sequences_of(whole))


PROMPTS = ["ab cd", "xyz", "hello world", "q", "abc abc", "zz top", "m n o", "kk"]


def test_a_saved_corpus_stands_in_for_generating(tmp_path):
    """The token ids of finished answers, kept in a corpus file, give a fresh work folder the same
    data without generating: the target reads each answer once (teacher forcing), and its
    features and labels are those the generation kept."""
    from specplay.core.training.data import generate_answers, load_corpus, save_corpus

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    whole = generate_answers(model, tok, PROMPTS, 6, tmp_path / "made", target_key=KEY, slots=3, shard_size=3)
    assert save_corpus(tmp_path / "made", tmp_path / "corpus.safetensors", "tiny") == len(PROMPTS)
    corpus = load_corpus(tmp_path / "corpus.safetensors", "tiny", KEY)
    said = []
    again = generate_answers(model, tok, PROMPTS, 6, tmp_path / "fresh", target_key=KEY, slots=3, shard_size=3,
                             corpus=corpus, progress=lambda msg, frac: said.append(msg))
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
    from specplay.core.training.data import generate_answers, load_corpus, save_corpus, usable_answer

    stop = {2}
    assert usable_answer([7, 8, 9, 10], [7, 8], 2, stop) == [7, 8, 9, 10]
    assert usable_answer([7, 8, 9, 10], [7, 8], 1, stop) == [7, 8, 9]
    assert usable_answer([7, 8, 9, 10], [7, 8], 3, stop) is None  # cut at 2: the third token is unknown
    assert usable_answer([7, 8, 9, 2], [7, 8], 5, stop) == [7, 8, 9, 2]  # it had ended
    assert usable_answer([7, 8, 9, 2], [7, 5], 5, stop) is None  # another prompt

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    path = tmp_path / "corpus.safetensors"
    generate_answers(model, tok, PROMPTS[:3], 6, tmp_path / "first", target_key=KEY, slots=3, shard_size=3)
    assert save_corpus(tmp_path / "first", path, "tiny") == 3
    whole = generate_answers(model, tok, PROMPTS, 6, tmp_path / "second", target_key=KEY, slots=3, shard_size=3)
    save_corpus(tmp_path / "first", path, "tiny")
    assert len(load_corpus(path, "tiny", KEY)) == 3
    assert save_corpus(tmp_path / "second", path, "tiny") == len(PROMPTS)
    assert save_corpus(tmp_path / "first", path, "tiny") == len(PROMPTS)  # merged, not replaced

    short = generate_answers(model, tok, PROMPTS, 3, tmp_path / "short", target_key=KEY, slots=3, shard_size=3)
    save_corpus(tmp_path / "short", tmp_path / "short.safetensors", "tiny")
    said = []
    longer = generate_answers(model, tok, PROMPTS, 6, tmp_path / "longer", target_key=KEY, slots=3, shard_size=3,
                              corpus=load_corpus(tmp_path / "short.safetensors", "tiny", KEY),
                              progress=lambda msg, frac: said.append(msg))
    assert sequences_of(longer) == sequences_of(whole)
    assert any(m.startswith("Generating answers") for m in said)  # the cut answers were made again
    cut = generate_answers(model, tok, PROMPTS, 3, tmp_path / "cut", target_key=KEY, slots=3, shard_size=3,
                           corpus=load_corpus(path, "tiny", KEY))
    assert sequences_of(cut) == sequences_of(short)


def test_an_unreadable_or_foreign_corpus_is_not_used(tmp_path, caplog):
    """A corpus of another target's answers, or a corrupt file, costs only the time it would have
    saved: it reads as empty, with a line in the log saying why."""
    import logging

    from specplay.core.training.data import generate_answers, load_corpus, save_corpus

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    generate_answers(model, tok, PROMPTS[:2], 4, tmp_path / "made", target_key=KEY, slots=2, shard_size=2)
    path = tmp_path / "corpus.safetensors"
    save_corpus(tmp_path / "made", path, "tiny")
    assert len(load_corpus(path, "tiny", KEY)) == 2
    with caplog.at_level(logging.INFO):
        assert load_corpus(path, "another-model", "sha256 of other weights") == {}
        assert "another-model" in caplog.text
        path.write_bytes(path.read_bytes()[:40])
        assert load_corpus(path, "tiny", KEY) == {}
        assert "cannot read the answer corpus" in caplog.text
    assert load_corpus(tmp_path / "missing.safetensors", "tiny", KEY) == {}


def chat_model(path, seed):
    """A tiny model folder with a chat template, loaded as a target."""
    from specplay.core.models import load_model
    from tiny import save_tiny_model

    folder = save_tiny_model(path, seed=seed)
    chat_tokenizer().save_pretrained(folder)
    return load_model(str(folder), device="cpu", dtype="float32")


def prepared(target, workdir, monkeypatch, prompts):
    """`specplay train --data-only` on a few instructions and one short text."""
    from specplay.core.training import recipes

    monkeypatch.setattr(recipes, "instruction_prompts", lambda n, seed: prompts[:n])
    monkeypatch.setattr(recipes, "code_sequences", lambda tok, n, seq_len, seed: [[4, 5, 6, 7, 8, 9, 10, 11]])
    settings = recipes.DataSettings(code_tokens=8, answers=len(prompts), answer_tokens=5, slots=2)
    features, _ = recipes.feature_data(target, settings, workdir, lambda s, f: None, lambda: False,
                                       corpus=workdir.parent / "no-corpus.safetensors")
    return features


def labels_by_sequence(data):
    bounds = data.starts.tolist()
    return {tuple(data.tokens[a:b].tolist()): data.labels[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])}


def test_data_made_by_another_target_with_the_same_folder_name_is_made_again(tmp_path, monkeypatch, caplog):
    """Two targets named alike (the default work folder is named after the target's folder) never
    share answers or features: the data is the one a fresh work folder gets, and the log says
    what was left out."""
    import logging

    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    one, other = chat_model(tmp_path / "a" / "chat", seed=0), chat_model(tmp_path / "b" / "chat", seed=1)
    shared = tmp_path / "work" / "chat"
    prepared(one, shared, monkeypatch, PROMPTS[:4])
    with caplog.at_level(logging.WARNING):
        got = prepared(other, shared, monkeypatch, PROMPTS[:4])
    assert labels_by_sequence(got) == labels_by_sequence(prepared(other, tmp_path / "fresh", monkeypatch, PROMPTS[:4]))
    assert "4 answers made by another target" in caplog.text
    assert "1 feature shards of another target" in caplog.text


def test_answers_to_instructions_that_have_changed_are_made_again(tmp_path, monkeypatch, caplog):
    """The instruction pool is written from this machine's standard library, so another Python can
    put another instruction at an index: its answer is made again, the others are kept."""
    import logging

    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    target = chat_model(tmp_path / "chat", seed=0)
    prepared(target, tmp_path / "work", monkeypatch, PROMPTS[:4])
    changed = [PROMPTS[0], PROMPTS[5], PROMPTS[2], PROMPTS[3]]
    with caplog.at_level(logging.WARNING):
        got = prepared(target, tmp_path / "work", monkeypatch, changed)
    assert labels_by_sequence(got) == labels_by_sequence(prepared(target, tmp_path / "fresh", monkeypatch, changed))
    assert "0 answers made by another target" in caplog.text and "1 to prompts that have changed" in caplog.text


def test_a_target_is_known_by_its_weights_hashed_once(tmp_path, monkeypatch):
    """A converted model by the source sha256 its marker records; a folder by its weights files,
    hashed once and remembered until a file changes; a hub snapshot by the names of its blobs."""
    import shutil

    from specplay.core.training import data
    from specplay.core.weights.cache import write_marker
    from tiny import save_tiny_model

    def quiet(stage, fraction):
        pass

    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    hashed = []
    real_sha256 = data.sha256_file
    monkeypatch.setattr(data, "sha256_file", lambda path, progress: hashed.append(path) or real_sha256(path))
    one, other = save_tiny_model(tmp_path / "one", seed=0), save_tiny_model(tmp_path / "other", seed=1)
    key = data.target_key(one, quiet)
    assert data.target_key(one, quiet) == key and len(hashed) == 1
    assert data.target_key(other, quiet) != key
    shutil.copyfile(other / "model.safetensors", one / "model.safetensors")
    assert data.target_key(one, quiet) == data.target_key(other, quiet) and len(hashed) == 3

    blob = tmp_path / "hub" / "blobs" / ("c" * 64)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"weights")
    snapshot = tmp_path / "hub" / "snapshots" / "main"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(blob)
    assert data.target_key(snapshot, quiet) != key and len(hashed) == 3

    write_marker(one, {"source": "m.gguf", "sha256": "ab" * 32})
    assert data.target_key(one, quiet) == "ab" * 32


def test_the_committed_corpus_is_read_for_the_default_target_alone():
    """The project's corpus is taken for the default target as the catalog pins it (a corpus from before
    corpora recorded their target's weights, or one that records the catalog's), not for other weights
    that share its name."""
    from specplay.core.paths import shipped_corpus
    from specplay.core.training.data import load_corpus
    from specplay.core.weights.catalog import CATALOG, DEFAULT_TARGET

    path = shipped_corpus(DEFAULT_TARGET)
    assert len(load_corpus(path, DEFAULT_TARGET, CATALOG[DEFAULT_TARGET].sha256)) > 2000
    assert load_corpus(path, DEFAULT_TARGET, "sha256 of other weights") == {}


def test_a_corpus_keeps_the_answers_of_its_own_target_alone(tmp_path):
    """Answers of two targets in one work folder: the corpus takes those of the target it is for,
    and records it; without saying which, it refuses to guess."""
    import pytest

    from specplay.core.errors import SpecPlayError
    from specplay.core.training.data import generate_answers, load_corpus, save_corpus

    tok = chat_tokenizer()
    (one, _), (other, _) = tiny_pair(dtype=torch.float64, seed=0), tiny_pair(dtype=torch.float64, seed=1)
    generate_answers(one, tok, PROMPTS[:3], 4, tmp_path / "made", target_key="one", slots=3, shard_size=3)
    generate_answers(other, tok, PROMPTS[:3], 4, tmp_path / "made", target_key="other", slots=3, shard_size=3)
    generate_answers(other, tok, PROMPTS[:3], 4, tmp_path / "alone", target_key="other", slots=3, shard_size=3)
    with pytest.raises(SpecPlayError, match="2 different targets"):
        save_corpus(tmp_path / "made", tmp_path / "corpus.safetensors", "tiny")
    assert save_corpus(tmp_path / "made", tmp_path / "corpus.safetensors", "tiny", key="other") == 3
    save_corpus(tmp_path / "alone", tmp_path / "alone.safetensors", "tiny")
    assert load_corpus(tmp_path / "corpus.safetensors", "tiny", "one") == {}
    assert load_corpus(tmp_path / "corpus.safetensors", "tiny", "other") == \
        load_corpus(tmp_path / "alone.safetensors", "tiny", "other")


def test_own_answers_are_the_targets_greedy_ones_made_afresh_and_read_as_splits_of_their_own(monkeypatch, tmp_path):
    """compare_recipes' own stage: the prompts of the splits named are answered afresh by the target (its
    greedy answers, whatever the committed corpus says), kept in a corpus beside the committed one, and
    captured as ``<split>-own``; an answer the committed corpus holds differently is counted as different."""
    from types import SimpleNamespace

    from specplay.core.training import compare_recipes as cr
    from specplay.core.training import data

    model, _ = tiny_pair(dtype=torch.float64)
    tok = chat_tokenizer()
    stop = tuple(model.info.eos_token_ids)
    monkeypatch.setattr(data, "instruction_prompts", lambda n, seed=0: PROMPTS[:n])
    monkeypatch.setattr(cr, "default_workdir", lambda target_id: tmp_path)
    monkeypatch.setattr(cr, "ANSWER_TOKENS", 8)
    monkeypatch.setitem(cr.SPLITS, "heldout", range(0, 2))
    monkeypatch.setitem(cr.SPLITS, "probe", range(2, 4))
    greedy, committed = {}, {}
    for k in range(5):
        tokens, _, labels = plain_greedy(model, data.chat_prompt_ids(tok, PROMPTS[k]), 8, stop=stop)
        greedy[k] = committed[k] = tokens + [int(labels[-1])]
    start = len(data.chat_prompt_ids(tok, PROMPTS[2]))
    changed = (committed[2][start + 2] + 1) % model.info.vocab_size
    committed[2] = committed[2][:start + 2] + [changed] + committed[2][start + 3:]
    monkeypatch.setattr(cr, "committed_corpus", lambda target: (tmp_path / "committed", KEY, committed))
    target = SimpleNamespace(model=model, tokenizer=tok, model_id="tiny")

    record = cr.own_answers(target, ["heldout", "probe"], log=lambda line: None)
    assert record["answers"] == 4 and record["same_answers"] == 3 and record["first_difference"] == [2]
    own = data.load_corpus(cr.own_corpus_path(target), "tiny", KEY)
    assert own == {k: greedy[k] for k in range(4)}
    for name, keys in (("heldout-own", (0, 1)), ("probe-own", (2, 3))):
        split = cr.load_split(tmp_path / "teacher" / name)
        assert split.starts.numel() - 1 == len(keys)
        assert split.num_tokens == sum(len(greedy[k]) - 1 for k in keys)
