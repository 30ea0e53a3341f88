"""`specplay train --recipe eagle3|hydra`: data with the target's layers and distribution, τ_sim, manifests."""

import json

import pytest
import torch

from specplay.core.cli import main
from specplay.core.methods.eagle import EagleConfig
from test_eagle3 import _run


def test_specplay_train_eagle3_prints_tau_sim_and_writes_a_head_the_method_runs(tmp_path, capsys):
    """`specplay train eagle --recipe eagle3` end to end on a tiny target: the target's layers are
    read, τ_sim is printed at each evaluation and kept in the manifest with the per-level
    accuracy, and the head drafts exactly (greedy output unchanged)."""
    from transformers import AutoTokenizer

    from specplay.core.models import load_model
    from tiny import save_tiny_model

    folder = save_tiny_model(tmp_path / "chat", seed=0, layers=3)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(folder)
    out = tmp_path / "e3.safetensors"
    args = ["train", "eagle", "--recipe", "eagle3", "--target", folder, "--answers", "6", "--answer-tokens", "8",
            "--code-tokens", "20", "--steps", "4", "--batch-size", "2", "--window", "16", "--unroll", "2",
            "--workdir", tmp_path / "w", "--out", out, "--corpus", tmp_path / "none.safetensors"]
    assert main([str(a) for a in args]) == 0
    printed, err = capsys.readouterr()
    assert "τ_sim" in err and "by level" in err
    manifest = json.loads(out.with_suffix(".json").read_text())
    assert manifest["recipe"] == "eagle3" and manifest["layers"] == [1, 0, 1] and manifest["unroll"] == 2
    assert 1.0 <= manifest["tau_sim"] <= 1 + 5 and manifest["tau_sim_roots"] > 0 and manifest["tau_sim_se"] >= 0
    assert len(manifest["accuracy"]["top1_by_level"]) == 3 and manifest["steps"] == 4
    assert json.loads(printed.splitlines()[-1])["tau_sim"] == manifest["tau_sim"]

    target = load_model(str(folder), device="cpu", dtype="float64")
    prompt = [4, 5, 6, 3, 7, 8]
    base = _run(target, "autoregressive", n=30, prompt=prompt)
    assert _run(target, "eagle", EagleConfig(head=str(out)), n=30, prompt=prompt).token_ids == base.token_ids

    assert main(["train", "medusa", "--recipe", "eagle3", "--target", str(folder)]) == 1
    assert "not one for medusa heads" in capsys.readouterr().err


def test_classic_and_hydra_medusa_heads_record_tau_sim(tmp_path, capsys):
    """The classic recipes measure τ_sim too, on their own held-out answers; Hydra heads train
    from the target's distribution and say so in their manifest."""
    from transformers import AutoTokenizer

    from tiny import save_tiny_model

    folder = save_tiny_model(tmp_path / "chat", seed=0, layers=2)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(folder)
    common = ["train", "medusa", "--target", folder, "--answers", "6", "--answer-tokens", "8", "--code-tokens", "20",
              "--steps", "4", "--batch-size", "8", "--num-heads", "3", "--workdir", tmp_path / "w",
              "--corpus", tmp_path / "none.safetensors"]
    for recipe in ("classic", "hydra"):
        out = tmp_path / f"{recipe}.safetensors"
        assert main([str(a) for a in common + ["--recipe", recipe, "--out", out]]) == 0
        assert "τ_sim" in capsys.readouterr().err
        manifest = json.loads(out.with_suffix(".json").read_text())
        assert manifest["recipe"] == recipe
        assert 1.0 <= manifest["tau_sim"] <= 4.0 and manifest["tau_sim_roots"] > 0 and manifest["tau_sim_se"] >= 0
        assert manifest["tau_sim_tree"]["shape"] == "static" and len(manifest["top1"]) == 3


