"""Merge rules (lmforge.peft.merge) against peft's merge_utils and add_weighted_adapter."""

from __future__ import annotations

import pytest
import torch

from lmforge.checkpoints.files import write_checksums, write_model_files
from lmforge.core.io import atomic_directory
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.peft.adapters import PEFT_PREFIX, save_adapter
from lmforge.peft.lora import LoraConfig, apply_lora, lora_modules
from lmforge.peft.merge import (
    combine,
    disjoint_mean,
    elected_sign_mask,
    merge_adapters,
    read_adapter,
    seeded_keep_mask,
    trim_to_density,
    write_adapter_files,
)
from lmforge.stages.export import ExportRecipe, run_export

peft = pytest.importorskip("peft")  # the reference (a dev dependency)
transformers = pytest.importorskip("transformers")
merge_utils = pytest.importorskip("peft.utils.merge_utils")

pytestmark = pytest.mark.usefixtures("one_thread")


def global_keep_mask(name: str, index: int, tensor: torch.Tensor, drop_rate: float) -> torch.Tensor:
    """DARE's mask drawn as peft draws it (torch's global generator, one call per tensor in order)."""
    return torch.bernoulli(torch.full_like(tensor, 1 - drop_rate))


def task_vectors(n: int = 3, shape=(6, 5), seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


# --------------------------------------------------------------------------- the rules, tensor by tensor


def test_trim_sign_election_and_disjoint_mean_are_peft_merge_utils():
    tvs = task_vectors()
    for density in (0.2, 0.5, 0.99):
        for t in tvs:
            torch.testing.assert_close(trim_to_density(t, density), merge_utils.prune(t, density, "magnitude"), rtol=0, atol=0)
    assert torch.equal(trim_to_density(tvs[0], 1.0), tvs[0])  # peft's prune returns the tensor itself at density 1
    stacked = torch.stack([trim_to_density(t, 0.5) for t in tvs])
    agree = elected_sign_mask(stacked)
    assert torch.equal(agree, merge_utils.calculate_majority_sign_mask(stacked, "total"))
    torch.testing.assert_close(disjoint_mean(stacked, agree), merge_utils.disjoint_merge(stacked, agree), rtol=0, atol=0)


@pytest.mark.parametrize("rule", ["linear", "ties", "dare_linear", "dare_ties", "magnitude_prune"])
def test_combine_is_peft_merge_utils_rule_for_rule(rule):
    tvs, weights = task_vectors(), [0.7, -0.4, 1.3]
    density, drop = 0.4, 0.3
    torch.manual_seed(5)
    expected = {
        "linear": lambda: merge_utils.task_arithmetic(tvs, torch.tensor(weights)),
        "ties": lambda: merge_utils.ties(tvs, torch.tensor(weights), density),
        "dare_linear": lambda: merge_utils.dare_linear(tvs, torch.tensor(weights), 1 - drop),
        "dare_ties": lambda: merge_utils.dare_ties(tvs, torch.tensor(weights), 1 - drop),
        "magnitude_prune": lambda: merge_utils.magnitude_prune(tvs, torch.tensor(weights), density),
    }[rule]()
    torch.manual_seed(5)  # the same masks: one Bernoulli draw per tensor, in input order
    ours = combine(tvs, weights, rule, density=density, drop_rate=drop, keep_mask=global_keep_mask)
    # the same float32 operations in the same order: equal to the last bit but for summation order
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_ties_by_hand():
    # τ1 = [3, -1, 0.5, -2], τ2 = [-1, -2, 0.2, 4], density 0.5 keeps the 2 largest of each:
    # τ̂1 = [3, 0, 0, -2], τ̂2 = [0, -2, 0, 4]; mass [3, -2, 0, 2] elects signs [+, -, +, +];
    # agreeing: entry 0 τ̂1 (3), entry 1 τ̂2 (-2), entry 2 none (0), entry 3 τ̂2 (4): disjoint mean [3, -2, 0, 4]
    t1, t2 = torch.tensor([3.0, -1, 0.5, -2]), torch.tensor([-1.0, -2, 0.2, 4])
    torch.testing.assert_close(combine([t1, t2], [1, 1], "ties", density=0.5), torch.tensor([3.0, -2, 0, 4]))
    # weights enter the mean, not the election: w = [2, 1] gives [6, -2, 0, 4]
    torch.testing.assert_close(combine([t1, t2], [2, 1], "ties", density=0.5), torch.tensor([6.0, -2, 0, 4]))
    # density 1 and signs that agree everywhere: TIES is the plain mean
    a, b = torch.tensor([1.0, -2, 3]), torch.tensor([3.0, -4, 1])
    torch.testing.assert_close(combine([a, b], [1, 1], "ties"), (a + b) / 2)


def test_dare_masks_are_seeded_per_tensor_and_rescale_the_kept_entries():
    t = torch.randn(200, 100, generator=torch.Generator().manual_seed(1))
    p = 0.3
    keep = seeded_keep_mask(7)
    m = keep("layers.0.attn.wq.weight", 0, t, p)
    assert torch.equal(m, keep("layers.0.attn.wq.weight", 0, t, p))  # reproducible
    assert not torch.equal(m, seeded_keep_mask(8)("layers.0.attn.wq.weight", 0, t, p))  # another seed
    assert not torch.equal(m, keep("layers.0.attn.wq.weight", 1, t, p))  # another input
    assert set(m.unique().tolist()) <= {0.0, 1.0}
    # kept fraction: Binomial(20000, 0.7) has std sqrt(0.7·0.3/20000) = 0.0032; 5 std = 0.016
    assert abs(m.mean().item() - (1 - p)) < 0.016
    dropped = combine([t], [1.0], "dare_linear", drop_rate=p, keep_mask=keep, name="layers.0.attn.wq.weight")
    torch.testing.assert_close(dropped, t * m / (1 - p))  # kept entries scaled by 1/(1-p), dropped ones 0
    assert torch.equal(combine([t], [1.0], "dare_linear", drop_rate=0.0, keep_mask=keep), t)  # p = 0: no drop


# --------------------------------------------------------------------------- adapters against add_weighted_adapter


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, small_tokenizer_dir) -> dict:
    """A tiny random base, its HF export, and three adapters in PEFT format: two of rank 4, one of rank 2."""
    root = tmp_path_factory.mktemp("merge")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)
    model = Transformer(cfg).eval()
    with atomic_directory(root / "ckpt") as tmp:
        write_model_files(tmp, model, small_tokenizer_dir)
        write_checksums(tmp)
    run_export(ExportRecipe(checkpoint=str(root / "ckpt"), run_dir=str(root / "hf")))
    paths = {}
    for name, r, alpha, seed in (("a", 4, 8.0, 1), ("b", 4, 12.0, 2), ("c", 2, 4.0, 3)):
        m = Transformer(cfg).eval()
        m.load_state_dict(model.state_dict())
        lora = LoraConfig(r=r, alpha=alpha, target_modules=["attn.wq", "attn.wv", "mlp.w2"])
        apply_lora(m, lora)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in lora_modules(m).values():
                module.lora_A.weight.copy_(0.3 * torch.randn(module.lora_A.weight.shape, generator=g))
                module.lora_B.weight.copy_(0.3 * torch.randn(module.lora_B.weight.shape, generator=g))
        paths[name] = save_adapter(m, lora, root / name, base_model_name_or_path=str(root / "hf"))
    return {"root": root, "hf": root / "hf", "ckpt": root / "ckpt", **paths}


