"""Tiny random models for tests: built in code, no files, no hub."""

from __future__ import annotations

import torch

from specplay.core.models.hf_backend import HFCausalLM
from specplay.core.models.native import DecoderConfig, NativeDecoder


def tiny_hf_config(arch: str = "qwen2", vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4,
                   kv_heads: int = 2, inter: int = 64, tie: bool = False):
    import transformers

    C = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
         "mistral": transformers.MistralConfig}[arch]
    return C(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


def tiny_hf_model(arch: str = "qwen2", seed: int = 0, dtype=torch.float32, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(arch, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval()
    # Random init gives near-uniform logits; sharpen them so greedy decoding is not a coin toss.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.25)
    return model


def native_from_hf(model, dtype=torch.float64, storage: str = "float") -> NativeDecoder:
    sd = model.state_dict()
    cfg = DecoderConfig.from_hf(model.config)
    return NativeDecoder(cfg, sd.get, name="tiny", dtype=dtype, storage=storage, eos_token_ids=(2,))


def block_and_singles(a, b, seq, prefix: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ``seq[prefix:]`` after ``seq[:prefix]``: read as one block by model ``a``, one
    token at a time by ``b`` (the same weights). Exact storage must make them equal."""
    a.forward_chain(seq[:prefix])
    block = a.forward(torch.tensor(seq[prefix:])).logits
    b.forward_chain(seq[:prefix])
    singles = []
    for t in seq[prefix:]:
        singles.append(b.forward(torch.tensor([t])).logits)
        b.commit(1)
    return block, torch.cat(singles)


def tiny_pair(arch: str = "qwen2", dtype=torch.float64, seed: int = 0, **kw):
    """(native, hf) views of the same random weights."""
    model = tiny_hf_model(arch, seed=seed, dtype=dtype, **kw)
    return native_from_hf(model, dtype=dtype), HFCausalLM(model, name="tiny-hf", eos_token_ids=(2,))


def tiny_tokenizer(vocab: int = 64, shuffle: int | None = None):
    """A real byte-level BPE tokenizer (the Qwen2 class) whose tokens are single characters.

    Ids 0-2 are ``<unk>``, ``<s>``, ``</s>`` (eos), 3 is a space, then letters and digits, so
    ``"ab cd"`` encodes to ``[4, 5, 3, 6, 7]``. ``shuffle`` permutes the letters, giving a
    tokenizer of the same size with another vocabulary mapping.
    """
    import random
    import string

    from transformers import Qwen2Tokenizer

    letters = list(string.ascii_lowercase + string.ascii_uppercase + string.digits)
    if shuffle is not None:
        random.Random(shuffle).shuffle(letters)
    chars = ["<unk>", "<s>", "</s>", "\u0120"] + letters[: vocab - 4]
    return Qwen2Tokenizer(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token="<unk>", bos_token="<s>",
                          eos_token="</s>", pad_token="<unk>")


def save_tiny_model(folder, arch: str = "qwen2", seed: int = 0, shuffle: int | None = None, **kw):
    """Write a tiny random model folder (config, safetensors, tokenizer) that ``load_model`` accepts."""
    from pathlib import Path

    folder = Path(folder)
    model = tiny_hf_model(arch, seed=seed, **kw)
    model.save_pretrained(str(folder))
    tiny_tokenizer(model.config.vocab_size, shuffle).save_pretrained(str(folder))
    return folder


def perturbed_copy(model, scale: float = 0.05, seed: int = 123):
    """A copy of ``model`` with noise on its matrices: a draft that agrees with it often, not always."""
    import copy

    g = torch.Generator().manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return other


def loaded(native, tokenizer=None, model_id: str = "tiny"):
    """Wrap a model as ``LoadedModel`` (what methods and the CLI take)."""
    from specplay.core.models.loader import LoadedModel

    return LoadedModel(model=native, tokenizer=tokenizer or tiny_tokenizer(native.info.vocab_size), model_id=model_id,
                       path=None)


def target_features(model, sequences):
    """A FeatureSet of ``model``'s final hidden states and argmax labels over ``sequences`` (for trainer tests)."""
    from specplay.core.training.data import FeatureSet

    feats, toks, labels, starts = [], [], [], [0]
    for s in sequences:
        model.reset()
        out = model.forward(torch.tensor(s), hidden=True)
        feats.append(out.hidden.float())
        labels.append(out.logits.argmax(-1))
        toks.append(torch.tensor(s))
        starts.append(starts[-1] + len(s))
    model.reset()
    return FeatureSet(torch.cat(feats), torch.cat(toks), torch.cat(labels), torch.tensor(starts))


def sgd_steps_lower(loss_fn, params, lr: float, steps: int = 3) -> bool:
    """Whether a few plain gradient steps on ``loss_fn()`` lower it."""
    with torch.no_grad():
        before = float(loss_fn())
    opt = torch.optim.SGD(params, lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
    with torch.no_grad():
        return float(loss_fn()) < before


class ConstantLM:
    """A stand-in causal LM whose next-token distribution is the same after any context.

    With a constant target, sequences are i.i.d. draws from one distribution, so exact
    sequence probabilities are products; with a constant draft, q is fixed. The cache only
    counts tokens.
    """

    def __init__(self, probs: list[float], name: str = "constant"):
        from specplay.core.models.base import ModelInfo

        p = torch.tensor(probs, dtype=torch.float64)
        self.logits_row = torch.where(p > 0, p.log(), torch.tensor(float("-inf"), dtype=torch.float64))
        self.info = ModelInfo(name=name, architecture="constant", vocab_size=len(probs), hidden_size=1, num_layers=1,
                              num_parameters=len(probs), device="cpu", dtype="float64", backend="test",
                              eos_token_ids=())
        self._len = 0
        self._pending = 0

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = self._pending = 0

    def forward(self, tokens, positions=None, attn_mask=None, *, hidden=False, layers=(), logit_rows=None,
                prefill=False):
        from specplay.core.models.base import ForwardOutput

        n = len(logit_rows) if logit_rows is not None else len(torch.as_tensor(tokens).reshape(-1))
        self._pending = len(torch.as_tensor(tokens).reshape(-1))
        return ForwardOutput(logits=self.logits_row.expand(n, -1).clone())

    def forward_chain(self, tokens, **kwargs):
        out = self.forward(tokens, **kwargs)
        self.commit(self._pending)
        return out

    def commit(self, keep) -> None:
        self._len += keep if isinstance(keep, int) else len(keep)
        self._pending = 0

    def crop(self, length: int) -> None:
        self._len = length


def need_llama_cpp() -> None:
    """Skip a test without llama-cpp-python (the ``peers`` extra), or fail it where CI requires the extra."""
    import os

    import pytest

    from specplay.core.models.llamacpp import available

    why = available()
    if why:
        if os.environ.get("SPECPLAY_REQUIRE_PEERS"):
            pytest.fail(why)
        pytest.skip(why)


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def add_tiny_vocabulary(w, n: int) -> None:
    """A GGUF writer's tokenizer: ``n`` tokens (unk, bos, eos, a byte, then plain ones), bos 1, eos 2."""
    import gguf

    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "<0x0A>"] + [f"t{i}" for i in range(4, n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.BYTE]
                      + [gguf.TokenType.NORMAL] * (n - 4))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_tiny_gguf(model, path) -> None:
    """A tiny Qwen2 ``transformers`` model (untied) as a float32 GGUF file that llama.cpp loads.

    Its vocabulary is placeholder SentencePiece pieces: llama.cpp only ever sees token ids here.
    """
    import gguf
    import numpy as np

    cfg = model.config
    assert cfg.model_type == "qwen2" and not cfg.tie_word_embeddings
    w = gguf.GGUFWriter(str(path), arch="qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tiny_vocabulary(w, cfg.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for i in range(cfg.num_hidden_layers):
        names.update({f"model.layers.{i}.{k}": f"blk.{i}.{v}" for k, v in _GGUF_LAYER_NAMES.items()})
    state = model.state_dict()
    for ours, theirs in names.items():
        w.add_tensor(theirs, np.ascontiguousarray(state[ours].detach().to(torch.float32).numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def greedy_continuations(target, prompts, n: int) -> list[list[int]]:
    """Each prompt followed by ``n`` tokens of the target's greedy decoding: the answers that heads
    trained on them learn, so that a greedy-identity test of their method accepts drafts."""
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method

    gen = GenerationConfig(max_new_tokens=n, stop_at_eos=False, stand_down=False)
    return [list(p) + drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target),
                                     list(p), gen)).token_ids for p in prompts]


def assert_drafts_accepted(res, tau: float) -> None:
    """A greedy-identity run proves exactness only where drafts were accepted (identity holds
    trivially when every draft is rejected): some were, and its mean tokens per step τ is above ``tau``."""
    m = res.metrics
    assert m.accepted > 0 and m.mean_accepted > tau, f"{m.accepted} of {m.drafted} accepted, τ {m.mean_accepted:.2f}"


def on_a_clock(monkeypatch, seconds_for: dict) -> list[float]:
    """Passes that take the time given, not the time they take: a pass of n tokens of each model in
    ``seconds_for`` (model -> n -> seconds) advances a clock by that much, and the decoding engine and
    the speculative method read that clock. Returns the clock (``[seconds]``)."""
    from types import SimpleNamespace

    from specplay.core.decoding import engine
    from specplay.core.methods import speculative

    clock = [0.0]
    for model, seconds in seconds_for.items():
        def timed(tokens, *args, _forward=model.forward, _seconds=seconds, **kwargs):
            clock[0] += _seconds(len(tokens))
            return _forward(tokens, *args, **kwargs)

        monkeypatch.setattr(model, "forward", timed)
    fake = SimpleNamespace(perf_counter=lambda: clock[0])
    monkeypatch.setattr(engine, "time", fake)
    monkeypatch.setattr(speculative, "time", fake)
    return clock
