"""The headless command line: ``specplay run | compare | models | ...``.

Expected failures (a missing model, a bad option) print one line on stderr and exit 1;
nothing here imports Qt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from specplay.core.errors import SpecPlayError

log = logging.getLogger("specplay")


# --------------------------------------------------------------------------- helpers
class _Progress:
    """Conversion/loading progress on stderr: one updating line on a terminal, else one line per stage."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.stage = None
        self.shown = -1

    def __call__(self, stage: str, fraction: float | None) -> None:
        if self.tty:
            pct = "" if fraction is None else f" {fraction:5.1%}"
            self.stream.write(f"\r\033[K{stage}{pct}")
            if fraction is not None and fraction >= 1.0:
                self.stream.write("\n")
            self.stream.flush()
            return
        decile = -1 if fraction is None else int(fraction * 10)
        if stage != self.stage or decile != self.shown and decile in (0, 5, 10):
            pct = "" if fraction is None else f" {fraction:.0%}"
            print(f"{stage}{pct}", file=self.stream, flush=True)
            self.stage, self.shown = stage, decile


def method_options() -> dict[str, dict]:
    """Every method option across methods: flag -> {dest, type, help, fields: [(method, field)]}."""
    from specplay.core.methods import METHODS
    from specplay.core.decoding.method import field_type

    opts: dict[str, dict] = {}
    for method_spec in METHODS.values():
        for f in dataclasses.fields(method_spec.config_class):
            flag = f.metadata.get("cli") or "--" + f.name.replace("_", "-")
            typ = field_type(method_spec.config_class, f)[0] or str
            if typ is bool and f.default is True:  # a switch that is on by default is turned off
                flag = "--no-" + flag[2:]
            entry = opts.setdefault(flag, {"dest": "m_" + flag[2:].replace("-", "_"), "type": typ, "helps": [],
                                           "fields": []})
            if entry["type"] is not typ:
                raise TypeError(f"option {flag} has different types across methods")
            entry["helps"].append(f"{method_spec.name}: {f.metadata.get('help', '')} (default {f.default})")
            entry["fields"].append((method_spec.name, f.name))
    return opts


def add_method_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("method options (each applies to the methods that have it)")
    for flag, o in method_options().items():
        help_text = "; ".join(o["helps"]).replace("%", "%%")
        if o["type"] is bool:
            group.add_argument(flag, dest=o["dest"], action="store_const", const=not flag.startswith("--no-"),
                               default=None, help=help_text)
        else:
            group.add_argument(flag, dest=o["dest"], type=o["type"], default=None, help=help_text)


def config_for(method: str, args: argparse.Namespace):
    """Build ``method``'s typed configuration from the command-line options that apply to it."""
    from specplay.core.methods import get_spec

    method_spec = get_spec(method)
    values = {}
    for o in method_options().values():
        value = getattr(args, o["dest"], None)
        for m, field_name in o["fields"]:
            if m == method and value is not None:
                values[field_name] = value
    return method_spec.config_class(**values)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from specplay.core.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

    g = p.add_argument_group("models")
    g.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: catalog id, folder, .gguf file or cached hub id (default {DEFAULT_TARGET})")
    g.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model for 'speculative' (default {DEFAULT_DRAFT})")
    g.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU; int8 on x86 CPUs, else float32), float32, bfloat16, float16, float64, int8 (CPU), "
                   "gguf (CPU: a GGUF target's own Q4_K/Q6_K blocks, exact; the draft keeps its fastest layers)")
    g.add_argument("--backend", default="auto", choices=["auto", "native", "transformers"], help=argparse.SUPPRESS)
    g.add_argument("--draft-backend", default="auto", choices=["auto", "native", "llamacpp"],
                   help="engine of the draft model: auto (llama.cpp in 4 bits for a quantized CPU draft from a GGUF "
                        "source where llama-cpp-python is installed, the peers extra; else native), native, llamacpp")


def _add_generation_args(p: argparse.ArgumentParser, prompt_required: bool = True) -> None:
    g = p.add_argument_group("generation")
    src = g.add_mutually_exclusive_group(required=prompt_required)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 text file")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--no-stand-down", action="store_true",
                   help="draft in every step, even where plain steps are faster (to study a method as it drafts)")
    g.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--log", type=Path, help="append the run record(s) as JSON lines to this file")


