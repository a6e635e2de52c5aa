"""The hicache namespace of an SGLang host pool, and SGLang page hashes as hicache keys.

Normative text: ``docs/l3-keys.md``, "Keys for SGLang pages". :func:`sglang_namespace`:
``model`` (SGLang's ``model_name`` or ``hicache_model``), ``weights_fingerprint``, the pool's
dtype, ``page_size``, ``tp_size`` / ``tp_rank`` (rank-replicated MLA: ``None`` / 1), component
``"full"``, no tenant salt (SGLang folds ``cache_salt`` into its hashes), ``layout`` (hicache's
of the same name, else ``page_first_direct``) and ``engine_layout`` ``"sglang:<layout>"`` (plus
``;pp=``, ``;cp=`` and, for ``page_unified``, ``;groups=<n>;v=<version>``).
:func:`sglang_page_key`: ``"hc3-" + hex(sha256(namespace digest || utf8(sglang key)))``,
fingerprint the first 8 bytes of ``sha256(utf8(sglang key))``. :func:`side_namespace`: a v2
side pool's records under the KV namespace with ``component`` = the pool's name and
``;pool=<class>/<layout>/<dtype>`` appended; ``mamba`` pins the rank even for MLA (its
state is TP-sharded). :func:`head_namespace`: the KV namespace of a ``page_head`` pool's
head-group records (``records="head"``, the rank dropped; at one head per record and
no ``pp``/``cp``, hicache's own ``page_first`` namespace, whose head records have the
same bytes). Pure: no sglang import, no IO.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hicache.config import MemLayout
from hicache.keys import HEAD_RECORDS, Namespace, PageKey, engine_page_key
from hicache.spec import DTYPES

__all__ = [
    "LAYOUT_FAMILY",
    "MHA_LAYOUTS",
    "MLA_LAYOUTS",
    "ShardIdentity",
    "dtype_name",
    "head_namespace",
    "sglang_namespace",
    "sglang_page_key",
    "side_namespace",
]

ENGINE = "sglang"

LAYOUT_FAMILY: dict[str, MemLayout] = {
    "layer_first": MemLayout.LAYER_FIRST,
    "page_first": MemLayout.PAGE_FIRST,
    "page_first_direct": MemLayout.PAGE_FIRST_DIRECT,
    "page_head": MemLayout.PAGE_FIRST_DIRECT,
    "page_unified": MemLayout.PAGE_FIRST_DIRECT,
}
"""SGLang host layout -> the hicache layout recorded in ``Namespace.layout`` (the exact
byte order is pinned by ``engine_layout``)."""

MHA_LAYOUTS: tuple[str, ...] = (
    "layer_first",
    "page_first",
    "page_first_direct",
    "page_head",
    "page_unified",
)
"""SGLang's MHA host layouts this integration stores."""

MLA_LAYOUTS: tuple[str, ...] = ("layer_first", "page_first", "page_first_direct", "page_unified")
"""SGLang's MLA host layouts this integration stores (``page_first_kv_split`` is
Ascend's: its page lies in several buffers, refused)."""


