"""Build the bundled demo preference data (data/preference/) from the SFT demo tasks.

Rejected answers are the demo SFT model's own wrong greedy answers where it has one, else
rule-made mistakes (lmforge.data.preference_demo). The committed files were made with the
SFT model of `make demo` (runs/demo/sft); without --sft every rejected answer is rule-made.

  .venv/bin/python scripts/build_preference_data.py --sft runs/demo/sft
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from lmforge.checkpoints.load import load_model
from lmforge.data.chatml import render_chatml
from lmforge.data.preference_demo import make_pairs, unpair, write_jsonl
from lmforge.inference.engine import GenerationConfig, generate


def model_answers(checkpoint: str, examples: list[dict]) -> list[str]:
    from lmforge.data.tokenizer import Tokenizer

    model, directory = load_model(checkpoint)
    model.eval()
    tok = Tokenizer.load(directory)
    prompts = [[tok.bos_id, *tok.encode("".join(s for s, _ in render_chatml(ex["messages"][:2], add_generation_prompt=True)))]
               for ex in examples]
    gen = GenerationConfig(max_new_tokens=32, temperature=0.0, stop_token_ids=[tok.token_to_id("<|im_end|>"), tok.eos_id])
    out: list[str] = []
    with torch.no_grad():
        for i in range(0, len(prompts), 64):
            out += [g.text for g in generate(model, prompts[i : i + 64], gen, tok)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", help="SFT checkpoint or run directory whose wrong answers become rejected answers")
    parser.add_argument("--sft-data", default="data/sft")
    parser.add_argument("--out", default="data/preference")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        examples = [json.loads(line) for line in (Path(args.sft_data) / f"{split}.jsonl").read_text().splitlines()]
        answers = model_answers(args.sft, examples) if args.sft else None
        pairs = make_pairs(examples, answers, seed=0 if split == "train" else 1)
        write_jsonl(out / f"{split}.jsonl", pairs)
        write_jsonl(out / f"kto_{split}.jsonl", unpair(pairs))
        print(split, len(pairs), "pairs;", dict(Counter(p["rejected_source"] for p in pairs)))


if __name__ == "__main__":
    main()
