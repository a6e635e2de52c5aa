"""How far two correct floating-point computations of the same values may differ.

The model and kernel tests compare against an independent implementation (transformers,
SDPA, a float64 reference). Both sides add the same terms in a different order: our paged
kernels against transformers' dense ops, and on x86 each side again depending on the
kernels ATen dispatches to (``ATEN_CPU_CAPABILITY``: ``default`` scalar loops, AVX2's 8
fp32 lanes, AVX-512's 16). A recursive sum of ``n`` terms in any order lies within
``gamma_n * sum|terms|`` of the exact sum, ``gamma_n = n*u / (1 - n*u)`` with the unit
roundoff ``u = eps / 2`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd
ed., section 4.2); two orderings therefore differ by at most about ``n * eps * sum|terms|``.
That is the bound a test may hold both sides to without depending on the dispatch; it is
still orders of magnitude under any defect the tests look for (a wrong slot, a missing
RoPE, a value rounded through a 16-bit type: ``2**-8`` relative for bf16).
"""

from __future__ import annotations

import torch

__all__ = ["order_bound"]


def order_bound(length: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """The most two orderings of a ``length``-term sum of ``dtype`` values may differ
    when ``scale`` bounds the sum of the terms' magnitudes: ``length * eps * scale``.

    >>> order_bound(64, 1.0) == 64 * 2.0**-23
    True
    """
    if length < 1:
        raise ValueError(f"length={length} must be at least 1 (the terms of the sum)")
    if not scale >= 0:
        raise ValueError(f"scale={scale} must be a magnitude (>= 0)")
    return length * torch.finfo(dtype).eps * scale
