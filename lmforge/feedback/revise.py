"""Critique -> revision rounds (SL-CAI, Bai et al. 2022, section 3.1).

For each prompt and response, each round draws a principle (seeded by the recipe's seed, the
item and the round, so a rerun draws the same ones), then asks the critic, in the paper's
few-turn format as a chat:

    user: <prompt>            assistant: <response>
    user: <critique request>  assistant: <critique>
    user: <revision request>  assistant: <revision>

The revision is the next round's response (a fresh conversation each round, so the prompt
stays short for a small critic). An empty revision leaves the response as it was, and is
counted; an empty response or critique ends that round's questions (a chat API refuses an
empty turn). All items of a batch go to the critic together: the critiques in one batch, then
the revisions in one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmforge.feedback.constitution import Constitution
from lmforge.feedback.judges import Chat, Judge


@dataclass(frozen=True)
class ToRevise:
    key: str  # the item (the prompt's file:line)
    index: int  # the prompt's number, for the principle draws
    prompt: str | list[dict]
    response: str


def draw_principle(constitution: Constitution, seed: int, index: int, step: int) -> int:
    """The principle of prompt ``index``'s round (or pair) ``step``: a hash of the three, so it
    does not depend on batching or resuming."""
    return int(np.random.default_rng([seed, index, step]).integers(len(constitution.principles)))


def as_turns(prompt: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def revise(critic: Judge, items: Sequence[ToRevise], constitution: Constitution, rounds: int, seed: int
           ) -> list[dict]:
    """Each item's rounds ``[{principle, critique, revision, kept}]`` and its ``final`` response.
    A round of an empty response, or whose critique is empty, asks nothing further (a chat API
    refuses an empty turn) and is marked ``skipped``."""
    responses = [item.response for item in items]
    traces: list[list[dict]] = [[] for _ in items]
    for r in range(rounds):
        principles = [constitution.principles[draw_principle(constitution, seed, item.index, r)] for item in items]
        asked = {i: [*as_turns(item.prompt), {"role": "assistant", "content": responses[i]},
                     {"role": "user", "content": principles[i].critique}]
                 for i, item in enumerate(items) if responses[i].strip()}
        critiques = dict(zip(asked, critic.generate([Chat(f"{items[i].key} round {r} critique", m)
                                                     for i, m in asked.items()])))
        asked = {i: [*asked[i], {"role": "assistant", "content": c}, {"role": "user", "content": principles[i].revision}]
                 for i, c in critiques.items() if c.strip()}
        revisions = dict(zip(asked, critic.generate([Chat(f"{items[i].key} round {r} revision", m)
                                                     for i, m in asked.items()])))
        for i, p in enumerate(principles):
            step = {"principle": p.name, "critique": critiques.get(i), "revision": revisions.get(i)}
            if i not in critiques:
                step["skipped"] = "empty_response"
            elif i not in revisions:
                step["skipped"] = "empty_critique"
            step["kept"] = bool((revisions.get(i) or "").strip())
            if step["kept"]:
                responses[i] = revisions[i]
            traces[i].append(step)
    return [{"rounds": t, "final": final} for t, final in zip(traces, responses)]