def peft_merge(adapters: dict, names: list[str], weights: list[float], combination: str, **kwargs):
    base = transformers.AutoModelForCausalLM.from_pretrained(adapters["hf"], attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.add_weighted_adapter(names, weights, "merged", combination_type=combination, **kwargs)
    model.set_adapter("merged")
    return model.eval()


def merged_factors(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """peft's merged adapter by module under PEFT's saved key prefix (``base_model.model.<module>``)."""
    return {f"{PEFT_PREFIX}{name}": (layer.lora_A["merged"].weight.detach(), layer.lora_B["merged"].weight.detach())
            for name, layer in model.base_model.model.named_modules() if hasattr(layer, "lora_A") and "merged" in layer.lora_A}


class MaskRecorder:
    """Records the Bernoulli masks peft draws, so our merge can be given the same ones by name."""

    def __init__(self):
        self.draws: list[torch.Tensor] = []
        self.real = torch.bernoulli

    def __call__(self, *args, **kwargs):
        out = self.real(*args, **kwargs)
        self.draws.append(out)
        return out

    def keep_mask(self, modules: list[str], n_inputs: int, svd: bool):
        """peft's draw order: each module in turn, its A factors (input by input), then its B factors;
        for the svd types each module's updates s_i B_i A_i, input by input."""
        parts = ["delta"] if svd else ["lora_A", "lora_B"]
        order = [(f"{m}.{part}", i) for m in modules for part in parts for i in range(n_inputs)]
        assert len(order) == len(self.draws)
        table = dict(zip(order, self.draws))
        return lambda name, index, tensor, p: table[(name, index)]


@pytest.mark.parametrize("combination", ["linear", "cat", "ties", "dare_linear", "dare_ties", "magnitude_prune", "svd",
                                         "ties_svd", "dare_linear_svd", "dare_ties_svd", "magnitude_prune_svd"])
def test_adapter_merge_matches_peft_add_weighted_adapter(adapters, combination, monkeypatch, tmp_path):
    svd = combination.endswith("svd")
    names = ["a", "c"] if combination == "cat" or svd else ["a", "b"]  # cat and svd merge adapters of any ranks
    weights = [0.6, -0.9]
    density, drop = 0.5, 0.4
    rule = combination.removesuffix("_svd")
    kwargs = {"ties": {"density": density}, "magnitude_prune": {"density": density}, "dare_linear": {"density": 1 - drop},
              "dare_ties": {"density": 1 - drop}}
    kwargs = {**kwargs.get(rule, {}), **({"svd_rank": 3} if svd else {})}
    recorder = MaskRecorder()
    monkeypatch.setattr(torch, "bernoulli", recorder)
    torch.manual_seed(11)
    theirs = peft_merge(adapters, names, weights, combination, **kwargs)
    monkeypatch.setattr(torch, "bernoulli", recorder.real)
    expected = merged_factors(theirs)

    read = [read_adapter(adapters[n]) for n in names]
    keep = recorder.keep_mask(list(expected), len(names), svd) if rule.startswith("dare") else None
    ours = merge_adapters([a for _, a in read], weights, combination, density=density if rule in ("ties", "magnitude_prune") else 1.0,
                          drop_rate=drop if rule.startswith("dare") else 0.0, keep_mask=keep, svd_rank=kwargs.get("svd_rank"))
    assert ours.r == {"cat": 6}.get(combination, 3 if svd else 4) and ours.scaling == 1.0
    assert set(ours.factors) == set(expected)
    for module, (A, B) in expected.items():
        # the same float32 operations as peft (sums of two terms in the same order): within 1e-6; the SVD
        # of the same matrix by the same LAPACK call: its rank-3 product to float32 rounding of |ΔW| < 10
        if svd:
            torch.testing.assert_close(ours.factors[module][1] @ ours.factors[module][0], B @ A, rtol=0, atol=1e-5)
        else:
            torch.testing.assert_close(ours.factors[module][0], A, rtol=0, atol=1e-6)
            torch.testing.assert_close(ours.factors[module][1], B, rtol=0, atol=1e-6)

    # the merged folder, loaded by peft, computes what peft's own merged adapter computes
    out = tmp_path / "merged"
    out.mkdir()
    write_adapter_files(out, ours, read[0][0], scale=1.0)
    x = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(4))
    base = transformers.AutoModelForCausalLM.from_pretrained(adapters["hf"], attn_implementation="eager")
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, theirs(x).logits, rtol=0, atol=1e-5)
        with loaded.disable_adapter():
            base_logits = loaded(x).logits
        assert (loaded(x).logits - base_logits).abs().max() > 1e-3  # the merged adapter changes the model


