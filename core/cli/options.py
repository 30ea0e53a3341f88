"""The command line's shared options: each method's knobs as flags, the models, generation and
sampling, and what they become (a method's configuration, a generation config, loaded models)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from specplay.core.errors import SpecPlayError

log = logging.getLogger("specplay")


class LineProgress:
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
    from specplay.core.decoding.method import field_type
    from specplay.core.methods import METHODS

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


def add_model_args(p: argparse.ArgumentParser) -> None:
    from specplay.core.weights.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

    g = p.add_argument_group("models")
    g.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: catalog id, folder, .gguf file or cached hub id (default {DEFAULT_TARGET})")
    g.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model for 'speculative' (default {DEFAULT_DRAFT})")
    g.add_argument("--device", default="auto", help="auto (CUDA, then MPS, then CPU), cpu, cuda, mps")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPU; on a CPU a GGUF target's own blocks where the exact kernel runs here, else int8 on x86, else float32), float32, bfloat16, float16, float64, int8 (CPU), "
                   "gguf (CPU: a GGUF target's own Q4_K/Q6_K blocks, exact; the draft keeps its fastest layers)")
    g.add_argument("--backend", default="auto", choices=["auto", "native", "transformers"], help=argparse.SUPPRESS)
    g.add_argument("--draft-backend", default="auto", choices=["auto", "native", "llamacpp"],
                   help="engine of the draft model: auto (llama.cpp in 4 bits for a quantized CPU draft from a GGUF "
                        "source where llama-cpp-python is installed, the peers extra; else native), native, llamacpp")


def add_generation_args(p: argparse.ArgumentParser, prompt_required: bool = True) -> None:
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


def prompt_text(args) -> str:
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


def check_counts(args) -> None:
    """The bench's counts in range, before any model loads (``--limit -1`` would drop the last question)."""
    for flag, value, least in (("--repeats", args.repeats, 1), ("--limit", args.limit, 1),
                               ("--per-category", args.per_category, 1), ("--warmup", args.warmup, 0)):
        if value is not None and value < least:
            raise SpecPlayError(f"{flag} must be {'at least 1' if least else '0 or more'}, got {value}")


def generation_config(args):
    from specplay.core.decoding.types import GenerationConfig, SamplingConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop),
                            stand_down=not args.no_stand_down,
                            sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed))


def load_models(args, need_draft: bool):
    from specplay.core.models.loader import check_draft_compatible, load_model

    progress = LineProgress()
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


def methods_from(text: str) -> list[str]:
    from specplay.core.methods import get_spec

    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise SpecPlayError("no methods given")
    for n in names:
        get_spec(n)
    return names
