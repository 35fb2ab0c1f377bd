"""KTO on unpaired feedback, through the one training loop: TRL's unpaired format,
`prompt`/`completion`/`label` (a boolean: desirable or not; plain or conversational, JSONL or
Parquet). The loss weighs desirable and undesirable examples by λ_D and λ_U against a KL
baseline from mismatched prompt/completion pairs (Ethayarajh et al. 2024). Full
fine-tuning or LoRA (reference = adapters disabled); reference log-probs precomputed or on
the fly. Warns at the start when λ_D·n_D / (λ_U·n_U) is outside [1, 4/3] or the data holds one kind
of example only (as TRL does). Logs the KL baseline, rewards and accuracy; reports exact-match accuracy and, on
held-out preference pairs (`pairs:`), the model's own pairwise preference before and after.

  lmforge kto recipes/demo/kto.yaml
  lmforge kto recipes/demo/kto.yaml desirable_weight=1.33 lora.r=16

Under torchrun it trains data-parallel with FSDP2, as `lmforge dpo` does (its `parallel:`
section; see docs/distributed.md); the KL baseline z0 is the mean over every rank's KL rows
of the micro-batch (pooled; TRL averages the processes' means, the same with equal rows):

  torchrun --standalone --nproc_per_node=2 -m lmforge kto recipes/demo/kto.yaml train.micro_batch_size=4
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmforge.core.io import InputError
from lmforge.core.run import log
from lmforge.data.documents import SkipLog
from lmforge.data.preference import pair_rows, read_preference_pairs, read_unpaired_examples, unpaired_rows
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import ParallelContext
from lmforge.objectives.kto import KTOLossConfig, KTOObjective, weight_balance_warning
from lmforge.peft.lora import LoraConfig
from lmforge.stages.dpo import PreferenceDataConfig, pairwise_preference, report, run_preference_training
from lmforge.train.finetune import ExactMatchConfig, run_data_parallel
from lmforge.train.loop import TrainConfig


@dataclass
class KTORecipe(KTOLossConfig):
    run_dir: str = "runs/kto"
    checkpoint: str = "runs/sft"  # the policy to start from (and the reference)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    pairs: list[str] = field(default_factory=list)  # held-out prompt/chosen/rejected pairs, scored before and after
    lora: LoraConfig | None = None
    precompute_reference: bool = True  # reference log-probs in one pass before training
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=5e-6, warmup_steps=10, eval_every=50,
                                                                   micro_batch_size=8))
    eval: ExactMatchConfig = field(default_factory=ExactMatchConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # read under torchrun: dp_shard, dp_replicate


def run_kto(recipe: KTORecipe) -> dict:
    return run_data_parallel(recipe, "kto", lambda ctx: train_kto(recipe, ctx))


def train_kto(recipe: KTORecipe, parallel: ParallelContext | None = None) -> dict:
    """The KTO run in one process, or on one rank of a data-parallel ``torchrun`` job (z0 over every rank's KL rows)."""
    loss_cfg = KTOLossConfig(recipe.beta, recipe.desirable_weight, recipe.undesirable_weight)

    def measure_for(tok):
        """The model's own preference on the held-out ``pairs:`` (read here, on every rank), if any."""
        if not recipe.pairs:
            return None
        skipped = SkipLog()
        pairs = read_preference_pairs(recipe.pairs, tok, recipe.data.max_length, on_bad=recipe.data.on_bad,
                                      on_too_long=recipe.data.on_too_long, skipped=skipped)
        log.info("kto: %d held-out pairs; %d skipped or truncated %s", len(pairs), skipped.total,
                 dict(skipped.by_reason) if skipped.total else "")
        if not pairs:
            raise InputError(f"pairs: no usable pairs in {recipe.pairs} ({skipped.total} skipped: "
                             f"{dict(skipped.by_reason)})")
        held_out = pair_rows(pairs, tok.pad_id)
        return lambda model, _val_rows, *args: pairwise_preference(model, held_out, *args)

    def check_balance(examples: list) -> None:
        n_desirable = sum(e.desirable for e in examples)
        warning = weight_balance_warning(n_desirable, len(examples) - n_desirable, loss_cfg.desirable_weight,
                                         loss_cfg.undesirable_weight)
        if warning:
            log.warning("kto: %s", warning)

    return run_preference_training(
        recipe,
        objective_for=lambda reference: KTOObjective(
            loss_cfg, reference, all_reduce=parallel.all_reduce_dp if parallel is not None else None),
        rows_for=unpaired_rows,
        reference_columns={"": "ref_logps", "kl_": "ref_kl_logps"},
        needs_reference=True,
        stage="kto",
        read_examples=read_unpaired_examples,
        rows_per_example=1,
        loss_name="kto",
        measure_for=measure_for,
        check_examples=check_balance,
        parallel=parallel,
    )


RECIPE = KTORecipe
run = run_kto
__all__ = ["KTORecipe", "run_kto", "report"]
