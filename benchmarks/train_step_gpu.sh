#!/usr/bin/env bash
# The GPU variant of the training-step benchmark, prepared for one H200 (or H100):
# bf16 autocast, FlashAttention through SDPA, fused AdamW, forward+loss compiled.
# Target: MFU >= 45% for the llama3-1b preset. Writes $RESULTS/train_step_cuda_*.json.
#
#   bash benchmarks/train_step_gpu.sh                  # on the GPU: gpt2-124m, then llama3-1b (~4 min)
#   DEVICE=cpu bash benchmarks/train_step_gpu.sh       # dry run: the same commands on CPU, each preset's
#                                                      # architecture at a tiny size, one short round
# Environment:
#   PY        interpreter (default .venv/bin/python if there is one, else python3); the repo root is
#             put on PYTHONPATH, so lmforge need not be installed
#   RESULTS   where the JSON goes (default benchmarks/results; the dry run: a temporary directory)
#   OUT       if set, the JSON and this script's log are copied there too (3 files)
#   ROUNDS, STEPS, GPT2_LIMIT_S, LLAMA_LIMIT_S   rounds, timed steps per round, and each run's time limit
#   EAGER=1   leave lmforge's forward uncompiled (the smoke test's dry run: compiling on a small CPU
#             takes 1-2 minutes a preset)
#
# Each run is stopped at its limit (exit 124) and the next still runs; train_step.py rewrites its JSON
# after every round, so a run cut short keeps the rounds it finished.
#
# Memory of the 1B run, both models alive at once (1.24 B parameters each): fp32 weights and AdamW's
# two moments stay, 12 bytes a parameter = 14.8 GB per model, 30 GB for the pair; gradients (4.9 GB)
# exist only during a model's own step (zero_grad sets them to None). One step at batch 4 x 2048
# holds roughly 17 GB of bf16 activations (16 layers, 130 KB a token a layer saved for backward by
# either model run eagerly, counted with saved_tensors_hooks on CPU at one and two layers),
# 2.5 GB of autocast's bf16 weight copies and, at the loss, the bf16 logits plus their fp32 copy,
# log-softmax and gradient (8192 x 128256 tokens x vocab: 2.1 + 3 x 4.2 GB). About 70 GB at the
# peak: fits an H200's 141 GB with room; an 80 GB H100 would need --peer none or --batch 2. The
# JSON records the measured peak (peak_memory_bytes, torch.cuda.max_memory_allocated).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
DEVICE=${DEVICE:-cuda}

if [[ "$DEVICE" == cuda ]]; then
    RESULTS=${RESULTS:-benchmarks/results}
    ROUNDS=${ROUNDS:-3} STEPS=${STEPS:-10}
    GPT2_LIMIT_S=${GPT2_LIMIT_S:-150} LLAMA_LIMIT_S=${LLAMA_LIMIT_S:-330}
    GPT2=(--preset gpt2-124m --batch 16 --seq 1024)
    LLAMA=(--preset llama3-1b --batch 4 --seq 2048)
else
    RESULTS=${RESULTS:-${TMPDIR:-/tmp}/lmforge-train-step-dry-run}
    ROUNDS=${ROUNDS:-1} STEPS=${STEPS:-1}
    GPT2_LIMIT_S=${GPT2_LIMIT_S:-150} LLAMA_LIMIT_S=${LLAMA_LIMIT_S:-150}
    GPT2=(--preset gpt2-124m --model d_model=64 n_layers=2 n_heads=4 ffn_hidden=128 vocab_size=512 --batch 2 --seq 32)
    LLAMA=(--preset llama3-1b --model d_model=64 n_layers=2 n_heads=4 n_kv_heads=1 ffn_hidden=128 vocab_size=512
           --batch 2 --seq 32)
fi

# bench NAME LIMIT_S ARGS...: one train_step.py run under a time limit, its JSON copied to $OUT
bench() {
    local name=$1 limit=$2
    shift 2
    local json="$RESULTS/train_step_${DEVICE}_${name}.json" start=$SECONDS rc=0
    rm -f "$json"  # never report an earlier run's figures as this one's
    echo "== $name, limit ${limit} s: $PY benchmarks/train_step.py $* --out $json"
    timeout --kill-after=20 "$limit" "$PY" benchmarks/train_step.py "$@" --out "$json" || rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s$([[ $rc == 124 ]] && echo ' (time limit)')"
    if [[ -n "${OUT:-}" && -f "$json" ]]; then cp "$json" "$OUT/"; fi
    return "$rc"
}

main() {
    echo "== $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), device $DEVICE"
    if [[ "$DEVICE" == cuda ]] && command -v nvidia-smi > /dev/null; then nvidia-smi; fi
    "$PY" -c 'import sys, importlib.metadata, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", importlib.metadata.version("transformers"))
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}, "
          f"bf16 {torch.cuda.is_bf16_supported()}, {torch.cuda.device_count()} device(s)")' || return
    mkdir -p "$RESULTS"
    local failed=0 compile=(--compile)
    if [[ "${EAGER:-0}" == 1 ]]; then compile=(); fi
    # torch.compile needs Triton (GPU) or a C++ compiler (CPU): a few seconds here rather than a lost run
    if [[ ${#compile[@]} -gt 0 ]] &&
        ! "$PY" -c "import torch; torch.compile(lambda x: x.sin() * 2)(torch.ones(8, device='$DEVICE'))"; then
        echo "== torch.compile fails on this machine (above): lmforge runs eager, a lower figure"
        compile=()
    fi
    # GPT-2-124M shape (LayerNorm/GELU: transformers has no Llama equivalent, so no peer)
    bench gpt2-124m "$GPT2_LIMIT_S" --device "$DEVICE" "${GPT2[@]}" --dtypes bf16 "${compile[@]}" --peer none \
        --rounds "$ROUNDS" --steps "$STEPS" || failed=1
    # Llama-3-style 1B against transformers' LlamaForCausalLM of the same shape
    bench llama3-1b "$LLAMA_LIMIT_S" --device "$DEVICE" "${LLAMA[@]}" --dtypes bf16 "${compile[@]}" \
        --rounds "$ROUNDS" --steps "$STEPS" || failed=1
    return "$failed"
}

if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    main 2>&1 | tee "$OUT/train_step_gpu_$DEVICE.log"
    exit "${PIPESTATUS[0]}"
fi
main
