"""What the benchmark runs, each behind one ``answer`` call: SpecPlay's own methods through the engine,
and the peers it is compared with on the same weights: ``transformers``' generate, assisted and
prompt-lookup decoding, llama.cpp on the target's GGUF file (the ``peers`` extra), and remote
OpenAI-compatible endpoints."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specplay.core.errors import ConfigError, ModelError, is_out_of_memory

HF_PEERS = ("hf_generate", "hf_assisted", "hf_prompt_lookup")
LLAMACPP_PEERS = ("llamacpp_generate", "llamacpp_prompt_lookup")
#: llama.cpp's own server (``specplay peers build-server``): with the draft model, and draftless.
SERVER_PEERS = ("llamacpp_speculative", "llamacpp_ngram")
PEERS = HF_PEERS + LLAMACPP_PEERS + SERVER_PEERS


@dataclass
class TurnResult:
    token_ids: list[int]
    text: str
    wall_time: float
    accept_lengths: list[int] | None
    drafted: int = 0
    accepted: int = 0
    error: str | None = None  # the turn failed (out of memory): a failure, not an answer
    time_to_first_token: float | None = None  # seconds, prefill included (None where not measured)
    steps: int | None = None  # the target's decoding steps, where a peer reports them but not each step's length


class OurMethod:
    """One of SpecPlay's methods, through the engine."""

    def __init__(self, name: str, config, target, draft):
        from specplay.core.methods import build_method

        self.name = name
        self.target = target
        self.method = build_method(name, config, target, draft)

    def params(self) -> dict:
        return self.method.describe()

    def run(self, prompt_ids: list[int], gen) -> TurnResult:
        from specplay.core.decoding.engine import run_to_end
        from specplay.core.decoding.types import StopReason

        r = run_to_end(self.target.model, self.target.tokenizer, self.method, prompt_ids, gen)
        m = r.metrics
        error = (r.error or "error") if r.stop_reason is StopReason.ERROR else None
        return TurnResult(r.token_ids, r.text, m.wall_time, m.accept_lengths, m.drafted, m.accepted, error,
                          m.time_to_first_token)


def _hf_generation_config(gen, eos: list[int], **options):
    """A transformers ``GenerationConfig`` with every setting that shapes the output taken from ``gen``.

    transformers fills unset fields from the model's ``generation_config.json`` and then from
    its own defaults (top-k 50 when sampling), so each is set here: the peers must sample
    from the same distribution as SpecPlay's methods (temperature and top-p only).
    """
    from transformers import GenerationConfig

    s = gen.sampling
    sampling = {"do_sample": False} if s.greedy else {"do_sample": True, "temperature": s.temperature,
                                                         "top_p": s.top_p, "top_k": 0}
    return GenerationConfig(max_new_tokens=gen.max_new_tokens, eos_token_id=eos or None, pad_token_id=(eos or [0])[0],
                            repetition_penalty=1.0, **sampling, **options)


class HFPeer:
    """A transformers decoding strategy on the same weights and storage."""

    def __init__(self, name: str, target, draft, hf_models: dict):
        self.name = name
        self.target = target
        self.model = _hf_model(target, hf_models)
        self.assistant = None
        self.options: dict = {}  # the strategy's own generation settings
        if name == "hf_assisted":
            if draft is None:
                raise ConfigError("hf_assisted needs a draft model")
            self.assistant = _hf_model(draft, hf_models)
        elif name == "hf_prompt_lookup":
            self.options["prompt_lookup_num_tokens"] = 10

    def params(self) -> dict:
        return dict(self.options)

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], gen) -> TurnResult:
        if not gen.sampling.greedy:
            torch.manual_seed(gen.sampling.seed)
        ids = torch.tensor([prompt_ids])
        eos = list(self.target.model.info.eos_token_ids)
        config = _hf_generation_config(gen, eos, **self.options)
        assistant = {"assistant_model": self.assistant} if self.assistant is not None else {}
        t0 = time.perf_counter()
        try:
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **assistant)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            return TurnResult([], "", time.perf_counter() - t0, None, error="out of memory while generating")
        wall = time.perf_counter() - t0
        new = out[0, len(prompt_ids):].tolist()
        for k, t in enumerate(new):  # tokens after an end-of-sequence token are not output
            if t in eos:
                new = new[: k + 1]
                break
        text = self.target.tokenizer.decode(new, skip_special_tokens=True)
        return TurnResult(new, text, wall, None)


