"""Write the measured figures of ``benchmarks/results/*.json`` into the Markdown pages that show
them, between markers, so that no figure is copied into prose by hand. Each result becomes a table
and a line naming the machine, the date and the command its JSON records (the commit stays in the
JSON); what a JSON does not record is written "not recorded", never guessed.

    python scripts/write_benchmark_docs.py           # rewrite every block from the JSON
    python scripts/write_benchmark_docs.py --check   # exit 1 if a block is not its JSON's (tests/test_benchmark_docs.py)

A block shows one result, ``benchmarks/results/<name>.json``; put it in any page under ``docs/``
(or in ``benchmarks/README.md`` or README.md) and the script fills it:

    <!-- bench:alignment: written by scripts/write_benchmark_docs.py from benchmarks/results/alignment.json -->
    <!-- /bench:alignment -->

The top-level README.md is written too. ``benchmarks/README.md`` also holds ``bench:summary``, a row per result, and a block of every
result: a JSON with none there gets one, under its own heading at the end of that file. The script
reads JSON and Markdown only (no torch), so its check is fast.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
INDEX = REPO / "benchmarks" / "README.md"  # every result has a block here
WRITER = "scripts/write_benchmark_docs.py"
NOT_RECORDED = "not recorded"
SUMMARY = "summary"
BLOCK = re.compile(r"<!-- bench:(?P<name>[\w.-]+): written by scripts/write_benchmark_docs\.py[^\n]*?-->\n"
                   r"(?P<body>.*?)<!-- /bench:(?P=name) -->", re.S)


# --------------------------------------------------------------------------- blocks in a page


def begin_marker(name: str) -> str:
    source = "benchmarks/results/*.json" if name == SUMMARY else f"benchmarks/results/{name}.json"
    return f"<!-- bench:{name}: written by {WRITER} from {source} -->"


def end_marker(name: str) -> str:
    return f"<!-- /bench:{name} -->"


def block(name: str, body: str) -> str:
    """The whole block, markers included, holding ``body``."""
    return f"{begin_marker(name)}\n{body.rstrip()}\n{end_marker(name)}"


def block_names(text: str) -> list[str]:
    """The names of the blocks in ``text``, in order."""
    return [m.group("name") for m in BLOCK.finditer(text)]


def with_blocks(text: str, bodies: dict[str, str]) -> str:
    """``text`` with each block rewritten from ``bodies`` (a block whose name is missing is refused)."""
    def rewrite(m: re.Match) -> str:
        name = m.group("name")
        if name not in bodies:
            raise KeyError(name)
        return block(name, bodies[name])

    return BLOCK.sub(rewrite, text)


# --------------------------------------------------------------------------- provenance


def machine_of(result: dict) -> str:
    """The machine as the JSON records it: CPU model, cores, threads, torch; the platform string
    where the CPU model is missing."""
    machine = result.get("machine")
    if isinstance(machine, str):
        machine = {"cpu": machine, "cpus": result.get("cpus"), "torch_threads": result.get("torch_threads")}
    if not isinstance(machine, dict) or not machine:
        return NOT_RECORDED
    if machine.get("summary"):
        return machine["summary"]
    cpu = machine.get("cpu") or machine.get("processor")
    parts = [cpu or f"{machine.get('platform', 'platform not recorded')} (CPU model {NOT_RECORDED})"]
    if machine.get("cpus"):
        parts.append(f"{machine['cpus']} cores")
    threads = machine.get("torch_threads", machine.get("threads"))
    if threads:
        parts.append(f"{threads} torch threads")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    if machine.get("device") and machine["device"] != "cpu":
        parts.append(machine["device"])
    return ", ".join(parts)


def provenance(name: str, result: dict) -> str:
    """The machine, date and command the JSON records (its commit stays in the JSON: the pages
    name no commit hashes)."""
    date = result.get("date")
    command = result.get("command")
    return (f"Machine: {machine_of(result)}; date: {date[:10] if date else NOT_RECORDED}; "
            f"command: {f'`{command}`' if command else NOT_RECORDED}. "
            f"From `benchmarks/results/{name}.json`.")


# --------------------------------------------------------------------------- tables


def num(x, digits: int = 3) -> str:
    """A figure as the JSON has it: ``digits`` significant digits below 1000, whole numbers with
    thousands separators from 1000 up, integers whole."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int) or abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) < 1:
        return f"{x:.{digits}g}"
    return f"{x:.{max(digits - len(str(int(abs(x)))), 0)}f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


@dataclass
class Rendered:
    lines: list[str]
    headline: str = "-"  # lmforge's figure, for the summary
    peer: str = "-"
    ratio: str = "-"
    target: str = "(reported)"
    met: str = ""


def met(ok: list[bool]) -> str:
    return "yes" if all(ok) else "no" if not any(ok) else f"{sum(ok)} of {len(ok)}"


def span(values: list[float], digits: int = 3) -> str:
    lo, hi = min(values), max(values)
    return num(lo, digits) if lo == hi else f"{num(lo, digits)}-{num(hi, digits)}"


def render_prepare(r: dict) -> Rendered:
    best = {k: min(v) for k, v in r.get("times_s", {}).items()}
    lines = table(["side", "MB/s", "best time (s)"], [
        ["`lmforge prepare`, end to end", num(r["lmforge_prepare_mb_per_s"]), num(best.get("lmforge_prepare"))],
        ["`tokenizers` `encode_batch`, in memory", num(r["tokenizers_encode_batch_mb_per_s"]), num(best.get("encode_batch"))],
        ["`tokenizers` `encode_batch_fast`, in memory", num(r["tokenizers_encode_batch_fast_mb_per_s"]),
         num(best.get("encode_batch_fast"))],
    ])
    lines += ["", f"{num(r['text_megabytes'])} MB of text, {r['documents']} documents, {num(r['tokens'])} tokens. "
                  f"lmforge / `encode_batch` {num(r['ratio'])} (target >= {r['target_ratio']}); "
                  f"/ `encode_batch_fast` {num(r['ratio_vs_encode_batch_fast'])}."]
    return Rendered(lines, f"{num(r['lmforge_prepare_mb_per_s'])} MB/s",
                    f"`encode_batch` {num(r['tokenizers_encode_batch_mb_per_s'])} MB/s", num(r["ratio"]),
                    f">= {r['target_ratio']}", met([r["ratio"] >= r["target_ratio"]]))


