"""EWC: the penalty against hand-computed numbers, its weighting in the one loop (the step's total is
the inner mean + P however the step is split), LoRA's merged weight, the online fold, and the diagonal
Fisher against brute-force loops (torch.func per sequence, float64) and the closed form of the output
layer's true Fisher."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad

from lmforge.core.io import InputError
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.objectives.clm import CausalLMObjective
from lmforge.objectives.ewc import (
    EWCConfig,
    EWCObjective,
    EWCPenalty,
    ewc_objective,
    ewc_penalty,
    online_fisher,
    read_fisher,
    write_fisher,
)
from lmforge.objectives.fisher import diagonal_fisher
from lmforge.peft.lora import LoraConfig, apply_lora
from lmforge.train.step import StepRunner

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(vocab: int = 32, tie: bool = False, dtype=torch.float64, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, max_seq_len=16,
                      tie_embeddings=tie)
    return Transformer(cfg).to(dtype).eval()


def test_penalty_value_and_gradient_match_the_hand_computed_case():
    # (λ/2) Σ F (θ-θ*)²; λ = 0.5: 0.25·(2·1² + 3·1²) + 0.25·(0.5·2²) = 1.25 + 0.5 = 1.75
    a = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([[3.0]], dtype=torch.float64, requires_grad=True)
    fisher = [torch.tensor([2.0, 3.0], dtype=torch.float64), torch.tensor([[0.5]], dtype=torch.float64)]
    anchor = [torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([[1.0]], dtype=torch.float64)]
    p = ewc_penalty([a, b], fisher, anchor, 0.5)
    assert float(p.detach()) == 1.75
    p.backward()  # λ F (θ - θ*): 0.5·[2, 3]·[1, 1] = [1, 1.5]; 0.5·0.5·2 = 0.5
    assert a.grad.tolist() == [1.0, 1.5] and b.grad.tolist() == [[0.5]]


def test_online_fisher_is_the_moving_average_with_gamma():
    folded = online_fisher({"w": torch.tensor([4.0, 0.0])}, {"w": torch.tensor([8.0, 2.0])}, 0.25)
    assert folded["w"].tolist() == [7.0, 1.5]  # 0.25·4 + 0.75·8, 0.75·2
    with pytest.raises(ValueError, match="different tensors"):
        online_fisher({"w": torch.zeros(1)}, {"v": torch.zeros(1)}, 0.5)


def random_fisher(model, seed: int = 1) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    fisher = {n: torch.rand(p.shape, generator=g, dtype=p.dtype) for n, p in model.named_parameters()}
    anchor = {n: p.detach() + 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in model.named_parameters()}
    return fisher, anchor


def step_gradient(model, objective, micro_batches):
    runner = StepRunner(model, objective, torch.optim.SGD(model.parameters(), lr=0.0), "fp32", 0.0)
    loss, n_targets, metrics, _ = runner.backward(micro_batches)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss, n_targets, metrics, grads


def test_the_steps_total_is_the_inner_mean_plus_the_penalty_however_it_is_split():
    model = tiny()
    fisher, anchor = random_fisher(model)
    lam = 3.0
    objective = EWCObjective(CausalLMObjective(), EWCPenalty(model, fisher, anchor, lam, where="test"))
    batch = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(2))
    whole = step_gradient(model, objective, [batch])
    split = step_gradient(model, objective, [batch[:1], batch[1:]])  # unequal micro-batches: 8 and 24 targets
    plain = step_gradient(model, CausalLMObjective(), [batch])
    params = dict(model.named_parameters())
    penalty = ewc_penalty([params[n] for n in fisher], list(fisher.values()), list(anchor.values()), lam).detach()
    # the loop totals the logged loss and metrics in float32 (a rounding of 6e-8 per addition); gradients stay float64
    assert float(whole[0]) == pytest.approx(float(plain[0] + penalty), rel=3e-7)
    assert float(split[0]) == pytest.approx(float(whole[0]), rel=3e-7)
    assert float(whole[2]["ewc/penalty"]) / whole[1] == pytest.approx(float(penalty), rel=3e-7)
    assert float(penalty) > 0.1 * float(plain[0])  # large enough to matter in the total
    for n in params:  # ∂/∂θ = inner gradient + λ F (θ - θ*)
        expected = plain[3][n] + lam * fisher[n] * (params[n].detach() - anchor[n])
        torch.testing.assert_close(whole[3][n], expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(split[3][n], expected, rtol=1e-10, atol=1e-12)


def test_evaluation_scores_the_inner_loss_alone():
    model = tiny()
    objective = EWCObjective(CausalLMObjective(), EWCPenalty(model, *random_fisher(model), 1.0, where="test"))
    batch = torch.randint(0, 32, (2, 9))
    with torch.no_grad():
        assert torch.equal(objective(model, batch).loss_sum, CausalLMObjective()(model, batch).loss_sum)


def test_with_lora_the_penalty_is_on_the_merged_weight_and_reaches_the_adapters():
    model = tiny()
    fisher, anchor = random_fisher(model)
    apply_lora(model, LoraConfig(r=2, alpha=4.0, target_modules=["attn.wq"]))
    layer = model.layers[0].attn.wq
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    penalty = EWCPenalty(model, fisher, anchor, 2.0, where="test")
    name = "layers.0.attn.wq.weight"
    W, A, B, s = layer.base.weight.detach(), layer.lora_A.weight, layer.lora_B.weight, layer.scaling
    merged = W + s * B.detach() @ A.detach()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained == ["layers.0.attn.wq.lora_A.weight", "layers.0.attn.wq.lora_B.weight"]
    value = penalty()
    assert float(value) == pytest.approx(float((fisher[name] * (merged - anchor[name]).square()).sum()), rel=1e-12)
    value.backward()  # ∂/∂B = λ s (F ⊙ (W + sBA - θ*)) Aᵀ, ∂/∂A = λ s Bᵀ (F ⊙ (W + sBA - θ*))
    residual = 2.0 * fisher[name] * (merged - anchor[name])
    torch.testing.assert_close(B.grad, s * residual @ A.detach().T, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(A.grad, s * B.detach().T @ residual, rtol=1e-12, atol=1e-14)


def test_a_fisher_of_another_models_shapes_is_refused_naming_the_file(tmp_path):
    small, other = tiny(vocab=32), tiny(vocab=48)
    path = write_fisher(tmp_path / "fisher.safetensors", *random_fisher(other), {"labels": "sampled"})
    with pytest.raises(InputError, match=r"ewc.fisher: .*fisher.safetensors holds embed.weight of shape \(48, 16\)"):
        ewc_objective(CausalLMObjective(), EWCConfig(fisher=str(path), lambda_=1.0), small)
    with pytest.raises(InputError, match="ewc.fisher: .*does not exist"):
        ewc_objective(CausalLMObjective(), EWCConfig(fisher=str(tmp_path / "none.safetensors")), small)


def test_a_fisher_file_keeps_f_and_the_anchor_by_name(tmp_path):
    model = tiny()
    fisher, anchor = random_fisher(model)
    write_fisher(tmp_path / "fisher.safetensors", fisher, anchor, {"labels": "empirical", "tokens": 12})
    got_f, got_a, meta = read_fisher(tmp_path)  # a directory: its fisher.safetensors
    assert meta["labels"] == "empirical" and meta["tokens"] == "12"
    assert all(torch.equal(got_f[n], fisher[n].float()) and torch.equal(got_a[n], anchor[n].float()) for n in fisher)


# --------------------------------------------------------------------------- the Fisher


def sequences(n: int, T: int, vocab: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        w = torch.randint(0, vocab, (T + 1,), generator=g)
        targets = w[1:].clone()
        targets[0] = -100  # an untrained position, as SFT's prompt tokens
        out.append((w[:-1], targets))
    return out


def log_likelihood(model, params, input_ids, labels):
    logits = functional_call(model, params, (input_ids[None],))[0]
    return -F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def brute_force_fisher(model, seqs, labels_of):
    """Σ over sequences of (∂ log p(labels)/∂θ)², by torch.func.grad per sequence, per target token."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    sums = {n: torch.zeros_like(p) for n, p in params.items()}
    tokens = 0
    for i, (ids, targets) in enumerate(seqs):
        labels = labels_of(i, ids, targets)
        g = grad(lambda p, ids=ids, labels=labels: log_likelihood(model, p, ids, labels))(params)
        for n in sums:
            sums[n] += g[n].square()
        tokens += int((targets != -100).sum())
    return {n: s / tokens for n, s in sums.items()}


