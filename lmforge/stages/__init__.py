"""Stages of the lifecycle, one module per verb, and the registry of verbs."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass
class Verb:
    """A verb and the stage module that implements it.

    A recipe verb's module defines ``RECIPE`` (a dataclass) and ``run(recipe)``. A verb
    with its own arguments (``lmforge export <checkpoint> <dir>``) also defines
    ``add_arguments(parser)`` and ``recipe_from_args(args) -> RECIPE``. Modules are
    imported only when their verb runs, so ``lmforge --help`` stays fast.
    """

    name: str
    summary: str  # one line for `lmforge --help`
    module: str
    distributed: bool = False  # runs under torchrun (its recipe's `parallel:`); others refuse WORLD_SIZE > 1

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


VERBS = [
    Verb("curate", "web pages and documents to a clean, deduplicated corpus + rejects + stats", "lmforge.stages.curate"),
    Verb("tokenizer", "train a byte-level BPE tokenizer (tokenizer.json, HF-compatible)", "lmforge.stages.tokenizer"),
    Verb("prepare", "tokenize documents into memory-mapped train/val token shards", "lmforge.stages.prepare"),
    Verb("pretrain", "pre-train a transformer on token shards (the one training loop)",
         "lmforge.stages.pretrain", distributed=True),
    Verb("sft", "supervised fine-tuning on chat data (full, LoRA or DoRA), assistant-only loss, packing",
         "lmforge.stages.sft", distributed=True),
    Verb("reward", "train a Bradley-Terry reward model (transformer + scalar head) on preference pairs",
         "lmforge.stages.reward", distributed=True),
    Verb("dpo", "preference optimisation on pairs: DPO, IPO, cDPO, rDPO, hinge, SimPO, ORPO, CPO",
         "lmforge.stages.dpo", distributed=True),
    Verb("kto", "KTO on unpaired desirable/undesirable examples",
         "lmforge.stages.kto", distributed=True),
    Verb("grpo", "RL with verifiable rewards: GRPO, Dr. GRPO, RLOO, REINFORCE++, DAPO's dynamic sampling",
         "lmforge.stages.grpo", distributed=True),
    Verb("ppo", "PPO-RLHF: policy, critic (value head), reward model and/or verifiers, KL in the reward, GAE",
         "lmforge.stages.ppo", distributed=True),
    Verb("distill", "on-policy distillation (GKD): the student's samples scored by a teacher, reverse KL or JSD per token",
         "lmforge.stages.distill"),
    Verb("rs", "rejection sampling: best of K samples per prompt by a reward, as SFT data or preference pairs",
         "lmforge.stages.rs"),
    Verb("cai", "Constitutional AI: critique -> revision SFT data (cai revise), AI preference labels (cai label)",
         "lmforge.stages.cai"),
    Verb("generate", "sample text from a checkpoint with a KV cache", "lmforge.stages.generate"),
    Verb("eval", "score a checkpoint on lm-evaluation-harness tasks (multiple choice, perplexity, generation)",
         "lmforge.stages.eval"),
    Verb("serve", "serve a checkpoint with OpenAI's HTTP API (chat, completions, streaming) and a chat page",
         "lmforge.stages.serve"),
    Verb("merge", "merge LoRA adapters or checkpoints: linear, task arithmetic, TIES, DARE (peft's combination types)",
         "lmforge.stages.merge"),
    Verb("fisher", "the diagonal Fisher of a checkpoint on a dataset, for EWC (or folded into a stored one: EWC++)",
         "lmforge.stages.fisher"),
    Verb("doremi", "DoReMi: a proxy trained with Group DRO against a reference -> domain weights for a mixture",
         "lmforge.stages.doremi"),
    Verb("export", "export a checkpoint as a Hugging Face model folder", "lmforge.stages.export"),
    Verb("import", "import a Hugging Face model folder as an lmforge checkpoint (--help lists the families)",
         "lmforge.stages.import_hf"),
    Verb("sweep", "a grid of pre-training runs (model sizes x tokens, or IsoFLOP) -> runs.csv for scaling fits",
         "lmforge.stages.sweep"),
    Verb("run", "run a lifecycle of stages from one YAML file and write a report", "lmforge.stages.lifecycle"),
    Verb("doctor", "print what a bug report needs: versions, CPU and its flags, peaks, GPUs, Chromium, free disk",
         "lmforge.stages.doctor"),
    Verb("bench", "measure this machine (bench peak: matmul FLOP/s per dtype, for MFU)", "lmforge.stages.bench"),
    Verb("plan", "plan a run (plan memory: bytes per device under a parallel layout)", "lmforge.stages.plan"),
    Verb("scaling", "scaling laws: fit runs (Chinchilla approaches 1-3, Kaplan), plan a budget, count FLOPs",
         "lmforge.stages.scaling"),
]
VERBS_BY_NAME = {v.name: v for v in VERBS}
