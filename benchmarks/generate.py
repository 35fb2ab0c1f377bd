"""Decoding throughput: lmforge's inference engine against transformers' `generate`.

    python benchmarks/generate.py [--batch-sizes 1 8 32] [--samples 8] [--dtypes float32 bfloat16] [--repeats 5]
                                  [--model n_layers=1 ...]

Both sides hold the same weights (lmforge's random init of the `tiny` preset, mapped with
`lmforge.model.hf`), decode the same prompts (random token ids, --prompt-len long) greedily
for exactly --new-tokens tokens (no early stop: lmforge with no stop tokens, transformers
with min_new_tokens = max_new_tokens), in the same dtype and with the same torch threads.
The peer is `LlamaForCausalLM.generate(do_sample=False)` with its defaults (SDPA attention,
dynamic cache). Figures are generated tokens per second over the whole call (prefill
included); runs alternate and the best of N is kept. Target ratio: >= 2.

The ``sampled`` rows draw ``--samples`` continuations of one prompt (lmforge's ``n``, one
prefill shared by the samples) against ``generate(do_sample=True, num_return_sequences=n)``
with the same temperature, top-k (off) and top-p, again for exactly --new-tokens tokens.

With ``--draft-checkpoint`` (a checkpoint with multi-token prediction modules, e.g. ``benchmarks/mtp.py``'s
``runs/mtp/mtp``) the result also has a ``drafting`` section: that model's batch-1 greedy decoding of
held-out prompts (``--draft-data``'s validation windows) without drafting and with 1 .. D drafted tokens a
step (``benchmarks/mtp.py``'s ``measure_drafting``): tokens/s, the speed-up, the share of drafts accepted,
and whether every token is greedy decoding's.

lmforge's first call on a model also builds its decoding layout (``decoding_view``: joined
q/k/v and w1/w3, q/k in RoPE's pair order, matrices packed for oneDNN on a CPU), which later
calls reuse while the weights are unchanged; that first call is the warm-up, reported as
``lmforge_first_call_s``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from record import command, commit, machine, now

from lmforge.core.config import load_config
from lmforge.inference.engine import GenerationConfig, generate
from lmforge.model.config import ModelConfig
from lmforge.model.families import build as build_model
from lmforge.model.hf import hf_config_dict, state_dict_to_hf
from lmforge.model.transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_config(args: argparse.Namespace) -> ModelConfig:
    return load_config(ModelConfig, None, [f"preset={args.preset}", *args.model])


def build_pair(cfg: ModelConfig) -> tuple[Transformer, torch.nn.Module]:
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    config = {k: v for k, v in hf_config_dict(ours.cfg).items() if k not in ("architectures", "model_type", "torch_dtype")}
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    missing, unexpected = theirs.load_state_dict(state_dict_to_hf(ours.state_dict(), ours.cfg), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights did not map: missing {missing}, unexpected {unexpected}")
    if ours.cfg.tie_embeddings:
        theirs.tie_weights()
    return ours, theirs


TEMPERATURE, TOP_P = 0.8, 0.95  # the sampled rows' settings, on both sides (top-k off)


def measure(batch: int, dtype: str, args: argparse.Namespace, samples: int = 1) -> dict:
    """Greedy decoding of ``batch`` prompts, or with ``samples`` > 1 sampling that many continuations of one prompt."""
    ours, theirs = build_pair(model_config(args))
    ours.to(DTYPES[dtype])
    theirs.to(DTYPES[dtype])
    prompts = torch.randint(3, ours.cfg.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
    sampled = samples > 1
    config = GenerationConfig(max_new_tokens=args.new_tokens, temperature=TEMPERATURE if sampled else 0.0, top_p=TOP_P if sampled else 1.0,
                              n=samples, seed=0 if sampled else None, stop_token_ids=[])
    n = args.new_tokens
    rows = batch * samples

    def run_lmforge() -> list[list[int]]:
        results = generate(ours, prompts.tolist(), config)
        assert len(results) == rows and all(len(r.tokens) == n for r in results)
        return [r.tokens for r in results]

    @torch.inference_mode()
    def run_transformers() -> list[list[int]]:
        sampling = dict(do_sample=True, num_return_sequences=samples, temperature=TEMPERATURE, top_p=TOP_P, top_k=0) \
            if sampled else dict(do_sample=False)
        out = theirs.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                              min_new_tokens=n, eos_token_id=None, pad_token_id=0, **sampling)
        assert out.shape == (rows, args.prompt_len + n)
        return out[:, args.prompt_len :].tolist()

    t0 = time.perf_counter()
    ours_first = run_lmforge()  # also the warm-up; builds the fused view
    first_call_s = time.perf_counter() - t0
    same_rows = sum(a == b for a, b in zip(ours_first, run_transformers()))
    times: dict[str, list[float]] = {"lmforge": [], "transformers": []}
    for _ in range(args.repeats):
        for name, fn in (("lmforge", run_lmforge), ("transformers", run_transformers)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ours_tps = rows * n / min(times["lmforge"])
    peer_tps = rows * n / min(times["transformers"])
    return {
        "batch": batch,
        **({"samples": samples} if sampled else {}),
        "dtype": dtype,
        "lmforge_tokens_per_s": round(ours_tps, 1),
        "transformers_tokens_per_s": round(peer_tps, 1),
        "ratio": round(ours_tps / peer_tps, 3),
        **({} if sampled else {"identical_greedy_rows": f"{same_rows}/{batch}"}),
        "lmforge_first_call_s": round(first_call_s, 4),
        "times_s": {k: [round(t, 4) for t in v] for k, v in times.items()},
    }


def measure_drafting_of(args: argparse.Namespace) -> dict:
    """``--draft-checkpoint``'s batch-1 greedy decoding of 8 held-out 32-token prompts, 64 new tokens each, without
    drafting and with each draft length its MTP modules allow (``benchmarks/mtp.py``'s ``measure_drafting``)."""
    from mtp import held_out_prompts, measure_drafting

    from lmforge.checkpoints.load import load_model

    model, where = load_model(args.draft_checkpoint)
    prompts = held_out_prompts(8, 32, Path(args.draft_data))
    rows = measure_drafting(model.eval(), prompts, 64, args.repeats, list(range(1, model.cfg.mtp.depth + 1)))
    return {"checkpoint": str(where), "prompts": len(prompts), "prompt_len": 32, "new_tokens": 64, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--model", nargs="+", default=[], metavar="KEY=VALUE",
                        help="model fields set over the preset's (e.g. n_layers=1 for a smoke run)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--samples", type=int, nargs="*", default=[8],
                        help="sampled rows: this many continuations of one prompt (none: no sampled rows)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--draft-checkpoint", default=None, help="a model with MTP modules: measure its drafting too")
    parser.add_argument("--draft-data", default="runs/mup/data", help="prepared shards whose validation windows prompt it")
    parser.add_argument("--out", default="benchmarks/results/generate.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    started = now()
    rows = [measure(b, d, args) for d in args.dtypes for b in args.batch_sizes]
    sampled = [measure(1, d, args, samples=k) for d in args.dtypes for k in args.samples]
    drafting = measure_drafting_of(args) if args.draft_checkpoint else None
    result = {
        "benchmark": "generate",
        "date": started,
        "command": command("generate.py", None),
        "commit": commit(),
        "machine": {**machine(), "transformers": transformers.__version__},
        "model": {"preset": args.preset, "overrides": args.model, "params": model_config(args).num_params(),
                  "init": "random (seed 0)"},
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "figure": "generated tokens per second, whole generate call (prefill + decode), best of repeats",
        "target_ratio": 2.0,
        "results": rows,
        "sampled": sampled,
        "sampling": {"temperature": TEMPERATURE, "top_p": TOP_P, "top_k": 0},
        **({"drafting": drafting} if drafting else {}),
    }
    print(f"{'batch':>5} {'dtype':>9} {'lmforge tok/s':>14} {'transformers tok/s':>19} {'ratio':>6}  greedy rows equal")
    for r in rows:
        print(f"{r['batch']:>5} {r['dtype']:>9} {r['lmforge_tokens_per_s']:>14.1f} {r['transformers_tokens_per_s']:>19.1f} "
              f"{r['ratio']:>6.2f}  {r['identical_greedy_rows']}")
    for r in sampled:
        print(f"{'n=' + str(r['samples']):>5} {r['dtype']:>9} {r['lmforge_tokens_per_s']:>14.1f} "
              f"{r['transformers_tokens_per_s']:>19.1f} {r['ratio']:>6.2f}  (sampled, one prompt)")
    print(f"target ratio >= {result['target_ratio']}; {result['machine']['cpu']}, {result['machine']['torch_threads']} threads")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
