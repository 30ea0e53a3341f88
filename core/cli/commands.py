"""What each subcommand does: ``run``, ``compare``, ``tune``, ``models``, ``bench``, ``audit`` and
``train``, each given the parsed arguments, each returning the process's exit code."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from specplay.core.cli.options import (LineProgress, check_counts, config_for, generation_config, load_models,
                                       methods_from, prompt_text)
from specplay.core.errors import SpecPlayError

log = logging.getLogger("specplay")


def cmd_run(args) -> int:
    from specplay.core.decoding.engine import run_to_end
    from specplay.core.methods import build_method, get_spec
    from specplay.core.records.runlog import RunRecord, dumps, stats_line
    from specplay.core.text import encode_prompt

    if args.engine:
        return _run_remote(args)
    method_spec = get_spec(args.method)
    method_config = config_for(args.method, args)
    gen_config = generation_config(args)
    prompt = prompt_text(args)
    if not prompt.strip():
        raise SpecPlayError("the prompt is empty")
    target, draft = load_models(args, method_spec.needs_draft)
    ids = encode_prompt(target.tokenizer, prompt, chat_template=not args.no_chat_template)
    method = build_method(args.method, method_config, target, draft)

    def stream(event):
        if not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()

    result = run_to_end(target.model, target.tokenizer, method, ids, gen_config, on_event=stream)
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
    names = methods_from(args.methods)
    if "autoregressive" not in names:
        names.insert(0, "autoregressive")
    configs = {n: config_for(n, args) for n in names}
    gen_config = generation_config(args)
    prompt = prompt_text(args)
    if not prompt.strip():
        raise SpecPlayError("the prompt is empty")
    target, draft = load_models(args, any(get_spec(n).needs_draft for n in names))
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
        from specplay.core.records.runlog import RunRecord

        curve = cost_curve(target.model)
        why = explain([RunRecord.from_dict(r) for r in comparison.records], curve)
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
    from specplay.core.measure import tune_server
    from specplay.core.measure.tune import format_tune, tune
    from specplay.core.methods import get_spec
    from specplay.core.records.runlog import dumps
    from specplay.core.text import encode_prompt

    server = args.method == tune_server.NAME  # llama-server's own draft size, not a method of SpecPlay's
    method_config = None if server else config_for(args.method, args)
    gen_config = generation_config(args)
    if not gen_config.sampling.greedy:
        raise SpecPlayError("tune predicts greedy runs: leave --temperature at 0")
    prompt = prompt_text(args)
    if not prompt.strip():
        raise SpecPlayError("the prompt is empty")
    target, draft = load_models(args, server or get_spec(args.method).needs_draft)
    ids = encode_prompt(target.tokenizer, prompt, chat_template=not args.no_chat_template)
    stages = LineProgress()
    on_stage = lambda text, fraction: stages(text, None)  # noqa: E731
    if server:
        result = tune_server.tune_llamacpp_speculative(target, draft, ids, gen_config, prompt=prompt,
                                                       warmup_tokens=args.warmup_tokens, on_stage=on_stage)
    else:
        result = tune(target, draft, args.method, method_config, ids, gen_config, prompt=prompt,
                      warmup_tokens=args.warmup_tokens, on_stage=on_stage)
    if args.json:
        print(dumps(result.to_dict()))
    else:
        print(format_tune(result))
    if args.log:
        _write_log(args.log, [result.to_dict(with_records=True)])
    return 0


def _compare_remote(args) -> int:
    from specplay.core.records.runlog import RunRecord, dumps
    from specplay.core.remote.endpoint import Endpoint
    from specplay.core.remote.runs import compare_endpoints, format_remote_table

    if args.methods:
        raise SpecPlayError("compare either local methods (--methods) or endpoints (--engine), not both in one run")
    endpoints = [Endpoint.parse(e) for e in args.engine]
    prompt = prompt_text(args)

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
    from specplay.core.records.runlog import RunRecord, dumps, stats_line
    from specplay.core.remote.endpoint import Endpoint
    from specplay.core.remote.runs import remote_record, stream_completion

    endpoint = Endpoint.parse(args.engine)
    prompt = prompt_text(args)

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
    from specplay.core.weights.catalog import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET, get_entry
    from specplay.core.weights.prepare import cached_entries, catalog_status, models_root, prune

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
    _prepare_models([get_entry(model_id).id for model_id in args.ids] or [DEFAULT_TARGET, DEFAULT_DRAFT],
                    DEFAULT_DRAFT)
    return 0


def _prepare_models(ids: list[str], draft_id: str) -> None:
    """Make ready every file a load of each model makes on this machine (the assembled GGUF, the kernel and
    its proof, the repacked or fitted blocks, int8 rows where those are what it runs on), by loading it once
    as it will be loaded: ``draft_id`` as a draft, the others as targets."""
    from specplay.core.models.loader import load_model

    for model_id in ids:
        loaded = load_model(model_id, role="draft" if model_id == draft_id else "target", progress=LineProgress())
        print(f"{model_id}: {loaded.path}")
        close = getattr(loaded.model, "close", None)
        if close:
            close()


def _measure_again() -> None:
    """Forget this machine's measurements and llama.cpp verdicts; measure the int8 kernels and the
    default draft's engines (llama.cpp's against the native one) now."""
    from specplay.core.kernels.linear import int8_supported
    from specplay.core.models.llamacpp import available, forget_verdicts
    from specplay.core.models.loader import compare_draft_engines
    from specplay.core.models.measurements import describe_quant_engine, forget_measurements, quant_engine
    from specplay.core.weights.catalog import DEFAULT_DRAFT

    measurements, verdicts = forget_measurements(), forget_verdicts()
    print(f"forgot {measurements} measurement{'s' * (measurements != 1)} and {verdicts} llama.cpp "
          f"verdict{'s' * (verdicts != 1)} of this machine")
    if int8_supported():
        quant_engine(LineProgress())
        print("  " + describe_quant_engine())
    if available() is None:
        for note in compare_draft_engines(DEFAULT_DRAFT, LineProgress()):
            if note.startswith("draft engine"):
                print(f"  {DEFAULT_DRAFT}: {note}")
    else:
        print("  llama.cpp's probes are measured again on the next load")


def _print_engines() -> None:
    """What was measured and chosen on this machine: the int8 kernel, llama.cpp's probes."""
    from specplay.core.models.llamacpp import available, known_verdicts
    from specplay.core.models.measurements import QUANT_KEY, cpu_name, describe_quant_engine, has_measured

    print(f"this machine: {cpu_name() or 'unknown CPU'}")
    print("  " + (describe_quant_engine() if has_measured(QUANT_KEY)
                  else "int8 kernel: not measured yet (measured on the first int8 load)"))
    why_not = available()
    verdicts = [] if why_not else known_verdicts()
    print(f"  llama.cpp: {why_not or ('no file tried yet' if not verdicts else 'tried in child processes')}")
    for line in verdicts:
        print(f"    {line}")