@dataclass(frozen=True, kw_only=True)
class ShardIdentity:
    """What of SGLang's ``HiCacheStorageConfig`` decides which bytes a rank's page holds.

    ``rank_replicated``: SGLang's ``is_mla_model`` (every TP rank holds the same page).
    """

    model: str
    tp_rank: int
    tp_size: int
    rank_replicated: bool
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r} is invalid; must be a non-empty str")
        for rank, size, what in (
            (self.tp_rank, self.tp_size, "tp"),
            (self.pp_rank, self.pp_size, "pp"),
            (self.cp_rank, self.cp_size, "cp"),
        ):
            if not (isinstance(size, int) and size >= 1 and isinstance(rank, int)):
                raise ValueError(f"{what} rank/size {rank!r}/{size!r} are invalid")
            if not 0 <= rank < size:
                raise ValueError(f"{what}_rank={rank} is outside [0, {size})")


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (any dtype's name, stored or not)."""
    return str(dtype).removeprefix("torch.")


def sglang_namespace(
    shard: ShardIdentity,
    *,
    weights_fingerprint: str,
    dtype: object,
    layout: str,
    page_size: int,
    unified_groups: int = 1,
    unified_version: str = "",
) -> Namespace:
    """The namespace of one SGLang KV host pool (see the module docstring).

    Raises ValueError naming the layout or the dtype when this integration cannot store
    the pool's pages (``MHA_LAYOUTS`` / ``MLA_LAYOUTS``; dtypes ``hicache.spec.DTYPES``).
    """
    allowed = MLA_LAYOUTS if shard.rank_replicated else MHA_LAYOUTS
    kind = "MLA" if shard.rank_replicated else "MHA"
    if layout not in allowed:
        raise ValueError(
            f"SGLang {kind} host pool layout {layout!r} cannot be stored by hicache; "
            f"supported: {list(allowed)}"
        )
    name = dtype_name(dtype)
    if name not in DTYPES:
        raise ValueError(
            f"SGLang host pool dtype {name!r} cannot be stored by hicache; supported: "
            f"{list(DTYPES)}"
        )
    parts = [f"{ENGINE}:{layout}"]
    if shard.pp_size > 1:
        parts.append(f"pp={shard.pp_rank}/{shard.pp_size}")
    if shard.cp_size > 1:
        parts.append(f"cp={shard.cp_rank}/{shard.cp_size}")
    if layout == "page_unified":
        parts.append(f"groups={unified_groups}")
        parts.append(f"v={unified_version or 'unknown'}")
    shared = shard.rank_replicated
    return Namespace(
        model=shard.model,
        weights_fingerprint=weights_fingerprint,
        kv_dtype=name,
        layout=LAYOUT_FAMILY[layout],
        page_size=page_size,
        tp_size=1 if shared else shard.tp_size,
        tp_rank=None if shared else shard.tp_rank,
        engine_layout=";".join(parts),
    )


PAGE_HEAD = f"{ENGINE}:page_head"
"""``engine_layout`` of a ``page_head`` pool's namespace without ``pp`` / ``cp`` parts."""


def head_namespace(rank: Namespace, group: int) -> Namespace:
    """The namespace of the head-group records of a ``page_head`` KV pool whose per-rank
    namespace (:func:`sglang_namespace`) is ``rank``: ``records="head"``, ``head_group``
    ``group``, ``tp_size`` 1 and ``tp_rank`` null. A record of one head is, per kind,
    ``(page_size, L, D)``: byte for byte hicache's ``page_first`` head record, so at
    ``group`` 1 without ``pp`` / ``cp`` it is hicache's namespace (``layout``
    ``page_first``, ``engine_layout`` ``""``); a larger group's ``(g, page_size, L, D)``
    is not hicache's ``(page_size, L, g, D)``, so the ``engine_layout`` stays (a
    different namespace: misses, never wrong bytes)."""
    if not rank.engine_layout.startswith(PAGE_HEAD):
        raise ValueError(
            f"head records are for SGLang's page_head layout, not {rank.engine_layout!r}"
        )
    if rank.tp_rank is None:
        raise ValueError("head records are for MHA pools (rank-replicated MLA is one record)")
    shared = group == 1 and rank.engine_layout == PAGE_HEAD
    return dataclasses.replace(
        rank,
        records=HEAD_RECORDS,
        head_group=group,
        tp_size=1,
        tp_rank=None,
        layout=MemLayout.PAGE_FIRST if shared else rank.layout,
        engine_layout="" if shared else rank.engine_layout,
    )


def side_namespace(
    kv: Namespace,
    shard: ShardIdentity,
    *,
    pool_name: str,
    pool_class: str,
    pool_layout: str,
    dtype: object,
) -> Namespace:
    """The namespace of a v2 side pool's records (see the module docstring)."""
    if not pool_name:
        raise ValueError("a side pool needs a non-empty name")
    sharded = pool_name == "mamba" or not shard.rank_replicated
    return dataclasses.replace(
        kv,
        component=pool_name,
        tp_size=shard.tp_size if sharded else 1,
        tp_rank=shard.tp_rank if sharded else None,
        engine_layout=f"{kv.engine_layout};pool={pool_class}/{pool_layout}/{dtype_name(dtype)}",
    )


def sglang_page_key(namespace: Namespace, sglang_key: str) -> PageKey:
    """The hicache key of SGLang page hash ``sglang_key`` under ``namespace``."""
    if not isinstance(sglang_key, str) or not sglang_key:
        raise ValueError(f"SGLang page key {sglang_key!r} is invalid; must be a non-empty str")
    return engine_page_key(namespace, sglang_key.encode("utf-8"))