def _prompt_text(args) -> str:
    """The prompt from ``--prompt`` or ``--prompt-file``; text that is not UTF-8 is an error here,
    before any model loads (an argument that is not UTF-8 reaches Python as lone surrogates)."""
    from specplay.core.text import lone_surrogate_at

    if args.prompt is not None:
        at = lone_surrogate_at(args.prompt)
        if at is not None:
            raise SpecPlayError(f"the prompt is not valid UTF-8 (a lone surrogate at character {at})")
        return args.prompt
    try:
        return args.prompt_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecPlayError(f"{args.prompt_file} is not valid UTF-8 (byte {exc.start})") from None
    except OSError as exc:
        raise SpecPlayError(f"cannot read {args.prompt_file}: {exc.strerror}") from None


def _check_counts(args) -> None:
    """The bench's counts in range, before any model loads (``--limit -1`` would drop the last question)."""
    for flag, value, least in (("--repeats", args.repeats, 1), ("--limit", args.limit, 1),
                               ("--per-category", args.per_category, 1), ("--warmup", args.warmup, 0)):
        if value is not None and value < least:
            raise SpecPlayError(f"{flag} must be {'at least 1' if least else '0 or more'}, got {value}")


def _generation_config(args):
    from specplay.core.decoding.types import GenerationConfig, SamplingConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop),
                            stand_down=not args.no_stand_down,
                            sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed))


def _load_models(args, need_draft: bool):
    from specplay.core.models.loader import check_draft_compatible, load_model

    progress = _Progress()
    target = load_model(args.target, args.device, args.dtype, backend=args.backend, progress=progress)
    for note in target.notes:
        print(f"note: {target.model_id}: {note}", file=sys.stderr)
    draft = None
    if need_draft:
        backend = args.backend if args.draft_backend == "auto" else args.draft_backend
        draft = load_model(args.draft, args.device, args.dtype, backend=backend, role="draft", progress=progress)
        for note in draft.notes:
            print(f"note: {draft.model_id}: {note}", file=sys.stderr)
        for warning in check_draft_compatible(target, draft):
            print(f"warning: {warning}", file=sys.stderr)
    return target, draft


def _methods_from(text: str) -> list[str]:
    from specplay.core.methods import get_spec

    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise SpecPlayError("no methods given")
    for n in names:
        get_spec(n)
    return names


# --------------------------------------------------------------------------- commands
def cmd_run(args) -> int:
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.methods import build_method, get_spec
    from specplay.core.records.runlog import RunRecord, dumps, stats_line
    from specplay.core.text import encode_prompt

    if args.engine:
        return _run_remote(args)
    method_spec = get_spec(args.method)
    method_config = config_for(args.method, args)
    gen_config = _generation_config(args)
    prompt = _prompt_text(args)
    if not prompt.strip():
        raise SpecPlayError("the prompt is empty")
    target, draft = _load_models(args, method_spec.needs_draft)
    ids = encode_prompt(target.tokenizer, prompt, chat_template=not args.no_chat_template)
    method = build_method(args.method, method_config, target, draft)

    def stream(event):
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()

    result = drain(generate(target.model, target.tokenizer, method, ids, gen_config), stream)
    record = RunRecord.of_run(result, target=target, draft=draft, prompt=prompt)
    if args.json:
        print(dumps(record.to_dict()))
    else:
        print(file=sys.stdout)
        print(f"[{result.method}] {stats_line(record)} · {result.metrics.steps} steps", file=sys.stderr)
    if args.log:
        record = RunRecord.of_run(result, target=target, draft=draft, prompt=prompt, include_events=True)
        _write_log(args.log, [record.to_dict()])
    if result.error:
        raise SpecPlayError(result.error)
    return 0


def _write_log(path: Path, records: list[dict]) -> None:
    from specplay.core.records.runlog import append_jsonl

    try:
        append_jsonl(path, records)
    except OSError as exc:
        raise SpecPlayError(f"cannot write the run log {path}: {exc.strerror or exc}") from None