def render_train_step(r: dict) -> Rendered:
    cfg = r["config"]
    rows = r["rows"]
    lines = [f"Preset `{cfg['preset']}` ({cfg['params'] / 1e6:.1f}M parameters), batch {cfg['batch']} x "
             f"{cfg['seq']} tokens, `compile` {'on' if cfg['compile'] else 'off'}; forward, backward, clip and "
             f"AdamW; best of {cfg['rounds']} rounds of {cfg['steps']} steps.", ""]
    lines += table(["precision", "model", "step (s)", "tokens/s", "MFU"],
                   [[x["precision"], x["model"], num(x["step_s"]), num(x["tokens_per_s"]), pct(x["mfu"])] for x in rows])
    ratios = r["ratio_lmforge_over_transformers"]
    peaks = r.get("peak_flops", {})
    t = r.get("targets", {})
    lines += ["", "lmforge / transformers: " + ", ".join(f"{p} {num(v)}" for p, v in ratios.items())
              + (f" (target bf16 >= {t['bf16_ratio']}, MFU >= {t['bf16_mfu']:.0%})" if t else "")
              + ". MFU against the measured matmul peak (`lmforge bench peak`): "
              + ", ".join(f"{p} {v / 1e9:.0f} GFLOP/s" for p, v in peaks.items())
              + (f". Peak memory {r['peak_memory_bytes'] / 1e9:.2f} GB." if r.get("peak_memory_bytes") else ".")]
    bf16 = {x["model"]: x for x in rows if x["precision"] == "bf16"}
    if "lmforge" in bf16 and "transformers" in bf16 and "bf16" in ratios:
        ours, peer = bf16["lmforge"], bf16["transformers"]
        ok = [ratios["bf16"] >= t["bf16_ratio"], ours["mfu"] >= t["bf16_mfu"]] if t else []
        return Rendered(lines, f"bf16 {num(ours['tokens_per_s'])} tok/s, MFU {pct(ours['mfu'])}",
                        f"`LlamaForCausalLM` {num(peer['tokens_per_s'])} tok/s", f"bf16 {num(ratios['bf16'])}",
                        f">= {t['bf16_ratio']}, MFU >= {t['bf16_mfu']:.0%}" if t else "(reported)",
                        f"ratio {'yes' if ok[0] else 'no'}, MFU {'yes' if ok[1] else 'no'}" if ok else "")
    return Rendered(lines)


def render_attention(r: dict) -> Rendered:
    rows = r["rows"]
    lines = [f"{r.get('figure', '')}; shapes batch x heads x kv heads x length x head dim; "
             f"AMX: {'yes' if r.get('cpu_has_amx') else 'no'}.", ""]
    lines += table(["shape", "dtype", "`F.scaled_dot_product_attention` (ms)", "`attend` (ms)", "speedup"],
                   [[x["shape"], x["dtype"], num(x["sdpa_ms"]), num(x["attend_ms"]), num(x["speedup"])] for x in rows])
    by = {}
    for x in rows:
        by.setdefault(x["dtype"], []).append(x["speedup"])
    return Rendered(lines, "`attend` (fp32 kernels on 16-bit values)", "16-bit `F.scaled_dot_product_attention`",
                    ", ".join(f"{d} {span(v)}" for d, v in by.items()))


def render_generate(r: dict) -> Rendered:
    m = r["model"]
    lines = [f"Preset `{m['preset']}` ({m['params'] / 1e6:.1f}M parameters, {m['init']}), {r['prompt_len']}-token "
             f"prompt, {r['new_tokens']} new tokens; {r['figure']} of {r['repeats']}.", ""]
    lines += table(["batch", "dtype", "lmforge tokens/s", "transformers tokens/s", "ratio", "greedy rows identical"],
                   [[x["batch"], x["dtype"], num(x["lmforge_tokens_per_s"]), num(x["transformers_tokens_per_s"]),
                     num(x["ratio"]), x.get("identical_greedy_rows", "-")] for x in r["results"]])
    if r.get("sampled"):
        s = r.get("sampling", {})
        lines += ["", f"{r['sampled'][0]['samples']} samples of one prompt (temperature {s.get('temperature')}, "
                      f"top-p {s.get('top_p')}, top-k {s.get('top_k')}) against `generate(num_return_sequences=...)`:", ""]
        lines += table(["batch", "samples", "dtype", "lmforge tokens/s", "transformers tokens/s", "ratio"],
                       [[x["batch"], x["samples"], x["dtype"], num(x["lmforge_tokens_per_s"]),
                         num(x["transformers_tokens_per_s"]), num(x["ratio"])] for x in r["sampled"]])
    if r.get("drafting"):
        dr = r["drafting"]
        lines += ["", f"Drafting with the MTP modules of `{dr['checkpoint']}` (`draft_tokens`): batch-1 greedy decoding of "
                      f"{dr['prompts']} held-out prompts of {dr['prompt_len']} tokens, {dr['new_tokens']} new tokens each; "
                      "accepted: the share of drafts kept (`benchmarks/mtp.py` trains that model):", ""]
        lines += drafting_table(dr["rows"])
    target = r.get("target_ratio")
    res = r["results"]
    by = {}
    for x in res:
        by.setdefault(x["dtype"], []).append(x)
    ok = {d: [x["ratio"] >= target for x in xs] for d, xs in by.items()} if target else {}
    return Rendered(lines, "; ".join(f"{d} batch {' / '.join(str(x['batch']) for x in xs)}: "
                                     f"{' / '.join(num(x['lmforge_tokens_per_s']) for x in xs)} tok/s" for d, xs in by.items()),
                    "`generate`: " + "; ".join(" / ".join(num(x["transformers_tokens_per_s"]) for x in xs) for xs in by.values()),
                    "; ".join(" / ".join(num(x["ratio"]) for x in xs) for xs in by.values()),
                    f">= {target}" if target else "(reported)", ", ".join(f"{d} {met(v)}" for d, v in ok.items()))


def side_name(key: str) -> str:
    """``lmforge_max_batch_512`` as ``lmforge, rollout.max_batch 512``."""
    if key.startswith("lmforge_max_batch_"):
        return f"lmforge, `rollout.max_batch` {key.rsplit('_', 1)[1]}"
    return key


def render_rollout(r: dict) -> Rendered:
    sh = r["shape"]
    lines = [f"{sh['prompts']} prompts x {sh['samples']} samples x {sh['new_tokens']} new tokens "
             f"({sh['prompt_len']}-token prompts), preset `{r['model']['preset']}`, {r['model'].get('dtype', '')}; "
             f"{r['figure']}.", ""]
    lines += table(["side", "tokens/s", "best time (s)"],
                   [[side_name(k), num(v), num(min(r["times_s"][k])) if k in r.get("times_s", {}) else "-"]
                    for k, v in r["tokens_per_s"].items()])
    load = r.get("load_average_1m")
    ratio = r["ratio"]
    target = r.get("target_ratio")
    lines += ["", "Ratio to transformers: " + ", ".join(f"{side_name(k)} {num(v)}" for k, v in ratio.items())
              + (f" (target >= {target})" if target else "")
              + (f"; load average {load['before']} before, {load['after']} after." if load else ".")]
    first = next(iter(ratio))
    return Rendered(lines, f"{num(r['tokens_per_s'][first])} tok/s ({side_name(first)})",
                    f"`generate(num_return_sequences={sh['samples']})` {num(r['tokens_per_s'].get('transformers'))} tok/s",
                    num(ratio[first]), f">= {target}" if target else "(reported)",
                    met([ratio[first] >= target]) if target else "")


