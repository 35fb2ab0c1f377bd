"""The routed FFN (``lmforge.model.moe``) against transformers' Mixtral, Qwen3-MoE and DeepSeek-V3 MoE blocks
(the numeric reference for routing order and weight normalisation), its balancing losses against their
equations and transformers' ``load_balancing_loss_func``, capacity, the selection bias and the load tracker."""

from __future__ import annotations

import pytest
import torch

from lmforge.model.moe import (
    LoadTracker,
    MoE,
    MoEConfig,
    Router,
    aux_losses,
    clear,
    load_balance_loss,
    router_z_loss,
    sequence_balance_loss,
)

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek  # noqa: E402
from transformers.models.mixtral import modeling_mixtral as mixtral  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe  # noqa: E402

D, F_HIDDEN = 16, 24
# float32 over a 16- and 24-term dot product and k <= 4 weighted sums: differences of order 1e-7 at outputs of order 1
ATOL = 1e-5


def random_moe(cfg: MoEConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(D, cfg, layer=3)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    return moe


def load_experts(theirs: torch.nn.Module, moe: MoE) -> None:
    """Our stacked experts into transformers 5's: gate_up_proj = [w1; w3] per expert, down_proj = w2."""
    with torch.no_grad():
        theirs.gate_up_proj.copy_(torch.cat((moe.experts.w1, moe.experts.w3), dim=1))
        theirs.down_proj.copy_(moe.experts.w2)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mixtral_routing_equals_transformers_sparse_moe_block(k):
    moe = random_moe(MoEConfig(n_experts=6, n_experts_per_token=k, expert_ffn_hidden=F_HIDDEN))
    hf_cfg = transformers.MixtralConfig(hidden_size=D, intermediate_size=F_HIDDEN, num_local_experts=6,
                                        num_experts_per_tok=k)
    theirs = mixtral.MixtralSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(moe.router.weight)
    load_experts(theirs.experts, moe)
    x = torch.randn(3, 7, D)
    with torch.no_grad():
        torch.testing.assert_close(moe.eval()(x), theirs(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_routing_equals_transformers_sparse_moe_block(norm_topk_prob):
    moe = random_moe(MoEConfig(n_experts=8, n_experts_per_token=2, expert_ffn_hidden=F_HIDDEN, norm_topk_prob=norm_topk_prob))
    hf_cfg = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F_HIDDEN, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    theirs = qwen3_moe.Qwen3MoeSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(moe.router.weight)
    load_experts(theirs.experts, moe)
    x = torch.randn(2, 9, D)
    with torch.no_grad():
        torch.testing.assert_close(moe.eval()(x), theirs(x), atol=ATOL, rtol=0)


def test_deepseek_v3_sigmoid_group_limited_routing_with_shared_experts_and_bias_equals_transformers():
    cfg = MoEConfig(n_experts=8, n_experts_per_token=3, expert_ffn_hidden=F_HIDDEN, scores="sigmoid", n_group=4,
                    topk_group=2, routed_scaling_factor=2.5, n_shared_experts=2, selection_bias=True)
    moe = random_moe(cfg)
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.randn(8) * 0.5)  # large enough to change choices
    hf_cfg = transformers.DeepseekV3Config(hidden_size=D, moe_intermediate_size=F_HIDDEN, n_routed_experts=8,
                                           num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                           n_shared_experts=2, norm_topk_prob=True)
    theirs = deepseek.DeepseekV3MoE(hf_cfg).eval()
    with torch.no_grad():
        theirs.gate.weight.copy_(moe.router.weight)
        theirs.gate.e_score_correction_bias.copy_(moe.router.expert_bias)
        for ours, name in ((moe.shared.w1, "gate_proj"), (moe.shared.w3, "up_proj"), (moe.shared.w2, "down_proj")):
            getattr(theirs.shared_experts, name).weight.copy_(ours.weight)
    load_experts(theirs.experts, moe)
    x = torch.randn(2, 9, D)
    with torch.no_grad():
        torch.testing.assert_close(moe.eval()(x), theirs(x), atol=ATOL, rtol=0)


def test_the_selection_bias_changes_which_experts_but_not_their_weights():
    cfg = MoEConfig(n_experts=4, n_experts_per_token=1, scores="sigmoid", norm_topk_prob=False, selection_bias=True)
    router = Router(D, cfg)
    torch.nn.init.normal_(router.weight, 0.0, 0.3)
    x = torch.randn(20, D)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))  # expert 2 always chosen
        routing = router(x)
    assert (routing.experts == 2).all()
    torch.testing.assert_close(routing.weights[:, 0], torch.sigmoid(x @ router.weight.T)[:, 2])  # unbiased


def test_group_limited_routing_keeps_each_tokens_experts_in_its_best_groups():
    cfg = MoEConfig(n_experts=8, n_experts_per_token=2, scores="sigmoid", n_group=4, topk_group=1)
    router = Router(D, cfg)
    torch.nn.init.normal_(router.weight, 0.0, 1.0)
    routing = router(torch.randn(50, D))
    groups = routing.experts // 2
    assert (groups[:, 0] == groups[:, 1]).all()  # one group: both experts in it
    best = routing.scores.view(50, 4, 2).sum(-1).argmax(-1)  # with 2 experts a group, its top-2 sum is its sum
    assert torch.equal(groups[:, 0], best)