class LlamaCppPeer:
    """llama.cpp (through ``llama-cpp-python``, the ``peers`` extra) on the target's GGUF file.

    The C++ CPU engine users pick for speed: plain decoding, or with its prompt-lookup draft.
    It reads the Q4_K_M weights as shipped (fewer bytes a token than SpecPlay's int8) and is
    not batch-invariant, so it is a peer to measure against, not an exact verifier. It gets
    the same prompt tokens (chat template applied by SpecPlay), the same threads and the
    same sampling settings. It opens the file only with settings a child process survived on
    this machine (:mod:`specplay.core.models.llamacpp`): plain decoding runs on SpecPlay's thin layer
    over llama.cpp's C API, which takes them; the prompt-lookup peer needs ``llama_cpp.Llama``,
    which always uses llama.cpp's extra buffers, so it runs only where those are safe.
    """

    def __init__(self, name: str, target):
        from specplay.core.models.llamacpp import LlamaCppSession, available, describe, usable_settings

        why = available()
        if why:
            raise ConfigError(f"{name} needs llama-cpp-python: pip install -e \".[peers]\" (it compiles llama.cpp, "
                              "about 6 minutes on two cores)")
        self.name = name
        self.target = target
        self.options = {"num_pred_tokens": 10} if name == "llamacpp_prompt_lookup" else {}
        threads = torch.get_num_threads()
        gguf = gguf_file(target)
        _, probes = usable_settings(gguf, threads)
        settings = self.settings_for(name, probes)
        self.engine = f"{settings.label} ({describe(probes)})"
        if self.options:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            # Verifying a draft reads every drafted row's logits, which llama-cpp-python keeps only with logits_all;
            # its flash attention is the one the chosen setting was proved with.
            self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=8192, n_threads=threads, n_threads_batch=threads,
                                       draft_model=LlamaPromptLookupDecoding(**self.options), logits_all=True,
                                       flash_attn=settings.flash_attn, verbose=False)
            self.session = None
        else:
            self.session = LlamaCppSession(gguf, 8192, threads, settings)

    @staticmethod
    def settings_for(name: str, probes: list):
        """The fastest settings a child survived; for the prompt-lookup peer, whose ``llama_cpp.Llama``
        always uses llama.cpp's extra buffers, the fastest of those with them on."""
        from specplay.core.models.llamacpp import describe, fastest_safe

        needs_extra = name == "llamacpp_prompt_lookup"
        settings = fastest_safe(probes, extra_buffers=needs_extra)
        if settings is None:
            which = " with extra buffers on, which llama_cpp.Llama always uses" if needs_extra else ""
            raise ModelError(f"{name}: llama.cpp is unsafe on this CPU{which} ({describe(probes)})")
        return settings

    def params(self) -> dict:
        return {**self.options, "engine": self.engine}

    def run(self, prompt_ids: list[int], gen) -> TurnResult:
        eos = set(self.target.model.info.eos_token_ids)
        new: list[int] = []
        first = None
        t0 = time.perf_counter()
        for token in self._tokens(prompt_ids, gen):
            first = first if first is not None else time.perf_counter() - t0
            new.append(int(token))
            if token in eos or len(new) >= gen.max_new_tokens:
                break
        wall = time.perf_counter() - t0
        text = self.target.tokenizer.decode(new, skip_special_tokens=True)
        return TurnResult(new, text, wall, None, time_to_first_token=first)

    def _tokens(self, prompt_ids: list[int], gen):
        from specplay.core.decoding.sampling import probabilities, sample

        s = gen.sampling
        if self.session is None:
            # temp 0 is llama.cpp's greedy sampler; no top-k, min-p or repetition penalty of its own.
            self.llm.set_seed(s.seed)
            yield from self.llm.generate(prompt_ids, reset=True, temp=s.temperature, top_p=s.top_p, top_k=0,
                                         min_p=0.0, repeat_penalty=1.0)
            return
        rng = torch.Generator().manual_seed(s.seed)
        # Every question is read from an empty cache, as SpecPlay's methods read it (llama_cpp.Llama's
        # generate would reuse the previous prompt's cached prefix: the chat template's system prompt).
        logits = self.session.eval(list(prompt_ids), 0)
        while True:
            greedy = s.temperature == 0
            token = int(logits.argmax()) if greedy else sample(probabilities(torch.from_numpy(logits),
                                                                              s.temperature, s.top_p), rng)
            yield token
            logits = self.session.eval([token], self.session.length)


