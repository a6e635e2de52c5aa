"""The attention-kernel probe (:mod:`hicache.runner.kernels.probe`) catches realistic
kernel bugs.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``) on the probe's own cases, :data:`PROBE_CASES`, unchanged (300 keys,
page 64, head dim 128, GQA 4, 2 KV heads): fp32 and fp16, as :func:`supported_cases`
picks for a CPU device (the interpreter cannot run a bf16 ``tl.dot``,
triton-lang/triton#11584); on CUDA (``gpu``) the compiled kernels in every dtype the GPU
supports, bf16 included. Checked here:

* the case list: one named list shared by the probe and these tests, cases that cross
  key blocks, bf16 only where the device has it, bad cases refused;
* the real kernels pass every case, well within each dtype's tolerance;
* the real kernels with one deliberate bug each (:func:`broken_kernel`: the accumulator
  or the normalizer not rescaled across key blocks, in the decode or in the extend
  kernel), called where the attention layers call them, fail the probe while the other
  kernel passes; so does a kernel wrong only for 16-bit inputs (the fp32 case passes,
  the fp16 one does not). The probe before these cases (11 keys, less than one block,
  fp32 only) passed all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.engine_fixtures import (
    SKIPPED_NORMALIZER_RESCALE,
    SKIPPED_RESCALE,
    broken_kernel,
)

pytest.importorskip("triton")

from hicache.runner.kernels import decode_attention, extend_attention
from hicache.runner.kernels.probe import (
    KEY_BLOCK,
    PROBE_CASES,
    TOLERANCES,
    cases_for,
    check_kernels,
    supported_cases,
)

CPU = torch.device("cpu")
KERNELS = {"decode": decode_attention, "extend": extend_attention}
WRAPPERS = {"decode": "paged_decode_attention", "extend": "paged_extend_attention"}


def break_kernel(
    monkeypatch: pytest.MonkeyPatch, kernel: str, bug: tuple[str, str], directory: Path
) -> Callable[..., Any]:
    """Put the ``kernel`` ("decode" or "extend") with ``bug`` where the probe and the
    attention layers look it up; returns the real wrapper."""
    module = KERNELS[kernel]
    real: Callable[..., Any] = getattr(module, WRAPPERS[kernel])
    broken = getattr(broken_kernel(module, *bug, directory), WRAPPERS[kernel])
    monkeypatch.setattr(module, WRAPPERS[kernel], broken)
    return real


def test_the_cases_cross_key_blocks_and_follow_the_device() -> None:
    assert [c.dtype for c in PROBE_CASES] == [torch.float32, torch.float16, torch.bfloat16]
    for c in PROBE_CASES:
        assert (c.page_size, c.head_dim, c.group, c.keys, c.kv_heads) == (64, 128, 4, 300, 2)
        assert c.keys > 4 * KEY_BLOCK and c.keys % KEY_BLOCK and c.keys % c.page_size
        assert c.tolerance == TOLERANCES[c.dtype]
    assert [c.dtype for c in supported_cases(CPU)] == [torch.float32, torch.float16]
    assert cases_for(bf16=True) == PROBE_CASES
    assert cases_for(bf16=False) == PROBE_CASES[:2]
    assert TOLERANCES[torch.float32] < TOLERANCES[torch.float16] < TOLERANCES[torch.bfloat16]
    with pytest.raises(ValueError, match="keys=128 is invalid; must exceed two key blocks"):
        dataclasses.replace(PROBE_CASES[0], keys=128)
    with pytest.raises(ValueError, match=r"dtype=torch\.float64 has no tolerance"):
        dataclasses.replace(PROBE_CASES[0], dtype=torch.float64)
    with pytest.raises(ValueError, match="group=0 is invalid"):
        dataclasses.replace(PROBE_CASES[0], group=0)


def test_the_real_kernels_pass_every_case_here() -> None:
    results = check_kernels(CPU)
    assert [r.case for r in results] == list(supported_cases(CPU))
    for r in results:
        assert r.ok, r
        # the margins the tolerances claim: 5x at least
        assert max(r.decode_error, r.extend_error) < r.case.tolerance / 5, r


@pytest.mark.parametrize("bug", [SKIPPED_RESCALE, SKIPPED_NORMALIZER_RESCALE], ids=["acc", "l"])
@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_a_kernel_that_skips_the_cross_block_rescale_fails_the_probe(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kernel: str, bug: tuple[str, str]
) -> None:
    break_kernel(monkeypatch, kernel, bug, tmp_path)
    (result,) = check_kernels(CPU, PROBE_CASES[:1])
    assert not result.ok
    wrong = result.decode_error if kernel == "decode" else result.extend_error
    right = result.extend_error if kernel == "decode" else result.decode_error
    assert wrong > 0.05 and right < 1e-5  # errors of 0.1 and more; the other kernel exact


def test_a_kernel_wrong_only_for_16_bit_inputs_fails_the_probe(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As a 16-bit ``tl.dot`` miscompiled on some GPU would be: fp32 passes, fp16 not."""
    real = break_kernel(monkeypatch, "decode", SKIPPED_RESCALE, tmp_path)
    broken = decode_attention.paged_decode_attention

    def by_dtype(q: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        out: torch.Tensor = (real if q.dtype == torch.float32 else broken)(q, *args, **kw)
        return out

    monkeypatch.setattr(decode_attention, "paged_decode_attention", by_dtype)
    fp32, fp16 = check_kernels(CPU)
    assert fp32.case.dtype == torch.float32 and fp32.ok
    assert fp16.case.dtype == torch.float16 and not fp16.ok
    assert fp16.decode_error > 0.05 and fp16.extend_error < fp16.case.tolerance


@pytest.mark.gpu
def test_the_compiled_kernels_pass_every_case_the_gpu_supports() -> None:
    cuda = torch.device("cuda")
    results = check_kernels(cuda)
    dtypes = [r.case.dtype for r in results]
    assert dtypes[:2] == [torch.float32, torch.float16]
    assert (torch.bfloat16 in dtypes) == torch.cuda.is_bf16_supported(including_emulation=False)
    for r in results:
        assert r.ok and max(r.decode_error, r.extend_error) < r.case.tolerance / 5, r


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_the_compiled_broken_kernels_fail_every_case_on_the_gpu(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kernel: str
) -> None:
    break_kernel(monkeypatch, kernel, SKIPPED_RESCALE, tmp_path)
    for r in check_kernels(torch.device("cuda")):
        assert not r.ok, r