def test_empirical_fisher_equals_a_per_sequence_brute_force_loop():
    model, seqs = tiny(), sequences(5, 8, 32)
    got, tokens, count = diagonal_fisher(model, seqs, labels="empirical")
    expected = brute_force_fisher(model, seqs, lambda i, ids, targets: targets)
    assert (tokens, count) == (35, 5)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-10, atol=1e-14)


def test_true_fisher_uses_labels_sampled_from_the_model_and_equals_the_brute_force_loop():
    model, seqs = tiny(), sequences(4, 8, 32)
    got, _, _ = diagonal_fisher(model, seqs, labels="sampled", seed=7)
    generator = torch.Generator().manual_seed(7)

    def sampled(i, ids, targets):  # the same draws, in the same order: ŷ_t ~ p(·|x_≤t) on trained positions
        with torch.no_grad():
            probs = model(ids[None])[0].softmax(-1)[targets != -100]
        labels = targets.clone()
        labels[targets != -100] = torch.multinomial(probs, 1, generator=generator)[:, 0]
        return labels

    expected = brute_force_fisher(model, seqs, sampled)
    empirical, _, _ = diagonal_fisher(model, seqs, labels="empirical")
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-10, atol=1e-14)
    assert not torch.allclose(got["lm_head.weight"], empirical["lm_head.weight"])  # not the data's labels
    assert max_tokens_respected(model, seqs)


