import torch

from lmforge.objectives.dpo import ties


def test_a_tie_is_a_zero_log_ratio_margin_up_to_float32_rounding_not_a_learned_one():
    ref_chosen, ref_rejected = torch.tensor([-300.0, -300.0, -300.0]), torch.tensor([-280.0, -280.0, -280.0])
    ulp = torch.finfo(torch.float32).eps * 512  # one float32 step at |logp| ~ 300
    chosen = ref_chosen + torch.tensor([0.0, 8 * ulp, 0.05])  # the reference, its rounding, a learned 0.05 nats
    assert ties(chosen, ref_rejected.clone(), ref_chosen, ref_rejected).tolist() == [True, True, False]
