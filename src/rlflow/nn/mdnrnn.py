"""The MDN-RNN world model (Ha & Schmidhuber's World Models, as used by RLFlow).

Per step the input is ``[z_t, one_hot(xfer_t) (N+1: rule N is the NO-OP), location_t / max_locations,
emb(location_t)]`` (a small learned location embedding next to the scaled index). An LSTM carries the history;
from its output ``h_t`` the heads predict what follows action ``a_t`` in graph ``z_t``:

    mus, sigmas, logpi   the next latent z_{t+1} as a mixture of K diagonal Gaussians (sigmas = softplus + 1e-3,
                         logpi = log_softmax over K)
    deltas               the change of the 4 cost metrics (runtime_ms, flops, bytes, launches), normalised:
                         d = (log1p(m_{t+1}) - log1p(m_t) - mean) / std, with mean/std of the training steps
                         stored in the buffers ``delta_mean``/``delta_std`` (see :meth:`MDNRNN.metrics_after`)
    changed              a logit: the step changes the cost metrics at all (the deltas are a zero-inflated
                         mixture: with probability 1 - sigmoid(changed) every delta is exactly 0, as for a
                         cost-neutral rewrite such as a commutativity swap; else ``deltas``)
    done                 a logit: the episode ends after this step
    log_counts           log1p of the per-rule match counts of the next graph (N, capped at max_locations, as
                         the masks are), predicted as a change of the current graph's counts c_t:
                         c_{t+1} = softplus_10(c_t + head(h_t)) (a smooth max(., 0)), the head starting at zero
                         (no change), so that one match used up is the same -1 at any count; the applied rule's
                         own count has a per-rule term besides (``rule_uses``), and a fixed table from the data
                         says what applying rule k does to rule j's count (``count_effects``: one merge uses up
                         the same pair's other merge rules' matches, moving a scale opens the fold that follows
                         it; a raise applies to a rule at 0 only if the data saw k open j from 0; see
                         :func:`rlflow.agents.world_model.count_effects`). Rule k is applicable
                         iff expm1(log_counts_k) > 0.5 (:meth:`MDNRNN.masks`). Predicted outright, the counts did
                         not fall as matches were used up: in the dream BERT's MatMul merges never ran out (69 in
                         one 100-step episode; the real graph has about 24), and the controller learned nothing else

``deltas`` and ``changed`` also have a term per rule, added to the head's output (``rule_delta``,
``rule_change``; a rule's effect on the cost metrics depends on the graph, but mostly on the rule: a commutativity
swap never changes them). Training starts them at the training data's per-rule statistics
(:meth:`MDNRNN.set_rule_priors`): with Adam's small steps, a few hundred updates could not otherwise move a rule's
logit far enough, and the world model kept predicting changes (and savings) for cost-neutral rewrites that the
controller then learned to make in the dream.

Besides z and the action, every step reads the current graph's counts c_t (the rollouts' counts in training,
the dream's own predictions in the dream, the real graph's when the controller runs for real).

``forward`` runs whole padded sequences; ``step`` runs one step from a given hidden state with the same
weights (the dream environment's cell). A hidden state of None is zeros (the start of an episode).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

N_METRICS = 4
MIN_SIGMA = 1e-3
COUNT_BETA = 10.0  # sharpness of the smooth max(., 0) of the next counts: softplus_10(0) = 0.07, rounds to 0


class WorldModelOutput(NamedTuple):
    """Predictions for each step; shapes for ``forward`` (``step`` drops the T axis)."""

    mus: torch.Tensor         # [B, T, K, Z]
    sigmas: torch.Tensor      # [B, T, K, Z]
    logpi: torch.Tensor       # [B, T, K]
    deltas: torch.Tensor      # [B, T, 4]   normalised log1p-metric deltas (given that the metrics change)
    changed: torch.Tensor     # [B, T]      logit: the metrics change at all
    done: torch.Tensor        # [B, T]      logit
    log_counts: torch.Tensor  # [B, T, N]   predicted log1p(match count) of the next graph
    hidden: tuple             # (h, c), each [1, B, H]
    member_deltas: torch.Tensor | None = None   # [B, T, E, 4]  an ensemble's members' deltas (else None)
    member_changed: torch.Tensor | None = None  # [B, T, E]     and their changed logits


class MDNRNN(nn.Module):
    def __init__(self, z_dim: int, n_xfers: int, max_locations: int, hidden: int = 256, gaussians: int = 8,
                 loc_embed: int = 8):
        super().__init__()
        self.config = {"z_dim": int(z_dim), "n_xfers": int(n_xfers), "max_locations": int(max_locations),
                       "hidden": int(hidden), "gaussians": int(gaussians), "loc_embed": int(loc_embed)}
        self.z_dim, self.n_xfers, self.max_locations = int(z_dim), int(n_xfers), int(max_locations)
        self.hidden_size, self.gaussians = int(hidden), int(gaussians)
        self.loc_emb = nn.Embedding(self.max_locations, loc_embed)
        in_dim = self.z_dim + self.n_xfers + 1 + 1 + loc_embed
        self.rnn = nn.LSTM(in_dim, self.hidden_size, batch_first=True)
        K, Z = self.gaussians, self.z_dim
        self.gmm_head = nn.Linear(self.hidden_size, 2 * K * Z + K)
        self.delta_head = nn.Linear(self.hidden_size, N_METRICS)
        self.done_head = nn.Linear(self.hidden_size, 1)
        self.count_change_head = nn.Linear(self.hidden_size, self.n_xfers)  # c_{t+1} - c_t
        self.change_head = nn.Linear(self.hidden_size, 1)  # created last: the other heads' init stays as it was
        self.rule_change = nn.Embedding(self.n_xfers + 1, 1)          # per-rule terms (zero until set_rule_priors)
        self.rule_delta = nn.Embedding(self.n_xfers + 1, N_METRICS)
        self.rule_uses = nn.Embedding(self.n_xfers + 1, 1)             # the change of the applied rule's own count
        nn.init.zeros_(self.rule_uses.weight)
        nn.init.zeros_(self.rule_change.weight)
        nn.init.zeros_(self.rule_delta.weight)
        nn.init.zeros_(self.count_change_head.weight)                  # at first: every count stays as it is
        nn.init.zeros_(self.count_change_head.bias)
        # what applying rule k does to rule j's count, from the data (rows k, j, change; see set_rule_priors)
        self.register_buffer("count_effects", torch.zeros(0, 4))
        self._effects_dense = None  # the same as an [N+1, N] table, built on first use
        self.register_buffer("delta_mean", torch.zeros(N_METRICS))
        self.register_buffer("delta_std", torch.ones(N_METRICS))

    # -- inputs -------------------------------------------------------------------------------------------
    def encode_inputs(self, z: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """z [B, T, Z] float, actions [B, T, 2] int (xfer, location; padding -1 allowed) -> [B, T, in_dim]."""
        xfer = actions[..., 0].long().clamp(0, self.n_xfers)
        loc = actions[..., 1].long().clamp(0, self.max_locations - 1)
        onehot = F.one_hot(xfer, self.n_xfers + 1).to(z.dtype)
        scaled = (loc.to(z.dtype) / self.max_locations).unsqueeze(-1)
        return torch.cat([z, onehot, scaled, self.loc_emb(loc)], dim=-1)

    def next_log_counts(self, counts: torch.Tensor, out: torch.Tensor, xfer: torch.Tensor) -> torch.Tensor:
        """counts [..., N] of the current graph (capped here at max_locations), the LSTM output [..., H], the rule
        applied [...] -> log1p of the next graph's predicted counts (the change added, the applied rule's own
        count changed by its per-rule term besides, then a smooth max with 0)."""
        own = self.rule_uses(xfer) * (xfer < self.n_xfers).unsqueeze(-1)               # the NO-OP: no rule's
        table, at_zero = self._effect_table()
        effect = torch.where(counts > 0.5, table[xfer], at_zero[xfer])  # a rule at 0: only raises seen from 0
        change = self.count_change_head(out).scatter_add(-1, xfer.clamp(max=self.n_xfers - 1).unsqueeze(-1),
                                                         own.to(out.dtype)) + effect
        return torch.log1p(F.softplus(counts.to(change.dtype).clamp(0, self.max_locations) + change, beta=COUNT_BETA))

    def _heads(self, out: torch.Tensor, hidden: tuple, xfer: torch.Tensor, counts: torch.Tensor) -> WorldModelOutput:
        K, Z = self.gaussians, self.z_dim
        g = self.gmm_head(out)
        lead = out.shape[:-1]
        mus = g[..., : K * Z].reshape(*lead, K, Z)
        sigmas = F.softplus(g[..., K * Z: 2 * K * Z]).reshape(*lead, K, Z) + MIN_SIGMA
        logpi = F.log_softmax(g[..., 2 * K * Z:], dim=-1)
        deltas = self.delta_head(out) + self.rule_delta(xfer)
        changed = (self.change_head(out) + self.rule_change(xfer)).squeeze(-1)
        return WorldModelOutput(mus, sigmas, logpi, deltas, changed, self.done_head(out).squeeze(-1),
                                self.next_log_counts(counts, out, xfer), hidden)

    def _effect_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [N+1, N] tables: the change of rule j's count (column) when rule k (row; the NO-OP last) is
        applied, and the same where j's count is 0 (the effects' 4th column; a table of 3 columns, from before
        it, uses the change there too)."""
        e = self.count_effects
        if self._effects_dense is None or self._effects_dense[0].device != e.device:
            table = torch.zeros(2, self.n_xfers + 1, self.n_xfers, device=e.device)
            if len(e):
                rows, cols = e[:, 0].long(), e[:, 1].long()
                table[0, rows, cols] = e[:, 2]
                table[1, rows, cols] = e[:, 3] if e.shape[1] > 3 else e[:, 2]
            self._effects_dense = (table[0], table[1])
        return self._effects_dense

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        effects = state_dict.get(prefix + "count_effects")
        if effects is not None:  # as many rows as the data gave: take the saved shape
            self.count_effects = torch.empty_like(effects, device=self.count_effects.device)
            self._effects_dense = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def set_rule_priors(self, change_logit: torch.Tensor, deltas: torch.Tensor, uses: torch.Tensor,
                        effects: torch.Tensor | None = None) -> None:
        """Start the per-rule terms at the training data's statistics: change_logit [N+1] (each rule's smoothed
        log-odds that a step changes the metrics, minus the head's bias), deltas [N+1, 4] (each rule's mean
        normalised delta over its steps that changed them, shrunk towards 0) and uses [N+1] (the mean change of a
        rule's own count when it is applied, shrunk towards 0: -1 for a rule whose match is used up); effects
        [P, 4] (rows rule k, rule j, the change of j's count when k is applied, the change where j's count is 0:
        a fixed term of the count prediction)."""
        self.rule_change.weight.copy_(torch.as_tensor(change_logit, dtype=torch.float32).reshape(-1, 1)
                                      - self.change_head.bias)
        self.rule_delta.weight.copy_(torch.as_tensor(deltas, dtype=torch.float32))
        self.rule_uses.weight.copy_(torch.as_tensor(uses, dtype=torch.float32).reshape(-1, 1))
        if effects is not None:
            self.count_effects = torch.as_tensor(effects, dtype=torch.float32, device=self.count_effects.device)
            self._effects_dense = None

    # -- running ------------------------------------------------------------------------------------------
    def forward(self, z: torch.Tensor, actions: torch.Tensor, counts: torch.Tensor,
                hidden: tuple | None = None) -> WorldModelOutput:
        """Whole sequences: z [B, T, Z], actions [B, T, 2], counts [B, T, N] (each step's current graph's match
        counts) -> predictions for every step (padding is computed too and must be masked by the caller; it comes
        after the real steps so it cannot affect them)."""
        out, hidden = self.rnn(self.encode_inputs(z, actions), hidden)
        return self._heads(out, hidden, actions[..., 0].long().clamp(0, self.n_xfers), counts)

    def step(self, z_t: torch.Tensor, action_t: torch.Tensor, counts_t: torch.Tensor,
             hidden: tuple | None = None) -> WorldModelOutput:
        """One step: z_t [B, Z], action_t [B, 2], counts_t [B, N] (the current graph's match counts), hidden
        (h, c) [1, B, H] or None -> predictions without the T axis, and the next hidden state.

        The same function as :meth:`forward` on a one-step sequence (a test compares them), computed as an
        LSTM cell that never builds the (N+1)-wide one-hot input: its product with the input weights is the
        rule's column of those weights, gathered (the dream's hot path; N ~ 1,200 on bert)."""
        B, Z, N1 = z_t.shape[0], self.z_dim, self.n_xfers + 1
        if hidden is None:
            hidden = self.initial_hidden(B, z_t.device)
        h, c = hidden[0][0], hidden[1][0]
        xfer = action_t[..., 0].long().clamp(0, self.n_xfers)
        loc = action_t[..., 1].long().clamp(0, self.max_locations - 1)
        w_ih, w_hh = self.rnn.weight_ih_l0, self.rnn.weight_hh_l0        # [4H, in_dim], [4H, H]
        z_t = z_t.to(w_ih.dtype)
        loc_in = torch.cat([(loc.to(z_t.dtype) / self.max_locations).unsqueeze(-1), self.loc_emb(loc)], -1)
        gates = torch.addmm(self.rnn.bias_ih_l0 + self.rnn.bias_hh_l0, z_t, w_ih[:, :Z].t())
        gates = gates + w_ih[:, Z:Z + N1].t()[xfer]                      # one_hot(xfer) @ W^T
        gates = gates.addmm_(loc_in, w_ih[:, Z + N1:].t()).addmm_(h, w_hh.t())
        i, f, g, o = gates.chunk(4, dim=-1)                              # PyTorch's gate order
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return self._heads(h, (h.unsqueeze(0), c.unsqueeze(0)), xfer, counts_t)

    def initial_hidden(self, batch: int, device=None) -> tuple:
        h = torch.zeros(1, batch, self.hidden_size, device=device)
        return h, h.clone()

    def set_delta_norm(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """The mean and std that normalise the log1p-metric deltas (of the training steps)."""
        self.delta_mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
        self.delta_std.copy_(torch.as_tensor(std, dtype=torch.float32))

    # -- decoding predictions -----------------------------------------------------------------------------
    def metrics_after(self, metrics: torch.Tensor, deltas: torch.Tensor,
                      changed: torch.Tensor | None = None) -> torch.Tensor:
        """The predicted raw metrics of the next graph: metrics [..., 4] (runtime_ms, flops, bytes, launches
        of the current graph), normalised deltas [..., 4] -> expm1(log1p(metrics) + delta * std + mean);
        ``changed`` [...] (bool, optional): where False the metrics stay exactly as they are."""
        logd = deltas * self.delta_std + self.delta_mean
        after = torch.expm1(torch.log1p(metrics.clamp(min=0)) + logd)
        return after if changed is None else torch.where(changed.unsqueeze(-1), after, metrics.to(after.dtype))

    @staticmethod
    def counts(log_counts: torch.Tensor) -> torch.Tensor:
        """Predicted match counts (>= 0) from the log1p head."""
        return torch.expm1(log_counts).clamp(min=0)

    @staticmethod
    def masks(log_counts: torch.Tensor) -> torch.Tensor:
        """Rule mask [..., N]: True where the predicted count > 0.5 (rounds to at least one match)."""
        return torch.expm1(log_counts) > 0.5

    def sample_z(self, out: WorldModelOutput, temperature: float = 1.0, generator=None) -> torch.Tensor:
        """Sample z_{t+1} [B, Z] from a one-step output (mixture weights sharpened/flattened by temperature)."""
        probs = torch.softmax(out.logpi / temperature, dim=-1)
        k = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        idx = k.view(-1, 1, 1).expand(-1, 1, self.z_dim)
        mu = out.mus.gather(1, idx).squeeze(1)
        sigma = out.sigmas.gather(1, idx).squeeze(1)
        noise = torch.randn(mu.shape, generator=generator, device=mu.device, dtype=mu.dtype)
        return mu + sigma * noise * temperature ** 0.5


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.clamp(1e-6, 1 - 1e-6)
    return torch.log(p) - torch.log1p(-p)


class EnsembleMDNRNN(nn.Module):
    """``members`` MDN-RNNs of the same shape, differently initialised and trained side by side, used as one world
    model with the same interface as :class:`MDNRNN`:

    - the next z is the uniform mixture of the members' mixtures (E x K components: log pi_k - log E), so
      :meth:`sample_z` picks a member and one of its components;
    - deltas and log counts are the members' means; the changed and done probabilities are the members' mean
      probabilities (as logits);
    - the hidden state is every member's, concatenated (``hidden_size`` = E x H: the controller reads them all);
    - the members' own deltas and changed logits are kept (``member_deltas``, ``member_changed``): their
      disagreement is what the dream subtracts from its reward (:class:`rlflow.env.dream.DreamEnv`).
    """

    def __init__(self, members: int, **member_args):
        super().__init__()
        if members < 2:
            raise ValueError("an ensemble needs at least 2 members (1: a plain MDNRNN)")
        self.members = nn.ModuleList(MDNRNN(**member_args) for _ in range(members))
        first = self.members[0]
        self.config = {**first.config, "members": int(members)}
        self.z_dim, self.n_xfers, self.max_locations = first.z_dim, first.n_xfers, first.max_locations
        self.member_hidden = first.hidden_size
        self.hidden_size = members * first.hidden_size
        self.gaussians = members * first.gaussians

    @property
    def delta_mean(self) -> torch.Tensor:
        return self.members[0].delta_mean

    @property
    def delta_std(self) -> torch.Tensor:
        return self.members[0].delta_std

    def set_delta_norm(self, mean, std) -> None:
        for m in self.members:
            m.set_delta_norm(mean, std)

    def set_rule_priors(self, change_logit, deltas, uses, effects=None) -> None:
        for m in self.members:
            m.set_rule_priors(change_logit, deltas, uses, effects)

    def _split(self, hidden: tuple | None) -> list:
        if hidden is None:
            return [None] * len(self.members)
        return list(zip(hidden[0].split(self.member_hidden, -1), hidden[1].split(self.member_hidden, -1)))

    def _join(self, outs: list[WorldModelOutput]) -> WorldModelOutput:
        E = len(outs)
        mean_p = lambda logits: _logit(torch.stack([torch.sigmoid(x) for x in logits]).mean(0))  # noqa: E731
        deltas = torch.stack([o.deltas for o in outs], -2)
        changed = torch.stack([o.changed for o in outs], -1)
        return WorldModelOutput(
            torch.cat([o.mus for o in outs], -2), torch.cat([o.sigmas for o in outs], -2),
            torch.cat([o.logpi for o in outs], -1) - math.log(E), deltas.mean(-2), mean_p([o.changed for o in outs]),
            mean_p([o.done for o in outs]), torch.stack([o.log_counts for o in outs]).mean(0),
            (torch.cat([o.hidden[0] for o in outs], -1), torch.cat([o.hidden[1] for o in outs], -1)),
            deltas, changed)

    def forward(self, z, actions, counts, hidden=None) -> WorldModelOutput:
        return self._join([m(z, actions, counts, h) for m, h in zip(self.members, self._split(hidden))])

    def member_outputs(self, z, actions, counts) -> list[WorldModelOutput]:
        """Each member's own predictions of whole sequences (training: every member has its own loss)."""
        return [m(z, actions, counts) for m in self.members]

    def step(self, z_t, action_t, counts_t, hidden=None) -> WorldModelOutput:
        return self._join([m.step(z_t, action_t, counts_t, h) for m, h in zip(self.members, self._split(hidden))])

    def initial_hidden(self, batch: int, device=None) -> tuple:
        h = torch.zeros(1, batch, self.hidden_size, device=device)
        return h, h.clone()

    metrics_after = MDNRNN.metrics_after
    counts = staticmethod(MDNRNN.counts)
    masks = staticmethod(MDNRNN.masks)
    sample_z = MDNRNN.sample_z


def make_world_model(members: int = 1, **member_args) -> MDNRNN | EnsembleMDNRNN:
    """One MDN-RNN (``members`` 1) or an ensemble of them; ``model_args`` of a checkpoint (its ``config``) too."""
    return MDNRNN(**member_args) if members <= 1 else EnsembleMDNRNN(members, **member_args)


def load_world_model_state(model: nn.Module, state_dict: dict, source: str) -> None:
    """``model.load_state_dict(state_dict)``; a state that does not fit (e.g. one saved by an older rlflow, before
    the per-rule terms) is a one-line RLFlowError naming ``source``."""
    from rlflow.errors import RLFlowError

    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        missing = sorted({k.split(".")[-2] for k in model.state_dict() if k not in state_dict})
        why = f"it lacks {', '.join(missing)}" if missing else str(e).strip().splitlines()[0][:200]
        raise RLFlowError(f"{source}: its world model does not fit this rlflow's ({why}): an older rlflow made it; "
                          "run train_world_model (and the controller) again") from None
