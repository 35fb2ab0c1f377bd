"""Multi-token prediction (model.mtp): each depth's targets and document masking, its losses against the
equations written out position by position, and the step runner's λ/D weighting and per-depth metrics."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.data.packing import IGNORE_INDEX
from lmforge.model import families
from lmforge.model.mtp import MTPTargets, check_depth, depth_targets, documents_from_starts, recorded_losses
from lmforge.objectives.clm import CausalLMObjective
from lmforge.train.step import StepRunner

MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
           moe=dict(n_experts=4, n_experts_per_token=2, first_dense_layers=1))


def tiny(family: str = "llama", depth: int = 2, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = families.model_config(dict(family=family, vocab_size=61, d_model=32, n_layers=2, n_heads=2, max_seq_len=48,
                                     mtp=dict(depth=depth), **(MLA if family == "deepseek_v3" else {}), **extra))
    return families.build(cfg).to(torch.float64)


def test_depth_targets_skip_untrained_labels_and_document_boundaries():
    # documents start at token 1 (BOS): positions 0-3 are one document, 4-7 the next
    tokens = torch.tensor([[1, 10, 11, 12, 1, 20, 21, 22]])
    labels = tokens.clone()
    labels[0, 6] = IGNORE_INDEX  # an untrained position
    targets = MTPTargets(tokens, labels, documents_from_starts(tokens, 1))
    assert documents_from_starts(tokens, 1).tolist() == [[1, 1, 1, 1, 2, 2, 2, 2]]
    # depth 1 at position i predicts token i + 2; kept only where i and i + 2 share a document and the label trains
    ignore = IGNORE_INDEX
    assert depth_targets(targets, 1).tolist() == [[11, 12, ignore, ignore, ignore, 22]]
    assert depth_targets(targets, 2).tolist() == [[12, ignore, ignore, ignore, 22]]


def reference_losses(model, tokens: torch.Tensor) -> list[tuple[float, int]]:
    """DeepSeek-V3's equations position by position: h'_i^k = M_k[RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^(k-1))],
    h^k = TRM_k(h'^k) over positions 0 .. L-k-2, P^k_i = OutHead(RMSNorm(h_i^k)), loss -log P^k_i[t_{i+k+1}]."""
    L = tokens.shape[1]
    with torch.no_grad():
        h = model.hidden_states(tokens[:, :-1])
        out = []
        for k, module in enumerate(model.mtp, start=1):
            n = L - k - 1
            joined = torch.stack([module.proj(torch.cat((module.embed_norm(model.embed(tokens[:, i + k])),
                                                          module.hidden_norm(h[:, i])), dim=-1)) for i in range(n)], dim=1)
            cos, sin = model.rope_at(0, n, None)
            rope = (torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1))
            h = module.block(joined, rope)
            total = 0.0
            for i in range(n):
                logp = torch.log_softmax(model.lm_head(module.norm(h[:, i])).double(), dim=-1)
                total -= float(logp.gather(1, tokens[:, i + k + 1, None]).sum())
            out.append((total, tokens.shape[0] * n))
    return out


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_recorded_losses_equal_the_equations(family):
    model = tiny(family).train()  # no dropout: the config's defaults are 0
    tokens = torch.randint(2, 61, (2, 13))
    model(tokens[:, :-1], mtp=MTPTargets(tokens, tokens, torch.zeros_like(tokens)))
    got = [(float(s.detach()), int(c)) for s, c in recorded_losses(model)]
    want = reference_losses(model, tokens)
    assert [c for _, c in got] == [c for _, c in want] == [2 * 11, 2 * 10]
    for (a, _), (b, _) in zip(got, want):
        # the loss takes its log-softmax in float32, as the main loss does: ~1e-7 relative on a sum of ~20 terms
        assert a == pytest.approx(b, rel=1e-6)


def test_evaluation_and_no_grad_record_nothing():
    model = tiny()
    tokens = torch.randint(2, 61, (1, 9))
    targets = MTPTargets(tokens, tokens, torch.zeros_like(tokens))
    model.eval()
    model(tokens[:, :-1], mtp=targets)
    assert recorded_losses(model) == []
    model.train()
    with torch.no_grad():
        model(tokens[:, :-1], mtp=targets)
    assert recorded_losses(model) == []


