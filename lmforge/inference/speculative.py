"""Self-speculative decoding with a model's own multi-token prediction modules (``model.mtp``).

A greedy row decodes in rounds. With t_n the token just chosen (its position n, the main cache
holding positions 0 .. n-1), the MTP depths draft the D tokens after it, each run at the last
position n-1: depth 1 reads the main model's h^0_{n-1} and t_n and drafts d_{n+1}; depth k reads
depth k-1's h^{k-1}_{n-1} and d_{n+k-1} and drafts d_{n+k} (``Drafter.draft``). The main model then verifies t_n, d_{n+1} .. d_{n+D}
in one forward: the drafts are accepted while each equals the greedy choice of the logits before it,
and the first disagreement (or the logits after the last draft) gives the next token t_{n'} for free.
The output is the greedy decoding's own, token for token: a draft is kept only where greedy decoding
would have chosen it, and the main cache is cut back to the accepted positions before the next round.

Each depth attends to its own cache over the positions before (the MTP modules' KV cache: layers
``n_layers .. n_layers + D - 1``). Depth k at position j reads the token t_{j+k}, known only for
j + k <= n, so each round recomputes, per depth, the positions from its last exact one: those whose
inputs are all accepted tokens are kept (``frontier``), the ones that read a draft are written again
in the next round, when their inputs are known. The drafts are thus exactly what the trained modules
compute for the positions they were trained on (``model.mtp``'s training forward), given the drafts
as inputs where the truth is not yet known.
"""

from __future__ import annotations

import torch
from torch import nn


class Drafter:
    """One row's drafting state: the MTP modules' cache and, per depth k, ``frontier[k-1]`` (its cache's
    exact positions, 0 .. frontier - 1) and ``exact[k-1]``: the exact hidden states h^(k-1) (1, m, d) at
    positions ``frontier[k-1]`` .. that depth k reads next round beyond what depth k-1 recomputes (for
    depth 1, the main model's hidden states of the positions not yet read)."""

    def __init__(self, model: nn.Module, depth: int, hidden: torch.Tensor, capacity: int, kv_cache_dtype: str = "auto"):
        n_layers = model.cfg.n_layers
        weight = model.embed.weight
        self.depth = depth
        self.cache = model.new_kv_cache(1, capacity, weight.dtype, weight.device, kv_cache_dtype,
                                        layers=range(n_layers, n_layers + depth))
        self.frontier = [0] * depth
        self.exact = [hidden] + [hidden[:, :0]] * (depth - 1)
        self.proposed = self.accepted = 0  # drafts verified and kept, over the row

    def draft(self, model: nn.Module, tokens: list[int]) -> list[int]:
        """The D drafts after ``tokens`` (the row's prompt and chosen tokens, t_0 .. t_n), by depth."""
        n = len(tokens) - 1  # the main model has read t_0 .. t_{n-1}
        drafts: list[int] = []
        exact = list(self.exact)  # last round's: this round's replace them as each depth runs
        below = None  # the depth before's hidden states of this round, from its old frontier to n-1
        for k in range(1, self.depth + 1):
            start = self.frontier[k - 1]
            previous = exact[k - 1] if below is None else torch.cat((exact[k - 1], below), dim=1)
            ahead = [tokens[j + k] if j + k <= n else drafts[j + k - n - 1] for j in range(start, n)]
            cache = self.cache.like(self.cache.tensors, start)
            ids = torch.tensor([ahead], device=previous.device)
            out = model.mtp_hidden(k, previous, ids, kv_cache=cache)  # positions start .. n-1
            drafts.append(int(model.mtp_logits(k, out[:, -1:]).argmax(dim=-1)))
            # exact now: the positions whose token t_{j+k} is known (j <= n - k); depth k+1 reads h^k from n - k on
            self.frontier[k - 1] = max(start, n - k + 1)
            if k < self.depth:
                keep_from = max(start, n - k)
                self.exact[k] = out[:, keep_from - start : self.frontier[k - 1] - start]
            below = out
        return drafts

    def verified(self, hidden: torch.Tensor, n_drafts: int, n_accepted: int) -> None:
        """After the main model's verifying forward: ``hidden`` (1, a + 1, d) its hidden states of t_n and the
        a accepted drafts, which depth 1 reads next round."""
        self.exact[0] = hidden
        self.proposed += n_drafts
        self.accepted += n_accepted


def accepted_count(drafts: torch.Tensor, logits: torch.Tensor) -> int:
    """How many leading drafts (D,) equal the greedy choice of the logits (D + 1, V) before each."""
    agree = (logits[: len(drafts)].argmax(dim=-1) == drafts).long()
    return int(agree.cumprod(dim=0).sum())
