#!/usr/bin/env bash
# The GPU variant of the training-step benchmark, prepared for one H200 (or H100):
# bf16 autocast, FlashAttention through SDPA, fused AdamW, forward+loss compiled.
# Target: MFU >= 45% for the llama3-1b preset. Writes benchmarks/results/train_step_cuda_*.json.
#   bash benchmarks/train_step_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# GPT-2-124M shape (LayerNorm/GELU: transformers has no Llama equivalent, so no peer)
$PY benchmarks/train_step.py --device cuda --preset gpt2-124m --batch 16 --seq 1024 --dtypes bf16 \
    --compile --peer none --rounds 3 --steps 10 --out benchmarks/results/train_step_cuda_gpt2-124m.json
# Llama-3-style 1B against transformers' LlamaForCausalLM of the same shape
$PY benchmarks/train_step.py --device cuda --preset llama3-1b --batch 4 --seq 2048 --dtypes bf16 \
    --compile --rounds 3 --steps 10 --out benchmarks/results/train_step_cuda_llama3-1b.json