def test_step_adds_weighted_depth_losses_and_logs_each_depth():
    model = tiny(depth=2)
    model.mtp.loss_weight = 0.3
    windows = [torch.randint(2, 61, (2, 11)), torch.randint(2, 61, (3, 11))]  # two micro-batches of 11-token windows
    objective = CausalLMObjective(document_start=1)
    runner = StepRunner(model, objective, torch.optim.SGD(model.parameters(), lr=0.0), "fp32", grad_clip=0.0)
    runner.model.train()
    loss, n_targets, metrics, _ = runner.backward(windows)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert n_targets == 5 * 10

    # the same objective written out: main CE over all targets + λ/D Σ_k (depth k's summed CE) / targets
    model.zero_grad()
    total, sums, counts = 0.0, [0.0, 0.0], [0, 0]
    for w in windows:
        model(w[:, :-1], mtp=MTPTargets(w, w, documents_from_starts(w, 1)))
        main = F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        depths = recorded_losses(model)
        total = total + main / n_targets + 0.3 / 2 * sum(s for s, _ in depths) / n_targets
        for k, (s, c) in enumerate(depths):
            sums[k] += float(s.detach())
            counts[k] += int(c)
    total.backward()
    for n, p in model.named_parameters():
        # the runner's cross-entropies run in float32 (causal_lm_loss, multi_token_loss): ~1e-7 relative
        assert torch.allclose(got[n], p.grad, rtol=1e-6, atol=1e-8), n
    with torch.no_grad():
        main = sum(F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten(), reduction="sum") for w in windows)
    assert float(loss) == pytest.approx(float(main) / n_targets)
    for k in (1, 2):
        assert float(metrics[f"mtp/depth{k}"]) / n_targets == pytest.approx(sums[k - 1] / counts[k - 1], rel=1e-6)
    assert counts == [5 * 9, 5 * 8]
    # at initialisation each depth's loss is near ln V
    assert abs(sums[0] / counts[0] - math.log(61)) < 0.5


def test_a_depth_with_no_target_in_the_window_is_refused():
    assert check_depth(0, 4) is None and check_depth(3, 4) is None
    assert "model.mtp.depth = 4" in check_depth(4, 4) and "data.seq_len = 4" in check_depth(4, 4)


def test_mtp_parameters_are_initialised_and_counted_in_the_state_dict():
    model = tiny(depth=1)
    names = [n for n in model.state_dict() if n.startswith("mtp.")]
    assert "mtp.0.proj.weight" in names and "mtp.0.block.attn.wq.weight" in names and "mtp.0.norm.weight" in names
    # hidden matrices as the blocks' (init_std), the residual projections scaled by 1/sqrt(2·layers)
    assert float(model.mtp[0].proj.weight.detach().std()) == pytest.approx(0.02, rel=0.1)
    assert float(model.mtp[0].block.attn.wo.weight.detach().std()) == pytest.approx(0.02 / 2, rel=0.15)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_parameter_counts_and_the_planner_hold_the_mtp_modules(family):
    from lmforge.distributed.config import ParallelConfig
    from lmforge.distributed.memory import plan_memory
    from lmforge.distributed.mesh import Layout

    model = tiny(family, depth=2)
    plain = tiny(family, depth=0)
    assert model.cfg.num_params() == sum(p.numel() for p in model.parameters())  # tied nothing: every tensor once
    assert model.cfg.num_params() - plain.cfg.num_params() == sum(p.numel() for p in model.mtp.parameters())
    # training FLOPs: each depth's block, projection and another pass of the head, 6 per weight, and its attention
    extra = model.cfg.flops_per_token(16) - plain.cfg.flops_per_token(16)
    per_depth = model.cfg.mtp_counts().matmul
    assert extra > 6 * 2 * per_depth and per_depth > 61 * 32  # the head's V·d is in each depth's matmuls
    args = dict(parallel=ParallelConfig(), layout=Layout(), micro_batch_size=2, seq_len=16, precision="fp32",
                activation_checkpointing=False)
    with_mtp, without = plan_memory(model.cfg, **args), plan_memory(plain.cfg, **args)
    assert with_mtp.params_on_device - without.params_on_device == model.cfg.num_params() - plain.cfg.num_params()
    assert with_mtp.activations > without.activations and with_mtp.detail["layers"] == 4
