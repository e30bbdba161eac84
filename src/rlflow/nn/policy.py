"""The agents' hierarchical, masked policy (RLFlow's controller heads) and value head.

First the transformation (rule) is chosen, among the valid ones plus the NO-OP; then the location, conditioned
on the chosen rule, among that rule's valid locations. Invalid choices get probability exactly 0 (their logits
are replaced by the lowest float before the softmax), so a sampled action is always valid under the masks.

Shapes: B = batch, D = input features (for the controller [z, h]; for the model-free agent the encoder's z),
N1 = rules + 1 (the last is the NO-OP), L = max_locations.
"""

from __future__ import annotations

import torch
from torch import nn


def masked_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` [..., K] with entries where ``mask`` [..., K] is 0/False set to the lowest float."""
    return logits.masked_fill(~mask.bool(), torch.finfo(logits.dtype).min)


def masked_entropy(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Entropy [...] of the categorical over the valid entries only (masked entries contribute 0)."""
    logp = torch.log_softmax(masked_logits(logits, mask), dim=-1)
    p = logp.exp()
    return -(p * logp).masked_fill(~mask.bool(), 0.0).sum(-1)


class HierarchicalPolicy(nn.Module):
    def __init__(self, in_dim: int, n_xfers: int, max_locations: int, hidden: int = 128, xfer_embed: int = 32):
        super().__init__()
        self.n1, self.max_locations = n_xfers + 1, max_locations
        self.trunk = nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.xfer_head = nn.Linear(hidden, self.n1)
        self.xfer_embed = nn.Embedding(self.n1, xfer_embed)
        self.loc_head = nn.Sequential(nn.Linear(hidden + xfer_embed, hidden), nn.Tanh(), nn.Linear(hidden, max_locations))
        self.value_head = nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def value(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, D] -> [B]."""
        return self.value_head(x).squeeze(-1)

    def _heads(self, x: torch.Tensor, xfer: torch.Tensor | None, xfer_mask: torch.Tensor,
               location_mask: torch.Tensor, generator: torch.Generator | None = None):
        h = self.trunk(x)
        xl = masked_logits(self.xfer_head(h), xfer_mask)                              # [B, N1]
        if xfer is None:
            xfer = torch.multinomial(torch.softmax(xl, -1), 1, generator=generator).squeeze(-1)
        loc_mask = location_mask[torch.arange(len(xfer)), xfer]                       # [B, L]
        ll = self.loc_head(torch.cat([h, self.xfer_embed(xfer)], -1))
        ll = masked_logits(ll, loc_mask)                                              # [B, L]
        return xl, ll, xfer, loc_mask

    @torch.no_grad()
    def act(self, x: torch.Tensor, xfer_mask: torch.Tensor, location_mask: torch.Tensor,
            generator: torch.Generator | None = None, greedy: bool = False):
        """Sample (or, greedy, take the most likely) actions. x [B, D], xfer_mask [B, N1], location_mask
        [B, N1, L] -> xfer [B], location [B], log-probability [B], value [B]."""
        h = self.trunk(x)
        xl = masked_logits(self.xfer_head(h), xfer_mask)
        if greedy:
            xfer = xl.argmax(-1)
        else:
            xfer = torch.multinomial(torch.softmax(xl, -1), 1, generator=generator).squeeze(-1)
        xl, ll, xfer, _ = self._heads(x, xfer, xfer_mask, location_mask)
        loc = ll.argmax(-1) if greedy else torch.multinomial(torch.softmax(ll, -1), 1, generator=generator).squeeze(-1)
        logp = torch.log_softmax(xl, -1).gather(-1, xfer[:, None]).squeeze(-1) + \
            torch.log_softmax(ll, -1).gather(-1, loc[:, None]).squeeze(-1)
        return xfer, loc, logp, self.value(x)

    def evaluate(self, x: torch.Tensor, xfer: torch.Tensor, loc: torch.Tensor, xfer_mask: torch.Tensor,
                 location_mask: torch.Tensor):
        """Log-probability [B], entropy [B] (rule head + location head) and value [B] of given actions."""
        xl, ll, _, loc_mask = self._heads(x, xfer, xfer_mask, location_mask)
        logp = torch.log_softmax(xl, -1).gather(-1, xfer[:, None]).squeeze(-1) + \
            torch.log_softmax(ll, -1).gather(-1, loc[:, None]).squeeze(-1)
        entropy = masked_entropy(self.xfer_head(self.trunk(x)), xfer_mask) + masked_entropy(
            self.loc_head(torch.cat([self.trunk(x), self.xfer_embed(xfer)], -1)), loc_mask)
        return logp, entropy, self.value(x)