def cmd_compare(args) -> int:
    from specplay.core.measure.compare import compare_methods, format_table
    from specplay.core.methods import get_spec
    from specplay.core.records.runlog import dumps
    from specplay.core.text import encode_prompt

    if args.engine:
        return _compare_remote(args)
    if not args.methods:
        raise SpecPlayError("name the methods to compare (--methods) or the endpoints (--engine URL, repeatable)")
    names = _methods_from(args.methods)
    if "autoregressive" not in names:
        names.insert(0, "autoregressive")
    configs = {n: config_for(n, args) for n in names}
    gen_config = _generation_config(args)
    prompt = _prompt_text(args)
    if not prompt.strip():
        raise SpecPlayError("the prompt is empty")
    target, draft = _load_models(args, any(get_spec(n).needs_draft for n in names))
    ids = encode_prompt(target.tokenizer, prompt, chat_template=not args.no_chat_template)

    def progress(name, result):
        if not args.json:
            print(f"{name}: {result.metrics.tokens_per_s:.2f} tok/s", file=sys.stderr)

    comparison = compare_methods(target, draft, names, configs, ids, gen_config, prompt=prompt,
                                 warmup_tokens=args.warmup_tokens, on_run=progress)
    doc = {"runs": comparison.records, "baseline": "autoregressive"}
    why = None
    if args.why and not any(r.error or r.cancelled for r in comparison.results.values()):
        from specplay.core.decoding.costmodel import cost_curve
        from specplay.core.measure.whyspeed import explain, format_explanation

        curve = cost_curve(target.model)
        why = explain(comparison.records, curve)
        doc["why"] = {"verify_cost": curve.to_dict(), "methods": [e.to_dict() for e in why]}
    if args.json:
        print(dumps(doc))
    else:
        print(format_table(comparison.records))
        if why is not None:
            print()
            print(format_explanation(why, curve))
    if args.log:
        _write_log(args.log, comparison.records_with_events)
    failed = [r for r in comparison.results.values() if r.error]
    if failed:
        raise SpecPlayError(f"{failed[0].method}: {failed[0].error}")
    return 0


def cmd_tune(args) -> int:
    from specplay.core.methods import get_spec
    from specplay.core.records.runlog import dumps
    from specplay.core.text import encode_prompt
    from specplay.core.measure.tune import format_tune, tune

    method_config = config_for(args.method, args)
    gen_config = _generation_config(args)
    if not gen_config.sampling.greedy:
        raise SpecPlayError("tune predicts greedy runs: leave --temperature at 0")
    prompt = _prompt_text(args)
    if not prompt.strip():
        raise SpecPlayError("the prompt is empty")
    target, draft = _load_models(args, get_spec(args.method).needs_draft)
    ids = encode_prompt(target.tokenizer, prompt, chat_template=not args.no_chat_template)
    stages = _Progress()
    result = tune(target, draft, args.method, method_config, ids, gen_config, prompt=prompt,
                  warmup_tokens=args.warmup_tokens, on_stage=lambda text, fraction: stages(text, None))
    if args.json:
        print(dumps(result.to_dict()))
    else:
        print(format_tune(result))
    if args.log:
        _write_log(args.log, [result.to_dict(with_records=True)])
    return 0


def _compare_remote(args) -> int:
    from specplay.core.remote import Endpoint, compare_endpoints, format_remote_table
    from specplay.core.records.runlog import RunRecord, dumps

    if args.methods:
        raise SpecPlayError("compare either local methods (--methods) or endpoints (--engine), not both in one run")
    endpoints = [Endpoint.parse(e) for e in args.engine]
    prompt = _prompt_text(args)

    def progress(run):
        if not args.json:
            state = f"ERROR: {run.error}" if run.error else f"{run.tokens_per_s:.2f} tok/s"
            print(f"{run.endpoint.label}: {state}", file=sys.stderr)

    records = compare_endpoints(endpoints, prompt, max_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed, chat=not args.no_chat_template,
                                warmup_tokens=args.warmup_tokens, on_run=progress)
    if args.json:
        print(dumps({"runs": records, "baseline": records[0]["method"] if records else None}))
    else:
        print(format_remote_table(records))
    if args.log:
        _write_log(args.log, records)
    failed = [r for r in map(RunRecord.from_dict, records) if r.error]
    if failed:
        raise SpecPlayError(f"{failed[0].method}: {failed[0].error}")
    return 0


