"""Sampling parameters and next-token sampling (greedy, temperature, top-k, top-p).

Reproducibility: a request with a ``seed`` draws from its own ``torch.Generator`` seeded
with it (:func:`make_generator`), so the same seed and the same logits give the same tokens
whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "make_generator", "sample"]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens.

    ``temperature`` >= 0; 0 means greedy (argmax), and then top-k/top-p are ignored.
    ``top_p`` in (0, 1]: keep the smallest set of most likely tokens whose probability
    reaches ``top_p`` (1 = off). ``top_k`` >= -1: keep the ``top_k`` most likely tokens;
    0 or -1 = off (both accepted, as OpenAI-style servers use either). ``max_tokens`` >= 1
    new tokens at most. ``stop`` strings end generation (handled by the caller, not here); any sequence
    of strings, stored as a tuple.
    ``seed`` makes sampling reproducible per request.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    stop: Sequence[str] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> ValueError:
            return ValueError(f"{field}={getattr(self, field)!r} is invalid; {allowed}")

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise bad("temperature", "must be a number >= 0")
        if not self.temperature >= 0:
            raise bad("temperature", "must be >= 0")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise bad("top_p", "must be a number in (0, 1]")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be an int >= -1 (0 or -1 = off)")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad("max_tokens", "must be an int >= 1")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be an int >= 1")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise bad("seed", "must be an int or None")

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (temperature 0, or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``params.seed``; None for greedy requests.

    Without a seed it is seeded from the OS, so requests stay independent of each other.
    """
    if params.greedy:
        return None
    gen = torch.Generator(device=torch.device(device))
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row of ``logits (B, V)``; returns ``(B,)`` int64 on its device.

    Greedy rows take the argmax. Other rows divide by the temperature, keep the top-k and
    then the top-p nucleus of the sorted distribution (the most likely token always stays)
    and draw from the renormalized probabilities with their generator (None: global RNG).
    """
    if logits.dim() != 2 or len(params) != logits.shape[0] or len(generators) != len(params):
        raise ValueError(
            f"logits {tuple(logits.shape)} needs one params and one generator per row, got "
            f"{len(params)} and {len(generators)}"
        )
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    device = logits.device
    temps = torch.tensor([params[i].temperature for i in rows], device=device)
    scaled = logits[rows].float() / temps[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=device)[None, :]
    top_k = torch.tensor([params[i].top_k for i in rows], device=device)
    top_k = torch.where(top_k > 0, top_k, scaled.shape[-1])
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([params[i].top_p for i in rows], device=device, dtype=probs.dtype)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill((mass_before >= top_p[:, None]) & (rank > 0), 0.0)
    for j, i in enumerate(rows):
        pick = torch.multinomial(probs[j], 1, generator=generators[i])
        tokens[i] = order[j, pick[0]]
    return tokens
