"""The Llama family: pre-norm blocks of the shared parts as they are (``model.transformer.Block``),
RoPE, GQA, SwiGLU; with its options, Mistral's sliding window, Qwen2's q/k/v biases and Qwen3's
QK-norm. Its config is ``ModelConfig`` itself and its model ``Transformer`` itself."""

from lmforge.model.config import ModelConfig
from lmforge.model.families.llama import hf
from lmforge.model.family import Family, HFMapping
from lmforge.model.transformer import Transformer

PRESETS: dict[str, dict] = {
    # Fits the 2-core CPU: ~17M parameters, the shape of the CPU benchmarks.
    "tiny": dict(vocab_size=8192, d_model=384, n_layers=6, n_heads=6, ffn_hidden=1024, max_seq_len=1024),
    # HuggingFaceTB/SmolLM2-135M's shape: GQA 9/3, SwiGLU 1536, tied, theta 1e5.
    "smollm2-135m": dict(
        vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_hidden=1536,
        rope_theta=100000.0, tie_embeddings=True, max_seq_len=2048,
    ),
    # Llama-3.2-1B's shape: GQA 32/8, SwiGLU 8192, tied, theta 5e5.
    "llama3-1b": dict(
        vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
        rope_theta=500000.0, tie_embeddings=True, max_seq_len=8192,
    ),
}

FAMILY = Family(
    name="llama",
    summary="Llama 2/3, Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (QK-norm); RoPE, GQA, SwiGLU",
    config=ModelConfig,
    model=Transformer,
    presets=PRESETS,
    hf=HFMapping.from_module(hf),
)