def render_finetune(r: dict) -> Rendered:
    c = r["config"]
    lines = [f"Preset `{c['preset']}`, batch {c['batch']} x {c['seq']}, {c['precision']} on {c['device']}, "
             f"{c['steps']} steps, best of {c['rounds']} rounds, each mode in its own process.", ""]
    lines += table(["mode", "tokens/s", "peak memory (MB)", "weights + buffers (MB)", "trainable", "optimizer state (MB)",
                    "speed vs full", "peak memory vs full"],
                   [[x["mode"], num(x["tokens_per_s"]), mb(x["peak_memory_bytes"]), mb(x["weights_and_buffers_bytes"]),
                     f"{x['trainable_params'] / 1e6:.2f} M", mb(x["optimizer_state_bytes"]), num(x["speed_vs_full"]),
                     num(x["peak_memory_vs_full"])] for x in r["rows"]])
    by = {x["mode"]: x for x in r["rows"]}
    modes = [m for m in by if m != "full"]
    return Rendered(lines, " / ".join(f"{m} {num(by[m]['tokens_per_s'])}" for m in modes) + " tok/s",
                    f"full fine-tuning {num(by['full']['tokens_per_s'])} tok/s" if "full" in by else "-",
                    " / ".join(num(by[m]["speed_vs_full"]) for m in modes))


def render_finetune_lowbit(r: dict) -> Rendered:
    c = r["config"]
    rows = r["rows"]
    lines = [f"`{c['recipe']}` from `{c['base']}`, LoRA r={c['r']}, alpha={c['alpha']}, lr {c['lr']}, {c['sft_steps']} steps"
             + (f" ({' '.join(c['set'])})" if c.get("set") else "") + f"; int groups of {c['group_size']} weights. Exact match "
             f"before training (the full-precision base's): {num(rows[0]['exact_match_before'])} on "
             f"{rows[0]['examples_scored']} held-out tasks.", ""]
    lines += table(["base", "base memory (MB)", "adapted weights (MB)", "bits per adapted weight", "val loss before",
                    "val loss after", "exact match after", "tokens/s"],
                   [[x["row"], mb(x["base_bytes"]), mb(x["adapted_weight_bytes"]), num(x["bits_per_adapted_weight"]),
                     num(x["val_loss_before"], 4), num(x["val_loss_after"], 4), num(x["exact_match_after"]),
                     num(x["tokens_per_s"])] for x in rows])
    by = {x["row"]: x for x in rows}
    lines += ["", "Validation loss is nats per assistant token; \"before\" is measured on the quantised base with its "
                  "adapters at their initial values, so it shows what quantisation costs and what LoftQ wins back."]
    low = by.get("int2"), by.get("int2 + LoftQ")
    headline = ("int2 val loss " + ", with LoftQ ".join(f"{num(x['val_loss_before'], 4)} -> {num(x['val_loss_after'], 4)}"
                                                    for x in low) if all(low) else "-")
    full = by.get("full precision")
    return Rendered(lines, headline, f"full-precision base {num(full['val_loss_before'], 4)} -> "
                                     f"{num(full['val_loss_after'], 4)}" if full else "-")


def render_dp(r: dict) -> Rendered:
    c, rows = r["config"], r["rows"]
    lines = [f"`{c['recipe']}` from `{c['base']}`, LoRA r={c['r']}, lr {c['lr']}, {c['steps']} steps of {c['batch']} "
             f"unpacked rows (DP: the expected size of a Poisson sample) of at most {c['max_length']} tokens; DP-SGD "
             f"clips each example's gradient to C = {c['max_grad_norm']}, δ = {c['delta']:g}, σ from Opacus's "
             f"{r['accountant'].upper()} accountant for each ε over the steps. Exact match before training (the base's): "
             f"{num(rows[0]['exact_match_before'])} on {rows[0]['examples_scored']} held-out tasks.", ""]
    lines += table(["ε", "σ", "ε spent", "val loss", "exact match", "tokens/s"],
                   [["∞" if x["epsilon"] is None else f"{x['epsilon']:g}", num(x["noise_multiplier"]),
                     num(x["epsilon_spent"]), num(x["val_loss_after"], 4), num(x["exact_match_after"]),
                     num(x["tokens_per_s"])] for x in rows])
    by = {x["epsilon"]: x for x in rows}
    private = [x for x in rows if x["epsilon"] is not None]
    headline = ", ".join(f"ε={x['epsilon']:g}: {num(x['exact_match_after'])}" for x in private) or "-"
    plain = by.get(None)
    return Rendered(lines, f"exact match {headline}", f"ε=∞ {num(plain['exact_match_after'])}" if plain else "-")


def render_curate(r: dict) -> Rendered:
    mh = r["minhash"]
    lines = [f"{r['documents']} documents ({num(r['text_megabytes'])} MB, {num(r['mean_words_per_document'])} words "
             f"each), one process, {mh['num_perm']} permutations, {mh['n_grams']}-grams of words.", ""]
    lines += table(["MinHash signatures", "documents/s"], [[k, num(v)] for k, v in mh["docs_per_s"].items()])
    lines += ["", "lmforge / datasketch, from text: " + ", ".join(f"{k} {num(v)}" for k, v in mh["ratio_from_text"].items())
              + "; signature only: " + ", ".join(f"{k} {num(v)}" for k, v in mh["ratio_signature_only"].items()) + "."]
    p = r.get("pipeline")
    if p:
        d = p.get("dedup", {})
        lines += ["", f"`lmforge curate recipes/demo/curate.yaml` end to end: {p['input_documents']} pages in "
                      f"{num(p['seconds'])} s ({num(p['docs_per_s'])} documents/s, {p['workers']} workers), {p['kept']} kept"
                  + (f"; near-duplicates against the {d['evaluable_pairs']} known pairs: precision {num(d['precision'])}, "
                     f"recall {num(d['recall'])} (recall at Jaccard >= 0.8: {num(d['recall_jaccard_ge_0.8'])})" if d else "")
                  + "."]
    return Rendered(lines, f"{num(mh['docs_per_s']['lmforge'])} docs/s",
                    f"datasketch (sha1) {num(mh['docs_per_s'].get('datasketch sha1 (default)'))} docs/s",
                    num(r["ratio"]), f">= {r['target_ratio']}", met([r["ratio"] >= r["target_ratio"]]))


def render_curate_read(r: dict) -> Rendered:
    lines = [f"{r['figure']}.", ""]
    lines += table(["input", "records", "shards", "all shards (s)", "one piece (s)", "ratio"],
                   [[x["input"], num(x["records"]), x["shards"], num(x["sharded_s"]), num(x["one_piece_s"]),
                     num(x["ratio"])] for x in r["results"]])
    limits = r.get("target_ratio_at_most", {})
    by = {}
    for x in r["results"]:
        by.setdefault(x["input"], []).append(x["ratio"])
    ok = {k: [v <= limits[k] for v in vs] for k, vs in by.items() if k in limits}
    lines += ["", "Target: at most " + ", ".join(f"{k} {v}" for k, v in limits.items()) + "."]
    return Rendered(lines, "sharded read: " + ", ".join(f"{k} {span(v)}" for k, v in by.items()),
                    "the same file read as one shard", "(the ratio)",
                    f"<= {span(list(limits.values()))}" if limits else "(reported)",
                    ", ".join(f"{k} {met(v)}" for k, v in ok.items()))


