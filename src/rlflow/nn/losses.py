"""Masked losses of the world model (pure functions of tensors).

Shapes: ``B`` episodes of a batch, ``T`` steps (padded), ``K`` mixture components, ``Z`` latent dimensions.
``mask`` is a bool (or 0/1) tensor ``[B, T]``: True for real steps, False for padding. Padded steps contribute
nothing to the value or the gradients: their terms are removed with ``torch.where`` (not multiplied by zero,
so that a NaN or inf in a padded step cannot leak through ``0 * nan``). With ``mask=None`` every step counts.
Every loss is the mean over the real steps; with no real step at all the loss is 0 (and still differentiable).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LOG_2PI = math.log(2.0 * math.pi)


def _step_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``mask`` as a bool tensor of the leading ``[B, T]`` shape of ``like`` (all True when None)."""
    if mask is None:
        return torch.ones(like.shape[:2], dtype=torch.bool, device=like.device)
    if mask.shape != like.shape[:2]:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match the steps {tuple(like.shape[:2])}")
    return mask.to(device=like.device, dtype=torch.bool)


def _masked_mean(per_step: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``per_step`` [B, T] over the True entries of ``mask`` [B, T] (0 if none)."""
    kept = torch.where(mask, per_step, torch.zeros_like(per_step))
    return kept.sum() / mask.sum().clamp(min=1)


def gmm_log_prob(target: torch.Tensor, mus: torch.Tensor, sigmas: torch.Tensor, logpi: torch.Tensor) -> torch.Tensor:
    """Log-density of ``target`` under a mixture of diagonal Gaussians, per step.

    target [B, T, Z], mus [B, T, K, Z], sigmas [B, T, K, Z] (> 0), logpi [B, T, K] (log mixture weights,
    logsumexp over K = 0)  ->  [B, T]: log sum_k pi_k prod_z N(target_z; mu_kz, sigma_kz), computed with
    logsumexp over the components (no underflow for far-away targets).
    """
    x = target.unsqueeze(-2)                                    # [B, T, 1, Z]
    zscore = (x - mus) / sigmas
    comp = -0.5 * zscore.pow(2) - torch.log(sigmas) - 0.5 * LOG_2PI  # [B, T, K, Z]
    return torch.logsumexp(logpi + comp.sum(-1), dim=-1)        # [B, T]


def gmm_loss(target: torch.Tensor, mus: torch.Tensor, sigmas: torch.Tensor, logpi: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
    """Negative log-likelihood of a diagonal Gaussian mixture, per latent dimension.

    target [B, T, Z], mus [B, T, K, Z], sigmas [B, T, K, Z], logpi [B, T, K], mask [B, T] or None -> scalar:
    ``- mean over real steps of log p(target) / Z`` (nats per dimension, so the value does not grow with the
    latent size; it can be negative, densities exceed 1 when sigma is small).
    """
    m = _step_mask(mask, target)
    # padded steps get harmless stand-ins before any arithmetic, so even a NaN there has zero gradient
    mz, mk = m.unsqueeze(-1), m.unsqueeze(-1).unsqueeze(-1)
    target = torch.where(mz, target, torch.zeros_like(target))
    mus = torch.where(mk, mus, torch.zeros_like(mus))
    sigmas = torch.where(mk, sigmas, torch.ones_like(sigmas))
    logpi = torch.where(mz, logpi, torch.full_like(logpi, -math.log(logpi.shape[-1])))
    logp = gmm_log_prob(target, mus, sigmas, logpi)
    return -_masked_mean(logp, m) / target.shape[-1]


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error over real steps and all trailing dimensions.

    pred, target [B, T, *D], mask [B, T] or None -> scalar: mean over real steps of the mean over D.
    """
    m = _step_mask(mask, pred)
    diff = torch.where(m.view(*m.shape, *([1] * (pred.dim() - 2))), pred - target, torch.zeros_like(pred))
    per_step = diff.pow(2).reshape(*pred.shape[:2], -1).mean(-1)
    return _masked_mean(per_step, m)


def masked_bce_with_logits(logits: torch.Tensor, target: torch.Tensor,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Binary cross-entropy of logits against 0/1 targets over real steps.

    logits, target [B, T] (or [B, T, *D], averaged over D), mask [B, T] or None -> scalar.
    """
    m = _step_mask(mask, logits)
    mm = m.view(*m.shape, *([1] * (logits.dim() - 2)))
    safe_logits = torch.where(mm, logits, torch.zeros_like(logits))
    safe_target = torch.where(mm, target.to(logits.dtype), torch.zeros_like(logits))
    per = F.binary_cross_entropy_with_logits(safe_logits, safe_target, reduction="none")
    per_step = per.reshape(*logits.shape[:2], -1).mean(-1)
    return _masked_mean(per_step, m)
