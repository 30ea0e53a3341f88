"""GPU check: every method on random-weight models shaped like the default pair.

Real weights cannot travel to a borrowed GPU machine, and a random model of the same shapes
exercises the same kernels at the same sizes. For a device and dtype this reports, as JSON:

* per method, whether its greedy output is identical to ``autoregressive``'s (the native
  engine's exactness claim in that dtype: low-precision kernels that block a verified batch
  differently from a single token can flip near-ties), with τ, the draft tokens it proposed
  and had accepted (a method that accepted none was checked on its rejection path only), and
  tokens/s;
* the target's verification cost curve T(k)/T(1) for k = 1 … 64.

Run it from the repository root::

    python tests/gpu_check.py --device cuda --dtype bfloat16 --out gpu-bf16.json
    python tests/gpu_check.py --device cpu --dtype float32 --scale tiny

``--scale tiny`` shrinks the shapes so that the check runs in seconds on a CPU (a test does
that, so the script cannot rot). Random weights give near-uniform distributions, so ties are
far more common than with a trained model: the identical flags here are a stress test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specplay.core.decoding.engine import run_to_end  # noqa: E402
from specplay.core.heads import save_heads  # noqa: E402
from specplay.core.methods import build_method  # noqa: E402
from specplay.core.records.runlog import tokens_by_source  # noqa: E402
from specplay.core.heads import EagleHead, MedusaHeads, head_config  # noqa: E402
from specplay.core.methods.eagle import EagleConfig  # noqa: E402
from specplay.core.methods.lookahead import LookaheadConfig  # noqa: E402
from specplay.core.methods.medusa import MedusaConfig  # noqa: E402
from specplay.core.methods.speculative import SpeculativeConfig  # noqa: E402
from specplay.core.models.loader import LoadedModel  # noqa: E402
from specplay.core.models.native import DecoderConfig, NativeDecoder  # noqa: E402
from specplay.core.decoding.types import GenerationConfig  # noqa: E402

#: Qwen2.5-Coder-1.5B-Instruct (target) and 0.5B-Instruct (draft), and a CPU-sized stand-in.
SHAPES = {
    "default": (dict(hidden=1536, inter=8960, layers=28, heads=12, kv_heads=2, vocab=151936),
                dict(hidden=896, inter=4864, layers=24, heads=14, kv_heads=2, vocab=151936)),
    "tiny": (dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=512),
             dict(hidden=32, inter=64, layers=1, heads=4, kv_heads=2, vocab=512)),
}
COST_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
#: See :func:`embeddings`.
DRAFT_WRITE_SCALE = 0.05


class IdTokenizer:
    """Decodes ids to text as numbers: all the engine needs to stream a random model's output."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        return "".join(f" {i}" for i in ids)


def random_decoder(shape: dict, name: str, device: str, dtype: torch.dtype, seed: int, embedding: torch.Tensor,
                   write_scale: float = 1.0) -> NativeDecoder:
    """A Qwen2-shaped native decoder with seeded random weights and the given (tied) embedding, made on ``device``.

    ``write_scale`` scales what each layer adds to the residual stream (its attention and MLP output projections).
    """
    import transformers

    hf_cfg = transformers.Qwen2Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=4096, tie_word_embeddings=True,
    )
    cfg = DecoderConfig.from_hf(hf_cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, kv_dim = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (cfg.num_heads * cfg.head_dim, h), "k_proj": (kv_dim, h), "v_proj": (kv_dim, h),
              "o_proj": (h, cfg.num_heads * cfg.head_dim), "gate_proj": (cfg.intermediate_size, h),
              "up_proj": (cfg.intermediate_size, h), "down_proj": (h, cfg.intermediate_size)}

    def tensor(key: str) -> torch.Tensor | None:
        if key.endswith("norm.weight"):
            return torch.ones(h, device=device)
        if key == "model.embed_tokens.weight":
            return embedding
        part = key.split(".")[-2]
        if key.endswith(".bias"):
            return torch.randn(shapes[part][0], generator=gen, device=device) * 0.02
        if part in shapes:
            out, fan_in = shapes[part]
            scale = write_scale if part in ("o_proj", "down_proj") else 1.0
            return torch.randn(out, fan_in, generator=gen, device=device) * (scale / fan_in ** 0.5)
        return None

    return NativeDecoder(cfg, tensor, name=name, device=device, dtype=dtype, eos_token_ids=())


