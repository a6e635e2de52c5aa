"""A once-per-device check that the Triton attention kernels run and agree with SDPA.

``attention_backend="auto"`` picks the kernels on CUDA only when this probe passes there: a
compile error, a launch failure or a wrong result costs a logged warning and the SDPA
path, never a failed or wrong forward. :func:`check_kernels` runs every case of
:data:`PROBE_CASES` the device supports (:func:`supported_cases`), both kernels against
SDPA over the gathered keys, in fp32, on the same rounded inputs. The cases reach what a
small case never does: several hundred keys (several ``BLOCK_N`` = 64 key blocks, so the
online softmax's cross-block rescale matters), page 64, head dim 128, GQA group 4, and
fp16/bf16 inputs (another ``tl.dot`` path). A case's batch (:func:`_case_batch`): three
sequences of ``keys``, ``keys // 2 + 1`` and 1 keys on shuffled pages; decode attends each
last token, extend adds ``keys // 3`` tokens to the longest and prefills the second, in one
launch; lengths end mid-page and mid-block. Cost: once per device (seconds of compiling
on a GPU, not measured yet; about 2 s of CPU per case under Triton's interpreter).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hicache.device_probe import DeviceProbe

__all__ = [
    "PROBE_CASES",
    "TOLERANCES",
    "CaseResult",
    "ProbeCase",
    "cases_for",
    "check_case",
    "check_kernels",
    "kernels_agree",
    "supported_cases",
]

log = logging.getLogger("hicache.engine")

KEY_BLOCK = 64
"""Keys the kernels take per step (their default ``block_n``): a case must span several."""

TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}
"""Largest error accepted per input dtype, an output element's error being
``|kernel - SDPA| / (1 + |SDPA|)`` (absolute below 1, relative above: a 16-bit output's
own rounding is relative), for K, V and q of unit scale, the reference computed in fp32
from the same rounded inputs. fp32: the kernels use ``ieee`` dots and match to ~1e-6.
16-bit: ``p`` is rounded for ``p·v`` and the output is stored in the input dtype, so
errors of a few units of the dtype's rounding ``u`` (fp16: ``u = 2**-11``, measured
~3e-4; bf16: ``u = 2**-8``, 8x coarser); the tolerance is 8u for fp16 and 4u for bf16. A
missing cross-block rescale, or a block dropped or read twice, errs by 0.1 or more (the
tests show it)."""


@dataclass(frozen=True, slots=True)
class ProbeCase:
    """One probe configuration: K/V and queries in ``dtype``, a pool of ``page_size``-token
    pages, ``kv_heads`` KV heads of ``head_dim``, ``group`` query heads per KV head (GQA),
    the longest sequence holding ``keys`` keys (more than two key blocks, so a rescale
    across blocks happens in every kernel)."""

    dtype: torch.dtype
    page_size: int
    head_dim: int
    group: int
    keys: int
    kv_heads: int = 2

    def __post_init__(self) -> None:
        if self.dtype not in TOLERANCES:
            raise ValueError(f"dtype={self.dtype} has no tolerance; one of {list(TOLERANCES)}")
        for name in ("page_size", "head_dim", "group", "kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid; must be >= 1")
        if self.keys <= 2 * KEY_BLOCK:
            raise ValueError(
                f"keys={self.keys} is invalid; must exceed two key blocks (> {2 * KEY_BLOCK})"
            )

    @property
    def tolerance(self) -> float:
        """The largest error accepted (:data:`TOLERANCES` of the dtype)."""
        return TOLERANCES[self.dtype]


PROBE_CASES: tuple[ProbeCase, ...] = tuple(
    ProbeCase(dtype=dtype, page_size=64, head_dim=128, group=4, keys=300)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
)
"""What the probe checks, each dtype where the device supports it (:func:`supported_cases`):
300 keys (4 blocks and 44 keys), page 64, head dim 128, 2 KV heads with 4 query heads
each. Tests run the same cases in Triton's interpreter."""


def cases_for(*, bf16: bool, cases: tuple[ProbeCase, ...] = PROBE_CASES) -> tuple[ProbeCase, ...]:
    """``cases`` less the bf16 ones unless ``bf16``."""
    return tuple(c for c in cases if bf16 or c.dtype != torch.bfloat16)


def supported_cases(device: torch.device) -> tuple[ProbeCase, ...]:
    """The cases of :data:`PROBE_CASES` that ``device`` can run: bf16 only on a CUDA device
    with native bf16 (``torch.cuda.is_bf16_supported`` without emulation); elsewhere (CPU:
    Triton's interpreter, which cannot run a bf16 ``tl.dot``, triton-lang/triton#11584)
    fp32 and fp16."""
    bf16 = False
    if device.type == "cuda":
        with torch.cuda.device(device):
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    return cases_for(bf16=bf16)


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One case's outcome: the largest error (:data:`TOLERANCES`) of the decode kernel's
    outputs and of the extend kernel's (NaN when a kernel wrote NaN)."""

    case: ProbeCase
    decode_error: float
    extend_error: float

    @property
    def ok(self) -> bool:
        """Both errors within the case's tolerance (NaN fails)."""
        tol = self.case.tolerance
        return self.decode_error <= tol and self.extend_error <= tol