SERVE_COLUMNS = ["wall (s)", "requests/s", "tokens/s", "first token, mean (ms)", "first token, p90 (ms)"]


def serve_row(x: dict) -> list[str]:
    return [num(x["wall_s"]), num(x["requests_per_s"]), num(x["tokens_per_s"]), num(x["ttft_mean_ms"]), num(x["ttft_p90_ms"])]


def render_serve(r: dict) -> Rendered:
    m = r["model"]
    lines = [f"{r['requests']} chat requests x {r['max_tokens']} tokens, preset `{m['preset']}` ({m['dtype']}); "
             f"{r['figure']} of {r['repeats']}.", ""]
    sides = {"server": "through `lmforge serve` (openai client, streaming, its own process)",
             "engine_in_process": "the same requests to the engine in process"}
    lines += table(["side", *SERVE_COLUMNS], [[label, *serve_row(r[k])] for k, label in sides.items() if k in r])
    runs = r.get("runs", {})
    lines += ["", f"Throughput ratio, engine in process / server: {num(r['http_overhead_ratio'])}"
              + ("; tokens/s over the repeats: " + ", ".join(f"{k.replace('_', ' ')} {span([x['tokens_per_s'] for x in v])}"
                                                           for k, v in runs.items()) if runs else "") + "."]
    return Rendered(lines, f"`lmforge serve` {num(r['server']['tokens_per_s'])} tok/s",
                    f"engine in process {num(r['engine_in_process']['tokens_per_s'])} tok/s",
                    num(r["http_overhead_ratio"]) + " (HTTP overhead)")


def render_serve_abuse(r: dict) -> Rendered:
    lines = [f"{r['figure']}.", ""]
    mx = r["maximal"]
    lines += table(["maximal legal request", "bytes", "status", "time (ms)", "`/health` worst (ms)"],
                   [[k, num(x["bytes"]), x["status"], num(x["ms"]), num(x["health_max_ms"])] for k, x in mx["requests"].items()])
    mixed = r["mixed"]
    clients = [["valid chat", num(mixed["valid_chat"]["count"]), f"p50 {num(mixed['valid_chat']['p50_ms'])} ms, "
                f"p99 {num(mixed['valid_chat']['p99_ms'])} ms"],
               ["valid chat, streamed", num(mixed["valid_chat_streamed"]["count"]),
                f"p50 {num(mixed['valid_chat_streamed']['p50_ms'])} ms, p99 {num(mixed['valid_chat_streamed']['p99_ms'])} ms"],
               *[[f"streams disconnecting ({k})", num(v), ""] for k, v in mixed.get("disconnecting_streams", {}).items()],
               *[["oversize body", num(v), f"answered {k}"] for k, v in mixed.get("oversize_statuses", {}).items()],
               *[[k.replace("_", " "), num(mixed[k]["count"]), f"closed after {num(mixed[k]['closed_after_max_s'])} s at most"]
                 for k in ("slow_head_clients", "slow_body_clients") if k in mixed],
               ["`/health`", num(mixed["health"]["count"]), f"p50 {num(mixed['health']['p50_ms'])} ms, "
                f"p99 {num(mixed['health']['p99_ms'])} ms, worst {num(mixed['health']['max_ms'])} ms"]]
    lines += ["", f"{num(mixed['seconds'])} s of mixed clients (errors of valid requests: "
                  f"{sum(mixed.get('valid_errors', {}).values())}):", ""]
    lines += table(["client", "count", "figure"], clients)
    lines += ["", f"RSS {num(mx['rss_before_mb'])} MB before the maximal requests, {num(mx['rss_after_mb'])} MB after; "
                  f"{num(r['rss_end_mb'])} MB at the end ({num(r['rss_end_over_baseline'])} x the start)."]
    goals = r.get("goals", {})
    lines += ["", *table(["goal", "met"], [[k.replace("_", " "), num(v)] for k, v in goals.items()])]
    return Rendered(lines, f"`/health` worst {num(max(x['health_max_ms'] for x in mx['requests'].values()))} ms "
                           "during maximal requests", "-", "-", "the goals below",
                    f"{sum(map(bool, goals.values()))} of {len(goals)}")


def render_alignment(r: dict) -> Rendered:
    start = r["start"]
    lines = [f"Every method through its stage and demo recipe for {r['steps']} optimizer steps from "
             f"`{r['checkpoint']}`, scored on the {start['examples']} tasks of `{r['tasks']}` (greedy answers); "
             f"reward: `{r.get('reward_model')}`; KL: {r['kl']}.", ""]
    rows = [["start (the SFT model)", pct(start["exact_match"]), num(start["reward_mean"], 2), num(start["kl_per_token"]),
             num(start["kl_per_sequence"]), "-", "-"]]
    rows += [[x["method"], pct(x["exact_match"]), num(x["reward_mean"], 2), num(x["kl_per_token"]),
              num(x["kl_per_sequence"]), x["steps"], num(x["wall_s"])] for x in r["results"]]
    lines += table(["method", "exact match", "reward model's mean score", "KL per answer token (nats)",
                    "KL per answer (nats)", "steps", "wall (s)"], rows)
    lines += ["", f"{num(r['wall_s'])} s in all."]
    return Rendered(lines, "exact match " + ", ".join(f"{x['method']} {pct(x['exact_match'])}" for x in r["results"]),
                    f"the SFT model {pct(start['exact_match'])}")


def render_rollout_correction(r: dict) -> Rendered:
    settings = {x["setting"]: x for x in r["settings"]}
    precision = next(iter(settings.values())).get("precision")
    lines = [f"`{r['recipe']}` from `{r['checkpoint']}` for {r['steps']} steps per setting ({r['repeats']} "
             f"round(s), the mean), the trainer in {precision}, the engine in fp32. Seconds of a step (the mean "
             f"after the first); the mismatch between the trainer's π_old and the engine's log-probs over every "
             f"step's response tokens (engine: the first step of each rollout batch, where π_θ is π_old); KL: k3 "
             f"of KL(π_rollout ‖ π_old).", ""]
    rows = []
    for x in r["settings"]:
        t, m = x["time"], x.get("mismatch") or {}
        em = x.get("exact_match")
        rows.append([x["setting"], num(x["step_s"]), num(t["rollout"]), num(t["old_logprobs"]),
                     pct(t["old_logprobs"] / x["step_s"]), num(t["reference"]),
                     num(t["forward_backward"]), num(m.get("ratio_mean"), 7), num(m.get("ratio_max"), 5),
                     pct(m.get("corrected_share")), num(m.get("kl"), 2), num(m.get("kl_max"), 2),
                     num(x["reward_mean"]), pct(em["after"]) if em else "-"])
    lines += table(["setting", "step (s)", "rollout (s)", "old log-probs (s)", "old log-probs share", "reference (s)",
                    "forward + backward (s)", "ratio mean", "ratio max", "truncated or masked", "KL mean",
                    "KL max", "reward mean", "exact match after"], rows)
    moved = [x["update"] for x in r["settings"] if "update" in x and x["setting"] != "engine"]
    if moved:
        lines += ["", f"One optimizer step moves the policy by a k3 KL of {num(statistics.mean(u['approx_kl'] for u in moved), 2)} "
                      f"on average (its largest ratio {num(max(u['ratio_max'] for u in moved), 4)}): the later steps "
                      f"over each rollout batch of the settings that recompute."]
    shares = [x["time"]["old_logprobs"] / x["step_s"] for x in r["settings"] if x["time"]["old_logprobs"] > 0]
    headline = "-"
    if shares:
        lines += ["", f"The separate recompute is {span([100 * v for v in shares], 2)}% of a step in the settings "
                      f"that make it, the share `rl.old_logprobs=engine` saves. The settings ran in turn on a shared "
                      f"machine (load average {r['load_before']} before, {r['load_after']} after): their seconds move "
                      f"with its load more than with the setting."]
        headline = f"recompute {span([100 * v for v in shares], 2)}% of a step"
    return Rendered(lines, headline, "`rl.old_logprobs=engine`: none")