def test_load_balance_loss_is_transformers_load_balancing_loss_func():
    cfg = MoEConfig(n_experts=6, n_experts_per_token=2)
    router = Router(D, cfg)
    torch.nn.init.normal_(router.weight, 0.0, 0.5)
    routing = router(torch.randn(40, D))
    theirs = mixtral.load_balancing_loss_func((routing.logits,), num_experts=6, top_k=2)
    torch.testing.assert_close(load_balance_loss(routing, 6), theirs, atol=1e-6, rtol=0)


def test_balance_losses_are_their_equations_and_minimal_when_balanced():
    cfg = MoEConfig(n_experts=4, n_experts_per_token=1, scores="sigmoid")
    router = Router(D, cfg)
    torch.nn.init.normal_(router.weight, 0.0, 0.5)
    x = torch.randn(2 * 6, D)
    routing = router(x)
    # the sequence-wise loss by its equation, sequence by sequence, with plain loops
    total = 0.0
    for s in range(2):
        experts, scores = routing.experts[6 * s: 6 * s + 6], routing.scores[6 * s: 6 * s + 6]
        f = [4 / (1 * 6) * sum(int(i in row) for row in experts.tolist()) for i in range(4)]
        normed = scores / scores.sum(-1, keepdim=True)
        total += sum(f[i] * float(normed[:, i].mean().detach()) for i in range(4))
    assert float(sequence_balance_loss(routing, 4, 2).detach()) == pytest.approx(total / 2, abs=1e-6)
    assert float(router_z_loss(routing.logits).detach()) == pytest.approx(
        float((torch.logsumexp(routing.logits, -1) ** 2).mean().detach()), abs=1e-6)
    # uniform routing: Switch's loss is k, DeepSeek's 1
    from lmforge.model.moe import Routing
    experts = torch.arange(8).remainder(4)[:, None]
    uniform = Routing(experts, torch.ones(8, 1), torch.zeros(8, 4), torch.full((8, 4), 0.25))
    assert float(load_balance_loss(uniform, 4)) == pytest.approx(1.0)
    assert float(sequence_balance_loss(uniform, 4, 2)) == pytest.approx(1.0)


def test_capacity_drops_the_assignments_past_an_experts_capacity_and_counts_them():
    cfg = MoEConfig(n_experts=2, n_experts_per_token=1, expert_ffn_hidden=F_HIDDEN, capacity_factor=1.0,
                    selection_bias=True)
    moe = random_moe(cfg).train()
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([10.0, 0.0]))  # every token to expert 0
    x = torch.randn(1, 8, D, requires_grad=True)
    y = moe(x)
    assert int(moe.last_dropped) == 4 and moe.last_load.tolist() == [8, 0]  # capacity ceil(1 * 8 / 2) = 4
    assert (y[0, 4:] == 0).all() and (y[0, :4] != 0).all()  # the first four tokens kept, in order
    dropless = MoE(D, MoEConfig(n_experts=2, n_experts_per_token=1, expert_ffn_hidden=F_HIDDEN, selection_bias=True))
    dropless.load_state_dict(moe.state_dict())
    torch.testing.assert_close(dropless(x)[0, :4], y[0, :4])


def test_a_training_forward_records_losses_and_load_and_evaluation_records_nothing():
    cfg = MoEConfig(n_experts=4, n_experts_per_token=2, expert_ffn_hidden=F_HIDDEN, aux_loss_coef=0.01,
                    seq_aux_loss_coef=0.001, z_loss_coef=0.001)
    moe = random_moe(cfg)
    x = torch.randn(2, 5, D)
    moe.eval()(x)
    assert moe.aux_losses == {} and moe.last_load is None
    moe.train()
    with torch.no_grad():
        moe(x)
    assert moe.aux_losses == {} and moe.last_load is None  # no gradients: a reference model's forward
    moe(x)
    assert set(moe.aux_losses) == {"load_balance", "seq_balance", "z_loss"}
    assert int(moe.last_load.sum()) == 2 * 5 * 2
    losses = aux_losses(moe)
    assert all(v.requires_grad for v in losses.values())
    sum(losses.values()).backward()
    assert moe.router.weight.grad.abs().sum() > 0
    clear(moe)
    assert moe.aux_losses == {} and moe.last_load is None