def max_tokens_respected(model, seqs) -> bool:
    _, tokens, count = diagonal_fisher(model, seqs, labels="sampled", max_tokens=10)
    return (tokens, count) == (14, 2)  # 7 targets a sequence: the second reaches 10


def test_exact_fisher_of_the_output_layer_is_the_closed_form():
    """log p(y|h) = w_y·h − logsumexp(W h): ∂/∂W_kj = (1[k=y] − p_k) h_j, so
    E_y[(∂/∂W_kj)²] = (p_k(1−p_k)² + (1−p_k)p_k²) h_j² = p_k(1−p_k) h_j², averaged over target tokens."""
    model, seqs = tiny(vocab=12), sequences(3, 5, 12)
    got, tokens, _ = diagonal_fisher(model, seqs, labels="exact")
    expected = torch.zeros_like(model.lm_head.weight)
    with torch.no_grad():
        for ids, targets in seqs:
            h = model.hidden_states(ids[None])[0][targets != -100]
            p = model.logits(h).softmax(-1)
            expected += (p * (1 - p)).T @ h.square()
    torch.testing.assert_close(got["lm_head.weight"], expected / tokens, rtol=1e-10, atol=1e-14)


def test_exact_fisher_is_the_enumerated_expectation_for_every_parameter():
    model, seqs = tiny(vocab=6), sequences(2, 3, 6)
    got, tokens, _ = diagonal_fisher(model, seqs, labels="exact")
    params = {n: p.detach() for n, p in model.named_parameters()}
    expected = {n: torch.zeros_like(p) for n, p in params.items()}
    for ids, targets in seqs:
        for t in (targets != -100).nonzero()[:, 0].tolist():
            for y in range(6):
                def log_p(p, t=t, y=y, ids=ids):
                    return functional_call(model, p, (ids[None],))[0, t].log_softmax(-1)[y]
                prob = float(log_p(params).exp())
                g = grad(log_p)(params)
                for n in expected:
                    expected[n] += prob * g[n].square()
    for n in expected:
        torch.testing.assert_close(got[n], expected[n] / tokens, rtol=1e-10, atol=1e-14)


def test_with_dora_the_penalty_is_on_the_weight_the_layer_computes_with():
    model = tiny()
    fisher, anchor = random_fisher(model)
    apply_lora(model, LoraConfig(r=2, alpha=4.0, target_modules=["mlp.w1"], use_dora=True))
    layer = model.layers[0].mlp.w1
    with torch.no_grad():
        layer.lora_B.weight.normal_()
        layer.lora_magnitude_vector.mul_(1.5)
    name = "layers.0.mlp.w1.weight"
    merged = layer.merged_weight()  # the layer's own (m/n)(W + s·BA)
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ merged.T, rtol=1e-12, atol=1e-12)  # it is what the layer computes
    value = EWCPenalty(model, fisher, anchor, 2.0, where="test")()
    assert float(value.detach()) == pytest.approx(float((fisher[name] * (merged - anchor[name]).square()).sum()),
                                                  rel=1e-12)
    value.backward()
    assert layer.lora_magnitude_vector.grad.abs().sum() > 0 and layer.lora_B.weight.grad.abs().sum() > 0


def test_activation_checkpointing_and_autocast_leave_the_penalty_unchanged():
    from lmforge.distributed.parallelize import apply_activation_checkpointing

    model = tiny(dtype=torch.float32)
    fisher, anchor = random_fisher(model)
    expected = float(EWCPenalty(model, fisher, anchor, 1.0, where="test")().detach())
    apply_activation_checkpointing(model)  # its wrappers' names are not the checkpoint's
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    penalty = EWCPenalty(model, fisher, anchor, 1.0, where="test")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert float(penalty().detach()) == expected