def _run_remote(args) -> int:
    from specplay.core.remote import Endpoint, remote_record, stream_completion
    from specplay.core.records.runlog import RunRecord, dumps, stats_line

    endpoint = Endpoint.parse(args.engine)
    prompt = _prompt_text(args)

    def stream(piece, _t):
        if not args.json:
            sys.stdout.write(piece)
            sys.stdout.flush()

    run = stream_completion(endpoint, prompt, max_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, chat=not args.no_chat_template, on_text=stream)
    record = remote_record(run, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed)
    if args.json:
        print(dumps(record))
    else:
        print(file=sys.stdout)
        typed = RunRecord.from_dict(record)
        exposed = "" if typed.spec_source else " · speculation: not exposed"
        print(f"[{typed.method}] {stats_line(typed)}{exposed}", file=sys.stderr)
    if args.log:
        _write_log(args.log, [record])
    if run.error:
        raise SpecPlayError(run.error)
    return 0


def cmd_models(args) -> int:
    from specplay.core.models.catalog import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET, get_entry
    from specplay.core.models.prepare import cached_entries, catalog_status, models_root, prepare_catalog_model, prune

    if args.models_command == "list":
        sizes = cached_entries()
        for e in CATALOG.values():
            role = " (default target)" if e.id == DEFAULT_TARGET else " (default draft)" if e.id == DEFAULT_DRAFT else ""
            state = catalog_status(e)
            disk = f"{sizes.pop(e.id) / 1e9:6.2f} GB" if e.id in sizes else f"{'-':>9s}"
            print(f"{e.id:32s} {state:14s} {disk}  {e.title}{role}")
            if state == "not installed":
                print(f"{'':32s} install: {e.install_hint}")
        for name, size in sizes.items():
            print(f"{name:32s} {'cached':14s} {size / 1e9:6.2f} GB")
        print(f"cache: {models_root()}")
        _print_engines()
        return 0
    if args.models_command == "prune":
        print(f"freed {prune(args.ids) / 1e9:.2f} GB in {models_root()}")
        return 0
    if args.models_command == "measure":
        _measure_again()
        return 0
    ids = args.ids or [DEFAULT_TARGET, DEFAULT_DRAFT]
    for model_id in ids:
        path = prepare_catalog_model(get_entry(model_id), _Progress())
        print(f"{model_id}: {path}")
    return 0


def _measure_again() -> None:
    """Forget this machine's measurements and llama.cpp verdicts; measure the int8 kernels and the
    default draft's engines (llama.cpp's against the native one) now."""
    from specplay.core.models.catalog import DEFAULT_DRAFT
    from specplay.core.models.engines import describe_quant_engine, forget_measurements, quant_engine
    from specplay.core.models.linear import int8_supported
    from specplay.core.models.llamacpp import available, forget_verdicts
    from specplay.core.models.loader import compare_draft_engines

    measurements, verdicts = forget_measurements(), forget_verdicts()
    print(f"forgot {measurements} measurement{'s' * (measurements != 1)} and {verdicts} llama.cpp "
          f"verdict{'s' * (verdicts != 1)} of this machine")
    if int8_supported():
        quant_engine(_Progress())
        print("  " + describe_quant_engine())
    if available() is None:
        for note in compare_draft_engines(DEFAULT_DRAFT, _Progress()):
            if note.startswith("draft engine"):
                print(f"  {DEFAULT_DRAFT}: {note}")
    else:
        print("  llama.cpp's probes are measured again on the next load")


