"""KTO on unpaired feedback, through the one training loop: TRL's unpaired format,
`prompt`/`completion`/`label` (a boolean: desirable or not; plain or conversational, JSONL or
Parquet). The loss weighs desirable and undesirable examples by λ_D and λ_U against a KL
baseline from mismatched prompt/completion pairs (Ethayarajh et al. 2024). Full
fine-tuning or LoRA (reference = adapters disabled); reference log-probs precomputed or on
the fly. Warns at the start when λ_D·n_D / (λ_U·n_U) is outside [1, 4/3] or the data holds one kind
of example only (as TRL does). Logs the KL baseline, rewards and accuracy; reports, on held-out
preference pairs (`pairs:`), the model's own pairwise preference and, with `score.name=exact_match`,
exact-match accuracy, before and after. The loss's options are under `objective:` (beta,
desirable_weight, undesirable_weight).

  lmforge kto recipes/demo/kto.yaml
  lmforge kto recipes/demo/kto.yaml objective.desirable_weight=1.33 lora.r=16

Under torchrun it trains data-parallel with FSDP2, as `lmforge dpo` does (its `parallel:`
section; see docs/distributed.md); the KL baseline z0 is the mean over every rank's KL rows
of the micro-batch (pooled; TRL averages the processes' means, the same with equal rows):

  torchrun --standalone --nproc_per_node=2 -m lmforge kto recipes/demo/kto.yaml train.micro_batch_size=4
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from lmforge.core.config import Renamed, option
from lmforge.core.io import InputError
from lmforge.core.run import log
from lmforge.data.documents import SkipLog
from lmforge.data.preference import pair_rows, read_preference_pairs, read_unpaired_examples, unpaired_rows
from lmforge.distributed.config import ParallelConfig
from lmforge.distributed.mesh import ParallelContext
from lmforge.objectives.ewc import EWCConfig
from lmforge.objectives.kto import KTOLossConfig, KTOObjective, weight_balance_warning
from lmforge.peft.lora import LoraConfig
from lmforge.stages.dpo import report
from lmforge.stages.finetune import FinetuneStage, PreferenceDataConfig, run_finetune
from lmforge.stages.scoring import RENAMED_EVAL_KEYS, ScoreConfig, combined, named_scorer, preference_scorer
from lmforge.train.loop import TrainConfig


@dataclass
class KTORecipe:
    run_dir: str = option(
        "runs/kto",
        help="the run directory: config.yaml, metrics.jsonl, checkpoints/, final/ (the trained model), summary.json",
    )
    checkpoint: str = option("runs/sft", help="the policy to start from (and the reference)")
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    objective: KTOLossConfig = option(default_factory=KTOLossConfig, help="beta, desirable_weight, undesirable_weight")
    pairs: list[str] = option(
        default_factory=list, help="held-out prompt/chosen/rejected pairs, scored before and after"
    )
    lora: LoraConfig | None = option(None, help="adapters only; the reference is then the model with adapters disabled")
    ewc: EWCConfig | None = option(None, help="set to add EWC's (λ/2)·Σ F(θ − θ*)² to the loss, F and θ* from "
                                   "`lmforge fisher` (docs/continual-learning.md)")
    precompute_reference: bool = option(True, help="reference log-probs in one pass before training")
    train: TrainConfig = field(default_factory=lambda: TrainConfig(lr=5e-6, warmup_steps=10, eval_every=50,
                                                                   micro_batch_size=8))
    score: ScoreConfig = option(default_factory=ScoreConfig, help="scored before and after training (none by default)")
    parallel: ParallelConfig = option(
        default_factory=ParallelConfig, help="read under torchrun: dp_shard, dp_replicate"
    )

    RENAMED_KEYS: ClassVar[dict[str, Renamed]] = {
        **{key: Renamed(f"objective.{key}") for key in ("beta", "desirable_weight", "undesirable_weight")},
        **RENAMED_EVAL_KEYS}


def kto_stage(recipe: KTORecipe, parallel: ParallelContext | None = None) -> FinetuneStage:
    """Unpaired examples with their mismatched KL rows, the KTO loss (z0 over every rank's KL rows),
    and the model's own preference on the held-out ``pairs:`` (plus the recipe's scorer)."""
    loss, d = recipe.objective, recipe.data

    def scorer(run, _val_rows):
        """The held-out ``pairs:`` are read here, on every rank, so their errors stop all alike."""
        own = None
        if recipe.pairs:
            skipped = SkipLog()
            pairs = read_preference_pairs(recipe.pairs, run.tok, d.max_length, on_bad=d.on_bad,
                                          on_too_long=d.on_too_long, skipped=skipped)
            log.info("kto: %d held-out pairs; %d skipped or truncated %s", len(pairs), skipped.total,
                     dict(skipped.by_reason) if skipped.total else "")
            if not pairs:
                raise InputError(f"pairs: no usable pairs in {recipe.pairs} ({skipped.total} skipped: "
                                 f"{dict(skipped.by_reason)})")
            own = preference_scorer(pair_rows(pairs, run.tok.pad_id), recipe.train.micro_batch_size, run.device,
                                    run.precision)
        return combined(named_scorer(recipe.score, run.tok, d.val), own)

    def check_balance(examples: list) -> None:
        n_desirable = sum(e.desirable for e in examples)
        warning = weight_balance_warning(n_desirable, len(examples) - n_desirable, loss.desirable_weight,
                                         loss.undesirable_weight)
        if warning:
            log.warning("kto: %s", warning)

    return FinetuneStage(
        "kto", read_unpaired_examples, rows=lambda examples, tok: unpaired_rows(examples, tok.pad_id, d.max_length, d.seed),
        objective=lambda reference: KTOObjective(
            loss, reference, all_reduce=parallel.all_reduce_dp if parallel is not None else None),
        scorer=scorer, reference_columns={"": "ref_logps", "kl_": "ref_kl_logps"},
        precompute_reference=recipe.precompute_reference, check_examples=check_balance,
        data_paths={"pairs": recipe.pairs}, summary={"loss": "kto"})


def run_kto(recipe: KTORecipe) -> dict:
    return run_finetune(recipe, "kto", kto_stage)


RECIPE = KTORecipe
run = run_kto
__all__ = ["KTORecipe", "run_kto", "report"]