def test_compare_recipes_trains_both_heads_on_the_same_answers_and_judges_them_alike(tmp_path):
    """specplay.core.training.compare_recipes on a tiny target: each stage's result has the comparison's
    fields, training lowers the loss, a CPU budget stops training within about a step of it, and a
    saved head judges as it did before saving, up to its int8 rows."""
    from specplay.core.heads import EagleHead, head_config, save_heads
    from specplay.core.training.compare_recipes import Comparison, save_trained
    from test_eagle3 import LAYERS, teacher_set
    from tiny import loaded, native_from_hf, tiny_hf_model

    model = loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64, layers=3))).model
    g = torch.Generator().manual_seed(0)
    seqs = [[4, 5, 6, 3] + torch.randint(3, 64, (36,), generator=g).tolist() for _ in range(8)]
    data = [teacher_set(model, seqs[:6], [4] * 6), teacher_set(model, seqs[6:], [4] * 2)]
    cmp = Comparison(model, *data, window=16, windows=8, roots=20)
    assert cmp.cut == 6 * 40 and cmp.eval_fraction == 0.25
    for recipe in ("eagle3", "classic"):
        head, r = cmp.trained(recipe, steps=12, log=lambda line: None, batch_size=4, lr=1e-2, warmup=1)
        assert r["recipe"] == recipe and r["steps"] == 12 and r["data_tokens"] == 240 and r["train_cpu_s"] > 0
        assert len(r["top1_by_level"]) == 5 and r["tau_sim_roots"] == 20 and 1.0 <= r["tau_sim"] <= 6.0
        assert r["loss_end"] < r["loss_start"]
        out = tmp_path / f"{recipe}.safetensors"
        save_trained(out, head, {**r, "command": "test"}, model, cmp.vocab_ids, "tiny", LAYERS)
        saved = cmp.shipped(out)
        assert saved["recipe"] == recipe and saved["steps"] == 12 and saved["draft_vocab"] == r["draft_vocab"]
        assert max(abs(a - b) for a, b in zip(saved["top1_by_level"], r["top1_by_level"])) <= 0.1
        as_saved = {"tau_sim": saved["tau_sim"], "top1_by_level": saved["top1_by_level"]}
        save_trained(out, head, {**r, "command": "test", "as_saved": as_saved}, model, cmp.vocab_ids, "tiny", LAYERS)
        assert json.loads(out.with_suffix(".json").read_text())["as_saved"] == as_saved
        assert cmp.shipped(out)["top1_by_level"] == saved["top1_by_level"]  # the same rows, saved again
    _, r = cmp.trained("classic", seconds=0.5, log=lambda line: None, batch_size=4, lr=1e-2, warmup=1)
    assert r["steps"] >= 1 and r["cpu_s_per_step_timed"] > 0
    assert r["train_cpu_s"] <= 0.5 + 4 * r["cpu_s_per_step_timed"] + 0.5
    for recipe in ("medusa", "hydra"):
        heads, r = cmp.trained(recipe, steps=30, log=lambda line: None, batch_size=16, lr=1e-2, warmup=1)
        assert r["recipe"] == recipe and r["steps"] == 30 and r["loss_end"] < r["loss_start"]
        assert len(r["top1_by_head"]) == 4 and len(r["accuracy"]) == 4 and r["eval_positions"] == 2 * 40
        assert r["tau_sim_roots"] == 20 and 1.0 <= r["tau_sim"] <= 5.0 and r["tau_sim_tree"]["shape"] == "static"
        out = tmp_path / f"{recipe}.safetensors"
        save_trained(out, heads, {**r, "command": "test"}, model, cmp.vocab_ids, "tiny")
        saved = cmp.shipped(out, "medusa")
        assert saved["recipe"] == recipe and saved["steps"] == 30 and saved["draft_vocab"] == r["draft_vocab"]
        assert max(abs(a - b) for a, b in zip(saved["top1_by_head"], r["top1_by_head"])) <= 0.05
    with pytest.raises(ValueError, match="steps"):
        cmp.trained("hydra", seconds=1.0, log=lambda line: None)

    head, info = EagleHead(head_config(model.cfg)), model.info  # a heads file is judged as it is
    save_heads(tmp_path / "e.safetensors", {**head.state_dict(), "vocab_ids": torch.arange(info.vocab_size)},
               {"kind": "eagle", "hidden_size": info.hidden_size, "vocab_size": info.vocab_size, "steps": 5,
                "intermediate_size": head.cfg.intermediate_size, "data": {"total_tokens": 99}, "train_seconds": 1.0})
    r = cmp.shipped(tmp_path / "e.safetensors")
    assert r["data_tokens"] == 99 and r["draft_vocab"] == info.vocab_size and len(r["top1_by_level"]) == 5


