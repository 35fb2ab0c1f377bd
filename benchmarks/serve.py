"""Serving throughput: 16 concurrent chat requests through `lmforge serve`'s HTTP API against
the same requests given to the inference engine in process.

    python benchmarks/serve.py [--requests 16] [--max-tokens 64] [--repeats 3] [--checkpoint DIR]
                               [--model n_layers=1 ...]

Both sides run one model (a checkpoint, or by default the `tiny` preset's random init with a
BPE tokenizer trained on the bundled corpus) and one engine configuration (max_batch =
--requests, float32), and answer the same chat prompts (ChatML, one per request, different
questions) with exactly --max-tokens tokens each (``ignore_eos``, temperature 0.7, seeded).
The server runs as `lmforge serve` in its own process (so the client's threads share no
interpreter lock with it); the HTTP side sends every request at once from a thread pool with
the official openai client, streaming, so its time to first token is when the first content
chunk arrives; the engine side
submits them to an ``Engine`` (on a thread, as the server's worker) and times the first token from
its per-token callback. Figures:
requests/s and generated tokens/s over the wall time of all requests, mean and p90 time to
first token, and the HTTP overhead ratio (engine tokens/s over server tokens/s; 1 = none).
Runs alternate; the best of --repeats is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import requests
import torch
from record import command, commit, machine, now  # this folder is the script's first import path

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.checkpoints.load import load_model
from lmforge.core.config import load_config
from lmforge.data.chat import chat_prompt_ids
from lmforge.data.chatml import IM_END
from lmforge.data.tokenizer import Tokenizer, TokenizerConfig, train_tokenizer
from lmforge.inference.engine import Engine, GenerationConfig, Request
from lmforge.model.config import ModelConfig
from lmforge.model.families import build as build_model

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "data" / "pretrain" / "shakespeare.jsonl"
TEMPERATURE = 0.7
NAME = "bench"


def build_checkpoint(args: argparse.Namespace, directory: Path) -> Path:
    """A random-init model of the preset and a tokenizer of its vocabulary, trained on the corpus."""
    cfg = load_config(ModelConfig, None, [f"preset={args.preset}", *args.model])
    texts = [json.loads(line)["text"] for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    tokenizer = train_tokenizer(texts, TokenizerConfig(vocab_size=cfg.vocab_size, max_train_chars=2_000_000))
    tokenizer.save(directory / "tokenizer")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    (directory / "ckpt").mkdir()
    write_model_files(directory / "ckpt", model, directory / "tokenizer")
    write_checksums(directory / "ckpt")
    return directory / "ckpt"


@contextlib.contextmanager
def serve_process(checkpoint: Path, options: list[str], quiet: bool = False) -> Iterator[tuple[str, int]]:
    """`lmforge serve` with ``options`` (key=value) on a free port in a subprocess: its URL and
    pid, once it answers; ``quiet`` drops its log (the abuse benchmark's refusals)."""
    command = [sys.executable, "-m", "lmforge", "serve", f"checkpoint={checkpoint}", "--port", "0", "device=cpu",
               f"model_name={NAME}", "log_level=warning", *options]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL if quiet else None, text=True)
    try:
        line = proc.stdout.readline()
        if " on http://" not in line:
            raise RuntimeError(f"lmforge serve did not start (exit {proc.wait()}): {line!r}")
        url = line.split(" on ")[1].split()[0]
        for _ in range(3000):
            # not up yet, or slow to answer on a busy machine (a read timeout): ask again
            with contextlib.suppress(requests.ConnectionError, requests.Timeout):
                if requests.get(url + "/health", timeout=1).ok:
                    break
            time.sleep(0.01)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def conversations(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Tell me about the {i}th king of Denmark."}] for i in range(n)]


def summary(wall: float, ttft: list[float], tokens: int, n: int) -> dict:
    return {"wall_s": round(wall, 4), "requests_per_s": round(n / wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "ttft_mean_ms": round(1000 * statistics.fmean(ttft), 2),
            "ttft_p90_ms": round(1000 * sorted(ttft)[min(len(ttft) - 1, int(0.9 * len(ttft)))], 2),
            "generated_tokens": tokens}


def run_http(client: openai.OpenAI, chats: list[list[dict]], max_tokens: int) -> dict:
    def one(i: int) -> tuple[float, int]:
        start = time.perf_counter()
        first, tokens = None, 0
        stream = client.chat.completions.create(model=NAME, messages=chats[i], max_tokens=max_tokens, stream=True,
                                                temperature=TEMPERATURE, seed=i, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first if first is not None else time.perf_counter() - start, tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(chats)) as pool:
        results = list(pool.map(one, range(len(chats))))
    wall = time.perf_counter() - t0
    return summary(wall, [r[0] for r in results], sum(r[1] for r in results), len(chats))


def run_engine(engine: Engine, prompts: list[list[int]], config: dict) -> dict:
    """The requests through ``engine`` on a thread of its own, as the server's worker runs it (the
    same threading for both sides: small CPU kernels on the main thread of a loaded 2-core machine
    ran ~10x slower than on another thread)."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(engine_requests(engine, prompts, config)))
    thread.start()
    thread.join()
    return out


def engine_requests(engine: Engine, prompts: list[list[int]], config: dict) -> dict:
    firsts: dict[int, float] = {}
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(Request(prompt, GenerationConfig(**config, seed=i),
                              on_token=lambda s, t, lp, top, i=i: firsts.setdefault(i, time.perf_counter() - t0)))
    results = dict(engine.run())
    wall = time.perf_counter() - t0
    tokens = sum(len(g.tokens) for gens in results.values() for g in gens)
    return summary(wall, list(firsts.values()), tokens, len(prompts))


def best(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r["tokens_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="a checkpoint to serve (default: a random-init preset)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--model", nargs="+", default=[], metavar="KEY=VALUE",
                        help="model fields set over the preset's (e.g. n_layers=1 for a smoke run)")
    parser.add_argument("--requests", type=int, default=16, help="concurrent chat requests (and the engine's max_batch)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default="benchmarks/results/serve.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    started = now()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(args.checkpoint) if args.checkpoint else build_checkpoint(args, Path(tmp))
        model, _ = load_model(str(checkpoint), device="cpu")
        model.eval()
        tokenizer = Tokenizer.load(checkpoint)
        chats = conversations(args.requests)
        prompts = [chat_prompt_ids(tokenizer, c) for c in chats]
        config = dict(max_new_tokens=args.max_tokens, temperature=TEMPERATURE, stop_token_ids=[])
        http_runs, engine_runs = [], []
        with serve_process(checkpoint, [f"max_batch={args.requests}", f"max_pending={args.requests}"]) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            run_http(client, chats[:2], 2)  # warm-up: the decoding layout, the first connections
            run_engine(Engine(model, tokenizer, max_batch=args.requests), prompts[:2], {**config, "max_new_tokens": 2})
            for _ in range(args.repeats):
                http_runs.append(run_http(client, chats, args.max_tokens))
                engine_runs.append(run_engine(Engine(model, tokenizer, max_batch=args.requests), prompts, config))
    http, engine = best(http_runs), best(engine_runs)
    expected = args.requests * args.max_tokens
    if http["generated_tokens"] != expected or engine["generated_tokens"] != expected:
        raise RuntimeError(f"expected {expected} tokens on each side, got {http['generated_tokens']} (HTTP) and "
                           f"{engine['generated_tokens']} (engine)")
    result = {
        "benchmark": "serve",
        "date": started,
        "command": command("serve.py", None),
        "commit": commit(),
        "machine": {**machine(), "openai": openai.__version__},
        "model": {"checkpoint": args.checkpoint, "preset": None if args.checkpoint else args.preset,
                  "overrides": args.model, "params": model.cfg.num_params(), "dtype": "float32",
                  "init": "checkpoint" if args.checkpoint else "random (seed 0)"},
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "prompt_tokens": [len(p) for p in prompts],
        "sampling": {"temperature": TEMPERATURE, "ignore_eos": True, "chat_stop": IM_END},
        "repeats": args.repeats,
        "figure": "all requests sent at once; wall time from the first send to the last token; best of repeats",
        "server": http,
        "engine_in_process": engine,
        "http_overhead_ratio": round(engine["tokens_per_s"] / http["tokens_per_s"], 3),
        "runs": {"server": http_runs, "engine_in_process": engine_runs},
    }
    print(f"{'side':>10} {'req/s':>7} {'tok/s':>8} {'TTFT mean ms':>13} {'TTFT p90 ms':>12}")
    for name, r in (("server", http), ("engine", engine)):
        print(f"{name:>10} {r['requests_per_s']:>7.2f} {r['tokens_per_s']:>8.1f} {r['ttft_mean_ms']:>13.1f} "
              f"{r['ttft_p90_ms']:>12.1f}")
    print(f"HTTP overhead ratio (engine tok/s / server tok/s): {result['http_overhead_ratio']:.3f}; "
          f"{args.requests} requests x {args.max_tokens} tokens; {result['machine']['cpu']}, "
          f"{result['machine']['torch_threads']} threads")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