def _print_engines() -> None:
    """What was measured and chosen on this machine: the int8 kernel, llama.cpp's probes."""
    from specplay.core.models.engines import QUANT_KEY, cpu_name, describe_quant_engine, has_measured
    from specplay.core.models.llamacpp import available, known_verdicts

    print(f"this machine: {cpu_name() or 'unknown CPU'}")
    print("  " + (describe_quant_engine() if has_measured(QUANT_KEY)
                  else "int8 kernel: not measured yet (measured on the first int8 load)"))
    why_not = available()
    verdicts = [] if why_not else known_verdicts()
    print(f"  llama.cpp: {why_not or ('no file tried yet' if not verdicts else 'tried in child processes')}")
    for line in verdicts:
        print(f"    {line}")


def cmd_bench(args) -> int:
    from specplay.core.measure.bench import PEERS, BenchSpec, check_methods, format_summary, format_sweep, load_questions, run_bench
    from specplay.core.methods import get_spec

    from specplay.core.remote import Endpoint

    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    check_methods(names)
    _check_counts(args)
    endpoints = {f"remote:{ep.label}": ep for ep in (Endpoint.parse(e) for e in args.engine)}
    questions = load_questions(args.prompts, args.categories, args.limit, args.per_category)
    configs = {n: config_for(n, args) for n in names if n not in PEERS}
    need_draft = any(n == "hf_assisted" or (n not in PEERS and get_spec(n).needs_draft) for n in names)
    temperatures = _temperatures(args.temperatures) if args.temperatures else ()
    target, draft = _load_models(args, need_draft)
    bench_spec = BenchSpec(methods=names + list(endpoints), endpoints=endpoints, configs=configs,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_p=args.top_p, seed=args.seed, warmup=args.warmup, repeats=args.repeats,
                           chat_template=not args.no_chat_template, temperatures=temperatures,
                           stand_down=not args.no_stand_down)
    result = run_bench(target, draft, questions, bench_spec, args.out, log=lambda m: print(m, file=sys.stderr, flush=True))
    from specplay.core.records.environment import format_card

    print(format_card(result["environment"]))
    for temperature, summary in result["by_temperature"].items():
        if len(temperatures) > 1:
            print(f"\ntemperature {temperature:g}:")
        print(format_summary(summary, result["verify_cost"], temperature))
    if len(temperatures) > 1:
        print()
        print(format_sweep(result["by_temperature"]))
    print(f"answers and summary.json in {args.out}", file=sys.stderr)
    return 0


def cmd_audit(args) -> int:
    from specplay.core.measure.audit import DEFAULT_PROMPT, AuditConfig, audit_record, format_audit, run_audit
    from specplay.core.methods import get_spec
    from specplay.core.records.runlog import dumps
    from specplay.core.text import encode_prompt
    from specplay.core.decoding.types import SamplingConfig

    method_spec = get_spec(args.method)
    method_config = config_for(args.method, args)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    config = AuditConfig(samples=args.samples, depth=args.tokens, min_expected=args.min_expected, alpha=args.alpha)
    prompt = DEFAULT_PROMPT if args.prompt is None and args.prompt_file is None else _prompt_text(args)
    if not prompt.strip():
        raise SpecPlayError("the prompt is empty")
    target, draft = _load_models(args, method_spec.needs_draft)
    ids = encode_prompt(target.tokenizer, prompt, chat_template=not args.no_chat_template)
    result = run_audit(target, draft, args.method, method_config, ids, sampling, config, progress=_Progress())
    record = audit_record(result, target=target, draft=draft, prompt=prompt)
    print(dumps(record) if args.json else format_audit(record))
    if args.log:
        _write_log(args.log, [record])
    if result.error:
        raise SpecPlayError(result.error)
    return 0


def _temperatures(text: str) -> tuple[float, ...]:
    from specplay.core.decoding.types import SamplingConfig

    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise SpecPlayError(f"--temperatures takes numbers separated by commas, e.g. 0,1 (got {text!r})") from None
    for t in values:
        SamplingConfig(temperature=t)  # the same check every run applies
    if not values or len(set(values)) < len(values):
        raise SpecPlayError(f"--temperatures needs distinct temperatures, e.g. 0,1 (got {text!r})")
    return values