class RemotePeer:
    """An OpenAI-compatible endpoint (:mod:`specplay.core.remote`) answering the same prompts.

    It gets the prompt as SpecPlay formats it (chat template applied, as text, through the
    completions API), so a server of the same model family sees what the local methods see;
    its answer is counted in the target's tokens (the server's own count where it gives one).
    """

    #: Whether the prompt goes as token ids (a server of the target's own file) instead of as text.
    sends_ids = False

    def __init__(self, endpoint, target, fields: dict | None = None):
        self.endpoint = endpoint
        self.name = f"remote:{endpoint.label}"
        self.target = target
        self.fields = dict(fields or {})  # the engine's own request fields

    def params(self) -> dict:
        return {"endpoint": self.endpoint.describe()}

    def run(self, prompt_ids: list[int], gen) -> TurnResult:
        from specplay.core.remote.runs import stream_completion

        s = gen.sampling
        tok = self.target.tokenizer
        run = stream_completion(self.endpoint, tok.decode(prompt_ids), max_tokens=gen.max_new_tokens,
                                temperature=s.temperature, top_p=s.top_p, seed=s.seed, chat=False,
                                prompt_tokens=list(prompt_ids) if self.sends_ids else None, fields=self.fields)
        ids = tok(run.text, add_special_tokens=False)["input_ids"]
        stats = run.speculation
        drafted, accepted = ((stats.drafted or 0), (stats.accepted or 0)) if stats else (0, 0)
        return TurnResult(ids, run.text, run.wall_time, None, drafted, accepted, run.error, run.time_to_first_token,
                          steps=stats.steps if stats else None)


class LlamaServerPeer(RemotePeer):
    """``llama-server`` (:mod:`specplay.core.remote.llama_server`) on the target's GGUF file, started
    for the bench and stopped by :meth:`close`: ``llamacpp_speculative`` with the draft's GGUF file and
    the server's own draft settings, ``llamacpp_ngram`` with its n-gram type that measured fastest
    here (:func:`ngram_type`). The prompt goes as the target's token ids (the chat template applied by
    SpecPlay), read afresh each time; the answer is compared by text; its draft counts become τ and
    acceptance. llama.cpp opens the files with the settings its probe child survived here."""

    sends_ids = True

    def __init__(self, name: str, target, draft):
        from specplay.core.remote.endpoint import Endpoint
        from specplay.core.remote.llama_server import REQUEST_FIELDS

        self.server, self.card = server_for(name, target, draft)
        self.server.start()
        super().__init__(Endpoint(self.server.url, name=name), target, REQUEST_FIELDS)
        self.name = name

    def params(self) -> dict:
        return dict(self.card)

    def close(self) -> None:
        self.server.stop()


def server_for(name: str, target, draft):
    """The (unstarted) :class:`~specplay.core.remote.llama_server.LlamaServer` of server peer ``name`` for
    these models, and its card: the probe's settings, the n-gram type and how it was chosen, the command."""
    from specplay.core.models.llamacpp import available, describe, fastest_safe, usable_settings
    from specplay.core.remote.llama_server import LlamaServer, command_line, server_args, why_unavailable

    why = why_unavailable() or (available() and f"{name} needs llama-cpp-python: pip install -e \".[peers]\"")
    if why:
        raise ConfigError(why)
    threads = torch.get_num_threads()
    gguf = gguf_file(target)
    _, probes = usable_settings(gguf, threads)
    settings = fastest_safe(probes)
    if settings is None:
        raise ModelError(f"{name}: llama.cpp is unsafe on this CPU ({describe(probes)})")
    card: dict = {"settings": settings.label}
    if name == "llamacpp_speculative":
        if draft is None:
            raise ConfigError("llamacpp_speculative needs a draft model")
        args = server_args(gguf, threads, settings, draft=gguf_file(draft))
    else:
        choice = ngram_type(gguf, threads, settings, target.tokenizer)
        card["spec_type"] = choice["type"]
        card["chosen_by"] = {k: choice[k] for k in ("prompts", "tokens_per_s", "drafts")}
        args = server_args(gguf, threads, settings, spec_type=choice["type"])
    card["command"] = command_line(args)
    return LlamaServer(args), card