def test_training_can_start_from_a_heads_file_and_its_draft_vocabulary(tmp_path):
    """compare_recipes' ``--init``: a stage starts from a saved head (one learnt on another storage's
    features, say) and its draft vocabulary, not afresh: its first losses are near the saved head's
    last ones, well below a new head's first; a file of another recipe is refused."""
    from specplay.core.training.compare_recipes import Comparison, save_trained
    from test_eagle3 import LAYERS, teacher_set
    from tiny import loaded, native_from_hf, tiny_hf_model

    model = loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64, layers=3))).model
    g = torch.Generator().manual_seed(0)
    seqs = [[4, 5, 6, 3] + torch.randint(3, 64, (36,), generator=g).tolist() for _ in range(8)]
    data = [teacher_set(model, seqs[:6], [4] * 6), teacher_set(model, seqs[6:], [4] * 2)]
    quiet = dict(log=lambda line: None, batch_size=4, lr=1e-2, warmup=1)
    for recipe, steps in (("eagle3", 40), ("hydra", 60)):
        cmp = Comparison(model, *data, window=16, windows=8, roots=20)
        head, first = cmp.trained(recipe, steps=steps, **quiet)
        path = tmp_path / f"{recipe}.safetensors"
        save_trained(path, head, {**first, "command": "test"}, model, cmp.vocab_ids, "tiny", LAYERS)
        again = Comparison(model, *data, draft_vocab=20, window=16, windows=8, roots=20)
        assert again.vocab_ids.numel() < cmp.vocab_ids.numel()
        start, origin = again.start_from(path, recipe)
        assert origin["file"] == path.name
        assert torch.equal(again.vocab_ids, cmp.vocab_ids)
        _, resumed = again.trained(recipe, steps=4, start=start, **quiet)
        assert resumed["loss_start"] < (first["loss_start"] + first["loss_end"]) / 2, (resumed, first)
        with pytest.raises(ValueError, match="not classic heads|not medusa heads"):
            again.start_from(path, "classic" if recipe == "eagle3" else "medusa")


def test_the_comparison_never_learns_from_its_held_out_answers():
    """The splits to learn from are disjoint from each other and from the held-out answers, and
    together hold every answer of the committed corpus the held-out ones do not."""
    from specplay.core.paths import shipped_corpus
    from specplay.core.training.compare_recipes import SPLITS, TARGET
    from specplay.core.training.data import load_corpus
    from specplay.core.weights.catalog import CATALOG

    learn = [set(SPLITS[name]) for name in ("train", "more", "rest", "late")]
    held = set(SPLITS["heldout"])
    assert all(not (a & b) for i, a in enumerate(learn) for b in learn[i + 1:])
    assert all(not (part & held) for part in learn)
    corpus = set(load_corpus(shipped_corpus(TARGET), TARGET, CATALOG[TARGET].sha256))
    assert corpus, "the committed corpus did not load"
    assert held <= corpus and corpus - held <= set().union(*learn)
    # unseen: the late answers the heads shipped on 2026-12-06 did not learn from (the first 688 of late)
    assert set(SPLITS["unseen"]) <= set(SPLITS["late"]) and not set(SPLITS["unseen"]) & held
    assert len([k for k in SPLITS["late"] if k in corpus and k not in SPLITS["unseen"]]) == 688


def test_a_training_stage_refuses_to_learn_from_the_held_out_answers(capsys):
    """``--splits`` names what a stage trains on (a head trained on from ``--init`` needs none of what it
    learnt from); the held-out answers judge every head, so training on them is refused before any
    model loads."""
    from specplay.core.training.compare_recipes import SPLITS, main

    for splits in ("unseen,heldout", "probe-own,heldout-own"):
        with pytest.raises(SystemExit) as raised:
            main(["eagle3", "--steps", "1", "--splits", splits])
        assert raised.value.code == 2 and "held-out answers judge the heads" in capsys.readouterr().err
    # probe, the trial of the target's own answers, is answers no split to learn from ever held out
    assert set(SPLITS["probe"]) <= set(SPLITS["rest"])


def test_the_own_stage_answers_named_splits_and_judge_names_its_file(capsys, tmp_path):
    """``own`` makes the ``-own`` splits from plain ones (it is not given one, nor is ``agreement``, which judges
    the committed answers); ``judge`` needs a heads file with a manifest; each refuses before any model loads."""
    from safetensors.torch import save_file

    from specplay.core.training.compare_recipes import main

    save_file({"w": torch.zeros(2)}, str(tmp_path / "bare.safetensors"))

    for argv, said in ((["own"], "own answers the prompts of --splits"),
                       (["own", "--splits", "probe-own"], "unknown split probe-own"),
                       (["agreement", "--splits", "heldout-own"], "unknown split heldout-own"),
                       (["judge", "--splits", "probe"], "judge needs --heads FILE"),
                       (["judge", "--heads", str(tmp_path / "none.safetensors")], "heads file not found"),
                       (["judge", "--heads", str(tmp_path / "bare.safetensors")], "has no SpecPlay manifest"),
                       (["eagle3", "--steps", "1", "--splits", "nothing-own"], "unknown split nothing-own")):
        with pytest.raises(SystemExit) as raised:
            main(argv)
        assert raised.value.code == 2 and said in capsys.readouterr().err, argv