def test_the_tracker_nudges_the_bias_by_the_sign_of_the_load_gap_and_reports_the_step():
    cfg = MoEConfig(n_experts=4, n_experts_per_token=1, expert_ffn_hidden=F_HIDDEN, bias_update_rate=0.01)
    moe = random_moe(cfg).train()
    tracker = LoadTracker(moe)
    loads = []
    for _ in range(2):  # two micro-batches, summed
        moe(torch.randn(1, 6, D))
        loads.append(moe.last_load.clone())
        tracker.add()
    tracker.finish_step()
    load = (loads[0] + loads[1]).float()
    torch.testing.assert_close(moe.router.expert_bias, 0.01 * torch.sign(load.mean() - load))
    metrics = tracker.metrics()
    share = load / load.sum()
    assert metrics["moe/layer3/load_max"] == pytest.approx(float(share.max()))
    assert metrics["moe/layer3/load_min"] == pytest.approx(float(share.min()))
    assert metrics["moe/layer3/dropped"] == 0
    nonzero = share[share > 0]
    assert metrics["moe/layer3/entropy"] == pytest.approx(float(-(nonzero * nonzero.log()).sum()), abs=1e-6)
    assert "router.expert_bias" in moe.state_dict()  # saved and resumed with the checkpoint


def test_bias_balancing_evens_out_a_skewed_router():
    """Auxiliary-loss-free balancing alone (no gradient step) moves a router that sends most tokens to one
    expert towards even load."""
    cfg = MoEConfig(n_experts=4, n_experts_per_token=1, expert_ffn_hidden=F_HIDDEN, scores="sigmoid",
                    bias_update_rate=0.05)
    moe = random_moe(cfg).train()
    with torch.no_grad():
        moe.router.weight[0] += 1.0  # expert 0 scores high for every token below
    tracker = LoadTracker(moe)
    x = torch.randn(4, 16, D) + 2.0
    entropies = []
    for _ in range(40):
        moe(x)
        tracker.add()
        tracker.finish_step()
        entropies.append(tracker.metrics()["moe/layer3/entropy"])
    assert entropies[0] < 1.0 < entropies[-1]  # ln 4 = 1.386 when even


@pytest.mark.parametrize("fields, named", [
    (dict(n_experts=4, n_experts_per_token=5), "model.moe.n_experts_per_token = 5 must be at most model.moe.n_experts = 4"),
    (dict(capacity_factor=0.0), "'model.moe.capacity_factor' = 0: must be > 0"),
    (dict(n_experts=8, n_group=3), "model.moe.n_experts = 8 must be a multiple of model.moe.n_group = 3"),
    (dict(n_experts=8, n_group=2, topk_group=3), "model.moe.topk_group = 3 must be at most model.moe.n_group = 2"),
])
def test_a_bad_moe_config_is_one_line_naming_the_key(fields, named):
    with pytest.raises(ValueError) as info:
        MoEConfig(**fields)
    assert named in str(info.value) and "\n" not in str(info.value)


@torch.no_grad()
def test_the_grouped_matmul_path_computes_the_loop_of_matmuls():
    """``Experts.grouped`` (``torch._grouped_mm``, the GPU path) against ``Experts.looped`` on the same sorted
    tokens, an expert left without any; run here on the CPU kernel, which has bf16 (forward and backward).
    Both round the hidden activations and the output to bf16 once each from float32 sums in different orders:
    within 3 bf16 roundings (eps 2^-8) of the output's scale."""
    from lmforge.model.moe import Experts

    torch.manual_seed(0)
    experts = Experts(16, 32, 4).bfloat16()
    for p in experts.parameters():
        p.normal_(0.0, 0.3)
    counts = torch.tensor([5, 0, 7, 4])
    x = torch.randn(16, 16).bfloat16()
    looped = experts.looped(x, counts).float()
    grouped = experts.grouped(x, counts, torch.bfloat16).float()
    scale = float(looped.abs().max())
    torch.testing.assert_close(grouped, looped, atol=3 * 2**-8 * scale, rtol=0)


def test_the_grouped_path_is_chosen_by_the_probe_made_when_the_weights_move(monkeypatch):
    """``Experts`` probes its device's grouped matmul when its weights move (``_apply``: ``.to``, ``.cuda``,
    FSDP's placement), so a compiled forward reads a set of dtypes rather than tracing the probe; on a CPU the
    probe says no (torch's CPU kernel has no float32 backward) and the loop runs."""
    import lmforge.model.moe as moe_module
    from lmforge.model.moe import Experts

    experts = Experts(16, 32, 4)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.3)
    experts = experts.to("cpu")
    assert experts.grouped_dtypes == frozenset()
    monkeypatch.setattr(moe_module, "grouped_mm_works", lambda device, dtype: dtype == torch.bfloat16)
    experts = experts.to(torch.bfloat16)
    assert experts.grouped_dtypes == {torch.bfloat16}
    calls = []
    monkeypatch.setattr(Experts, "grouped", lambda self, x, counts, dtype: calls.append(dtype) or x.new_zeros(x.shape))
    experts(torch.randn(8, 16).bfloat16(), torch.tensor([2, 2, 2, 2]))
    assert calls == [torch.bfloat16]
    experts = experts.float()
    assert experts(torch.randn(8, 16), torch.tensor([2, 2, 2, 2])).abs().sum() > 0  # float32: the loop ran
    assert calls == [torch.bfloat16]
