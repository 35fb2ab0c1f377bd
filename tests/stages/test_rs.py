"""`lmforge rs`: best-of-K by a reward into SFT data or preference pairs that `lmforge sft` and
`lmforge dpo` read (in a lifecycle), deterministic selection, counts of what was dropped and
why, resuming without sampling scored prompts again, and bad input refused before sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import lmforge.stages.rs as rs
from lmforge.core.config import ConfigError, load_config
from lmforge.core.io import InputError
from lmforge.data.chat import read_sft_examples
from lmforge.data.preference import read_preference_pairs
from lmforge.data.sft_demo import make_examples
from lmforge.stages import VERBS_BY_NAME
from lmforge.stages.lifecycle import LifecycleRecipe, run_lifecycle
from lmforge.stages.rs import RSRecipe, run_rs, select
from tests.conftest import REPO, write_jsonl

# a random model's responses differ in length, so a length penalty ranks them; \S refuses blank ones
REWARD = ["reward.components=[{kind: regex, pattern: '\\S'}]", "reward.length_penalty=1.0"]
# pairs need a group whose best and worst differ: about a third of a random model's responses hold an
# "e" (a length alone rarely differs: a response stops early at about 3% of samples of 8 tokens)
PAIRS = ["output=pairs", "reward.components=[{kind: regex, pattern: e}]"]


@pytest.fixture()
def prompts(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", make_examples(6, seed=2))


def recipe(tmp_path, base, prompts, *overrides) -> RSRecipe:
    return load_config(RSRecipe, None, [f"run_dir={tmp_path / 'rs'}", f"checkpoint={base}",
                                        f"data.prompts=[{prompts}]", "rollout.n=4", "rollout.max_new_tokens=8",
                                        "prompts_per_chunk=2", "device=cpu", *REWARD, *overrides])


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_best_of_k_becomes_sft_data_that_sft_reads(tmp_path, base_checkpoint, prompts, small_tokenizer):
    summary = run_rs(recipe(tmp_path, base_checkpoint, prompts))
    records = lines(tmp_path / "rs" / "sft.jsonl")
    assert summary["prompts"] == 6 and summary["kept"] == len(records) == 6 and summary["dropped"] == {}
    source = make_examples(6, seed=2)
    for record, example in zip(records, source):
        assert record["messages"][:-1] == example["messages"][:-1] and record["messages"][-1]["role"] == "assistant"
        assert record["answer"] == example["answer"] and record["task"] == example["task"]
    chunk = json.loads((tmp_path / "rs" / "chunks" / "chunk-00000.json").read_text())
    group = chunk["groups"][0]
    best = max(group["samples"], key=lambda s: (s["reward"], -s["tokens"], -s["sample"]))
    assert records[0]["messages"][-1]["content"] == best["text"] and records[0]["rs"]["reward"] == best["reward"]
    assert set(best["terms"]) == {"regex", "length_penalty"}
    examples = list(read_sft_examples([str(tmp_path / "rs" / "sft.jsonl")], small_tokenizer, 256))
    assert len(examples) == 6 and all(any(label != -100 for label in e.labels) for e in examples)


def test_best_against_worst_becomes_pairs_that_dpo_reads(tmp_path, base_checkpoint, prompts, small_tokenizer):
    summary = run_rs(recipe(tmp_path, base_checkpoint, prompts, *PAIRS))
    records = lines(tmp_path / "rs" / "pairs.jsonl")
    assert summary["kept"] == len(records) and summary["kept"] + sum(summary["dropped"].values()) == 6
    assert records and all(r["rs"]["reward"] > r["rs"]["rejected_reward"] for r in records)
    pairs = read_preference_pairs([str(tmp_path / "rs" / "pairs.jsonl")], small_tokenizer, 128)
    assert len(pairs) == len(records)


def sample(i, reward, tokens=3, text=None, finish="stop"):
    return {"sample": i, "reward": reward, "tokens": tokens, "text": text or f"t{i}", "finish_reason": finish}


def group(*samples):
    return {"source": "p:1", "prompt": "q", "fields": {"answer": "a"}, "samples": list(samples)}


def rules(*overrides) -> RSRecipe:
    return load_config(RSRecipe, None, ["data.prompts=[x]", *overrides])


def test_ties_go_to_the_shorter_then_the_first_sampled_and_the_worst_to_the_longer():
    g = group(sample(0, 1.0, 5), sample(1, 1.0, 2), sample(2, 1.0, 2), sample(3, 0.0, 4), sample(4, 0.0, 6))
    record, why = select(g, rules("output=pairs"))
    assert why == "kept" and (record["chosen"], record["rejected"]) == ("t1", "t4")
    assert record["prompt"] == "q" and record["answer"] == "a"
    assert select(g, rules())[0] == {"answer": "a", "prompt": "q", "completion": "t1",
                                     "rs": {"source": "p:1", "reward": 1.0, "sample": 1}}


def test_dropped_prompts_say_why():
    assert select(group(sample(0, 0.2), sample(1, 0.4)), rules("threshold=0.5"))[1] == "below_threshold"
    assert select(group(sample(0, 0.5), sample(1, 0.5)), rules("output=pairs"))[1] == "no_margin"
    assert select(group(sample(0, 0.5), sample(1, 0.4)), rules("output=pairs", "min_margin=0.2"))[1] == "no_margin"
    assert select(group(sample(0, 0.5, text="x"), sample(1, 0.4, text="x")), rules("output=pairs"))[1] == "identical_texts"
    assert select(group(sample(0, 0.5, text=" ")), rules())[1] == "no_candidate"
    cut = group(sample(0, 0.9, finish="length"), sample(1, 0.1))
    assert select(cut, rules("reward.mask_truncated=true"))[0]["completion"] == "t1"
    assert select(cut, rules())[0]["completion"] == "t0"


def test_an_interrupted_run_resumes_without_sampling_scored_prompts_again(tmp_path, base_checkpoint, prompts,
                                                                         monkeypatch):
    whole = run_rs(recipe(tmp_path / "a", base_checkpoint, prompts))
    sampled = []
    real_sample, real_write = rs.sample_rollouts, rs.atomic_write_json

    def counting(model, tok, ps, cfg, state, k):
        sampled.append((state.cursor, k))
        return real_sample(model, tok, ps, cfg, state, k)

    def killed_at_second_chunk(path, obj):
        if path.name == "chunk-00001.json":
            raise KeyboardInterrupt
        real_write(path, obj)

    monkeypatch.setattr(rs, "sample_rollouts", counting)
    monkeypatch.setattr(rs, "atomic_write_json", killed_at_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        run_rs(recipe(tmp_path / "b", base_checkpoint, prompts))
    monkeypatch.setattr(rs, "atomic_write_json", real_write)
    sampled.clear()
    again = run_rs(recipe(tmp_path / "b", base_checkpoint, prompts))
    assert sampled == [(2, 2), (4, 2)]  # the first chunk's two prompts were not sampled again
    assert (tmp_path / "b" / "rs" / "sft.jsonl").read_text() == (tmp_path / "a" / "rs" / "sft.jsonl").read_text()
    assert again["kept"] == whole["kept"]
    sampled.clear()
    reselected = run_rs(recipe(tmp_path / "b", base_checkpoint, prompts, "output=pairs", "threshold=-0.5"))
    assert sampled == [] and reselected["format"] == "pairs"  # selection alone changed: nothing sampled
    with pytest.raises(InputError, match="chunk-00000.json: written by rs with another checkpoint, prompts, rollout"):
        run_rs(recipe(tmp_path / "b", base_checkpoint, prompts, "rollout.n=3"))


def no_sampling(*args, **kwargs):
    raise AssertionError("sampled before the bad input was found")


def test_bad_input_is_refused_before_any_sampling(tmp_path, base_checkpoint, prompts, monkeypatch):
    monkeypatch.setattr(rs, "sample_rollouts", no_sampling)
    with pytest.raises(ConfigError, match="output: pairs needs at least two samples per prompt.*rollout.n is 1"):
        run_rs(recipe(tmp_path, base_checkpoint, prompts, "output=pairs", "rollout.n=1"))
    lacking = write_jsonl(tmp_path / "lacking.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"},
                                                       {"prompt": "What is 2 + 2?"}])
    with pytest.raises(InputError, match=r"lacking\.jsonl:2: the reward needs field\(s\) \['answer'\]"):
        run_rs(recipe(tmp_path, base_checkpoint, lacking, "reward.components=[{kind: numeric_match}]"))
    with pytest.raises(ConfigError, match="data.prompts is empty"):
        run_rs(load_config(RSRecipe, None, [f"run_dir={tmp_path / 'x'}"]))


def test_a_reward_callable_that_raises_names_itself_and_the_prompt_line(tmp_path, base_checkpoint, prompts,
                                                                       monkeypatch):
    (tmp_path / "bad_rewards.py").write_text("def judge(text, prompt):\n    raise ValueError('cannot judge')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(InputError, match=r"prompts\.jsonl:1: the reward function bad_rewards:judge raised "
                                         r"ValueError\('cannot judge'\)"):
        run_rs(recipe(tmp_path, base_checkpoint, prompts, "reward.components=[{kind: callable, "
                                                          "function: 'bad_rewards:judge'}]", "reward.length_penalty=0"))


def test_a_lifecycle_runs_rs_then_sft_and_rs_pairs_then_dpo(tmp_path, base_checkpoint, prompts):
    train = ["train.max_steps=1", "train.warmup_steps=0", "train.micro_batch_size=2", "train.precision=fp32",
             "train.eval_every=1", "train.tensorboard=false", "train.device=cpu", "data.max_length=96"]
    common = [f"checkpoint={base_checkpoint}", f"data.prompts=[{prompts}]", "rollout.n=4", "rollout.max_new_tokens=8",
              "device=cpu", *REWARD]
    stages = [
        {"name": "rs", "verb": "rs", "overrides": [f"run_dir={tmp_path / 'rs'}", *common]},
        {"name": "sft", "verb": "sft", "overrides": [f"run_dir={tmp_path / 'sft'}", f"checkpoint={base_checkpoint}",
                                                     f"data.train=[{tmp_path / 'rs' / 'sft.jsonl'}]", *train]},
        {"name": "rs_pairs", "verb": "rs", "overrides": [f"run_dir={tmp_path / 'rs-pairs'}", *common, *PAIRS]},
        {"name": "dpo", "verb": "dpo", "overrides": [f"run_dir={tmp_path / 'dpo'}", f"checkpoint={base_checkpoint}",
                                                     f"data.train=[{tmp_path / 'rs-pairs' / 'pairs.jsonl'}]", *train]},
    ]
    life = tmp_path / "life.yaml"
    life.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "stages": stages}))
    results = run_lifecycle(load_config(LifecycleRecipe, life))
    assert [r["status"] for r in results] == ["ran"] * 4
    assert results[1]["result"]["train_examples"] == 6 and results[1]["result"]["step"] == 1
    assert results[3]["result"]["train_examples"] == results[2]["result"]["kept"] > 0
    report = (tmp_path / "run" / "report.md").read_text()
    assert "6 prompts x 4 samples: **6 kept**" in report


def test_the_demo_recipe_and_its_lifecycle_stages_load():
    path = REPO / "recipes" / "demo" / "rs.yaml"
    assert load_config(RSRecipe, path).reward.components[0].kind == "demo_exact_match"
    text = path.read_text().split("# lifecycle:\n", 1)[1]
    block = "\n".join(line[2:] for line in text.splitlines() if line.startswith("#   "))
    stages = yaml.safe_load(block)
    assert [s["verb"] for s in stages] == ["rs", "sft", "rs", "dpo"]
    configs = [load_config(VERBS_BY_NAME[s["verb"]].load().RECIPE, REPO / s["recipe"], s.get("overrides", []))
               for s in stages]
    assert configs[1].data.train == [str(Path(configs[0].run_dir) / "sft.jsonl")]
    assert configs[3].data.train == [str(Path(configs[2].run_dir) / "pairs.jsonl")] and configs[2].output == "pairs"
