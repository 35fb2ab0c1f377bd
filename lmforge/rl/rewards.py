"""Rewards of rollouts: verifiers, a trained reward model, a recipe's own Python function, their
weighted sum, and the length terms.

Components (``reward.components``, each with a ``weight``; the reward is their weighted sum,
and each component's score is kept for logging):

- ``exact_match``: 1 when the response's final answer (``eval.answers.final_answer``) is the prompt's ``field``
  (``answer``) up to whitespace and a trailing period, else 0;
- ``numeric_match``: 1 when the final answer's number equals the field's within ``rel_tol``;
- ``regex``: 1 when ``pattern`` is found in the response (a format reward: anchor it with ``^…$``);
- ``demo_exact_match``: the demo tasks' checker, ``data.sft_demo.exact_match``, on the whole response;
- ``similarity``: partial credit in [0, 1], ``eval.answers.edit_similarity`` of the final answer and
  the field (one minus the Levenshtein distance over the longer length): a dense signal for a
  model whose exact answers are rare, which a binary verifier leaves in zero-variance groups;
- ``reward_model``: the scalar of a model trained by ``lmforge reward`` (``path``) on prompt +
  response laid out as its preference rows were (``data.preference``); its tokenizer must be
  the policy's, checked when it is loaded;
- ``callable``: ``function: "module:function"``, called as ``function(response_text, prompt)``
  (a ``rl.prompts.Prompt``: ``.fields``, ``.prompt``, ``.source``) and returning a number;
  checked importable and callable with two arguments when the recipe is loaded; raising or
  returning anything but a finite number is an error naming the function and the prompt's line.

Then, with ``L`` the response's tokens and ``L_max`` = ``max_new_tokens``:

- ``length_penalty`` c: ``- c * L / L_max``;
- DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), with buffer ``L_cache`` =
  ``overlong_buffer`` > 0: ``0`` for ``L <= L_max - L_cache``, ``((L_max - L_cache) - L) / L_cache``
  inside the buffer, ``-1`` for a response cut at ``L_max`` (it ran past it); times
  ``overlong_penalty``. DAPO's overlong filtering, ``mask_truncated``, gives truncated
  responses no loss (``rl.rollout.rollout_batch``'s ``loss_mask``; ``lmforge rs`` never keeps one).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from lmforge.checkpoints.load import load_reward_model, resolve_checkpoint
from lmforge.core.config import ConfigError, at_least, in_range, load_plugin, option, plugin_field, positive
from lmforge.core.io import InputError
from lmforge.data.chat import tokenize_segments
from lmforge.data.chatml import IM_END
from lmforge.data.sft_demo import exact_match as demo_exact_match
from lmforge.data.tokenizer import Tokenizer
from lmforge.eval.answers import edit_similarity, exact_match, final_answer, numeric_match
from lmforge.rl.rollout import Rollout

Kind = Literal["exact_match", "numeric_match", "regex", "demo_exact_match", "similarity", "reward_model", "callable"]
FIELD_KINDS = ("exact_match", "numeric_match", "demo_exact_match", "similarity")  # the kinds that read a prompt field

# --------------------------------------------------------------------------- configuration


@dataclass
class RewardComponentConfig:
    """One term of the reward (see the module docstring for each kind)."""

    kind: Kind = option(
        "exact_match",
        help="exact_match, numeric_match, regex, demo_exact_match, similarity, "
        "reward_model or callable (`lmforge.rl.rewards`)",
    )
    weight: float = in_range(1.0, help="any finite number")
    name: str | None = option(None, help="how its score is logged; default: the kind")
    field: str = option(
        "answer",
        help="exact_match, numeric_match, demo_exact_match, similarity: the prompt field holding the reference",
    )
    rel_tol: float = at_least(0, 1e-6, help="numeric_match")
    pattern: str | None = option(None, help="regex: found in the response -> 1")
    path: str | None = option(None, help="reward_model: `lmforge reward`'s run directory or final/ checkpoint")
    function: str | None = plugin_field(
        help='callable: "module:function" (a plugin: Python code run as the stage starts), '
        "called as function(response_text, prompt)"
    )
    batch_size: int = positive(16, help="reward_model: rows scored together")

    @property
    def label(self) -> str:
        return self.name or self.kind


@dataclass
class RewardConfig:
    """The ``reward:`` section: the components and the length terms."""

    components: list[RewardComponentConfig] = option(
        default_factory=lambda: [RewardComponentConfig()], help="the reward's terms, summed by weight"
    )
    length_penalty: float = at_least(0, 0.0, help="c in -c * tokens / max_new_tokens")
    overlong_buffer: int = at_least(0, 0, help="DAPO's L_cache; 0 = no soft overlong punishment")
    overlong_penalty: float = at_least(0, 1.0, help="the soft punishment's scale at and past max_new_tokens")
    mask_truncated: bool = option(
        False, help="DAPO's overlong filtering: truncated responses carry no loss / are never kept"
    )

    def required_fields(self) -> list[str]:
        """The prompt fields the components read, which every prompt record must have."""
        return sorted({c.field for c in self.components if c.kind in FIELD_KINDS})

    def check(self) -> None:
        """What each kind needs, before any model is loaded (ConfigError naming the component)."""
        if not self.components:
            raise ConfigError("reward.components is empty: list at least one (e.g. - kind: exact_match)")
        labels = [c.label for c in self.components]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"reward.components have repeated names {labels}: give each a distinct `name`")
        for i, c in enumerate(self.components):
            key = f"reward.components[{i}] ({c.kind})"
            needs = {"regex": "pattern", "reward_model": "path", "callable": "function"}.get(c.kind)
            if needs is not None and getattr(c, needs) is None:
                raise ConfigError(f"{key} needs `{needs}`")
            if c.kind == "regex":
                try:
                    re.compile(c.pattern)
                except re.error as exc:
                    raise ConfigError(f"{key}: pattern {c.pattern!r} is not a regular expression: {exc}") from exc
            if c.kind == "callable":
                load_callable(c.function, key)


def load_callable(spec: str, key: str = "reward") -> Callable:
    """The function ``module:function`` names (``core.config.load_plugin``), checked callable with
    (response_text, prompt)."""
    fn = load_plugin(spec, f"{key}.function", "my_rewards:brevity")
    try:
        inspect.signature(fn).bind("response", None)
    except TypeError as exc:
        raise ConfigError(f"{key}: {spec} must take two arguments (response_text, prompt): {exc}") from exc
    except ValueError:  # a builtin without a signature: found out at its first call
        pass
    return fn


# --------------------------------------------------------------------------- scoring


@dataclass
class Scores:
    """The reward of each rollout and each term of it (component labels, ``length_penalty``, ``overlong``)."""

    total: list[float]
    terms: dict[str, list[float]]


def reward_model_ids(tok: Tokenizer, r: Rollout) -> list[int]:
    """Prompt + response as ``data.preference`` lays out a completion for the reward model: a chat
    prompt's response as an assistant turn (``<|im_end|>\\n`` after it), a plain one with EOS."""
    if r.prompt.conversational:
        ids, _ = tokenize_segments(tok, [(r.text + IM_END + "\n", True)], add_bos=False)
    else:
        ids, _ = tokenize_segments(tok, [(r.text, True)], add_eos=True, add_bos=False)
    return r.prompt.ids + ids