def cmd_train(args) -> int:
    from specplay.core.models.linear import has_bf16_units
    from specplay.core.models.loader import load_model
    from specplay.core.training.common import TrainSettings
    from specplay.core.training.pipeline import DataSettings, train_heads

    if args.save_corpus and not args.data_only:
        raise SpecPlayError("--save-corpus goes with --data-only (make the data, keep its token ids, then train)")
    from specplay.core.training.recipes import RECIPES

    if args.recipe not in RECIPES[args.kind]:
        raise SpecPlayError(f"the {args.recipe} recipe is not one for {args.kind} heads: use "
                            f"{' or '.join(RECIPES[args.kind])}")
    defaults = {"medusa": (128, 1e-3), "eagle": (16, 3e-4)}[args.kind]
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size or defaults[0], lr=args.lr or defaults[1],
                             seed=args.seed, bf16=args.bf16 == "on" or (args.bf16 == "auto" and has_bf16_units()))
    data = DataSettings(code_tokens=args.code_tokens, answers=args.answers, answer_tokens=args.answer_tokens,
                        seed=args.seed, slots=args.slots)
    progress = _Progress()
    target = load_model(args.target, args.device, args.dtype, progress=progress)
    if args.data_only:
        from specplay.core.training.data import save_corpus
        from specplay.core.training.pipeline import answers_dir, default_workdir, prepare_data, target_key

        workdir = args.workdir or default_workdir(target.model_id)
        _, stats = prepare_data(target, data, workdir, progress, lambda: False, args.corpus)
        print(json.dumps(stats))
        if args.save_corpus:
            # This target's answers only: a shared work folder may also hold another target's.
            n = save_corpus(answers_dir(workdir, data), args.save_corpus, target.model_id,
                            key=target_key(target.path, progress))
            print(f"{args.save_corpus} holds {n} answers", file=sys.stderr)
        return 0

    def on_step(p):
        m = p.metrics
        if p.step % args.log_every == 0 or "top1" in m or p.step == p.total:
            line = f"step {p.step}/{p.total}  loss {m['loss']:.4f}  {p.elapsed_s:.0f}s"
            if "top1" in m:
                top1 = m["top1"] if isinstance(m["top1"], list) else [m["top1"]]
                line += "  top-1 " + " ".join(f"{a:.1%}" for a in top1)
            if "top1_by_level" in m:
                line += "  by level " + " ".join(f"{a:.1%}" for a in m["top1_by_level"])
            if m.get("tau_sim") is not None:
                line += f"  τ_sim {m['tau_sim']:.2f}"
            print(line, file=sys.stderr, flush=True)

    path, manifest = train_heads(args.kind, target, data, settings, num_heads=args.num_heads,
                                 draft_vocab=args.draft_vocab, intermediate=args.intermediate, window=args.window,
                                 unroll=args.unroll or (3 if args.recipe == "eagle3" else 1), init=args.init,
                                 head_recipe=args.recipe, teacher_weight=args.teacher_weight, corpus=args.corpus,
                                 workdir=args.workdir, out=args.out, resume=args.resume,
                                 command="specplay " + " ".join(sys.argv[1:]), progress=progress, on_step=on_step)
    print(f"saved {path}")
    print(json.dumps({k: manifest[k] for k in ("accuracy", "tau_sim", "data", "steps", "train_seconds")
                      if k in manifest}))
    return 0


# --------------------------------------------------------------------------- parser
#: Every option an endpoint takes (:meth:`specplay.core.remote.Endpoint.parse`).
ENGINE_METAVAR = "URL[,model=M][,name=N][,key-env=VAR][,timeout=S][,deadline=S]"


