"""The worker: all model work runs here, in one thread, and only signals leave it.

Requests arrive as queued slot calls (one at a time, in order); each carries a job number.
:meth:`Worker.cancel` is called directly from the GUI thread and marks every job up
to a number as cancelled, so a Stop pressed before a queued job starts still reaches it.
The engine checks the flag between steps, so a run stops within one step.
"""

from __future__ import annotations

import gc
import logging
import threading
import traceback
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, Signal, Slot

from specplay.app import preload
from specplay.core.errors import Cancelled, SpecPlayError, TokenizerMismatchError

log = logging.getLogger(__name__)

CALIBRATION_MESSAGE = "Measuring this machine's verification cost, once (a few seconds)…"


@dataclass
class ModelsLoaded:
    """What a load request produced: the models, and what the user should know about the draft."""

    target: object  # LoadedModel
    draft: object | None  # LoadedModel, or None (none asked for, or incompatible)
    warnings: list[str] = field(default_factory=list)
    draft_error: str | None = None
    job: int = 0
    cost_curve: object | None = None  # the target's CostCurve when already measured (a model kept loaded)
    draft_pending: bool = False  # the target is ready and the draft still loads (``sig_draft_loaded`` follows)

    def __iter__(self):  # (target, draft) unpacking, as the first window used
        return iter((self.target, self.draft))


@dataclass
class RunDone:
    """A generation, remote completion or audit that ended (finished, stopped, or cut short by an
    error) with its history record. The record is made in the worker thread: it reads the models,
    which only that thread touches."""

    result: object  # RunResult, RemoteRun or AuditResult
    record: dict


@dataclass
class RemoteRequest:
    """One streamed completion from an OpenAI-compatible endpoint (a :class:`specplay.core.remote.endpoint.Endpoint`)."""

    endpoint: object
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0
    chat: bool = True
    warmup_tokens: int = 0
    job: int = 0
    #: A server peer (``core.measure.peers.SERVER_PEERS``) the worker starts on the loaded models for this
    #: run instead of the endpoint (which then only names it); the prompt goes as the target's token ids.
    server: str = ""


@dataclass
class LoadRequest:
    target: str
    draft: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    draft_backend: str = "auto"  # see core.models.loader.load_model's backend
    job: int = 0


@dataclass
class RunRequest:
    prompt: str
    method: str
    config: object  # GenerationConfig
    method_config: object | None = None  # the method's config dataclass (None: defaults)
    chat_template: bool = True
    warmup_tokens: int = 0  # a short unrecorded run first (compare: fair timing for every method)
    job: int = 0


@dataclass
class AuditRequest:
    """A losslessness audit (:mod:`specplay.core.measure.audit`) of ``run``'s method on its prompt and sampling settings."""

    run: RunRequest
    samples: int
    depth: int
    job: int = 0


@dataclass
class TuneRequest:
    """A tune (:mod:`specplay.core.measure.tune`) of ``run``'s method on its prompt: its knobs predicted, then proved."""

    run: RunRequest
    job: int = 0
    #: Tune llama-server's own draft size on ``run``'s prompt (``core.measure.tune_server``), not its method.
    server: bool = False