def embeddings(target_shape: dict, draft_shape: dict, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random embeddings (tied to the LM heads) for the target and for a draft that agrees with it at times.

    The target's is large enough that its LM head gives peaked, not uniform, distributions.
    The draft's is the target's through a random projection to the draft's width, four times
    larger, and the draft's layers write to its residual stream at ``DRAFT_WRITE_SCALE``: the
    draft then ranks next tokens by their embeddings' likeness to the context's, and the random
    target repeats tokens often enough that such a draft is accepted at times (9 of 32 draft
    tokens at the default shapes in float32). With an independent draft none is ever accepted,
    and ``speculative`` would be checked on its rejection path alone.
    """
    g = torch.Generator(device=device).manual_seed(3)
    vocab, width, draft_width = target_shape["vocab"], target_shape["hidden"], draft_shape["hidden"]
    target = torch.randn(vocab, width, generator=g, device=device) * 0.1
    projection = torch.randn(width, draft_width, generator=g, device=device) * (4 / width ** 0.5)
    return target, target @ projection


def random_heads(folder: Path, target: NativeDecoder) -> tuple[Path, Path]:
    """Random Medusa heads and a random EAGLE head for ``target``, saved as heads files."""
    torch.manual_seed(0)
    vocab, hidden = target.info.vocab_size, target.info.hidden_size
    medusa = MedusaHeads(hidden, 3)
    for block in medusa.blocks:
        torch.nn.init.normal_(block.linear.weight, std=0.3 / hidden ** 0.5)
    tensors = dict(medusa.state_dict(), vocab_ids=torch.arange(vocab))
    accuracy = [[0.6, 0.15, 0.05], [0.4, 0.1, 0.04], [0.3, 0.08, 0.03]]
    medusa_path = folder / "medusa.safetensors"
    save_heads(medusa_path, tensors, {"kind": "medusa", "target": "random", "hidden_size": hidden,
                                      "vocab_size": vocab, "num_heads": 3, "accuracy": accuracy})
    inter = target.cfg.intermediate_size
    eagle = EagleHead(head_config(target.cfg, inter))
    eagle_path = folder / "eagle.safetensors"
    save_heads(eagle_path, dict(eagle.state_dict(), vocab_ids=torch.arange(vocab)),
               {"kind": "eagle", "target": "random", "hidden_size": hidden, "vocab_size": vocab,
                "intermediate_size": inter})
    return medusa_path, eagle_path


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def verify_cost_curve(model: NativeDecoder, device: str, context: int = 256, repeats: int = 5) -> dict[str, float]:
    """T(k)/T(1): median time of a k-token forward pass after ``context`` cached tokens, over one token's."""
    g = torch.Generator().manual_seed(1)
    model.reset()
    model.forward_chain(torch.randint(0, model.info.vocab_size, (context,), generator=g))
    medians = {}
    for k in COST_SIZES:
        block = torch.randint(0, model.info.vocab_size, (k,), generator=g)
        model.forward(block)  # warm-up for this shape
        samples = []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            model.forward(block)
            synchronize(device)
            samples.append(time.perf_counter() - start)
        medians[k] = statistics.median(samples)
    model.reset()
    return {str(k): round(t / medians[1], 3) for k, t in medians.items()} | {"T1_ms": round(medians[1] * 1e3, 3)}


def first_difference(tokens: list[int], baseline: list[int]) -> int | None:
    """The first position where ``tokens`` and ``baseline`` differ, None if they are equal.

    A run cut short (out of memory at full size) differs where it ends, though it may agree up to there.
    """
    if tokens == baseline:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, baseline)) if a != b), min(len(tokens), len(baseline)))


def run_methods(target: LoadedModel, draft: LoadedModel, heads: tuple[Path, Path], prompt: list[int],
                max_new_tokens: int) -> list[dict]:
    medusa_path, eagle_path = heads
    methods = [("autoregressive", None), ("speculative", SpeculativeConfig(cost_sized=False, gamma=5)), ("prompt_lookup", None),
               ("lookahead", LookaheadConfig()), ("medusa", MedusaConfig(heads=str(medusa_path), tree="small")),
               ("eagle", EagleConfig(head=str(eagle_path), auto_size=False))]
    # Every method drafts in every step: the check is about its accepted paths, not about when drafting pays.
    gen = GenerationConfig(max_new_tokens=max_new_tokens, stop_at_eos=False, stand_down=False)
    rows, baseline = [], None
    for name, config in methods:
        method = build_method(name, config, target, draft)
        result = run_to_end(target.model, target.tokenizer, method, prompt, gen, warmup_tokens=8)
        baseline = baseline if baseline is not None else result.token_ids
        rows.append({"method": name, "identical": result.token_ids == baseline,
                     "first_difference": first_difference(result.token_ids, baseline),
                     "tau": round(result.metrics.mean_accepted, 3), "drafted": result.metrics.drafted,
                     "accepted": result.metrics.accepted, "tokens_per_s": round(result.metrics.tokens_per_s, 2),
                     "sources": tokens_by_source(result.events),
                     "unsourced": sum(t.source is None for e in result.events for t in e.tokens),
                     "error": result.error})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--scale", default="default", choices=sorted(SHAPES))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="also write the report to this JSON file")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    target_shape, draft_shape = SHAPES[args.scale]
    target_embedding, draft_embedding = embeddings(target_shape, draft_shape, args.device)
    target = LoadedModel(random_decoder(target_shape, "random-target", args.device, dtype, 0, target_embedding),
                         IdTokenizer(), model_id="random-target", path=None)
    draft = LoadedModel(random_decoder(draft_shape, "random-draft", args.device, dtype, 1, draft_embedding,
                                       DRAFT_WRITE_SCALE), IdTokenizer(), model_id="random-draft", path=None)
    g = torch.Generator().manual_seed(2)
    chunk = torch.randint(0, target_shape["vocab"], (40,), generator=g).tolist()
    prompt = chunk + torch.randint(0, target_shape["vocab"], (20,), generator=g).tolist() + chunk[:20]
    with tempfile.TemporaryDirectory() as folder:
        heads = random_heads(Path(folder), target.model)
        methods = run_methods(target, draft, heads, prompt, args.max_new_tokens)
    report = {"device": args.device, "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda")
              else "cpu", "dtype": args.dtype, "scale": args.scale, "torch": torch.__version__,
              "methods": methods, "verify_cost": verify_cost_curve(target.model, args.device)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
