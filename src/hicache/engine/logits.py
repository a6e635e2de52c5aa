"""What a step does to its logits besides the draw: penalties, ``logit_bias`` and
``min_tokens`` masking before it (:func:`adjust_logits`), and the log probabilities
reported back (:func:`token_logprobs`).

Log probabilities are taken from the raw logits, before any adjustment or temperature
(see :class:`~hicache.engine.sampling.SamplingParams`). Both functions work on a batch of
rows at once and fail rows one by one: a row whose parameters or history make the batched
computation raise is retried alone and, if it still fails, reported in ``errors`` while the
other rows get exactly what they would have got without it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from hicache.engine.sampling import SamplingParams
from hicache.logprob import TokenLogprob

__all__ = ["AdjustResult", "TokenLogprob", "adjust_logits", "token_logprobs"]


@dataclass(frozen=True, slots=True)
class AdjustResult:
    """Logits after :func:`adjust_logits`: ``logits (R, V)`` fp32 (the input itself when no
    row needed an adjustment), ``errors`` row -> why that row could not be adjusted (its
    row is left as it came)."""

    logits: torch.Tensor
    errors: Mapping[int, str]


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    eos_token_ids: Collection[int],
) -> AdjustResult:
    """Apply each row's penalties, ``logit_bias`` and ``min_tokens`` mask to ``logits (R, V)``.

    ``prompts[i]`` / ``outputs[i]``: row ``i``'s prompt and generated token ids so far.
    In order: ``repetition_penalty`` over prompt and output tokens (positive logits divided,
    negative multiplied), ``frequency_penalty * count + presence_penalty * (count > 0)``
    subtracted with counts over the output, ``logit_bias`` added, then, while fewer than
    ``min_tokens`` tokens were generated, ``stop_token_ids`` and (unless ``ignore_eos``)
    ``eos_token_ids`` set to -inf. Ids outside ``[0, V)`` fail their row (the engine's
    validation refuses them earlier). Returns a new fp32 tensor when any row changes;
    ``logits`` itself is never modified.
    """
    rows = len(params)
    if logits.dim() != 2 or logits.shape[0] != rows or not len(prompts) == rows == len(outputs):
        raise ValueError(
            f"logits {tuple(logits.shape)} needs one params, prompt and output per row, got "
            f"{rows}, {len(prompts)} and {len(outputs)}"
        )
    errors: dict[int, str] = {}
    todo: list[int] = []
    for i, p in enumerate(params):
        try:
            if p.adjusts_logits:
                todo.append(i)
        except Exception as exc:  # params that bypassed validation
            errors[i] = f"{type(exc).__name__}: {exc}"
    if not todo:
        return AdjustResult(logits, errors)
    out = logits.float().clone()
    eos = tuple(eos_token_ids)

    def run(group: list[int]) -> None:
        out[group] = _adjusted(
            out[group],
            [params[i] for i in group],
            [prompts[i] for i in group],
            [outputs[i] for i in group],
            eos,
        )

    _per_row_on_failure(todo, run, errors)
    return AdjustResult(out, errors)


def _per_row_on_failure(
    rows: list[int], run: Callable[[list[int]], None], errors: dict[int, str]
) -> None:
    """``run(rows)``; if it raises, ``run([i])`` for each row, recording the failures."""
    try:
        run(rows)
    except Exception:
        for i in rows:
            try:
                run([i])
            except Exception as exc:
                errors[i] = f"{type(exc).__name__}: {exc}"


def _adjusted(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    eos: tuple[int, ...],
) -> torch.Tensor:
    """:func:`adjust_logits` for rows that all need it, without isolation: ``(R, V)``."""
    vocab = logits.shape[1]
    device = logits.device
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        seen = _counts([[*prompts[i], *outputs[i]] for i in rep], vocab, device) > 0
        pen = torch.tensor([params[i].repetition_penalty for i in rep], device=device)[:, None]
        sub = logits[rep]
        logits[rep] = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
    occ = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if occ:
        counts = _counts([outputs[i] for i in occ], vocab, device)
        freq = torch.tensor([params[i].frequency_penalty for i in occ], device=device)
        pres = torch.tensor([params[i].presence_penalty for i in occ], device=device)
        logits[occ] -= freq[:, None] * counts + pres[:, None] * (counts > 0).float()
    r_idx: list[int] = []
    t_idx: list[int] = []
    bias: list[float] = []
    for i, p in enumerate(params):
        r_idx += [i] * len(p.logit_bias)
        t_idx += p.logit_bias.keys()
        bias += p.logit_bias.values()
    if r_idx:
        _check_ids(t_idx, vocab)
        logits.index_put_(
            (torch.tensor(r_idx, device=device), torch.tensor(t_idx, device=device)),
            torch.tensor(bias, device=device, dtype=logits.dtype),
            accumulate=True,
        )
    r_idx, t_idx = [], []
    for i, p in enumerate(params):
        if len(outputs[i]) < p.min_tokens:
            masked = {*p.stop_token_ids, *(() if p.ignore_eos else eos)}
            r_idx += [i] * len(masked)
            t_idx += masked
    if r_idx:
        _check_ids(t_idx, vocab)
        logits[torch.tensor(r_idx, device=device), torch.tensor(t_idx, device=device)] = float(
            "-inf"
        )
    return logits


def _check_ids(ids: Sequence[int], vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the logits' vocabulary [0, {vocab})")


def _counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Occurrences of each token id in each of ``seqs``: ``(len(seqs), vocab)`` fp32."""
    flat = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    if flat.numel() and not (int(flat.min()) >= 0 and int(flat.max()) < vocab):
        bad = flat[(flat < 0) | (flat >= vocab)][0]
        raise ValueError(f"token id {int(bad)} is outside the logits' vocabulary [0, {vocab})")
    rows = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([len(s) for s in seqs]))
    counts = torch.zeros(len(seqs), vocab, device=device)
    counts.index_put_(
        (rows.to(device), flat.to(device)), torch.ones(flat.shape, device=device), accumulate=True
    )
    return counts


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], top: Sequence[int]
) -> list[TokenLogprob]:
    """Row ``i``: ``token_ids[i]``'s log probability under ``log_softmax(logits[i])`` and
    the ``top[i]`` most likely tokens. ``logits (R, V)`` raw (before any adjustment);
    ``top[i]`` >= 0. Raises ValueError on mismatched lengths or an id outside ``[0, V)``."""
    rows, vocab = logits.shape
    if len(token_ids) != rows or len(top) != rows:
        raise ValueError(
            f"logits {tuple(logits.shape)} needs one token and one k per row, got "
            f"{len(token_ids)} and {len(top)}"
        )
    if rows == 0:
        return []
    _check_ids(token_ids, vocab)
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None])[:, 0].tolist()
    k = min(max(top), vocab)
    if k == 0:
        return [TokenLogprob(int(t), float(chosen[i])) for i, t in enumerate(token_ids)]
    values, ids = lp.topk(k, dim=-1)
    top_v = values.cpu().numpy()  # fp32 (rows, k)
    top_i = ids.to(torch.int32).cpu().numpy()
    return [
        TokenLogprob(
            int(t),
            float(chosen[i]),
            top_i[i, : top[i]].tobytes(),
            top_v[i, : top[i]].tobytes(),
        )
        for i, t in enumerate(token_ids)
    ]
