"""Rollouts: ``n`` sampled responses per prompt from the policy, through the inference engine.

Each prompt is one engine request with ``n`` samples (the engine prefills the prompt once and
copies its cache for the samples); its samples form a group (GRPO's, best-of-n's) with one
group id. A sample keeps its prompt, its response token ids (with the stop token that ended
it, whose probability the trainer trains too), the engine's log-probability of each response
token, its finish reason (``stop``, or ``length`` when ``max_new_tokens`` cut it: DAPO masks
such overlong responses) and the prompt's fields, which the rewards read.

**Log-probs.** The engine records log-softmax of the raw float32 logits, at temperature 1
and before top-k/top-p: exactly what ``Transformer.forward`` over prompt + response gives
(``tests/rl/test_rollout.py``, |Δ| < 1e-5 in fp32), so the first PPO/GRPO ratio is 1. They
are the log-probs of the distribution the tokens were drawn from only when the sampling
leaves it unchanged: ``temperature: 1``, ``top_p: 1``, ``top_k: 0``
(``RolloutConfig.exact_logprobs``). At another temperature, or with truncation, they remain the
model's untempered log-probs (still what the trainer's forward recomputes, so the ratio
starts at 1), but the samples came from the tempered or truncated distribution, so the
policy gradient is slightly off-policy; an on-policy trainer samples at temperature 1.

**Seeds and resuming.** Each request draws from its own ``torch.Generator`` seeded by
``(seed, epoch, prompt index)`` (counter-based, as the token loader's draws): a prompt gets
the same samples whatever else shares its batch (up to the float rounding of the batch's
matmuls) and however the run was interrupted. So the whole state of the sampler, RNG
included, is ``RolloutState``: the seed, the epoch and the cursor in that epoch's seeded
prompt order, and the next group id (``state_dict``/``load_state_dict``).

``rollout_batch`` lays rollouts out as the trainer's padded tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lmforge.core.config import at_least, option, positive, seed_field, unit_interval
from lmforge.core.io import InputError
from lmforge.data.chatml import IM_END
from lmforge.data.tokenizer import Tokenizer
from lmforge.inference.engine import Engine, FinishReason, Generation, GenerationConfig, Request
from lmforge.rl.prompts import Prompt


@dataclass
class RolloutConfig:
    """How responses are sampled: ``n`` per prompt, the sampling settings, when to stop."""

    n: int = positive(8, help="samples per prompt: one group")
    max_new_tokens: int = positive(128, help="the longest response; a response cut there counts as truncated")
    temperature: float = at_least(0, 1.0, help="1: the recorded log-probs are the sampling distribution's (see above)")
    top_p: float = unit_interval(1.0, low_open=True, help="1 = off")
    top_k: int = at_least(0, 0, help="0 = off")
    stop: list[str] = option(default_factory=list, help="the response is cut before the first of these")
    stop_token_ids: list[int] | None = at_least(
        0, None, help="null: <|im_end|> and end of text for chat prompts, end of text otherwise"
    )
    seed: int = seed_field(0, help="the seed of the prompt order and of each prompt's samples")
    max_batch: int = positive(
        512, help="rows decoding together (a prompt's n samples count n): a wave costs max_new_tokens steps"
    )
    shuffle: bool = option(True, help="prompts in a seeded order per epoch, else in file order")

    @property
    def exact_logprobs(self) -> bool:
        """Whether the recorded log-probs are those of the distribution the tokens were drawn from."""
        return self.temperature == 1.0 and self.top_p == 1.0 and self.top_k == 0

    def generation(self, stop_token_ids: list[int]) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                                top_p=self.top_p, stop=list(self.stop), stop_token_ids=stop_token_ids, n=self.n)


@dataclass
class Rollout:
    """One sampled response to a prompt."""

    prompt: Prompt
    group: int  # the same for the n samples of one prompt in one draw
    sample: int  # 0 .. n-1 within the group
    response_ids: list[int]  # generated tokens, ending with the stop token when one ended the response
    logprobs: list[float]  # the engine's log-prob of each of response_ids (see the module docstring)
    finish_reason: FinishReason  # "length": cut by max_new_tokens (overlong)
    text: str  # the response as text, cut before a stop string, without the stop token
    versions: list[int] | None = None  # a rollout worker's: the policy version that drew each of response_ids

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def request_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of prompt ``index``'s generator in ``epoch``: a hash of the three, so it does not
    depend on which prompts were sampled before or with it."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, np.uint64)[0])


@dataclass
class RolloutState:
    """Where sampling is in the prompt stream; restoring it resumes exactly (see the module docstring)."""

    seed: int
    n_prompts: int
    shuffle: bool = True
    epoch: int = 0
    cursor: int = 0  # prompts of this epoch's order already sampled
    groups: int = 0  # groups issued so far: the next group's id

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_prompts)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_prompts)

    def take(self, k: int) -> list[tuple[int, int, int]]:
        """The next ``k`` prompts as ``(group id, epoch, prompt index)``, advancing the state (epochs wrap)."""
        out = []
        while len(out) < k:
            if self.cursor >= self.n_prompts:
                self.epoch, self.cursor = self.epoch + 1, 0
            order = self.order(self.epoch)
            step = min(k - len(out), self.n_prompts - self.cursor)
            for index in order[self.cursor : self.cursor + step].tolist():
                out.append((self.groups, self.epoch, index))
                self.groups += 1
            self.cursor += step
        return out

    def state_dict(self) -> dict:
        return {"seed": self.seed, "n_prompts": self.n_prompts, "shuffle": self.shuffle, "epoch": self.epoch,
                "cursor": self.cursor, "groups": self.groups}

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["n_prompts"], state["shuffle"]) != (self.seed, self.n_prompts, self.shuffle):
            raise InputError(f"the rollout state is for {state['n_prompts']} prompts with seed {state['seed']} "
                             f"(shuffle {state['shuffle']}), these are {self.n_prompts} with seed {self.seed} "
                             f"(shuffle {self.shuffle}): the prompts or the seed changed; use a new run_dir")
        self.epoch, self.cursor, self.groups = int(state["epoch"]), int(state["cursor"]), int(state["groups"])


def stop_ids_for(prompt: Prompt, cfg: RolloutConfig, tok: Tokenizer) -> list[int]:
    """The recipe's stop tokens, else the end of the assistant's turn and of text for a chat prompt, of text otherwise."""
    if cfg.stop_token_ids is not None:
        return list(cfg.stop_token_ids)
    return [tok.token_to_id(IM_END), tok.eos_id] if prompt.conversational else [tok.eos_id]


def sample_rollouts(model: nn.Module, tok: Tokenizer, prompts: Sequence[Prompt], cfg: RolloutConfig,
                    state: RolloutState, num_prompts: int) -> list[list[Rollout]]:
    """The next ``num_prompts`` prompts of ``state``'s order, ``cfg.n`` samples each: one list
    (a group) per prompt, in that order. ``state`` moves past them."""
    if state.n_prompts != len(prompts):
        raise ValueError(f"the rollout state is for {state.n_prompts} prompts, got {len(prompts)}")
    engine = Engine(model, tok, max_batch=cfg.max_batch)
    device = model.embed.weight.device
    requests = {}
    for group, epoch, index in state.take(num_prompts):
        prompt = prompts[index]
        generator = torch.Generator(device).manual_seed(request_seed(state.seed, epoch, index))
        try:
            request_id = engine.submit(Request(prompt.ids, cfg.generation(stop_ids_for(prompt, cfg, tok)), generator))
        except ValueError as exc:  # a prompt too long for the model's context
            raise InputError(f"{prompt.source}: {exc}") from exc
        requests[request_id] = (group, prompt)
    was_training = model.training
    model.eval()
    try:
        finished = dict(engine.run())
    finally:
        model.train(was_training)
    return [[rollout_of(prompt, group, sample, g) for sample, g in enumerate(finished[request_id])]
            for request_id, (group, prompt) in requests.items()]


def rollout_of(prompt: Prompt, group: int, sample: int, g: Generation) -> Rollout:
    ids, logprobs = list(g.tokens), list(g.logprobs)
    if g.stop_token is not None:  # (token, log-prob, alternatives): the trainer trains the choice to stop too
        ids.append(g.stop_token[0])
        logprobs.append(g.stop_token[1])
    return Rollout(prompt, group, sample, ids, logprobs, g.finish_reason, g.text or "")


def rollout_batch(rollouts: Sequence[Rollout], pad_id: int, rewards: Sequence[float] | None = None,
                  mask_truncated: bool = False) -> dict[str, torch.Tensor]:
    """The trainer's tensors of ``rollouts``, prompt + response right-padded with ``pad_id`` to the longest:

    - ``input_ids`` (B, T), ``attention_mask`` (B, T) (1 on real tokens);
    - ``response_mask`` (B, T): True on the response's tokens;
    - ``loss_mask`` (B, T): ``response_mask``, all False for a truncated response with
      ``mask_truncated`` (DAPO's overlong filtering);
    - ``old_logprobs`` (B, T) float32, aligned with ``input_ids``: ``old_logprobs[b, t]`` is the
      engine's log π(input_ids[b, t] | input_ids[b, :t]) on response tokens, 0 elsewhere (a
      trainer compares it with ``log_softmax(logits[:, :-1]).gather(input_ids[:, 1:])`` at ``[:, 1:]``);
    - ``group_ids``, ``prompt_lengths``, ``response_lengths`` (B,) and ``truncated`` (B,) bool;
      ``rewards`` (B,) float32 when given.
    """
    if not rollouts:
        raise ValueError("no rollouts to batch")
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    B = len(rollouts)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention = torch.zeros(B, width, dtype=torch.long)
    response = torch.zeros(B, width, dtype=torch.bool)
    old = torch.zeros(B, width, dtype=torch.float32)
    for b, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.response_ids)
        input_ids[b, : p + n] = torch.tensor(r.prompt_ids + r.response_ids)
        attention[b, : p + n] = 1
        response[b, p : p + n] = True
        old[b, p : p + n] = torch.tensor(r.logprobs, dtype=torch.float32)
    truncated = torch.tensor([r.truncated for r in rollouts])
    loss = response & ~truncated[:, None] if mask_truncated else response.clone()
    batch = {"input_ids": input_ids, "attention_mask": attention, "response_mask": response, "loss_mask": loss,
             "old_logprobs": old, "group_ids": torch.tensor([r.group for r in rollouts]),
             "prompt_lengths": torch.tensor([len(r.prompt_ids) for r in rollouts]),
             "response_lengths": torch.tensor([len(r.response_ids) for r in rollouts]), "truncated": truncated}
    if rewards is not None:
        if len(rewards) != B:
            raise ValueError(f"{len(rewards)} rewards for {B} rollouts")
        batch["rewards"] = torch.tensor(list(rewards), dtype=torch.float32)
    return batch