@dataclass(frozen=True, slots=True)
class _CaseBatch:
    """A case's inputs (module docstring): the pool layer ``k``/``v (S, Hkv, D)``, ``table
    (3, W)`` page ids, ``lengths`` keys per sequence, the decode queries ``q_decode (3, Hq,
    D)`` and the extend's ``q_extend (T, Hq, D)`` for sequences 0 and 1 with
    ``prefixes``/``extends`` tokens."""

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    slots: list[torch.Tensor]
    lengths: list[int]
    q_decode: torch.Tensor
    q_extend: torch.Tensor
    prefixes: list[int]
    extends: list[int]


def _case_batch(case: ProbeCase, device: torch.device, seed: int = 0) -> _CaseBatch:
    """The random batch of ``case`` on ``device`` (drawn on the CPU, so the same everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    ps, hkv, dim = case.page_size, case.kv_heads, case.head_dim
    lengths = [case.keys, case.keys // 2 + 1, 1]
    width = -(-case.keys // ps)
    pages = len(lengths) * width + 1
    shape = (pages * ps, hkv, dim)
    k = torch.randn(shape, generator=gen).to(device, case.dtype)
    v = torch.randn(shape, generator=gen).to(device, case.dtype)
    order = torch.randperm(pages, generator=gen)
    table = torch.stack([order[i * width : (i + 1) * width] for i in range(len(lengths))])
    slots = []
    for row, n in zip(table, lengths, strict=True):
        t = torch.arange(n)
        slots.append((row[t // ps] * ps + t % ps).to(device))
    new = case.keys // 3
    prefixes, extends = [case.keys - new, 0], [new, lengths[1]]
    hq = hkv * case.group
    q_decode = torch.randn(len(lengths), hq, dim, generator=gen).to(device, case.dtype)
    q_extend = torch.randn(sum(extends), hq, dim, generator=gen).to(device, case.dtype)
    return _CaseBatch(k, v, table.to(device), slots, lengths, q_decode, q_extend, prefixes, extends)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float
) -> torch.Tensor:
    """fp32 SDPA of ``q (n, Hq, D)``, new tokens at positions ``prefix ..``, over ``k``/``v
    (prefix + n, Hkv, D)`` with the causal-after-prefix mask: ``(n, Hq, D)``."""
    n, keys = q.shape[0], k.shape[0]
    mask = (
        torch.arange(keys, device=q.device)[None, :]
        <= (prefix + torch.arange(n, device=q.device))[:, None]
    )
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``|got - want| / (1 + |want|)`` (:data:`TOLERANCES`), in fp32; NaN when
    ``got`` holds a NaN."""
    diff = (got.float() - want).abs() / (1 + want.abs())
    return float("nan") if bool(diff.isnan().any()) else float(diff.max().item())


def check_case(case: ProbeCase, device: torch.device) -> CaseResult:
    """Both kernels on ``case``'s batch (module docstring) against SDPA, on ``device``.
    Raises what a kernel raises (a compile or launch error)."""
    # looked up at call time, from their modules, so the probe checks what the
    # attention layers call
    from hicache.runner.kernels import decode_attention, extend_attention

    b = _case_batch(case, device)
    scale = case.head_dim**-0.5
    lens = torch.tensor(b.lengths, device=device)
    got = decode_attention.paged_decode_attention(
        b.q_decode, b.k, b.v, b.table, lens, page_size=case.page_size, scale=scale
    )
    want = torch.stack(
        [
            _sdpa(b.q_decode[i : i + 1], b.k[s], b.v[s], len(s) - 1, scale)[0]
            for i, s in enumerate(b.slots)
        ]
    )
    decode_error = _error(got, want)
    got = extend_attention.paged_extend_attention(
        b.q_extend,
        b.k,
        b.v,
        b.table[:2],
        torch.tensor(b.prefixes, device=device),
        torch.tensor(b.extends, device=device),
        page_size=case.page_size,
        scale=scale,
        max_extend=max(b.extends),
    )
    wants, row = [], 0
    for s, p, n in zip(b.slots[:2], b.prefixes, b.extends, strict=True):
        wants.append(_sdpa(b.q_extend[row : row + n], b.k[s], b.v[s], p, scale))
        row += n
    extend_error = _error(got, torch.cat(wants))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return CaseResult(case, decode_error, extend_error)


def check_kernels(
    device: torch.device, cases: tuple[ProbeCase, ...] | None = None
) -> tuple[CaseResult, ...]:
    """:func:`check_case` for each of ``cases`` (default: :func:`supported_cases` of
    ``device``), in order; raises what a kernel raises."""
    chosen = supported_cases(device) if cases is None else cases
    return tuple(check_case(c, device) for c in chosen)


def _probe(device: torch.device) -> bool:
    """Whether every supported case passes; logs the cases that do not."""
    ok = True
    for result in check_kernels(device):
        if not result.ok:
            c = result.case
            log.warning(
                "attention kernel probe on %s: %s page %d head_dim %d group %d keys %d:"
                " decode error %.3g, extend error %.3g (tolerance %g)",
                device,
                c.dtype,
                c.page_size,
                c.head_dim,
                c.group,
                c.keys,
                result.decode_error,
                result.extend_error,
                c.tolerance,
            )
            ok = False
    return ok


kernels_agree = DeviceProbe("the Triton attention kernels", "SDPA", _probe, log)
"""Whether the decode and extend kernels run on a device and match SDPA there on every
supported case of :data:`PROBE_CASES` (checked once per device)."""
