"""The Phi-3 family: the shared transformer (pre-norm RMSNorm blocks, RoPE or LongRoPE, GQA, SwiGLU, no
biases, an optional window on every layer), whose Hugging Face weights join q/k/v and gate/up."""

from lmforge.model.families.phi3 import hf
from lmforge.model.families.phi3.config import Phi3Config
from lmforge.model.families.phi3.model import Phi3
from lmforge.model.family import Family, HFMapping

# microsoft/Phi-3.5-mini-instruct's LongRoPE factors (its config.json's rope_scaling): 48 per set, one per
# pair of a 96-wide head; the long set for sequences past the original 4096 positions
PHI35_MINI_SHORT_FACTOR = [
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
    1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
    1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
    1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
    2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
    2.749999523162842, 2.8399994373321533,
]
PHI35_MINI_LONG_FACTOR = [
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
    1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
    4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
    17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
    50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
    62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
    63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
    64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
    64.51000213623047, 64.52999877929688, 64.83999633789062,
]
_PHI3_MINI = dict(vocab_size=32064, d_model=3072, n_layers=32, n_heads=32, ffn_hidden=8192, norm_eps=1e-5,
                  rope_theta=10000.0)

PRESETS: dict[str, dict] = {
    # Fits the 2-core CPU: the llama family's "tiny" shape as a Phi-3.
    "phi3-tiny": dict(vocab_size=8192, d_model=384, n_layers=6, n_heads=6, ffn_hidden=1024, max_seq_len=1024),
    # microsoft/Phi-3-mini-4k-instruct: 3.8B, 32 layers of width 3072, 32 heads, SwiGLU 8192, a 2047-token
    # window on every layer of a 4096 context.
    "phi3-mini-4k": dict(**_PHI3_MINI, max_seq_len=4096, sliding_window=2047),
    # microsoft/Phi-3.5-mini-instruct, the shape of Phi-3-mini-128k: LongRoPE from 4096 to 131072 positions
    # (factor 32, attention factor sqrt(1 + ln 32 / ln 4096)); its window (262144) is past the context.
    "phi3.5-mini": dict(**_PHI3_MINI, max_seq_len=131072, rope_scaling="longrope", rope_factor=32.0,
                        rope_original_max_seq_len=4096, rope_short_factor=PHI35_MINI_SHORT_FACTOR,
                        rope_long_factor=PHI35_MINI_LONG_FACTOR),
}

FAMILY = Family(
    name="phi3",
    summary="Phi-3 / Phi-3.5: the Llama arithmetic with LongRoPE and a window; q/k/v and gate/up joined in HF",
    config=Phi3Config,
    model=Phi3,
    presets=PRESETS,
    hf=HFMapping.from_module(hf),
)
