"""LayerProgress: the per-layer "done" signal of a layer-wise load.

The producer (the transfer worker) copies layer 0, 1, ... in order and calls
:meth:`LayerProgress.mark_layer_done` after each; a consumer (the model's forward) calls
:meth:`LayerProgress.wait` before reading a layer, so layer N can be computed while layer
N+1 is still being copied.

On CUDA the producer passes the CUDA event it recorded on its copy stream after the layer's
copies; ``wait`` blocks the host only until that event has been *recorded* (the layer was
enqueued), then makes the consumer's current stream wait on it, so the GPU, not the host,
waits for the bytes. On CPU the copy is done when the layer is marked.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

__all__ = ["LayerProgress", "TransferError"]


class TransferError(RuntimeError):
    """A transfer op failed; raised to a consumer waiting on one of its layers."""


class LayerProgress:
    """Counts the layers of one load that have arrived.

    Invariants: layers are marked in order ``0 .. num_layers-1``, each once; after
    :meth:`fail`, no layer is marked any more. Layers marked before a failure stay valid.
    Thread-safe: one producer, any number of consumers.
    """

    def __init__(self, num_layers: int, device: torch.device | str | None = None) -> None:
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers={num_layers!r} is invalid; must be an int >= 1")
        self._num_layers = num_layers
        self._device = torch.device(device) if device is not None else None
        self._cond = threading.Condition()
        self._arrived = 0
        self._events: list[Any] = [None] * num_layers
        self._error: BaseException | None = None

    @classmethod
    def completed(cls, num_layers: int) -> LayerProgress:
        """A progress whose every layer has already arrived (nothing to wait for)."""
        p = cls(num_layers)
        p._arrived = num_layers
        return p

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def layers_done(self) -> int:
        """How many layers (a prefix ``0 .. layers_done-1``) have arrived."""
        with self._cond:
            return self._arrived

    @property
    def done(self) -> bool:
        """Whether every layer has arrived."""
        with self._cond:
            return self._arrived == self._num_layers

    @property
    def failed(self) -> bool:
        """Whether the producer reported an error."""
        with self._cond:
            return self._error is not None

    @property
    def error(self) -> BaseException | None:
        """The producer's error, if it failed."""
        with self._cond:
            return self._error

    def mark_layer_done(self, layer: int, event: Any = None) -> None:
        """Producer: ``layer`` has been copied (or, on CUDA, enqueued before ``event``).

        ``event`` is a ``torch.cuda.Event`` already recorded on the copy stream, or None.
        Layers must be marked in order; raises ValueError otherwise or after :meth:`fail`.
        """
        with self._cond:
            if self._error is not None:
                raise ValueError("mark_layer_done after fail()")
            if layer != self._arrived:
                raise ValueError(f"layer {layer} marked out of order; expected {self._arrived}")
            self._events[layer] = event
            self._arrived += 1
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """Producer: the op failed; wake every waiter. Layers already marked stay valid."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def wait(self, layer: int, timeout: float | None = None) -> None:
        """Consumer: return once ``layer`` has arrived.

        Raises IndexError for a bad layer, TimeoutError after ``timeout`` seconds, and
        :class:`TransferError` (chained to the producer's error) if the op failed before
        ``layer`` arrived. On CUDA also makes the current stream wait on the layer's event.
        """
        if not 0 <= layer < self._num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self._num_layers})")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._arrived <= layer and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"layer {layer} did not arrive within {timeout} s "
                        f"({self._arrived}/{self._num_layers} layers done)"
                    )
                self._cond.wait(remaining)
            if self._arrived <= layer:
                err = self._error
                raise TransferError(f"load failed before layer {layer} arrived: {err}") from err
            event = self._events[layer]
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def wait_all(self, timeout: float | None = None) -> None:
        """Consumer: :meth:`wait` for the last layer (so for every layer)."""
        self.wait(self._num_layers - 1, timeout)

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else f"{self._arrived}/{self._num_layers}"
        return f"LayerProgress({state})"
