"""Serving under abuse: `lmforge serve` on loopback while clients do what hostile or broken
clients do, and what the valid traffic beside them and `/health` see.

    python benchmarks/serve_abuse.py [--seconds 20] [--valid-clients 4] [--checkpoint DIR]
                                     [--model n_layers=1 ...] [--out benchmarks/results/serve_abuse.json]

The server runs as `lmforge serve` in its own process (the `tiny` preset's random init with a
BPE tokenizer of the bundled corpus, or --checkpoint), with its default body limit and short
head/body timeouts (2 s) so slow clients are reaped within the run. Two phases:

1. Maximal legal requests, one at a time, while `/health` is polled every 20 ms: the longest text
   the server tokenizes (``max_text_chars`` characters: refused after tokenizing, as it has
   more tokens than the context), a body one KiB under ``max_body_bytes`` of small integers in a
   field the API ignores (the costliest JSON to parse) with a valid chat, and a conversation of
   the most turns the API takes. Figures: each request's time and status, `/health`'s worst
   latency meanwhile (the goal: under 100 ms), RSS before and after (the goal: within 10%).
2. --seconds of mixed traffic: --valid-clients clients sending chat completions (half of them
   streamed to the end), streams that disconnect after three events, bodies over the limit, slow
   clients (a request head a byte every 0.5 s; a body that stops), with `/health` polled and RSS
   sampled. Figures: p50/p99 latency and errors of the valid traffic, statuses of the rest, how
   long the server took to close the slow clients, RSS over time.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import requests
from record import command, commit, machine, now  # this folder is the script's first import path
from serve import NAME, build_checkpoint, serve_process

from lmforge.checkpoints.load import load_model
from lmforge.data.tokenizer import Tokenizer
from lmforge.serve.app import max_text_chars
from lmforge.serve.protocol import MAX_TURNS
from lmforge.stages.serve import ServeRecipe

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 2.0  # the server's head and body timeouts in this run
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Tell me about the king."}], "max_tokens": 16}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc: this benchmark reads a Linux process's memory")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


class Poller:
    """Calls ``probe`` every ``every`` seconds on a thread, keeping its results, until stopped."""

    def __init__(self, probe: Callable[[], object], every: float):
        self.probe, self.every, self.results = probe, every, []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stopping.is_set():
            self.results.append(self.probe())
            self.stopping.wait(self.every)

    def __enter__(self) -> Poller:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join()


def health_ms(url: str) -> float:
    """/health's latency in ms (an error or a timeout counts as 10 s)."""
    start = time.perf_counter()
    try:
        ok = requests.get(url + "/health", timeout=10).ok
    except requests.RequestException:
        ok = False
    return 1000 * (time.perf_counter() - start) if ok else 10_000.0


def timed_post(url: str, body: bytes) -> tuple[int | str, float]:
    start = time.perf_counter()
    try:
        status = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=120).status_code
    except requests.RequestException as exc:
        status = type(exc).__name__
    return status, round(1000 * (time.perf_counter() - start), 1)


# ------------------------------------------------------------------------------ phase 1


def maximal_requests(tokenizer: Tokenizer, max_len: int, max_body: int) -> dict[str, tuple[str, bytes]]:
    corpus = " ".join(json.loads(line)["text"] for line in (REPO / "data/pretrain/shakespeare.jsonl").open())
    chars = max_text_chars(tokenizer, max_len)
    text = (corpus * (chars // len(corpus) + 1))[:chars]
    filler = json.dumps(CHAT)[:-1] + ', "ignored": ['
    count = (max_body - 1024 - len(filler)) // 2
    body = (filler + ",".join(["1"] * count) + "]}").encode()
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "Hi"} for i in range(MAX_TURNS - 1)]
    return {
        "longest text tokenized": ("/v1/completions", json.dumps({"model": NAME, "prompt": text, "max_tokens": 1}).encode()),
        "largest body (integers in an ignored field)": ("/v1/chat/completions", body),
        "most turns": ("/v1/chat/completions", json.dumps({**CHAT, "messages": turns + [CHAT["messages"][0]]}).encode()),
    }


def phase_maximal(url: str, pid: int, cases: dict[str, tuple[str, bytes]]) -> dict:
    out, before = {}, rss_mb(pid)
    for name, (path, body) in cases.items():
        with Poller(lambda: health_ms(url), 0.02) as health:
            time.sleep(0.1)
            status, ms = timed_post(url + path, body)
            time.sleep(0.1)
        out[name] = {"bytes": len(body), "status": status, "ms": ms, "health_max_ms": round(max(health.results), 1),
                     "health_p50_ms": percentile(health.results, 0.5), "health_polls": len(health.results)}
    time.sleep(2)
    after = rss_mb(pid)
    return {"requests": out, "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
            "rss_after_over_before": round(after / before, 3)}


