"""The agents' hierarchical, masked policy (RLFlow's controller heads) and value head.

First the transformation (rule) is chosen, among the valid ones plus the NO-OP; then the location, conditioned
on the chosen rule, among that rule's valid locations. Invalid choices get probability exactly 0 (their logits
are replaced by the lowest float before the softmax), so a sampled action is always valid under the masks.

Shapes: B = batch, D = input features (for the controller [z, h]; for the model-free agent the encoder's z),
N1 = rules + 1 (the last is the NO-OP), L = max_locations.

Locations come in one of two forms (``locations`` below), both meaning the same thing for rule k:
a dense boolean mask [B, N1, L] (the real environment's ``location_mask``), or per-rule counts [B, N1] (integer
dtype; the dream's ``location_count``): rule k's valid locations are 0 .. count_k - 1, as in the real
environment, whose mask rows are exactly such prefixes. Only the chosen rule's row is ever built from counts,
so the dream never materialises N1 x L masks.

With ``count_features`` the trunk and the value head also see how many valid locations each rule has,
``log1p(count)`` [B, N1], taken from the same ``locations`` argument (the real environment's mask rows summed, the
dream's predicted counts): what a step makes possible or impossible next (e.g. a merge that leaves two fusions
without a match) is then in the input itself, not only in what the frozen encoder's z kept of it.
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


def location_rows(locations: torch.Tensor, xfer: torch.Tensor, max_locations: int) -> torch.Tensor:
    """The location mask [B, L] of each chosen rule ``xfer`` [B], from a dense mask [B, N1, L] or counts [B, N1]
    (see the module docstring)."""
    rows = torch.arange(len(xfer), device=xfer.device)
    if locations.dim() == 3:
        return locations[rows, xfer].bool()
    if locations.dtype.is_floating_point or locations.dtype == torch.bool:
        raise TypeError("location counts must be an integer tensor [B, N1] (or pass a dense [B, N1, L] mask)")
    n = locations[rows, xfer]
    return torch.arange(max_locations, device=xfer.device)[None, :] < n[:, None]


def location_counts(locations: torch.Tensor) -> torch.Tensor:
    """Valid locations per rule [B, N1] from a dense mask [B, N1, L] or counts [B, N1] (float)."""
    if locations.dim() == 3:
        return locations.bool().sum(-1).float()
    return locations.float()


class HierarchicalPolicy(nn.Module):
    def __init__(self, in_dim: int, n_xfers: int, max_locations: int, hidden: int = 128, xfer_embed: int = 32,
                 count_features: bool = False):
        super().__init__()
        self.n1, self.max_locations, self.count_features = n_xfers + 1, max_locations, bool(count_features)
        d = in_dim + (self.n1 if self.count_features else 0)
        self.trunk = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.xfer_head = nn.Linear(hidden, self.n1)
        self.xfer_embed = nn.Embedding(self.n1, xfer_embed)
        self.loc_head = nn.Sequential(nn.Linear(hidden + xfer_embed, hidden), nn.Tanh(), nn.Linear(hidden, max_locations))
        self.value_head = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def inputs(self, x: torch.Tensor, locations: torch.Tensor | None) -> torch.Tensor:
        """The trunk's and value head's input: x [B, D], with ``count_features`` followed by log1p of each rule's
        valid locations -> [B, D + N1]."""
        if not self.count_features:
            return x
        if locations is None:
            raise ValueError("this policy reads each rule's location count: pass the locations (mask or counts)")
        return torch.cat([x, torch.log1p(location_counts(locations).to(x.dtype))], -1)

    def value(self, x: torch.Tensor, locations: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, D] (and, with ``count_features``, the locations: mask [B, N1, L] or counts [B, N1]) -> [B]."""
        return self.value_head(self.inputs(x, locations)).squeeze(-1)

    def _location_logits(self, h: torch.Tensor, xfer: torch.Tensor, locations: torch.Tensor):
        """Raw location logits [B, L] given the trunk output and the chosen rules, and their mask [B, L]."""
        loc_mask = location_rows(locations, xfer, self.max_locations)
        return self.loc_head(torch.cat([h, self.xfer_embed(xfer)], -1)), loc_mask

    @torch.no_grad()
    def act(self, x: torch.Tensor, xfer_mask: torch.Tensor, locations: torch.Tensor,
            generator: torch.Generator | None = None, greedy: bool = False):
        """Sample (or, greedy, take the most likely) actions. x [B, D], xfer_mask [B, N1], locations (a mask
        [B, N1, L] or counts [B, N1]) -> xfer [B], location [B], log-probability [B], value [B]."""
        inp = self.inputs(x, locations)
        h = self.trunk(inp)
        xl = masked_logits(self.xfer_head(h), xfer_mask)                              # [B, N1]
        if greedy:
            xfer = xl.argmax(-1)
        else:
            xfer = torch.multinomial(torch.softmax(xl, -1), 1, generator=generator).squeeze(-1)
        ll, loc_mask = self._location_logits(h, xfer, locations)
        ll = masked_logits(ll, loc_mask)                                              # [B, L]
        loc = ll.argmax(-1) if greedy else torch.multinomial(torch.softmax(ll, -1), 1, generator=generator).squeeze(-1)
        logp = torch.log_softmax(xl, -1).gather(-1, xfer[:, None]).squeeze(-1) + \
            torch.log_softmax(ll, -1).gather(-1, loc[:, None]).squeeze(-1)
        return xfer, loc, logp, self.value_head(inp).squeeze(-1)

    def evaluate(self, x: torch.Tensor, xfer: torch.Tensor, loc: torch.Tensor, xfer_mask: torch.Tensor,
                 locations: torch.Tensor):
        """Log-probability [B], entropy [B] (rule head + location head) and value [B] of given actions."""
        inp = self.inputs(x, locations)
        h = self.trunk(inp)
        xl_raw = self.xfer_head(h)
        ll_raw, loc_mask = self._location_logits(h, xfer, locations)
        xl, ll = masked_logits(xl_raw, xfer_mask), masked_logits(ll_raw, loc_mask)
        logp = torch.log_softmax(xl, -1).gather(-1, xfer[:, None]).squeeze(-1) + \
            torch.log_softmax(ll, -1).gather(-1, loc[:, None]).squeeze(-1)
        entropy = masked_entropy(xl_raw, xfer_mask) + masked_entropy(ll_raw, loc_mask)
        return logp, entropy, self.value_head(inp).squeeze(-1)
