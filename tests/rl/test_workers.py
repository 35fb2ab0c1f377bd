"""The rollout workers' pieces in one process (``lmforge.rl.workers``): a partial rollout that new
weights interrupt continues under them with its tokens tagged by version (the tokens before equal
the old weights' own run), or, discarded, equals a fresh sample under the new weights; the trainer
drops a group past ``max_off_policy_steps``, counts it and sends its prompt again; the threads split."""

from __future__ import annotations

import copy

import pytest
import torch

from lmforge.inference.engine import Engine, GenerationConfig, Request, decoding_view
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.rl.losses import PolicyLossConfig
from lmforge.rl.prompts import Prompt
from lmforge.rl.rollout import RolloutConfig
from lmforge.rl.trainer import GRPOConfig
from lmforge.rl.workers import AsyncRolloutBatches, Job, update_jobs, versions_of, worker_threads
from tests.rl.test_trainer import LengthReward

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: more threads only spin
CFG = GenerationConfig(max_new_tokens=10, stop_token_ids=[], n=2)  # never stops early: 10 tokens a sample
PROMPT = [1, 17, 42, 99, 7]


def models() -> tuple[Transformer, Transformer]:
    torch.manual_seed(0)
    old = Transformer(ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64))
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return old, new


def alone(model: Transformer) -> list:
    """The request's two samples under ``model`` alone, start to end."""
    engine = Engine(model, max_batch=8)
    engine.submit(Request(PROMPT, CFG, torch.Generator().manual_seed(5)))
    return dict(engine.run())[0]


def interrupted(partial: str, after: int):
    """The request decoding ``after`` steps under the old weights, then the new ones loaded in place."""
    old, new = models()
    model = copy.deepcopy(old)
    engine, jobs = Engine(model, max_batch=8), {}

    def submit(task, restarts, version):
        rid = engine.submit(Request(PROMPT, CFG, torch.Generator().manual_seed(5)))
        jobs[rid] = Job(task, rid, restarts, version)

    submit((0, 0, 0), 0, 0)
    finished = []
    with torch.inference_mode():
        for _ in range(after):
            finished += engine.step()
    with torch.no_grad():
        model.load_state_dict(new.state_dict())
    engine.net = decoding_view(model)
    update_jobs(engine, jobs, 1, partial, submit)
    with torch.inference_mode():
        while engine.active:
            finished += engine.step()
    (rid, generations), = finished
    return jobs[rid], generations, alone(old), alone(new)


def test_a_continued_rollout_keeps_the_old_tokens_and_tags_the_new_ones():
    job, generations, old_run, _ = interrupted("continue", after=4)
    for sample, (g, o) in enumerate(zip(generations, old_run)):
        versions = versions_of(job, sample, len(g.tokens))
        # 4 steps chose tokens 0-3; the 5th (index 4) comes from the logits the old weights computed last
        assert versions == [0] * 5 + [1] * 5
        assert g.tokens[:5] == o.tokens[:5] and g.logprobs[:5] == o.logprobs[:5]
        assert g.tokens[5] != o.tokens[5] or g.logprobs[5] != o.logprobs[5]  # drawn from the new weights


def test_a_discarded_rollout_is_sampled_again_under_the_new_weights():
    job, generations, _, new_run = interrupted("discard", after=4)
    assert job.restarts == 1 and job.start_version == 1 and not job.segments
    for sample, (g, n) in enumerate(zip(generations, new_run)):
        assert versions_of(job, sample, len(g.tokens)) == [1] * 10
        assert g.tokens == n.tokens and g.logprobs == n.logprobs


class FakePool:
    """Groups arrive as the test says, with the versions it says; sent tasks are recorded."""

    def __init__(self):
        self.sent, self.arriving = [], []

    def send(self, tasks):
        self.sent += [tuple(t) for t in tasks]

    def receive(self, block=True):
        if self.arriving:
            return self.arriving.pop(0)
        assert not block, "the test gave no more groups"
        return None


def payload(task, version, rewards=(0.0, 1.0)):
    return {"task": list(task), "restarts": 0, "totals": list(rewards), "terms": {"length": list(rewards)},
            "samples": [([3, 4], [-1.0, -1.0], "stop", "x", [version, version]) for _ in rewards]}


def test_a_group_past_the_bound_is_dropped_counted_and_its_prompt_sent_again(small_tokenizer):
    prompts = [Prompt([small_tokenizer.bos_id, 40 + i], f"p:{i}", f"p{i}") for i in range(6)]
    model = models()[0]
    source = AsyncRolloutBatches(model, small_tokenizer, prompts, RolloutConfig(n=2, max_new_tokens=4, seed=0),
                                 GRPOConfig(prompts_per_step=2), PolicyLossConfig(), LengthReward(), 4, spec=None,
                                 workers=1, max_off_policy_steps=1, trainer_threads=1)
    source.pool = pool = FakePool()
    source.figures = {"stale_dropped": 0.0, "partial_restarts": 0.0}
    first = source.state.take(3)  # three prompts already in flight, sampled by versions 0, 2 and 3
    source.in_flight = {t[0]: t for t in first}
    pool.arriving = [payload(first[0], 0), payload(first[1], 2), payload(first[2], 3)]
    groups = source.pull(2, step=3)  # at step 3 version 0 is 3 steps old: past the bound of 1
    assert [g.rollouts[0].group for g in groups] == [first[1][0], first[2][0]]
    assert source.figures["stale_dropped"] == 1
    assert source.resend == [first[0]] and not pool.sent  # the two fresh groups sufficed
    assert source.state_dict()["in_flight"] == [list(first[0])]  # a checkpoint now: sampled again on resume
    source.send(2)  # the next prompts sent: the dropped group's first, the same (group, epoch, index)
    assert pool.sent[0] == first[0] and pool.sent[1][0] == 3 and len(pool.sent) == 2 and not source.resend


@pytest.mark.parametrize("workers, requested, total, expected", [
    (1, 0, 2, (1, 1)), (2, 0, 2, (1, 1)), (1, 0, 8, (4, 4)), (2, 0, 9, (3, 3)), (1, 3, 8, (3, 5)),
])
def test_the_threads_are_split_between_the_trainer_and_the_workers(workers, requested, total, expected):
    assert worker_threads(workers, requested, total) == expected