#: The app's prompt presets the n-gram type is chosen on (shipped with SpecPlay; no bench question):
#: one answer written afresh, one that repeats much of its prompt.
NGRAM_CALIBRATION = ("Merge two sorted lists", "Add type hints to a function")
NGRAM_CALIBRATION_TOKENS = 64


def ngram_type(gguf: Path, threads: int, settings, tokenizer) -> dict:
    """llama-server's fastest n-gram type here (greedy, on :data:`NGRAM_CALIBRATION`): measured once per
    machine, server build, file, threads and settings, then read back. ``{"type", "prompts",
    "tokens_per_s": {type: tok/s}, "drafts": {type: {"drafted", "accepted"}}}`` (its own draft sizes)."""
    import json

    from specplay.core.models.measurements import measured
    from specplay.core.paths import assets_dir
    from specplay.core.remote.endpoint import Endpoint
    from specplay.core.remote.llama_server import NGRAM_TYPES, REQUEST_FIELDS, LlamaServer, build_stamp, server_args
    from specplay.core.remote.runs import stream_completion
    from specplay.core.text import encode_messages

    presets = {p["name"]: p["prompt"] for p in json.loads((assets_dir() / "prompts" / "presets.json").read_text(
        encoding="utf-8"))["presets"]}
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": presets[n]}]) for n in NGRAM_CALIBRATION]

    def measure() -> dict:
        speeds, drafts = {}, {}
        for kind in NGRAM_TYPES:
            with LlamaServer(server_args(gguf, threads, settings, spec_type=kind)) as server:
                ep = Endpoint(server.url, name=kind)
                runs = [stream_completion(ep, "calibration", max_tokens=n, chat=False, prompt_tokens=ids,
                                          fields=REQUEST_FIELDS) for ids in prompts for n in (4, NGRAM_CALIBRATION_TOKENS)]
            timed = runs[1::2]  # each after its untimed warm-up
            failed = next((r.error for r in runs if r.error), None)
            if failed:
                raise ModelError(f"llama-server with --spec-type {kind} failed on a calibration prompt: {failed}")
            speeds[kind] = sum(r.new_tokens for r in timed) / sum(r.wall_time for r in timed)
            stats = [r.speculation for r in timed if r.speculation]
            drafts[kind] = {"drafted": sum(st.drafted or 0 for st in stats),
                            "accepted": sum(st.accepted or 0 for st in stats)}
        return {"type": max(speeds, key=speeds.get), "prompts": list(NGRAM_CALIBRATION), "tokens_per_s": speeds,
                "drafts": drafts}

    key = (f"llama-server n-gram type|{build_stamp()}|{gguf.name}:{gguf.stat().st_size}|{threads} threads|"
           f"{settings.label}|{NGRAM_CALIBRATION_TOKENS} tokens")
    return measured(key, measure, valid=lambda kept: kept.get("type") in NGRAM_TYPES
                    and isinstance(kept.get("tokens_per_s"), dict) and isinstance(kept.get("drafts"), dict))


def gguf_file(target) -> Path:
    """The GGUF file a target was loaded from: a ``.gguf`` path, or a catalog model's assembled file."""
    from specplay.core.weights.prepare import source_gguf

    gguf = source_gguf(target.model_id)
    if gguf is not None:
        return gguf
    raise ConfigError(f"the llama.cpp peers need a GGUF file; target '{target.model_id}' is not one (use a catalog id "
                      "or a .gguf file)")


def _hf_model(loaded, cache: dict):
    """The transformers model for a LoadedModel, with the same weights and storage."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from specplay.core.models.loader import float_weights_dir, quantize_hf_linears

    key = str(float_weights_dir(loaded.model_id, loaded.path))
    if key not in cache:
        info = loaded.model.info
        # A 4-bit draft (on llama.cpp, or SpecPlay's int4 layers) runs in transformers in int8, the nearest
        # storage it has here; transformers has no int4 dtype to load into.
        int8 = info.dtype in ("int8", "int4") or info.backend == "llama.cpp"
        dtype = torch.float32 if int8 or info.dtype == "float32" else getattr(torch, info.dtype)
        hf = AutoModelForCausalLM.from_pretrained(key, dtype=dtype).eval().to(info.device)
        # Unset fields of a call's generation config are filled from this one, which comes from the
        # model folder's generation_config.json (suppressed tokens, min-p, ...); a blank one keeps them out.
        hf.generation_config = GenerationConfig()
        if int8:
            quantize_hf_linears(hf)
        cache[key] = hf
    return cache[key]