def test_cat_and_a_full_rank_svd_are_the_exact_weighted_sum_of_the_updates_and_linear_is_not(adapters):
    (_, a), (_, b) = read_adapter(adapters["a"]), read_adapter(adapters["b"])
    w = [0.5, 0.5]
    exact = {m: w[0] * a.scaling * (B @ A) + w[1] * b.scaling * (b.factors[m][1] @ b.factors[m][0])
             for m, (A, B) in a.factors.items()}
    cat, linear = merge_adapters([a, b], w, "cat"), merge_adapters([a, b], w, "linear")
    svd = merge_adapters([a, b], w, "svd", svd_rank=8)  # the sum has rank <= 4 + 4: its rank-8 SVD is exact
    for m, delta in exact.items():
        torch.testing.assert_close(cat.factors[m][1] @ cat.factors[m][0], delta, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(svd.factors[m][1] @ svd.factors[m][0], delta, rtol=0, atol=1e-5)
        # linear holds the cross terms B_a A_b and B_b A_a: far from the sum
        assert (linear.factors[m][1] @ linear.factors[m][0] - delta).abs().max() > 1e-2


def test_adapters_peft_cannot_merge_are_refused_by_name(adapters, tmp_path):
    import json

    from lmforge.core.io import InputError

    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters["a"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((adapters["a"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(InputError, match=r"^inputs\[1\]\.path: .*DoRA"):
        read_adapter(dora, "inputs[1].path")
    with pytest.raises(InputError, match=r"^inputs\[0\]\.path: .*adapter_config.json: not found"):
        read_adapter(tmp_path / "nothing", "inputs[0].path")


def test_read_adapter_returns_the_saved_factors(adapters):
    config, adapter = read_adapter(adapters["b"])
    assert (adapter.r, adapter.scaling) == (4, 3.0) and config["lora_alpha"] == 12.0
    assert all(k.startswith(PEFT_PREFIX) for k in adapter.factors)
    assert len(adapter.factors) == 6  # q_proj, v_proj, down_proj in 2 layers


def test_rslora_adapters_merge_to_the_exact_sum_where_peft_scales_the_merge_by_sqrt_r(adapters, tmp_path):
    """peft's merged adapter keeps the first adapter's use_rslora with lora_alpha = r, so its scaling is
    r/√r = √r, not 1: the same factors, an update √r times too large. Ours is written without rsLoRA."""
    base = transformers.AutoModelForCausalLM.from_pretrained(adapters["hf"], attn_implementation="eager")
    cfg = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32)
    folders = []
    for name, seed in (("rs1", 1), ("rs2", 2)):
        m = Transformer(cfg)
        lora = LoraConfig(r=4, alpha=8.0, use_rslora=True, target_modules=["attn.wq"])
        apply_lora(m, lora)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in lora_modules(m).values():
                module.lora_B.weight.copy_(0.3 * torch.randn(module.lora_B.weight.shape, generator=g))
        folders.append(save_adapter(m, lora, tmp_path / name, base_model_name_or_path=str(adapters["hf"])))
    model = peft.PeftModel.from_pretrained(base, folders[0], adapter_name="rs1")
    model.load_adapter(folders[1], adapter_name="rs2")
    model.add_weighted_adapter(["rs1", "rs2"], [1.0, 1.0], "merged", combination_type="cat")
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["merged"] == pytest.approx(8 ** 0.5)  # peft's: √(r_1 + r_2)

    read = [read_adapter(f) for f in folders]
    assert read[0][1].scaling == pytest.approx(8 / 2)  # α/√r
    ours = merge_adapters([a for _, a in read], [1.0, 1.0], "cat")
    module = f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj"
    torch.testing.assert_close(ours.factors[module][0], layer.lora_A["merged"].weight.detach(), rtol=0, atol=1e-6)
    exact = sum(a.scaling * a.factors[module][1] @ a.factors[module][0] for _, a in read)
    torch.testing.assert_close(ours.scaling * ours.factors[module][1] @ ours.factors[module][0], exact, rtol=0, atol=1e-5)
    out = tmp_path / "merged"
    out.mkdir()
    write_adapter_files(out, ours, read[0][0], scale=1.0)
    written = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(adapters["hf"], attn_implementation="eager"), out)
    assert written.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == 1.0
