"""Page and state-slot copies between the device (L1) and host (L2) pools, and the
layer-done signal."""

from hicache.transfer.base import PageCopier
from hicache.transfer.direct import DirectCopier
from hicache.transfer.engine import Completion, LayerHook, OpKind, TransferEngine
from hicache.transfer.io_backend import make_copier
from hicache.transfer.kernel import KernelCopier
from hicache.transfer.plan import OpPlan, Run, check_compatible
from hicache.transfer.progress import LayerProgress, TransferError
from hicache.transfer.state import (
    DirectStateCopier,
    KernelStateCopier,
    StateCopier,
    make_state_copier,
)

__all__ = [
    "Completion",
    "DirectCopier",
    "DirectStateCopier",
    "KernelCopier",
    "KernelStateCopier",
    "LayerHook",
    "LayerProgress",
    "OpKind",
    "OpPlan",
    "PageCopier",
    "Run",
    "StateCopier",
    "TransferEngine",
    "TransferError",
    "check_compatible",
    "make_copier",
    "make_state_copier",
]
