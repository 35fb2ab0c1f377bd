"""lmforge checkpoints as an lm-evaluation-harness model: ``python -m lmforge.eval.harness
--model lmforge --model_args checkpoint=runs/demo/pretrain --tasks demo_answers --include_path
data/eval`` (the harness's own command line), or ``simple_evaluate(model=LMForgeLM(...))``.

Importing this module registers ``LMForgeLM`` under the name ``lmforge`` (``register_model``) and
lmforge eval's ``numeric_match`` as a harness metric, so a task using it runs in both.
Its three requests run in this process through the same functions as ``lmforge eval``
(``eval.scoring``), so a task scored either way gives the same numbers. Needs the ``lm_eval``
package (``pip install 'lmforge[eval]'``).
"""

from __future__ import annotations

import lm_eval.api.metrics  # noqa: F401 (registers the harness's aggregations, which numeric_match names)
import lm_eval.models  # noqa: F401 (the harness's own models: its registry loads them only while it is empty,

#                                    so registering ours first would hide local-completions, hf, ...)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_metric, register_model
from torch import nn

from lmforge.data.tokenizer import Tokenizer
from lmforge.eval import answers, scoring


@register_model("lmforge")
class LMForgeLM(LM):
    """An lmforge model in process: ``checkpoint`` (a checkpoint or run directory), or a built
    ``model`` with its ``tokenizer``; ``batch_size`` rows per forward; ``seed`` for sampled
    generation (each request its own seeded generator); ``add_bos_token`` (default true: lmforge
    trains every document after BOS) starts each context with BOS, as the harness's own models
    do when given ``add_bos_token=True`` (false: the harness's default for hf and API models,
    which is what ``local-completions`` through ``lmforge serve`` sends)."""

    def __init__(self, checkpoint: str | None = None, model: nn.Module | None = None,
                 tokenizer: Tokenizer | None = None, batch_size: int | str | None = 16, device: str | None = "auto",
                 dtype: str = "float32", seed: int = 1234, add_bos_token: bool | str = True, **_: object) -> None:
        super().__init__()
        if model is None:
            if checkpoint is None:
                raise ValueError("LMForgeLM needs checkpoint=PATH (or a model and its tokenizer)")
            model, tokenizer = scoring.load_checkpoint(checkpoint, device or "auto", dtype)
        elif tokenizer is None:
            raise ValueError("LMForgeLM(model=...) needs its tokenizer too")
        self.model, self.tok = model.eval(), tokenizer
        self.batch_size = int(batch_size) if batch_size not in (None, "auto") else 16
        self.seed = int(seed)
        self.bos = add_bos_token if isinstance(add_bos_token, bool) else str(add_bos_token).lower() == "true"

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return scoring.loglikelihood_pairs(self.model, self.tok, [r.args for r in requests], self.batch_size,
                                           self.bos)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return scoring.loglikelihood_rolling(self.model, self.tok, [r.args[0] for r in requests], self.batch_size)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return scoring.generate_until(self.model, self.tok, [r.args for r in requests], self.seed, self.batch_size,
                                      self.bos)


@register_metric(metric="numeric_match", higher_is_better=True, output_type="generate_until", aggregation="mean")
def numeric_match(references: list, predictions: list, rel_tol: float = 1e-6, abs_tol: float = 0.0) -> float:
    """lmforge eval's ``numeric_match`` for the harness: the last number of the response is the target's."""
    return float(answers.numeric_match(predictions[0], references[0], rel_tol=rel_tol, abs_tol=abs_tol))


if __name__ == "__main__":  # the harness's command line with the lmforge model registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