def build_parser() -> argparse.ArgumentParser:
    from specplay.core import __version__
    from specplay.core.measure.audit import DEFAULT_DEPTH as AUDIT_DEPTH, DEFAULT_SAMPLES as AUDIT_SAMPLES
    from specplay.core.measure.bench import BUILTIN_SETS
    from specplay.core.measure.compare import WARMUP_TOKENS
    from specplay.core.methods import METHODS

    parser = argparse.ArgumentParser(
        prog="specplay",
        description="SpecPlay: lossless LLM inference acceleration, compared and shown. "
                    "Without a command, the desktop app opens.",
    )
    parser.add_argument("-v", "--version", action="version", version=f"specplay {__version__}")
    parser.add_argument("--verbose", action="store_true", help="log details to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="generate with one method and stream the text")
    p.add_argument("--method", default="autoregressive", choices=list(METHODS))
    p.add_argument("--engine", metavar=ENGINE_METAVAR,
                   help="stream from an OpenAI-compatible endpoint instead of a local method")
    _add_generation_args(p)
    _add_model_args(p)
    add_method_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help="run several methods on the same prompt and compare them")
    p.add_argument("--methods", help=f"comma-separated, from: {', '.join(METHODS)}")
    p.add_argument("--engine", action="append", default=[], metavar=ENGINE_METAVAR,
                   help="an OpenAI-compatible endpoint to compare instead of local methods (repeatable; the first "
                        "is the baseline); an API key is sent only from the variable key-env=VAR names or the OS "
                        "keyring entry for the URL, and never over plain http:// to another machine")
    p.add_argument("--warmup-tokens", type=int, default=WARMUP_TOKENS,
                   help="untimed warm-up generation per method (0 = none)")
    p.add_argument("--why", action="store_true",
                   help="also explain each speed: this machine's verify cost curve, each method's step cost in "
                        "plain steps, the speedup that predicts against the one measured, and the break-even draft cost")
    _add_generation_args(p)
    _add_model_args(p)
    add_method_options(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("tune", help="predict the fastest setting of a method's draft size for a prompt on this "
                                    "machine from one run, then run it to check")
    p.add_argument("--method", required=True, choices=["speculative", "prompt_lookup", "eagle"])
    p.add_argument("--warmup-tokens", type=int, default=WARMUP_TOKENS,
                   help="untimed warm-up generation before each timed run (0 = none)")
    _add_generation_args(p)
    _add_model_args(p)
    add_method_options(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("bench", help="benchmark methods and transformers peers on a prompt set (Spec-Bench style)")
    p.add_argument("--prompts", default="code", help=f"a Spec-Bench question file, or a built-in set: {', '.join(BUILTIN_SETS)}")
    p.add_argument("--categories", nargs="*", help="only these categories (mt_bench = the 8 MT-bench ones)")
    p.add_argument("--limit", type=int, help="first N questions")
    p.add_argument("--per-category", type=int, help="first N questions of each category")
    p.add_argument("--methods", required=True,
                   help="comma-separated methods and peers (hf_generate, hf_assisted, hf_prompt_lookup; with the "
                        "'peers' extra: llamacpp_generate, llamacpp_prompt_lookup)")
    p.add_argument("--engine", action="append", default=[], metavar=ENGINE_METAVAR,
                   help="also benchmark an OpenAI-compatible endpoint on the same prompts (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--temperatures", metavar="T1,T2", help="a sweep: every method at each temperature in turn "
                   "(e.g. 0,1: τ, acceptance and speedup per temperature; replaces --temperature)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of the first question per method")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--no-stand-down", action="store_true",
                   help="every method drafts in every step, even where plain steps are faster")
    p.add_argument("--out", type=Path, required=True, help="folder for answer files and summary.json")
    _add_model_args(p)
    add_method_options(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("audit", help="test a method's samples against the target's exact distribution (chi-square)")
    p.add_argument("--method", default="speculative", choices=list(METHODS))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text (default: a short code request)")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 text file")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument("--samples", type=int, default=AUDIT_SAMPLES, help="independent samples N (each its own seed)")
    p.add_argument("--tokens", type=int, default=AUDIT_DEPTH, help="new tokens tested per sample K; each sample's steps draft as deep as the method does, and "
                        "the record's deepest_verified says how deep a draft position the verifier was judged at "
                        "within them")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sample i decodes with seed + 2i")
    p.add_argument("--min-expected", type=float, default=5.0, help="bins under this expected count are merged")
    p.add_argument("--alpha", type=float, default=0.01, help="family-wise level of the joint and per-position tests")
    p.add_argument("--json", action="store_true", help="print one JSON record instead of the text report")
    p.add_argument("--log", type=Path, help="append the audit record as a JSON line to this file")
    _add_model_args(p)
    add_method_options(p)
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("train", help="train Medusa heads or an EAGLE head for a target, on CPU")
    p.add_argument("kind", choices=["medusa", "eagle"])
    _add_model_args(p)
    g = p.add_argument_group("data (self-distillation from the target)")
    g.add_argument("--code-tokens", type=int, default=60_000, help="tokens of standard-library source")
    g.add_argument("--answers", type=int, default=64, help="instructions the target answers (the slow part)")
    g.add_argument("--answer-tokens", type=int, default=256, help="max tokens per answer")
    g.add_argument("--slots", type=int, default=16, help="answers generated at once (a CPU pass over 16 rows costs "
                   "about twice one row)")
    g.add_argument("--data-only", action="store_true", help="generate the data (resumably) and stop, without training")
    g.add_argument("--workdir", type=Path, help="cache for answers, features and checkpoints")
    g.add_argument("--corpus", type=Path, help="answers made before (token ids, --save-corpus): read by the target "
                   "instead of generated, about 1.6x as fast (default: the project's assets/training file for "
                   "the target, where there is one)")
    g.add_argument("--save-corpus", type=Path, metavar="FILE", help="with --data-only: add the token ids of every "
                   "answer made so far to FILE")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=1000)
    g.add_argument("--batch-size", type=int, default=None, help="positions (medusa, default 128) or windows (eagle, default 16)")
    g.add_argument("--lr", type=float, default=None, help="default 1e-3 (medusa), 3e-4 (eagle)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--bf16", choices=["auto", "on", "off"], default="auto", help="bfloat16 matmuls (auto: where the CPU has bf16 units)")
    g.add_argument("--num-heads", type=int, default=4, help="medusa heads")
    g.add_argument("--draft-vocab", type=int, default=32768, help="tokens the heads can draft")
    g.add_argument("--intermediate", type=int, default=None, help="eagle: MLP width of the head (default: the target's)")
    g.add_argument("--window", type=int, default=128, help="eagle: training window length")
    g.add_argument("--recipe", choices=["classic", "eagle3", "hydra"], default="classic",
                   help="classic: the heads as shipped; eagle3 (eagle): fused low/middle/high target layers in, tokens "
                   "out, trained on its own states; hydra (medusa): each head reads the token drafted before its own. "
                   "Both new recipes learn the target's top-K distribution and read the target's layers once more")
    g.add_argument("--teacher-weight", type=float, default=1.0, help="eagle3, hydra: share of the loss on the "
                   "target's top-K distribution, the rest on its argmax")
    g.add_argument("--unroll", type=int, default=None, help="eagle: also train on the head's own predicted features, "
                   "this many drafting levels deep (costs about this many times the time per step; default 1, "
                   "eagle3: 3)")
    g.add_argument("--init", choices=["target", "identity"], default="target",
                   help="eagle: start the head's layer from the target's last layer, or from a near-identity layer")
    g.add_argument("--resume", action="store_true", help="continue from the last checkpoint in the work folder")
    g.add_argument("--log-every", type=int, default=25)
    g.add_argument("--out", type=Path, help="heads file to write (default: user data folder)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("models", help="list, prepare or prune the built-in models and the model cache, or measure "
                                      "this machine again")
    msub = p.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="the catalog and what is installed")
    pp = msub.add_parser("prepare", help="assemble, verify and convert catalog models ahead of time")
    pp.add_argument("ids", nargs="*", help="catalog ids (default: the default target and draft)")
    msub.add_parser("measure", help="forget this machine's measurements (int8 kernels, draft engines, memory "
                                    "bandwidth) and llama.cpp's verdicts, and measure the int8 kernels again now; "
                                    "the rest is measured again on the next load")
    pr = msub.add_parser("prune", help="free disk space in the model cache")
    pr.add_argument("ids", nargs="*", help="cached entries to remove whole (default: only what is made again on demand: "
                                           "float32 copies beside int8 weights, assembled GGUF files, leftovers)")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        _quiet_libraries()
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except SpecPlayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def _quiet_libraries() -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