class RewardModelScorer:
    """A reward model from ``lmforge reward``, loaded once; refuses one whose tokenizer is not the policy's."""

    def __init__(self, path: str, tok: Tokenizer, device: torch.device | str, batch_size: int, key: str):
        directory = resolve_checkpoint(path)
        theirs = Tokenizer.load(directory)
        if theirs.sha256 != tok.sha256:
            raise InputError(f"{key}: the reward model {directory} has another tokenizer than the policy "
                             f"(tokenizer.json sha256 {theirs.sha256[:12]} vs {tok.sha256[:12]}): it would read other "
                             f"tokens; train the reward model from the policy's checkpoint")
        self.model = load_reward_model(directory, device=device).eval()
        self.tok, self.batch_size, self.device = tok, batch_size, device

    @torch.no_grad()
    def __call__(self, rollouts: Sequence[Rollout]) -> list[float]:
        out: list[float] = []
        limit = self.model.cfg.max_seq_len
        for start in range(0, len(rollouts), self.batch_size):
            chunk = rollouts[start : start + self.batch_size]
            rows = [reward_model_ids(self.tok, r) for r in chunk]
            for r, ids in zip(chunk, rows):
                if len(ids) > limit:
                    raise InputError(f"{r.prompt.source}: prompt + response take {len(ids)} tokens, more than the "
                                     f"reward model's max_seq_len {limit}; lower rollout.max_new_tokens")
            width = max(map(len, rows))
            ids = torch.full((len(rows), width), self.tok.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, row in enumerate(rows):
                ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
            out += self.model(ids.to(self.device), mask.to(self.device)).float().cpu().tolist()
        return out


def call_reward(fn: Callable, spec: str, r: Rollout) -> float:
    """``fn(text, prompt)`` as a float; raising, or returning a non-number, names the function and the prompt."""
    try:
        value = fn(r.text, r.prompt)
    except Exception as exc:
        raise InputError(f"{r.prompt.source}: the reward function {spec} raised {exc!r}") from exc
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise InputError(f"{r.prompt.source}: the reward function {spec} returned {value!r}, not a finite number")
    return float(value)


def verifier(c: RewardComponentConfig) -> Callable[[Rollout], float]:
    """The per-rollout score of a verifier kind."""
    if c.kind == "exact_match":
        return lambda r: float(exact_match(final_answer(r.text), str(r.prompt.fields[c.field]), strip_answer=True))
    if c.kind == "numeric_match":
        return lambda r: float(numeric_match(final_answer(r.text), r.prompt.fields[c.field], c.rel_tol, abs_tol=c.rel_tol))
    if c.kind == "demo_exact_match":
        return lambda r: float(demo_exact_match(r.text, str(r.prompt.fields[c.field])))
    if c.kind == "similarity":
        return lambda r: edit_similarity(final_answer(r.text), str(r.prompt.fields[c.field]))
    if c.kind == "regex":
        pattern = re.compile(c.pattern, re.DOTALL)
        return lambda r: float(pattern.search(r.text) is not None)
    fn = load_callable(c.function)
    return lambda r: call_reward(fn, c.function, r)


def overlong_punishment(length: int, truncated: bool, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (eq. 13), in [-1, 0]; see the module docstring."""
    if buffer <= 0:
        return 0.0
    if truncated:
        return -1.0
    start = max_new_tokens - buffer
    return 0.0 if length <= start else max(-1.0, (start - length) / buffer)


class Reward:
    """``RewardConfig`` made ready: verifiers built, the reward model loaded (tokenizer checked)."""

    def __init__(self, cfg: RewardConfig, tok: Tokenizer, max_new_tokens: int, device: torch.device | str = "cpu"):
        cfg.check()
        if cfg.overlong_buffer > max_new_tokens:
            raise ConfigError(f"reward.overlong_buffer {cfg.overlong_buffer} exceeds max_new_tokens {max_new_tokens}")
        self.cfg, self.max_new_tokens = cfg, max_new_tokens
        self.scorers: list[tuple[str, float, Callable[[Sequence[Rollout]], list[float]]]] = []
        for i, c in enumerate(cfg.components):
            if c.kind == "reward_model":
                batch = RewardModelScorer(c.path, tok, device, c.batch_size, f"reward.components[{i}]")
            else:
                one = verifier(c)
                batch = lambda rollouts, one=one: [one(r) for r in rollouts]  # noqa: E731
            self.scorers.append((c.label, c.weight, batch))

    def __call__(self, rollouts: Sequence[Rollout]) -> Scores:
        terms = {label: scorer(rollouts) for label, _, scorer in self.scorers}
        total = [sum(w * terms[label][i] for label, w, _ in self.scorers) for i in range(len(rollouts))]
        cfg = self.cfg
        if cfg.length_penalty > 0:
            terms["length_penalty"] = [-cfg.length_penalty * len(r.response_ids) / self.max_new_tokens for r in rollouts]
        if cfg.overlong_buffer > 0:
            terms["overlong"] = [cfg.overlong_penalty * overlong_punishment(
                len(r.response_ids), r.truncated, self.max_new_tokens, cfg.overlong_buffer) for r in rollouts]
        for key in ("length_penalty", "overlong"):
            total = [t + v for t, v in zip(total, terms.get(key, [0.0] * len(total)))]
        return Scores(total, terms)

