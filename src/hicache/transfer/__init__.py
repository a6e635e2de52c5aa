"""Page copies between the device (L1) and host (L2) pools, and the layer-done signal."""

from hicache.transfer.base import PageCopier
from hicache.transfer.direct import DirectCopier
from hicache.transfer.engine import Completion, LayerHook, OpKind, TransferEngine
from hicache.transfer.io_backend import make_copier
from hicache.transfer.kernel import KernelCopier
from hicache.transfer.plan import OpPlan, Run, check_compatible
from hicache.transfer.progress import LayerProgress, TransferError

__all__ = [
    "Completion",
    "DirectCopier",
    "KernelCopier",
    "LayerHook",
    "LayerProgress",
    "OpKind",
    "OpPlan",
    "PageCopier",
    "Run",
    "TransferEngine",
    "TransferError",
    "check_compatible",
    "make_copier",
]
