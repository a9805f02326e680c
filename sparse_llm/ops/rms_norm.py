"""RMSNorm as transformers' LlamaRMSNorm computes it, and its backward written out.

The backward is spelled out for the sparse FFN block (sparse_llm.ops.ffn.block), which runs
the norm inside its own autograd function and differentiates it on the rows that changed only.
"""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim: normalised in float32 and cast back to x's dtype
    before the scale, as transformers' LlamaRMSNorm does; then cast to `out_dtype` if given."""
    out = weight * rms_norm_stats(x, eps)[0]
    return out if out_dtype is None else out.to(out_dtype)


def rms_norm_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(xhat = x / rms(x) in x's dtype, r = rsqrt(mean(x^2) + eps) in float32, [..., 1]): the
    forward's normalised rows, before the scale, and what the backward needs besides them."""
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * r).to(x.dtype), r


def rms_norm_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x in x's dtype, grad_weight in weight's dtype) of `rms_norm` for x: [..., D]."""
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return rms_norm_backward_from(grad_out, x32 * r, r, weight, x.dtype)


def rms_norm_backward_from(
    grad_out: torch.Tensor, xhat: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, x_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_backward` from the normalised rows xhat (any float dtype: a rounded copy gives
    the gradient to that rounding) and r = rsqrt(mean(x^2) + eps) ([..., 1], float32).

    With g = grad_out * weight: grad_x = r * (g - xhat * mean(g * xhat)),
    grad_weight = sum over rows of grad_out * xhat (xhat as the forward rounded it to x's dtype).
    In float32 like the forward; the casts pass gradients through unchanged, as autograd's do.
    """
    xhat = xhat.float()
    grad = grad_out.float()
    grad_weight = (grad * xhat.to(x_dtype).float()).reshape(-1, xhat.shape[-1]).sum(0)
    g = grad * weight.float()
    grad_x = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return grad_x.to(x_dtype), grad_weight.to(weight.dtype)