def render_long_context(r: dict) -> Rendered:
    cfg, pk = r["config"], r["config"]["passkey"]
    buckets = [f"{lo}-{hi}" for lo, hi in cfg["buckets"]]
    lengths = [str(n) for n in pk["lengths"]]
    extensions = {"PI": "extend_pi", "NTK": "extend_ntk", "YaRN": "extend_yarn"}
    rows = []
    for x in r["rows"]:
        steps = r["training"].get(extensions.get(x["method"], ""), {}).get("step")
        rows.append([x["method"], f"{steps} steps at {cfg['max_len']}" if x["trained"] else "none (zero-shot)",
                     *(f"{x['perplexity'][b]:.1f}" if x["perplexity"][b] < 1e4 else f"{x['perplexity'][b]:.2g}"
                       for b in buckets),
                     *(f"{100 * x['passkey'][n]:.0f}%" for n in lengths)])
    lines = table(["RoPE", "continued training", *(f"ppl {b}" for b in buckets), *(f"passkey {n}" for n in lengths)], rows)
    lines += ["", f"Perplexity of {cfg['windows']} held-out windows of {cfg['max_len']} tokens by position; passkey: "
              f"log-likelihood ranking of the key against {pk['candidates'] - 1} others (chance "
              f"{100 / pk['candidates']:.0f}%), {pk['keys']} keys at each of {len(pk['depths'])} depths "
              f"({pk['depths'][0]:.0%}-{pk['depths'][-1]:.0%}) per length."]
    return Rendered(lines, "PI, NTK and YaRN, zero-shot and after continued training", "no scaling")


def render_optimizers(r: dict) -> Rendered:
    s = r["summary"]
    rows = []
    for name, b in s["best"].items():
        tried = ", ".join(f"{x['lr']:g} ({num(x['final_val_loss'], 4)})" for x in r["runs"] if x["optimizer"] == name)
        rows.append([name, f"{b['lr']:g}", tried, num(b["final_val_loss"], 4), num(b["val_loss_at_equal_time"], 4),
                     num(b["tokens_per_s"])])
    loads = [v for x in r["runs"] for v in x.get("load_average", [])]
    load = f" The machine's load average (1 min) around the runs: {span(loads, 2)}." if loads else ""
    lines = [f"{r['steps']} steps of `{r['recipe']}` each, at three peak rates (Muon's: of the blocks' matrices, "
             "AdamW training the rest at the recipe's rate); validation loss of the recipe's mixture at the last step, "
             f"and at equal training time: {num(s['equal_time_s'])} s, the fastest best run's.{load}", ""]
    lines += table(["optimizer", "best rate", "rates tried (final loss)", "validation loss, last step",
                    "at equal time", "tokens/s"], rows)
    best = min(s["best"].items(), key=lambda kv: kv[1]["final_val_loss"])
    adamw = s["best"].get("adamw")
    return Rendered(lines, f"{best[0]}: val loss {num(best[1]['final_val_loss'], 4)}",
                    f"adamw {num(adamw['final_val_loss'], 4)}" if adamw else "-", "-", "(reported)")


def render_mup(r: dict) -> Rendered:
    rates, widths, best = r["rates"], r["widths"], r["summary"]["best_lr"]
    loss = {(x["param"], x["width"], x["lr"]): x["val_loss"] for x in r["runs"]}
    rows = []
    for param, label in (("sp", "SP"), ("mup", "µP")):
        for w in widths:
            cells = []
            for lr in rates:
                value = loss.get((param, w, lr))
                text = "-" if value is None else num(value, 4) if value == value else "diverged"
                cells.append(f"**{text}**" if best.get(param, {}).get(str(w)) == lr else text)
            rows.append([label, w, *cells])
    moved = {k: grid_moves(v) for k, v in r["summary"]["grid_steps_moved"].items()}
    lines = [f"Validation loss after {r['steps']} steps of `{r['recipe']}` at each width and AdamW peak rate "
             f"(bold: each row's best); µP relative to width {r['base_width']}, where it is the standard model.", ""]
    lines += table(["", "width", *(f"lr {lr:g}" for lr in rates)], rows)
    lines += ["", f"From width {widths[0]} to {widths[-1]} the best rate {moved.get('sp')} (steps of a factor of 2) "
              f"under SP and {moved.get('mup')} under µP."]
    return Rendered(lines, f"µP's best rate {moved.get('mup')}", f"SP's {moved.get('sp')}", "-",
                    "µP within 1 step", met([r["summary"]["mup_transfers"]]))


def render_nanogpt(r: dict) -> Rendered:
    s, sides = r["summary"], r["sides"]
    ref = sides.get(s["reference"], {})
    text = r.get("text", {})
    lines = [f"Validation loss in nats per character on the same {num(text.get('chars'))} characters of "
             f"`{text.get('source')}` and the same 90/10 split; the target is {s['target_from']}, "
             f"{num(s['target_val_loss'], 4)}; each side in its own process with {r.get('threads')} torch thread(s), one after another; "
             "lmforge's recipes are in `recipes/nanogpt/`.", ""]
    rows = []
    if ref:
        last = ref["evals"][-1] if ref.get("evals") else {}
        rows.append(["nanoGPT, its README's CPU command", f"{num(last.get('val_loss'), 4)} @ {last.get('step')}",
                     "-", num(s.get("reference_wall_s")), "reference", ""])
    for name, x in s["sides"].items():
        cfg = sides.get(name, {})
        compiled = ("" if "compiled" not in name else
                    ", compiled, " + ("a warm cache" if cfg.get("compile_cache") == "kept" else "an empty cache"))
        rows.append([f"`{cfg.get('recipe', name).removeprefix('recipes/nanogpt/')}`{compiled}",
                     f"{num(x['final_val_loss'], 4)}", x["step"] if x["reached"] else "not reached", num(x["wall_s"]),
                     num(x.get("wall_ratio")), "yes" if x.get("goal_met") else "no"])
    lines += table(["side", "val loss at its last step", "step it passes the target", "wall s to the target",
                    "wall time vs nanoGPT", f"within {num(s['goal_ratio'], 2)}?"], rows)
    best = min((x for x in s["sides"].values() if x["reached"]), key=lambda x: x["wall_s"], default=None)
    return Rendered(lines, f"target in {num(best['wall_s'])} s" if best else "target not reached",
                    f"nanoGPT {num(s.get('reference_wall_s'))} s" if ref else "-",
                    num(best.get("wall_ratio")) if best else "-", f"<= {num(s['goal_ratio'], 2)}",
                    met([bool(s.get("goal_met"))]))