class Worker(QObject):
    """Loads models and runs generations; lives in its own ``QThread``.

    Signals:
        sig_progress(str, float): a loading or conversion stage and its fraction (-1: unknown).
        sig_models_loaded(object): a :class:`ModelsLoaded`: as soon as the target is ready; with a draft
            asked for, it still loads then (``draft_pending``), beside the runs that need none.
        sig_draft_loaded(object): the :class:`ModelsLoaded` with that draft (or why there is none).
        sig_step(object): a ``StepEvent`` of the current run.
        sig_run_finished(object): a :class:`RunDone` for a ``RunResult`` or ``RemoteRun`` (finished or cancelled).
        sig_failed(str): a message for the user (the job ended without a result).
        sig_cost_curve(object): the target's verification ``CostCurve``, measured before its first run.
        sig_audit_finished(object): a :class:`RunDone` for the ``AuditResult`` of an audit (finished or stopped).
        sig_tune_finished(object): a :class:`RunDone` for the ``TuneResult`` of a tune and its record.
    """

    sig_progress = Signal(str, float)
    sig_models_loaded = Signal(object)
    sig_draft_loaded = Signal(object)
    sig_step = Signal(object)
    sig_run_finished = Signal(object)
    sig_failed = Signal(str)
    sig_cost_curve = Signal(object)
    sig_audit_finished = Signal(object)
    sig_tune_finished = Signal(object)

    def __init__(self):
        super().__init__()
        self._cancelled_upto = 0
        self._cancel_all = False
        self.target = None
        self.draft = None
        self._cache: dict[tuple, object] = {}  # (role, spec, device, dtype, backend) -> LoadedModel
        # (method, its config) -> the built method, kept while the models stay: building Medusa or
        # EAGLE reads and prepares its heads, seconds a run would otherwise pay again.
        self._methods: dict[tuple, object] = {}
        self._draft_thread: threading.Thread | None = None
        self._draft_cancel = False

    # -- called from the GUI thread ------------------------------------------------------------

    def cancel(self, job: int | None = None) -> None:
        """Thread-safe: stop job ``job`` and every earlier one (None: whatever runs now)."""
        if job is None:
            self._cancel_all = True
        else:
            self._cancelled_upto = max(self._cancelled_upto, job)

    def cancel_draft(self) -> None:
        """Thread-safe: stop the draft that loads beside the runs (it reports why it is not there)."""
        self._draft_cancel = True

    def wait_for_draft(self) -> None:
        """Stop the draft loading beside the runs, and wait until it has (a new load, the window closing)."""
        thread = self._draft_thread
        if thread is not None:
            self._draft_cancel = True
            thread.join()

    # -- in the worker thread ------------------------------------------------------------------

    def _stopper(self, job: int):
        self._cancel_all = False
        return lambda: self._cancel_all or self._cancelled_upto >= job > 0

    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, SpecPlayError):
            self.sig_failed.emit(str(exc))
        else:
            log.error("unexpected error\n%s", traceback.format_exc())
            self.sig_failed.emit(f"Unexpected error: {exc!r}")

    @Slot(object)
    def load(self, request: LoadRequest) -> None:
        from specplay.core.models import load_model

        self.wait_for_draft()
        should_cancel = self._stopper(request.job)
        self._draft_cancel = False
        try:
            def reporting(cancelled, message: str):
                # Every slow step of a load reports here (GGUF assembly per chunk, quantization, probes,
                # timing), some with no cancel callback of their own: a Stop ends them here.
                def progress(stage, fraction):
                    if cancelled():
                        raise Cancelled(message)
                    self.sig_progress.emit(stage, -1.0 if fraction is None else float(fraction))
                return progress

            def draft_cancelled() -> bool:
                return self._draft_cancel

            callbacks = {"target": (reporting(should_cancel, "loading cancelled"), should_cancel),
                         "draft": (reporting(draft_cancelled, "loading the draft cancelled"), draft_cancelled)}

            keys = {"target": ("target", request.target, request.device, request.dtype, "auto"),
                    "draft": ("draft", request.draft, request.device, request.dtype, request.draft_backend)}
            wanted = {keys["target"], keys["draft"]} if request.draft else {keys["target"]}
            preload.keep_only(wanted)
            # Free models no longer wanted before loading new ones (memory is the limit).
            for key in [k for k in self._cache if k not in wanted]:
                del self._cache[key]
            self.target = self.draft = None
            self._methods.clear()
            gc.collect()
            _empty_cuda_cache()

            def get(role: str):
                key = keys[role]
                if key not in self._cache:
                    progress, cancelled = callbacks[role]
                    # The launch may have begun this load before the window was built (app.preload).
                    begun = preload.take(key, progress, cancelled)
                    self._cache[key] = begun or load_model(key[1], request.device, request.dtype, backend=key[4],
                                                           role=role, progress=progress, should_cancel=cancelled)
                return self._cache[key]

            target = get("target")
            self.target = target
            from specplay.core.decoding import costmodel

            curve = costmodel.cost_curve(target.model) if costmodel.is_measured(target.model) else None
            if not request.draft:
                self.sig_models_loaded.emit(ModelsLoaded(target, None, [], None, request.job, curve))
                return
            if keys["draft"] in self._cache:  # kept loaded: nothing to wait for
                self.sig_models_loaded.emit(self._take_draft(request, get, keys["draft"], target, curve))
                return
            # The target is usable now: runs that need no draft go ahead while the draft loads beside them.
            self.sig_models_loaded.emit(ModelsLoaded(target, None, [], None, request.job, curve, draft_pending=True))
            self._draft_thread = threading.Thread(target=self._load_draft,
                                                  args=(request, get, keys["draft"], target, curve),
                                                  name="specplay-draft", daemon=True)
            self._draft_thread.start()
        except Exception as exc:  # the worker must survive any failure
            self._fail(exc)

    def _load_draft(self, request: LoadRequest, get, key: tuple, target, curve) -> None:
        """In the draft's own thread: load it, then report it (or why it is not there)."""
        try:
            loaded = self._take_draft(request, get, key, target, curve)
        finally:
            self._draft_thread = None
        self.sig_draft_loaded.emit(loaded)

    def _take_draft(self, request: LoadRequest, get, key: tuple, target, curve) -> ModelsLoaded:
        """The draft ``get`` loads, with the target: kept as this worker's draft, or why there is none."""
        from specplay.core.models import check_draft_compatible

        draft, warnings, draft_error = None, [], None
        try:
            draft = get("draft")
            warnings = check_draft_compatible(target, draft)
        except TokenizerMismatchError as exc:
            draft, draft_error = None, str(exc)
            self._cache.pop(key, None)
        except SpecPlayError as exc:  # the target is fine; report the draft's problem (or its cancel)
            draft, draft_error = None, str(exc)
        except Exception as exc:  # a damaged file, a bug: the target stays loaded all the same
            log.error("the draft %s did not load\n%s", request.draft, traceback.format_exc())
            draft, draft_error = None, f"the draft {request.draft} could not be loaded: {exc!r}"
            self._cache.pop(key, None)
        self.draft = draft
        return ModelsLoaded(target, draft, warnings, draft_error, request.job, curve)

    def _draft_of(self, method: str):
        """The draft model a record of ``method`` names: the loaded one if the method drafts with it."""
        from specplay.core.methods import METHODS

        spec = METHODS.get(method)
        return self.draft if spec is not None and spec.needs_draft else None

    def _prompt_ids(self, request: RunRequest) -> list[int]:
        """The request's prompt as token ids, once the target's verification cost is known."""
        from specplay.core.decoding import costmodel
        from specplay.core.text import encode_prompt

        if self.target is None:
            raise SpecPlayError("load a target model first")
        ids = encode_prompt(self.target.tokenizer, request.prompt, request.chat_template)
        if not costmodel.is_measured(self.target.model):
            # Once per loaded target: several methods size their drafts by it, and "Why this speed" shows it.
            self.sig_progress.emit(CALIBRATION_MESSAGE, -1.0)
            self.sig_cost_curve.emit(costmodel.cost_curve(self.target.model))
        return ids

    @Slot(object)
    def generate(self, request: RunRequest) -> None:
        from specplay.core.decoding.engine import run_to_end
        from specplay.core.methods import build_method
        from specplay.core.records.runlog import run_record

        should_stop = self._stopper(request.job)
        try:
            ids = self._prompt_ids(request)
            key = (request.method, request.method_config)
            method = self._methods.get(key)
            if method is None:
                method = self._methods[key] = build_method(request.method, request.method_config, self.target,
                                                           self.draft)
            result = run_to_end(self.target.model, self.target.tokenizer, method, ids, request.config,
                                warmup_tokens=request.warmup_tokens, should_stop=should_stop,
                                on_event=self.sig_step.emit)
            record = run_record(result, target=self.target, draft=self._draft_of(result.method), prompt=request.prompt,
                                include_events=True, extra={"chat_template": request.chat_template})
            self.sig_run_finished.emit(RunDone(result, record))
        except Exception as exc:
            self._fail(exc)

    @Slot(object)
    def audit(self, request: AuditRequest) -> None:
        from specplay.core.measure.audit import AuditConfig, audit_record, run_audit

        should_stop = self._stopper(request.job)
        try:
            config = AuditConfig(samples=request.samples, depth=request.depth)
            run = request.run
            ids = self._prompt_ids(run)

            def progress(stage, fraction):
                self.sig_progress.emit(stage, -1.0 if fraction is None else float(fraction))

            # The audit builds its own method, over models that read the prompt once (core.measure.audit.ReusedPrompt).
            result = run_audit(self.target, self.draft, run.method, run.method_config, ids, run.config.sampling,
                               config, should_stop, progress)
            record = audit_record(result, target=self.target, draft=self._draft_of(run.method), prompt=run.prompt,
                                  extra={"chat_template": run.chat_template})
            self.sig_audit_finished.emit(RunDone(result, record))
        except Exception as exc:
            self._fail(exc)

    @Slot(object)
    def tune(self, request: TuneRequest) -> None:
        from specplay.core.decoding.engine import WARMUP_TOKENS
        from specplay.core.measure.tune import tune, tune_record
        from specplay.core.measure.tune_server import tune_llamacpp_speculative

        should_stop = self._stopper(request.job)
        try:
            run = request.run
            ids = self._prompt_ids(run)
            on_stage = lambda stage, fraction: self.sig_progress.emit(stage, fraction)  # noqa: E731
            if request.server:
                result = tune_llamacpp_speculative(self.target, self.draft, ids, run.config, prompt=run.prompt,
                                                   should_stop=should_stop, on_stage=on_stage)
            else:
                result = tune(self.target, self.draft, run.method, run.method_config, ids, run.config,
                              prompt=run.prompt, warmup_tokens=WARMUP_TOKENS, should_stop=should_stop,
                              on_stage=on_stage)
            record = tune_record(result, target=self.target, extra={"chat_template": run.chat_template})
            self.sig_tune_finished.emit(RunDone(result, record))
        except Exception as exc:  # a Stop before the proof included (core.errors.Cancelled says so)
            self._fail(exc)

    @Slot(object)
    def generate_remote(self, request: RemoteRequest) -> None:
        """Stream from a remote endpoint (or a server peer started for it): each chunk is a step event; the
        result is a ``RemoteRun``."""
        should_stop = self._stopper(request.job)
        try:
            if request.server:
                self._stream_from_server(request, should_stop)
                return
            kwargs = dict(temperature=request.temperature, top_p=request.top_p, seed=request.seed, chat=request.chat,
                          should_stop=should_stop)
            self._stream_remote(request, kwargs)
        except Exception as exc:
            self._fail(exc)

    def _stream_from_server(self, request: RemoteRequest, should_stop) -> None:
        """Start llama-server on the loaded models, stream the request's prompt (its token ids) from it, stop it."""
        from dataclasses import replace

        from specplay.core.measure.peers import server_for
        from specplay.core.remote.endpoint import Endpoint
        from specplay.core.remote.llama_server import REQUEST_FIELDS
        from specplay.core.text import encode_prompt

        if self.target is None:
            raise SpecPlayError("load a target model first")
        ids = encode_prompt(self.target.tokenizer, request.prompt, request.chat)
        server, _ = server_for(request.server, self.target, self.draft)
        server.start(should_stop)
        try:
            kwargs = dict(temperature=request.temperature, top_p=request.top_p, seed=request.seed, chat=False,
                          prompt_tokens=ids, fields=REQUEST_FIELDS, should_stop=should_stop)
            self._stream_remote(replace(request, endpoint=Endpoint(server.url, name=request.server)), kwargs)
        finally:
            server.stop()

    def _stream_remote(self, request: RemoteRequest, kwargs: dict) -> None:
        """One streamed completion (after its warm-up), its chunks as step events, its record."""
        from specplay.core.remote.runs import chunk_event, remote_record, stream_completion

        if request.warmup_tokens > 0:
            stream_completion(request.endpoint, request.prompt, max_tokens=request.warmup_tokens, **kwargs)
        count = [0]

        def on_text(piece: str, elapsed: float) -> None:
            count[0] += 1
            self.sig_step.emit(chunk_event(count[0] - 1, piece, elapsed, count[0]))

        run = stream_completion(request.endpoint, request.prompt, max_tokens=request.max_tokens, on_text=on_text,
                                **kwargs)
        record = remote_record(run, max_new_tokens=request.max_tokens, temperature=request.temperature,
                               top_p=request.top_p, seed=request.seed)
        self.sig_run_finished.emit(RunDone(run, record))


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
