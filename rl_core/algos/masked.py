"""Statistics over the valid (mask == 1) entries of a tensor, as verl's ``torch_functional`` defines them."""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """sum(values * mask); NaN/Inf in masked-out positions do not leak into the sum."""
    valid_values = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (valid_values * mask).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """sum(values * mask) / (sum(mask) + 1e-8)."""
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries; with ``unbiased`` the Bessel factor n / (n - 1), n = sum(mask)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("masked_var: the mask selects no element")
        if mask_sum == 1:
            raise ValueError(
                "masked_var: the mask selects one element, the unbiased variance divides by zero; use a larger batch"
            )
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the valid entries (mean added back when not ``shift_mean``)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean
