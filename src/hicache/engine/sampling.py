"""Sampling parameters and next-token sampling (greedy, temperature, top-k, top-p).

What happens to a step's logits before the draw (penalties, ``logit_bias``, ``min_tokens``)
and the log probabilities reported back live in :mod:`hicache.engine.logits`.

Reproducibility: a request with a ``seed`` draws from its own ``torch.Generator`` seeded
with it (:func:`make_generator`), so the same seed and the same logits give the same tokens
whatever else shares the batch; its state moves from a prefill instance to its decode
instance after the first draw (:func:`generator_state`, :func:`set_generator_state`).

Isolation: :func:`sample_rows` samples each row on its own terms. A row whose logits are
not finite, whose filtered distribution is not a distribution, or whose draw raises is
reported in :attr:`SampleResult.errors`; the other rows still get their tokens, drawn
exactly as they would have been without the failing row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

__all__ = [
    "GREEDY_TEMPERATURE",
    "LOGIT_BIAS_MAX",
    "MAX_LOGPROBS",
    "PENALTY_MAX",
    "SEED_MAX",
    "SEED_MIN",
    "InvalidRequest",
    "SampleResult",
    "SamplingParams",
    "generator_state",
    "make_generator",
    "sample",
    "sample_rows",
    "set_generator_state",
]

GREEDY_TEMPERATURE = 1e-6
"""A temperature below this is greedy (argmax), as in SGLang: dividing logits by a smaller
one overflows to inf and makes the distribution NaN."""
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
"""The seeds ``torch.Generator.manual_seed`` takes (a negative seed is used modulo 2**64)."""
MAX_LOGPROBS = 20
"""The most alternatives ``logprobs`` / ``prompt_logprobs`` may ask for (OpenAI's
``top_logprobs`` limit)."""
PENALTY_MAX = 2.0
"""``presence_penalty`` and ``frequency_penalty`` lie in [-PENALTY_MAX, PENALTY_MAX] (OpenAI)."""
LOGIT_BIAS_MAX = 100.0
"""A ``logit_bias`` value lies in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] (OpenAI)."""


class InvalidRequest(ValueError):
    """A request field with a value the engine does not serve; ``param`` names the field
    (as the OpenAI error object's ``param``), None when no single field is at fault."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens.

    ``temperature`` >= 0 and finite; below :data:`GREEDY_TEMPERATURE` (0 included) means
    greedy (argmax), and then top-k/top-p are ignored. ``top_p`` in (0, 1]: keep the
    smallest set of most likely tokens whose probability reaches ``top_p`` (1 = off).
    ``top_k`` >= -1: keep the ``top_k`` most likely tokens; 0 or -1 = off (both accepted,
    as OpenAI-style servers use either); a ``top_k`` at or above the vocabulary size keeps
    every token (it is clamped to the vocabulary when sampling). ``max_tokens`` >= 1 new
    tokens at most. ``stop`` strings end generation (handled by the caller, not here); any
    sequence of strings, stored as a tuple. ``seed`` in [:data:`SEED_MIN`,
    :data:`SEED_MAX`] makes sampling reproducible per request.

    Log probabilities (None = not returned) are those of the model's raw distribution,
    ``log_softmax`` of its fp32 logits, before penalties, ``logit_bias``, ``min_tokens``
    masking, temperature, top-k and top-p (OpenAI's and vLLM's default): they say what the
    model thinks of a token, whatever picked it. ``logprobs`` = k in [0,
    :data:`MAX_LOGPROBS`]: each generated token's logprob and the k most likely tokens.
    ``prompt_logprobs`` = k: the same for every prompt token given the tokens before it
    (the first prompt token has none). ``logprob_start_len`` = s >= 0 (SGLang's field; only
    with ``prompt_logprobs``; at most the prompt's length, checked at validation): only the
    prompt positions from s on are scored, those before it stay None. The cache serves such
    a request a cached prefix of at most ``max(0, s - 1)`` tokens (the logprob of position p
    reads the logits of position p - 1, so every scored position's logits are computed),
    and its pages are cached for others as any request's (:attr:`max_prefix`).

    Logit processing, applied in this order to each step's logits before the draw:
    ``repetition_penalty`` > 0 (1 = off; HF/SGLang: every token in prompt or output has a
    positive logit divided by it, a negative one multiplied), ``frequency_penalty`` and
    ``presence_penalty`` in [-2, 2] (OpenAI: ``logit -= frequency * count + presence *
    (count > 0)`` with ``count`` the token's occurrences in the output so far),
    ``logit_bias`` (token id -> value in [-100, 100] added to its logit; keys may be ints
    or decimal strings, as JSON sends them; ids are checked against the vocabulary by
    :meth:`check_vocab`), then ``min_tokens`` >= 0 (<= ``max_tokens``): until that many
    tokens were generated, the end-of-sequence ids (unless ``ignore_eos``) and
    ``stop_token_ids`` get -inf, and no stop condition ends the request.

    ``ignore_eos``: the model's end-of-sequence tokens do not end the request (it runs to
    ``max_tokens`` or a stop). ``stop_token_ids``: generating one of these ends the
    request (finish reason ``stop``); the id stays in ``output_ids`` but not in the text.

    ``max_load_tokens`` (None: no cap; else an int >= 0): at most this many prompt tokens
    are restored for the request from L2 and L3 (whole pages; what L1 holds is free); the
    rest of a longer hit is recomputed.

    A bad value raises :class:`InvalidRequest` (a ValueError) whose ``param`` is the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    stop: Sequence[str] = ()
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_start_len: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    max_load_tokens: int | None = None

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> InvalidRequest:
            return InvalidRequest(
                f"{field}={getattr(self, field)!r} is invalid; {allowed}", param=field
            )

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise bad("temperature", "must be a number >= 0")
        if not 0 <= self.temperature < float("inf"):
            raise bad("temperature", "must be a finite number >= 0")
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
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise bad("seed", f"must be in [{SEED_MIN}, {SEED_MAX}] (-2**63 .. 2**64-1)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS
            ):
                raise bad(name, f"must be None or an int in [0, {MAX_LOGPROBS}]")
        start = self.logprob_start_len
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise bad("logprob_start_len", "must be an int >= 0 (a prompt position)")
        if start and self.prompt_logprobs is None:
            raise bad("logprob_start_len", "it applies to prompt_logprobs, which are not asked")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(v := getattr(self, name)) or not -PENALTY_MAX <= v <= PENALTY_MAX:
                raise bad(name, f"must be a number in [{-PENALTY_MAX}, {PENALTY_MAX}]")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp < float("inf"):
            raise bad("repetition_penalty", "must be a finite number > 0 (1 = off)")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        mt = self.min_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or not 0 <= mt <= self.max_tokens:
            raise bad("min_tokens", f"must be an int in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        ids = self.stop_token_ids
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | frozenset | set):
            raise bad("stop_token_ids", "must be a list of token ids (ints >= 0)")
        ids = tuple(ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise bad("stop_token_ids", "must be a list of token ids (ints >= 0)")
        object.__setattr__(self, "stop_token_ids", ids)
        cap = self.max_load_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise bad("max_load_tokens", "must be None or an int >= 0 (prompt tokens)")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise :class:`InvalidRequest` when a token id in ``logit_bias`` or
        ``stop_token_ids`` is not in ``[0, vocab_size)`` (the model's logits width); the
        engine's ``validate`` calls it, so sampling never sees such an id."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest(
                    f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                    param=name,
                )

    @property
    def max_prefix(self) -> int | None:
        """The most leading tokens a cached prefix may serve this request: None (no
        limit) without ``prompt_logprobs``; else ``max(0, logprob_start_len - 1)``, so the
        forward computes the logits of every position before a scored one."""
        if self.prompt_logprobs is None:
            return None
        return max(0, self.logprob_start_len - 1)

    @property
    def adjusts_logits(self) -> bool:
        """Whether any penalty, bias or ``min_tokens`` may change this request's logits."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (temperature below
        :data:`GREEDY_TEMPERATURE`, or top_k 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _is_number(v: object) -> bool:
    """A real int or float that is finite (bools refused)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _logit_bias(raw: object) -> Mapping[int, float]:
    """``raw`` checked and frozen: int keys >= 0 (decimal strings accepted, as JSON object
    keys are strings), float values in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]."""

    def bad(detail: str) -> InvalidRequest:
        return InvalidRequest(f"logit_bias is invalid: {detail}", param="logit_bias")

    if not isinstance(raw, Mapping):
        raise bad(f"must be a mapping of token id to bias, got {type(raw).__name__}")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if isinstance(key, str) and key.isascii() and key.isdecimal():
            tid = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            tid = key
        else:
            raise bad(f"key {key!r} is not a token id (an int >= 0)")
        if tid < 0:
            raise bad(f"key {key!r} is not a token id (an int >= 0)")
        if not _is_number(value) or not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX:
            raise bad(f"value {value!r} for token {tid} must be in [-100, 100]")
        out[tid] = float(value)
    return MappingProxyType(out)


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


def generator_state(gen: torch.Generator | None) -> bytes | None:
    """``gen``'s state as bytes (None for None: a greedy request), for
    :func:`set_generator_state` on another instance: a prefill instance hands its request's
    generator, past the first draw, to the decode instance that draws the rest."""
    if gen is None:
        return None
    return bytes(gen.get_state().numpy().tobytes())


def set_generator_state(gen: torch.Generator, state: bytes) -> str | None:
    """Give ``gen`` the ``state`` :func:`generator_state` read; None when done, else why
    not (a state of another device type's generator)."""
    try:
        gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except (RuntimeError, ValueError) as exc:
        return f"{len(state)} bytes do not fit a {gen.device.type} generator: {exc}"
    return None


@dataclass(frozen=True, slots=True)
class SampleResult:
    """One sampling step of a batch.

    ``tokens``: ``(B,)`` int64 on the logits' device, one token id per row; ``token_ids``
    the same ids on the host (read once with the row checks: no further device sync).
    ``errors``: row -> why that row could not be sampled. A failed row's entry in
    ``tokens`` is its argmax only so that the tensor stays a valid batch of ids; it must
    not be used.
    """

    tokens: torch.Tensor
    errors: Mapping[int, str]
    token_ids: tuple[int, ...]

    @property
    def ok(self) -> bool:
        """Whether every row got a token."""
        return not self.errors


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> SampleResult:
    """Pick one token per row of ``logits (B, V)``, failing rows one by one.

    Greedy rows take the argmax. Other rows divide by the temperature, keep the top-k and
    then the top-p nucleus of the sorted distribution (the most likely token always stays)
    and draw from the renormalized probabilities with their generator (None: global RNG).
    A row whose logits hold NaN or +inf or no finite value, whose filtered probabilities
    are not finite or sum to zero, or whose computation raises, lands in ``errors``; no
    generator of another row is advanced differently because of it.

    Raises ValueError only when the arguments do not describe one batch (a caller bug).
    """
    if logits.dim() != 2 or len(params) != logits.shape[0] or len(generators) != len(params):
        raise ValueError(
            f"logits {tuple(logits.shape)} needs one params and one generator per row, got "
            f"{len(params)} and {len(generators)}"
        )
    tokens = logits.argmax(dim=-1)
    errors: dict[int, str] = {}
    batch = logits.shape[0]
    if batch == 0:
        return SampleResult(tokens, errors, ())
    # max propagates NaN; +inf and all -inf rows are not finite either
    finite = torch.isfinite(logits.max(dim=-1).values)
    rows: list[int] = []
    for i, p in enumerate(params):
        try:
            if not p.greedy:
                rows.append(i)
        except Exception as exc:  # params that bypassed validation
            errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
    # a row with logits that are not finite gets garbage probabilities here, no exception,
    # and never reaches the draw; the other rows' values do not depend on it
    groups: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    if rows:
        try:
            groups = [(rows, *_filtered_probs(logits[rows], [params[i] for i in rows]))]
        except Exception:  # find the row(s) at fault; the others are filtered on their own
            for i in rows:
                try:
                    groups.append(([i], *_filtered_probs(logits[[i]], [params[i]])))
                except Exception as exc:
                    errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
    # one device -> host read: the argmax ids, the finite flags, each group's validity
    valid = [torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0) for _, probs, _ in groups]
    host = torch.cat([tokens, finite.to(tokens.dtype), *(v.to(tokens.dtype) for v in valid)])
    read = host.tolist()
    token_ids, flags, at = read[:batch], read[batch : 2 * batch], 2 * batch
    for i, ok in enumerate(flags):
        if not ok:
            errors[i] = "the model's logits for this request hold NaN or inf"
    drawn = False
    for group, probs, order in groups:
        group_valid, at = read[at : at + len(group)], at + len(group)
        for j, i in enumerate(group):
            if i in errors:
                continue
            if not group_valid[j]:
                errors[i] = (
                    f"sampling failed: temperature={params[i].temperature!r} gives no valid"
                    " distribution over these logits"
                )
                continue
            try:
                pick = torch.multinomial(probs[j], 1, generator=generators[i])
                tokens[i] = order[j, pick[0]]
                drawn = True
            except Exception as exc:
                errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
    if drawn:  # the drawn ids are on the device: a second read
        token_ids = tokens.tolist()
    return SampleResult(tokens, errors, tuple(token_ids))


def _filtered_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k and top-p over ``logits (R, V)``: ``(probs, order)``, both
    ``(R, V)``; ``probs`` are sorted descending and ``order`` maps them back to token ids."""
    device = logits.device
    vocab = logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
    scaled = logits.float() / temps[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    # clamp in Python: a top_k beyond int64 (or the vocabulary) keeps everything
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill((mass_before >= top_p[:, None]) & (rank > 0), 0.0)
    return probs, order


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Pick one token per row of ``logits (B, V)``; returns ``(B,)`` int64 on its device.

    The all-or-nothing form of :func:`sample_rows`: raises RuntimeError naming the failed
    rows when any row fails. Prefer :func:`sample_rows`, which fails only those rows.
    """
    result = sample_rows(logits, params, generators)
    if result.errors:
        detail = "; ".join(f"row {i}: {msg}" for i, msg in sorted(result.errors.items()))
        raise RuntimeError(f"sampling failed for {len(result.errors)} row(s): {detail}")
    return result.tokens