def render_kv_cache(r: dict) -> Rendered:
    m, d = r["model"], r["decode"]
    rows = []
    for x in r["rows"]:
        at = x["cache_bytes_at_context"]
        ring = f" (a ring of {x['capacity']})" if x["capacity"] is not None and x["capacity"] < r["context"] else ""
        rows.append([x["name"], f"`{x['kv_cache_dtype']}`" if x["kv_cache_dtype"] else "-", num(x["bytes_per_token"]),
                     num(x["bytes_vs_bf16"]), "-" if at is None else f"{at / 2**10:,.0f}{ring}",
                     num(x["perplexity"], 5), num(x.get("kl_to_fp32"), 2), num(x.get("max_logprob_change"), 2),
                     num(x["decode_tokens_per_s"]), x.get("note", "")])
    lines = [f"A {m['n_layers']}-layer model of {m['n_heads']} heads of {m['head_dim']} ({num(m['params'])} parameters, "
             f"vocabulary {m['vocab_size']}) trained {m['steps']} steps at {r['context']} tokens on the demo corpus "
             f"(validation loss {num(m['val_loss'], 4)}); perplexity of {r['windows']} held-out windows of {r['context']} "
             f"tokens, every key and value read back from the cache, and how far each row's predictions are from the "
             f"fp32 cache's on them (mean KL, nats per prediction; the largest change of a log-probability); "
             f"decode: {d['batch']} rows, {d['new_tokens']} steps "
             f"after a prefill to {r['context'] - d['new_tokens']}, best of {d['repeats']}, {d['threads']} threads, "
             f"the model in float32 (load average {span(r['load_average'], 2)}: a shared machine, timings are noisy).", ""]
    lines += table(["cache", "kv_cache_dtype", "bytes/token", "vs bf16", f"KiB at {r['context']}", "perplexity",
                    "KL to fp32", "max Δ log p", "decode tok/s", "note"], rows)
    by = {x["name"]: x for x in r["rows"]}
    int8, int4, ref = by.get("int8", {}), by.get("int4", {}), by.get("fp32", {})
    return Rendered(lines, f"int8 {num(int8.get('bytes_vs_bf16'))}x bf16's bytes (KL {num(int8.get('kl_to_fp32'), 2)}), "
                    f"int4 {num(int4.get('bytes_vs_bf16'))}x (KL {num(int4.get('kl_to_fp32'), 2)})",
                    f"the fp32 cache: perplexity {num(ref.get('perplexity'), 5)}")


MOE_RUNS = {"dense": "dense", "moe": "MoE, aux-loss-free bias", "moe_unbalanced": "MoE, no balancing"}


def render_moe(r: dict) -> Rendered:
    s = r["summary"]
    rows = []
    for x in r["runs"]:
        load = x.get("final_load")
        share = (f"{num(sum(v['load_min'] for v in load.values()) / len(load), 3)} / "
                 f"{num(sum(v['load_max'] for v in load.values()) / len(load), 3)}") if load else "-"
        rows.append([MOE_RUNS.get(x["name"], x["name"]), num(x["val_loss"], 4), num(x["tokens_per_s"]),
                     mb(x["memory_bytes"]), num(x["params"]), num(x["active_matmul_params"]), num(x["flops_per_token"]),
                     share])
    loads = [v for x in r["runs"] for v in x.get("load_average", [])]
    lines = [f"{r['steps']} steps of `{r['recipe']}` per model on the same tokens ({num(r['runs'][0]['tokens'])}): "
             f"{r['experts']} experts, {r['top_k']} per token, against the dense SwiGLU of their active width; "
             f"validation loss at the last step, median tokens/s after the first step, the loop's peak memory. Expert "
             f"shares of the last step's assignments, mean over the MoE layers (even: 1/{r['experts']} = "
             f"{num(1 / r['experts'], 3)}). The machine's load average (1 min) around the runs: {span(loads, 2)}.", ""]
    lines += table(["model", "validation loss", "tokens/s", "peak memory (MB)", "parameters", "active matmul weights",
                    "FLOPs/token", "least / most loaded expert"], rows)
    best = min(r["runs"], key=lambda x: x["val_loss"])
    lines += ["", f"Lowest validation loss: {MOE_RUNS.get(best['name'], best['name'])} ({num(best['val_loss'], 4)}); "
              f"the MoE with the bias against the dense model: {s['winner']} lower (MoE minus dense "
              f"{num(s['val_loss_moe_minus_dense'], 3)}), at {num(s['tokens_per_s_moe_over_dense'], 3)}x its tokens/s "
              "(a shared machine whose load moved between the runs: the speeds are noisy, the losses and loads are not)."]
    return Rendered(lines, f"MoE - dense val loss {num(s['val_loss_moe_minus_dense'], 3)}",
                    f"dense {num(next(x['val_loss'] for x in r['runs'] if x['name'] == 'dense'), 4)}",
                    f"{num(s['tokens_per_s_moe_over_dense'], 3)}x tokens/s")


def drafting_table(rows: list[dict]) -> list[str]:
    """``benchmarks/mtp.py``'s ``measure_drafting`` rows (also in generate.json's ``drafting``) as a table."""
    return table(["drafts a step", "tokens/s", "speed-up", "accepted", "tokens equal to greedy"],
                 [[x["draft_tokens"] or "none", num(x["tokens_per_s"]), num(x["speedup"], 3),
                   "-" if x["acceptance"] is None else num(x["acceptance"], 3), num(x["identical_to_greedy"])] for x in rows])


def render_mtp(r: dict) -> Rendered:
    s, dec = r["summary"], r["decoding"]
    rows = [[x["name"], x["depth"], num(x["val_loss"], 4), num(x["tokens_per_s"]), span(x["load_average"], 2),
             num(x["params"]), ", ".join(f"{k.split('/')[1]} {num(v, 4)}" for k, v in x["final_depth_losses"].items()) or "-"]
            for x in r["runs"]]
    lines = [f"{r['steps']} steps of `{r['recipe']}` per model on the same tokens ({num(r['runs'][0]['tokens'])}): the main "
             "head's validation loss at the last step, the median training tokens/s after the first step with the "
             "machine's load average (1 min) before and after the run (a shared machine: the speeds are noisy, the "
             "losses are not), and each depth's training loss at the last step.", ""]
    lines += table(["model", "MTP depth", "validation loss", "tokens/s", "load", "parameters", "depth losses"], rows)
    lines += ["", f"Greedy decoding of {dec['prompts']} held-out prompts of {dec['prompt_len']} tokens, one at a time, "
              f"{dec['new_tokens']} new tokens each, best of {dec['repeats']} (runs alternating), the `mtp` model's "
              "modules drafting; accepted: the share of drafts kept.", ""]
    lines += drafting_table(r["drafting"])
    return Rendered(lines, f"MTP - plain val loss {num(s['val_loss_mtp_minus_plain'], 3)}",
                    f"plain {num(next(x['val_loss'] for x in r['runs'] if x['name'] == 'plain'), 4)}",
                    f"drafting {num(s['best_speedup'], 3)}x")


