"""lm-evaluation-harness's `local-completions` model through the server: its log-likelihoods
(echo + logprobs, token-id prompts) and its greedy generations equal what the model computes
in process, on local JSONL tasks."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.checkpoints.load import load_model
from lmforge.data.tokenizer import Tokenizer
from lmforge.inference.engine import GenerationConfig, generate
from tests.conftest import write_jsonl
from tests.serve.conftest import MODEL_NAME

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tenacity", reason="lm_eval's API models need tenacity (the dev extra installs it)")

QUESTIONS = [
    {"question": "Who is the king of Denmark?", "choices": [" Claudius", " Hamlet", " Horatio"], "answer": 0},
    {"question": "To be, or not to be: that is", "choices": [" the question", " an answer"], "answer": 0},
    {"question": "Now is the winter of our", "choices": [" discontent", " summer", " spring"], "answer": 0},
]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A multiple-choice (log-likelihood) and a generate-until task over local JSONL files."""
    root = tmp_path_factory.mktemp("tasks")
    data = write_jsonl(root / "questions.jsonl", QUESTIONS)
    common = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
              "doc_to_text": "{{question}}"}
    (root / "mc.yaml").write_text(json.dumps({
        **common, "task": "lmforge_serve_mc", "output_type": "multiple_choice", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]}))
    (root / "gen.yaml").write_text(json.dumps({
        **common, "task": "lmforge_serve_gen", "output_type": "generate_until", "doc_to_target": "{{choices[0]}}",
        "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": 10, "do_sample": False, "temperature": 0},
        "metric_list": [{"metric": "exact_match"}]}))
    return root


def evaluate(server, checkpoint, tasks, task: str, backend: str, **extra) -> list[dict]:
    from lm_eval.tasks import TaskManager

    model_args = {"base_url": server[0].url + "/v1/completions", "model": MODEL_NAME, "tokenizer_backend": backend,
                  "max_length": 1024, "num_concurrent": 1, "max_retries": 1, **extra}
    if backend == "huggingface":
        model_args["tokenizer"] = str(checkpoint)
    out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=[task],
                                  task_manager=TaskManager(include_path=str(tasks), include_defaults=False), log_samples=True,
                                  bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    return out["samples"][task]


def pair_tokens(hf_tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm_eval's `_encode_pair`: trailing spaces move to the continuation, the whole is encoded
    and the context's tokens split off."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = hf_tok(context + continuation, add_special_tokens=False).input_ids
    ctx = hf_tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_loglikelihoods_through_the_server_equal_the_models(server, checkpoint, tasks, backend):
    samples = evaluate(server, checkpoint, tasks, "lmforge_serve_mc", backend)
    model, _ = load_model(str(checkpoint), device="cpu")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    assert len(samples) == len(QUESTIONS)
    for sample in samples:
        for (context, continuation), (ll, greedy) in zip(sample["arguments"], [r[0] for r in sample["resps"]]):
            ctx, cont = pair_tokens(hf_tok, context, continuation)
            with torch.no_grad():
                logits = model(torch.tensor([ctx + cont]))[0].float()
            logprobs = torch.log_softmax(logits[len(ctx) - 1 : -1], -1)
            expected = logprobs.gather(1, torch.tensor(cont)[:, None]).sum().item()
            assert ll == pytest.approx(expected, abs=1e-4)
            assert greedy == bool((logprobs.argmax(-1) == torch.tensor(cont)).all())


@pytest.mark.parametrize("backend", ["huggingface", "none"])
def test_generate_until_through_the_server_equals_the_engines_greedy_text(server, checkpoint, tasks, backend):
    samples = evaluate(server, checkpoint, tasks, "lmforge_serve_gen", backend)
    model, _ = load_model(str(checkpoint), device="cpu")
    tok = Tokenizer.load(checkpoint)
    for sample in samples:
        context = sample["arguments"][0][0]
        # token prompts from the huggingface backend carry no BOS; a text prompt gets one from the server
        prompt = tok.encode(context) if backend == "huggingface" else [tok.bos_id, *tok.encode(context)]
        stops = ["\n\n"] + ([tok.config["eos_token"]] if backend == "huggingface" else [])
        (expected,) = generate(model, [prompt], GenerationConfig(max_new_tokens=10, temperature=0.0, stop=stops), tok)
        assert sample["resps"][0][0] == expected.text


def test_the_server_and_the_in_process_adapter_give_the_same_numbers(server, checkpoint, tasks):
    """The same tasks through `local-completions` and through `lmforge.eval.harness`'s in-process
    model: every log-likelihood to 1e-4 and every greedy generation equal. The harness's API
    models send contexts without BOS (their default `add_bos_token=False`, and the remote
    tokenizer asks for no special tokens), so the adapter is asked for the same."""
    from lm_eval.tasks import TaskManager

    from lmforge.eval.harness import LMForgeLM

    adapter = LMForgeLM(checkpoint=str(checkpoint), device="cpu", batch_size=4, add_bos_token=False)
    for task in ("lmforge_serve_mc", "lmforge_serve_gen"):
        served = evaluate(server, checkpoint, tasks, task, "remote")
        local = lm_eval.simple_evaluate(model=adapter, tasks=[task], log_samples=True, bootstrap_iters=0,
                                        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                                        random_seed=0, numpy_random_seed=0, torch_random_seed=0)["samples"][task]
        assert len(served) == len(local) == len(QUESTIONS)
        for a, b in zip(sorted(served, key=lambda s: s["doc_id"]), sorted(local, key=lambda s: s["doc_id"])):
            assert a["arguments"] == b["arguments"]
            if task.endswith("mc"):
                for (ll_a, greedy_a), (ll_b, greedy_b) in zip([r[0] for r in a["resps"]], [r[0] for r in b["resps"]]):
                    assert ll_a == pytest.approx(ll_b, abs=1e-4) and greedy_a == greedy_b
            else:
                assert a["resps"][0][0] == b["resps"][0][0]
