"""Can a checkpoint copy from its context? The in-context copying probe of Olsson et al. (2022):
a sequence of random tokens, then the same sequence again. A model with induction heads
predicts the second copy far better than the first (the first is unpredictable: about
ln(vocabulary) nats per token); one without them scores both alike.

    PYTHONPATH=. python benchmarks/copying.py runs/demo/pretrain runs/demo/sft [--length 50]

Prints, per checkpoint, the mean negative log-likelihood (nats per token) of the first and the
second copy and their difference (the copying gain). No timing: the numbers are the model's.
"""

from __future__ import annotations

import argparse
import json

import torch

from lmforge.checkpoints.load import load_model


@torch.no_grad()
def copying_nll(model: torch.nn.Module, vocab_size: int, length: int, rows: int, seed: int,
                low: int = 100) -> tuple[float, float]:
    """Mean NLL of the first copy's tokens 2..L and of the second copy's L tokens, where each row is
    L tokens drawn uniformly from ``[low, vocab_size)`` (past the special and byte tokens), twice."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(low, vocab_size, (rows, length), generator=g)
    ids = torch.cat([half, half], 1)
    logp = torch.log_softmax(model(ids).float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return float(-logp[:, : length - 1].mean()), float(-logp[:, length - 1 :].mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="checkpoint or run directories")
    parser.add_argument("--length", type=int, default=50, help="tokens in each copy")
    parser.add_argument("--rows", type=int, default=8, help="sequences to average over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--low", type=int, default=100, help="the smallest token id drawn (past the special and byte tokens)")
    args = parser.parse_args()
    for path in args.checkpoints:
        model, _ = load_model(path)
        model.eval()
        first, second = copying_nll(model, model.cfg.vocab_size, args.length, args.rows, args.seed, args.low)
        print(json.dumps({"checkpoint": path, "first_copy_nll": round(first, 3), "second_copy_nll": round(second, 3),
                          "copying_gain": round(first - second, 3)}))


if __name__ == "__main__":
    main()