def cmd_peers(args) -> int:
    from specplay.core.remote.llama_server import build

    build(args.jobs, log=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


def cmd_bench(args) -> int:
    from specplay.core.measure.bench import BenchSpec, check_methods, format_summary, format_sweep, run_bench
    from specplay.core.measure.peers import PEERS
    from specplay.core.measure.prompts import load_questions
    from specplay.core.methods import get_spec

    from specplay.core.remote.endpoint import Endpoint

    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    check_methods(names)
    check_counts(args)
    endpoints = {f"remote:{ep.label}": ep for ep in (Endpoint.parse(e) for e in args.engine)}
    questions = load_questions(args.prompts, args.categories, args.limit, args.per_category)
    configs = {n: config_for(n, args) for n in names if n not in PEERS}
    need_draft = any(n in ("hf_assisted", "llamacpp_speculative") or (n not in PEERS and get_spec(n).needs_draft)
                     for n in names)
    temperatures = _temperatures(args.temperatures) if args.temperatures else ()
    target, draft = load_models(args, need_draft)
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
    from specplay.core.decoding.types import SamplingConfig
    from specplay.core.measure.audit import DEFAULT_PROMPT, AuditConfig, audit_record, format_audit, run_audit
    from specplay.core.methods import get_spec
    from specplay.core.records.runlog import dumps
    from specplay.core.text import encode_prompt

    method_spec = get_spec(args.method)
    method_config = config_for(args.method, args)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    config = AuditConfig(samples=args.samples, depth=args.tokens, min_expected=args.min_expected, alpha=args.alpha)
    prompt = DEFAULT_PROMPT if args.prompt is None and args.prompt_file is None else prompt_text(args)
    if not prompt.strip():
        raise SpecPlayError("the prompt is empty")
    target, draft = load_models(args, method_spec.needs_draft)
    ids = encode_prompt(target.tokenizer, prompt, chat_template=not args.no_chat_template)
    result = run_audit(target, draft, args.method, method_config, ids, sampling, config, progress=LineProgress())
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
    from specplay.core.kernels.linear import has_bf16_units
    from specplay.core.models.loader import load_model
    from specplay.core.training.common import TrainSettings
    from specplay.core.training.data import DataSettings
    from specplay.core.training.recipes import RECIPES, recipe_names, train_heads

    if args.save_corpus and not args.data_only:
        raise SpecPlayError("--save-corpus goes with --data-only (make the data, keep its token ids, then train)")
    if (args.kind, args.recipe) not in RECIPES:
        raise SpecPlayError(f"the {args.recipe} recipe is not one for {args.kind} heads: use "
                            f"{' or '.join(recipe_names(args.kind))}")
    defaults = {"medusa": (128, 1e-3), "eagle": (16, 3e-4)}[args.kind]
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size or defaults[0], lr=args.lr or defaults[1],
                             seed=args.seed, bf16=args.bf16 == "on" or (args.bf16 == "auto" and has_bf16_units()))
    data = DataSettings(code_tokens=args.code_tokens, answers=args.answers, answer_tokens=args.answer_tokens,
                        seed=args.seed, slots=args.slots)
    progress = LineProgress()
    target = load_model(args.target, args.device, args.dtype, progress=progress)
    if args.data_only:
        from specplay.core.training.data import answers_dir, save_corpus, target_key
        from specplay.core.training.recipes import default_workdir, prepare_data

        workdir = args.workdir or default_workdir(target.model_id)
        _, stats = prepare_data(RECIPES[args.kind, args.recipe], target, data, workdir, progress, lambda: False,
                                args.corpus)
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
                                 recipe=args.recipe, teacher_weight=args.teacher_weight, corpus=args.corpus,
                                 workdir=args.workdir, out=args.out, resume=args.resume,
                                 command="specplay " + " ".join(sys.argv[1:]), progress=progress, on_step=on_step)
    print(f"saved {path}")
    print(json.dumps({k: manifest[k] for k in ("accuracy", "tau_sim", "data", "steps", "train_seconds")
                      if k in manifest}))
    return 0