def grid_moves(steps: int) -> str:
    """How far a best rate moved along the grid, in words: "stays", "moves 1 step down"."""
    if steps == 0:
        return "stays"
    return f"moves {abs(steps)} step{'s' if abs(steps) != 1 else ''} {'down' if steps < 0 else 'up'}"


def render_any(r: dict) -> Rendered:
    """A result with no renderer of its own: its top-level figures."""
    rows = [[f"`{k}`", num(v)] for k, v in r.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("cpus", "torch_threads")]
    lines = [f"{r['figure']}.", ""] if r.get("figure") else []
    lines += table(["figure", "value"], rows) if rows else ["(no top-level figures; see the JSON)"]
    return Rendered(lines)


def render_forgetting(r: dict) -> Rendered:
    m, s = r["model"], r["summary"]
    rows = [[x["setting"], num(x["old_bpb"], 4), num(x["new_bpb"], 4), num(x["forgetting_bpb"], 3),
             num(x["gain_bpb"], 3), num(x["final_penalty"], 3)] for x in r["rows"]]
    lines = [f"A {m['n_layers']}-layer model of width {m['d_model']} pre-trained {r['steps']} steps on {r['old']}, "
             f"then continued {r['steps']} steps on {r['new']} ({num(r['tokens_per_step'])} tokens a step) from the "
             f"same weights on the same windows in each setting; EWC's Fisher over {num(r['fisher_tokens'])} tokens "
             f"of the first task" + (f"; self-distillation's teacher the pre-trained model, at τ = "
                                     f"{num(r['distill_temperature'])}" if "distill_temperature" in r else "")
             + f". Bits per byte on {r['validation_windows']} validation windows of each; forgetting is "
             f"the first task's rise from the pre-trained model's {num(r['base_old_bpb'], 4)}, gain the second's fall "
             f"from {num(r['base_new_bpb'], 4)}.", ""]
    last = "penalty or τ²·KL at the end" if "distill_temperature" in r else "penalty at the end"
    lines += table(["setting", "old task (bpb)", "new task (bpb)", "forgetting", "gain", last], rows)
    best = s["best_setting"]
    if best:
        ratio = s["best_forgetting_over_naive"]
        lines += ["", f"Of the settings that keep at least 3/4 of naive continuation's gain, {best} forgets least"
                  + (f" ({num(ratio, 3)}x naive's forgetting)." if ratio is not None else ".")]
    else:
        lines += ["", "No setting keeps 3/4 of naive continuation's gain."]
    ratio = s["best_forgetting_over_naive"]
    return Rendered(lines, f"{best}: {num(ratio, 3)}x naive forgetting" if best and ratio is not None else "-",
                    f"naive forgetting {num(s['naive_forgetting_bpb'], 3)} bpb", "-")


def render_doremi(r: dict) -> Rendered:
    names, m, s = r["domains"], r["model"], r["summary"]
    lines = [f"A {m['n_layers']}-layer model of width {m['d_model']} trained {r['steps']} steps of "
             f"{num(r['tokens_per_step'])} tokens on each mixture of the {len(names)} domains, "
             f"{r['seeds_per_mixture']} seeds each (initialisation and data order); the validation loss "
             f"(nats/token) of each domain on the same {r['eval_windows_per_domain']} windows of {r['seq_len']} tokens "
             "averaged over the seeds, their unweighted mean over the domains (with its range over the seeds) and "
             "the worst domain's. DoReMi seed s: the main model of seed s on the weights of proxy seed s (the mean "
             f"of α over its updates, η = {num(r['step_size'])}, c = {num(r['smoothing'])}) against a reference "
             "trained on the uniform mixture, proxy and reference of the main model's shape.", ""]
    rows = [[x["mixture"], *(num(x["val_loss"][n], 4) for n in names),
             f"**{num(x['mean_loss'], 4)}** ({num(x['mean_loss_range'][0], 4)}-{num(x['mean_loss_range'][1], 4)})",
             num(x["worst_loss"], 4)] for x in r["rows"]]
    lines += table(["mixture", *names, "mean (range over seeds)", "worst"], rows)
    lines += ["", "The mixtures' weights: DoReMi's from three proxy seeds, and the largest minus the smallest:", ""]
    weights = [["uniform", *(num(r["uniform"][n], 3) for n in names)],
               ["stratified", *(num(r["stratified"][n], 3) for n in names)]]
    weights += [[f"DoReMi seed {x['seed']}", *(num(x["weights"][n], 3) for n in names)] for x in r["seeds"]]
    weights.append(["DoReMi spread", *(num(r["weight_spread"][n], 3) for n in names)])
    lines += table(["weights", *names], weights)
    lines += ["", f"Lowest mean loss: {s['best_mean']}; lowest worst-domain loss: {s['best_worst']}."]
    return Rendered(lines, f"DoReMi mean loss {num(s['doremi_mean_loss'], 4)}",
                    f"uniform {num(s['uniform_mean_loss'], 4)}, stratified {num(s['stratified_mean_loss'], 4)}", "-")


def render_rl_async(r: dict) -> Rendered:
    settings = {x["setting"]: x for x in r["settings"]}
    base, one_thread = settings.get("sync"), settings.get("sync-1t")

    def times(x: dict, b: dict | None) -> str:
        return num(x["tokens_per_s"] / b["tokens_per_s"], 3) if b else "-"

    lines = [f"`{r['recipe']}` from `{r['checkpoint']}` for {r['steps']} steps per setting ({r['repeats']} round(s), "
             "the mean). sync: in-process sampling then training (torch's default threads; sync-1t on one thread); "
             "wW-kK: W rollout workers (`rl.rollout_workers`), `rl.max_off_policy_steps` K. Trained tokens per second "
             "over the steps after the first (the first holds the workers' start); seconds of a step and of its rollout "
             "wait (the trainer waiting for groups; in-process, the sampling) and training (forward, backward, "
             "optimizer, scoring forwards); the final reward is the mean reward of the last quarter of the steps; "
             "the oldest sample trained on, in optimizer steps.", ""]
    rows = [[x["setting"], x["workers"], x["max_off_policy_steps"], num(x["tokens_per_s"]), times(x, base),
             times(x, one_thread), num(x["step_s"]), num(x["rollout_s"]), num(x["train_s"]), num(x["first_step_s"]),
             num(x["final_reward"]), num(int(x["off_policy_steps_max"])), num(int(x["stale_dropped"]))]
            for x in r["settings"]]
    lines += table(["setting", "workers", "staleness", "tokens/s", "x sync", "x sync-1t", "step (s)", "rollout wait (s)",
                    "train (s)", "first step (s)", "final reward", "oldest sample", "stale dropped"], rows)
    lines += ["", f"Load average {num(r['load_before'])} before the runs and {num(r['load_after'])} after, on a machine "
                  "the other sessions' jobs share: every setting's seconds move with that load, a two-thread trainer's "
                  "most (it waits on both of its threads), and on a machine with more runnable processes than cores "
                  "a setting of more processes (the trainer and its workers) is given more of the CPUs than one "
                  "process, so its ratio is not what an idle machine would give. Read the ratios with sync-1t beside "
                  "sync, and rerun on an idle machine before trusting them.",
              "", "![reward against wall time and each step's split](img/rl_async.png)"]
    one = settings.get("w1-k1")
    fair = one_thread or base  # the one-thread in-process run: the same threads as the trainer beside one worker
    if not (fair and one):
        return Rendered(lines)
    ratio = one["tokens_per_s"] / fair["tokens_per_s"]
    return Rendered(lines, f"staleness 1, one worker: {num(one['tokens_per_s'])} tokens/s, final reward "
                    f"{num(one['final_reward'])}", f"{fair['setting']} {num(fair['tokens_per_s'])} tokens/s, final "
                    f"reward {num(fair['final_reward'])}", f"{num(ratio)}x", ">= 1.5x, no lower reward",
                    met([ratio >= 1.5, one["final_reward"] >= fair["final_reward"]]))