# ------------------------------------------------------------------------------ phase 2


def valid_client(url: str, stream: bool, stop: threading.Event, latencies: list, errors: Counter) -> None:
    session = requests.Session()
    while not stop.is_set():
        start = time.perf_counter()
        try:
            with session.post(url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=60,
                              stream=stream) as response:
                done = response.ok and (not stream or response.text.rstrip().endswith("data: [DONE]"))
            if done:
                latencies.append(1000 * (time.perf_counter() - start))
            else:
                errors[str(response.status_code)] += 1
        except requests.RequestException as exc:
            errors[type(exc).__name__] += 1


def leaving_stream(url: str, stop: threading.Event, count: Counter) -> None:
    body = {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    while not stop.is_set():
        try:
            with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60) as response:
                lines = response.iter_lines()
                for _ in range(3):
                    next(lines)
            count["left after 3 events"] += 1
        except (requests.RequestException, StopIteration) as exc:
            count[type(exc).__name__] += 1


def oversize_client(url: str, max_body: int, stop: threading.Event, statuses: Counter) -> None:
    body = b"x" * (max_body + 2**20)
    while not stop.is_set():
        statuses[str(timed_post(url + "/v1/chat/completions", body)[0])] += 1
        stop.wait(0.2)


def slow_client(url: str, kind: str, closes: list, stop: threading.Event) -> None:
    """One connection that never finishes its request (a head sent a byte every 0.5 s, or a body
    that stops); the seconds until the server closes it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=0.5) as sock:
        drip = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000 if kind == "head" else b""
        if kind == "body":
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        for i in range(1000):
            if stop.is_set():
                return
            try:
                if i < len(drip):
                    sock.send(drip[i : i + 1])
                if sock.recv(65536) == b"":
                    break  # closed (a 408 first, for a body)
            except TimeoutError:
                continue
            except OSError:
                break
    closes.append(time.monotonic() - start)


def phase_mixed(url: str, pid: int, seconds: float, valid_clients: int, max_body: int) -> dict:
    stop = threading.Event()
    plain, streamed, errors, left, oversize = [], [], Counter(), Counter(), Counter()
    closes: dict[str, list[float]] = {"head": [], "body": []}
    threads = [threading.Thread(target=valid_client, args=(url, i % 2 == 1, stop, streamed if i % 2 else plain, errors))
               for i in range(valid_clients)]
    threads += [threading.Thread(target=leaving_stream, args=(url, stop, left)) for _ in range(2)]
    threads += [threading.Thread(target=oversize_client, args=(url, max_body, stop, oversize))]

    def slow_clients() -> None:
        workers = []
        while not stop.wait(0.5):
            for kind in ("head", "body"):
                workers.append(threading.Thread(target=slow_client, args=(url, kind, closes[kind], stop), daemon=True))
                workers[-1].start()
        for worker in workers:
            worker.join(2 * TIMEOUT_S + 5)

    threads.append(threading.Thread(target=slow_clients))
    t0 = time.monotonic()
    with Poller(lambda: (time.monotonic() - t0, rss_mb(pid)), 0.5) as rss, Poller(lambda: health_ms(url), 0.05) as health:
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        stop.set()
        for thread in threads:
            thread.join()
    for _ in range(300):  # until the server holds nothing
        if requests.get(url + "/health", timeout=10).json()["pending"] == 0:
            break
        time.sleep(0.1)

    def latency(values: list[float]) -> dict:
        return {"count": len(values), "p50_ms": percentile(values, 0.5), "p99_ms": percentile(values, 0.99)}

    def closing(values: list[float]) -> dict:
        return {"count": len(values), "closed_after_mean_s": round(statistics.fmean(values), 2) if values else None,
                "closed_after_max_s": round(max(values), 2) if values else None}

    return {"seconds": seconds, "valid_chat": latency(plain), "valid_chat_streamed": latency(streamed),
            "valid_errors": dict(errors), "disconnecting_streams": dict(left), "oversize_statuses": dict(oversize),
            "slow_head_clients": closing(closes["head"]), "slow_body_clients": closing(closes["body"]),
            "health": {**latency(health.results), "max_ms": round(max(health.results), 1)},
            "rss_mb": [(round(t, 1), round(mb, 1)) for t, mb in rss.results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=None, help="a checkpoint to serve (default: a random-init preset)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--model", nargs="+", default=[], metavar="KEY=VALUE", help="model fields over the preset's")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the mixed traffic runs")
    parser.add_argument("--valid-clients", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/serve_abuse.json")
    args = parser.parse_args()
    random.seed(0)
    started, max_body = now(), ServeRecipe.max_body_bytes  # the server's default, which this run keeps

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(args.checkpoint) if args.checkpoint else build_checkpoint(args, Path(tmp))
        model, _ = load_model(str(checkpoint), device="cpu")
        tokenizer, max_len = Tokenizer.load(checkpoint), model.cfg.max_seq_len
        with serve_process(checkpoint, ["max_batch=8", f"head_timeout_s={TIMEOUT_S}", f"body_timeout_s={TIMEOUT_S}",
                                        "max_connections=128"], quiet=True) as (url, pid):
            for _ in range(3):  # warm-up: the decoding layout, the first connections
                requests.post(url + "/v1/chat/completions", json=CHAT, timeout=120)
            baseline = rss_mb(pid)
            maximal = phase_maximal(url, pid, maximal_requests(tokenizer, max_len, max_body))
            mixed = phase_mixed(url, pid, args.seconds, args.valid_clients, max_body)
            time.sleep(2)
            after = rss_mb(pid)
            still_serves = requests.post(url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    result = {
        "benchmark": "serve_abuse",
        "date": started,
        "command": command("serve_abuse.py", None),
        "commit": commit(),
        "machine": machine(),
        "model": {"checkpoint": args.checkpoint, "preset": None if args.checkpoint else args.preset,
                  "overrides": args.model, "params": model.cfg.num_params(), "max_len": max_len},
        "server": {"max_body_bytes": max_body, "head_timeout_s": TIMEOUT_S, "body_timeout_s": TIMEOUT_S,
                   "max_text_chars": max_text_chars(tokenizer, max_len), "max_batch": 8},
        "figure": "loopback; phase 1 one maximal legal request at a time with /health polled every 20 ms; phase 2 "
                  "mixed valid and abusive clients for --seconds",
        "maximal": maximal,
        "mixed": mixed,
        "rss_baseline_mb": round(baseline, 1),
        "rss_end_mb": round(after, 1),
        "rss_end_over_baseline": round(after / baseline, 3),
        "goals": {"health_under_100ms_during_maximal": all(r["health_max_ms"] < 100 for r in maximal["requests"].values()),
                  "rss_within_10pct_after_maximal": abs(maximal["rss_after_over_before"] - 1) <= 0.10,
                  "rss_within_10pct_at_end": abs(after / baseline - 1) <= 0.10,
                  "no_valid_errors": not mixed["valid_errors"], "still_serves": still_serves},
    }
    print(f"{'maximal legal request':<46} {'bytes':>9} {'status':>7} {'ms':>8} {'/health max ms':>15}")
    for name, r in maximal["requests"].items():
        print(f"{name:<46} {r['bytes']:>9} {r['status']!s:>7} {r['ms']:>8.1f} {r['health_max_ms']:>15.1f}")
    print(f"RSS {maximal['rss_before_mb']:.0f} MB before, {maximal['rss_after_mb']:.0f} MB after "
          f"({maximal['rss_after_over_before']:.3f}x)\n")
    print(f"{'mixed traffic, ' + str(args.seconds) + ' s':<46} {'count':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for name in ("valid_chat", "valid_chat_streamed", "health"):
        r = mixed[name]
        print(f"{name:<46} {r['count']:>9} {r['p50_ms'] or 0:>8.1f} {r['p99_ms'] or 0:>8.1f}")
    print(f"valid errors {mixed['valid_errors'] or 'none'}; disconnecting streams {mixed['disconnecting_streams']}; "
          f"oversize bodies {mixed['oversize_statuses']}")
    for kind in ("slow_head_clients", "slow_body_clients"):
        r = mixed[kind]
        print(f"{kind}: {r['count']} closed by the server after {r['closed_after_mean_s']} s mean, "
              f"{r['closed_after_max_s']} s max (timeouts {TIMEOUT_S} s)")
    peak = max((mb for _, mb in mixed["rss_mb"]), default=after)
    print(f"RSS {baseline:.0f} MB baseline, {peak:.0f} MB peak, {after:.0f} MB at the end "
          f"({result['rss_end_over_baseline']:.3f}x); goals: {result['goals']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