def render_curriculum(r: dict) -> Rendered:
    runs, s = r["runs"], r["summary"]
    names = sorted(runs[0]["val_by_dataset"])
    base = runs[0]["val_loss"]
    lines = [f"`{r['recipe']}` for {r['steps']} steps ({num(r['tokens'])} tokens, the same for every run"
             f"{'' if s['same_tokens'] else ': NOT the same'}), with the overrides `{' '.join(r['overrides'])}`; "
             f"seeded alike, on shards of the same tokens. {r['warmup'].removeprefix('data.')}; the order's score: "
             f"{r['score']}. Validation loss (nats/token) at the last step: the mixture's weighted mean and each "
             "dataset's; the difference from the shuffled loader; median tokens/s after the first step.", ""]
    rows = [[x["name"], x["what"], f"**{num(x['val_loss'], 4)}**", *(num(x["val_by_dataset"][n], 4) for n in names),
             num(x["val_loss"] - base, 3) if i else "-", num(x["tokens_per_s"])] for i, x in enumerate(runs)]
    lines += table(["loader", "what", "validation loss", *names, "minus shuffled", "tokens/s"], rows)
    loads = [v for x in runs for v in x.get("load_average", [])]
    lines += ["", f"Lowest validation loss: {s['best']}. The machine's load average (1 min) around the runs: "
              f"{span(loads, 2)}; tokens/s move with it, the losses do not."]
    return Rendered(lines, f"best {s['best']}", f"shuffled {num(base, 4)}", "-")


RENDERERS: dict[str, Callable[[dict], Rendered]] = {
    "prepare": render_prepare, "train_step": render_train_step, "attention": render_attention,
    "generate": render_generate, "rollout": render_rollout, "finetune": render_finetune,
    "finetune_lowbit": render_finetune_lowbit, "curate": render_curate,
    "curate_read": render_curate_read, "serve": render_serve, "serve_abuse": render_serve_abuse,
    "alignment": render_alignment, "long_context": render_long_context, "optimizers": render_optimizers,
    "mup": render_mup, "nanogpt": render_nanogpt, "kv_cache": render_kv_cache, "moe": render_moe, "mtp": render_mtp, "rollout_correction": render_rollout_correction,
    "forgetting": render_forgetting, "dp": render_dp, "doremi": render_doremi, "rl_async": render_rl_async,
    "curriculum": render_curriculum,
}


def render(name: str, result: dict) -> Rendered:
    renderer = RENDERERS.get(result.get("benchmark", name), render_any)
    try:
        out = renderer(result)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a JSON of another shape than its renderer's
        print(f"benchmarks/results/{name}.json: its table could not be written ({type(exc).__name__}: {exc}); "
              "written as its top-level figures: update its renderer in scripts/write_benchmark_docs.py", file=sys.stderr)
        out = render_any(result)
    out.lines = [*out.lines, "", provenance(name, result)]
    return out


def summary_body(rendered: dict[str, Rendered], results: dict[str, dict]) -> str:
    rows = [[f"`{name}.json`", x.headline, x.peer, x.ratio, x.target, x.met] for name, x in rendered.items()]
    return "\n".join(table(["result", "lmforge", "peer", "ratio", "target", "met?"], rows)
                     + ["", "Each result's table, with the machine, date and commit its JSON records, is below."])


# --------------------------------------------------------------------------- the pages


def read_results(results_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(results_dir.glob("*.json"))}


def bodies_of(results: dict[str, dict]) -> dict[str, str]:
    rendered = {name: render(name, r) for name, r in results.items()}
    return {SUMMARY: summary_body(rendered, results), **{name: "\n".join(x.lines) for name, x in rendered.items()}}


def default_pages() -> list[Path]:
    return [INDEX, REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def with_missing_blocks(text: str, names: list[str]) -> str:
    """``text`` (the index) with a section and block appended for each of ``names`` it lacks."""
    for name in names:
        text = text.rstrip("\n") + (f"\n\n## {name}\n"
                                    f"Written from `benchmarks/results/{name}.json`; say here what it measures.\n\n"
                                    f"{block(name, '')}\n")
    return text


def update(pages: list[Path], results_dir: Path, index: Path, check: bool) -> list[str]:
    """Rewrite (or, with ``check``, compare) every block of ``pages``; the problems, one a line."""
    results = read_results(results_dir)
    bodies = bodies_of(results)
    problems = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        names = block_names(text)
        unknown = [n for n in names if n not in bodies]
        problems += [f"{page}: block bench:{n} names no result ({results_dir}/{n}.json is missing)" for n in unknown]
        if page == index:
            missing = [n for n in results if n not in names]
            if SUMMARY not in names:
                problems.append(f"{page}: no bench:{SUMMARY} block")
            if missing and check:
                problems += [f"{page}: no block for {results_dir}/{n}.json" for n in missing]
            elif missing:
                text = with_missing_blocks(text, missing)
        if unknown:
            continue
        new = with_blocks(text, bodies)
        if new != text:
            if check:
                problems += [f"{page}: block bench:{n} is not its JSON's" for n in names
                             if block(n, bodies[n]) not in text]
            else:
                page.write_text(new, encoding="utf-8")
                print(f"wrote {', '.join(block_names(new))} into {page}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a block is not its JSON's")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of result JSON (default benchmarks/results)")
    parser.add_argument("--index", type=Path, default=INDEX, help="the page that shows every result (default benchmarks/README.md)")
    parser.add_argument("pages", nargs="*", type=Path, help="the pages to write (default: the index and docs/**/*.md)")
    args = parser.parse_args(argv)
    pages = args.pages or ([args.index, *default_pages()[1:]] if args.index != INDEX else default_pages())
    if args.index not in pages:
        pages = [args.index, *pages]
    problems = update(pages, args.results, args.index, args.check)
    for p in problems:
        print(p, file=sys.stderr)
    if problems and args.check:
        print("run python scripts/write_benchmark_docs.py to write them", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
