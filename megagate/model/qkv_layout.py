"""Row layout of the fused `linear_qkv` weight and conversions between the layouts found in the wild.

megagate fuses every head-specific, query-dependent gate projection of positions G1–G4 into `linear_qkv`, laid out
per query group so that column-parallel TP (which hands each rank a contiguous block of rows) gives every rank the
q, k, v *and* gate rows of the same heads:

    per group g (ng groups, npg = np / ng query heads each):
        [ q: npg·hn | q-side gate (G1/G4): npg·w | k: hn | v: hn | kv-side gate (G2/G3): w ]      w = hn or 1

For G1 elementwise this is exactly megatron-core's `attention_output_gate` layout ([q, gate, k, v] per group), so
those checkpoints load unchanged; `convert_rows` maps any layout onto another by naming every row.

Hugging Face layouts (separate q_proj / k_proj / v_proj; k and v are [ng·hn] in group order everywhere):

    qwen3, qwen3_moe (no gate)    q_proj [np·hn]: per head its hn rows
    qwen3_next (G1 elementwise)   q_proj [2·np·hn]: per head [q_h: hn | gate_h: hn]
    paper (the paper's released Qwen3 code, `elementwise_attn_output_gate` / `headwise_attn_output_gate`)
                                  q_proj per KV group [q of the group's npg heads: npg·hn | their gates: npg·w]
                                  elementwise: [2·np·hn] rows; headwise: [np·hn + np] rows (one scalar per head)

The Qwen3-Next and the paper's elementwise q_proj have the same shape ([2·np·hn, h]) but different row orders
(per head vs per group): no check on shapes can tell them apart, so the converters take the format explicitly
(`from_qwen3_next` vs `from_paper`), and converting with the wrong one gives a model whose outputs differ (a test
shows it). Every converter checks the shapes against (num_heads, num_groups, head_dim) and raises a one-line
ConfigError on a mismatch (e.g. a headwise paper q_proj given to `from_qwen3_next`). All conversions are pure row
reindexing: the tensors they return are bit-identical to their sources, contiguous and own their storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megagate.errors import ConfigError
from megagate.model.gate import GateConfig

RowKey = tuple[str, int, int]  # (tensor, head or group index, channel)


def check_tensor_parallel(
    num_heads: int, num_groups: int, tp_size: int, *, model: str = "", parallel: str = ""
) -> None:
    """The one check that tensor parallelism can split the attention, megatron's rule: each TP rank gets whole query
    heads, and either whole KV groups (groups a multiple of TP) or one KV group it shares with TP / groups ranks
    (groups a divisor of TP: megatron gathers that group's projection and each rank keeps its slice of the heads).

    `model` / `parallel` prefix the names in the message (e.g. "model." and "parallel." for a config file's keys).
    """
    if num_heads % tp_size:
        raise ConfigError(
            f"{model}num_attention_heads ({num_heads}) must be divisible by {parallel}tensor_model_parallel_size "
            f"({tp_size})"
        )
    if num_groups % tp_size and tp_size % num_groups:
        raise ConfigError(
            f"{model}num_query_groups ({num_groups}) must be a multiple or a divisor of "
            f"{parallel}tensor_model_parallel_size ({tp_size})"
        )


@dataclass(frozen=True)
class QkvLayout:
    """Sizes of the fused qkv(+gate) projection for `num_heads` query heads in `num_groups` KV groups."""

    num_heads: int
    num_groups: int
    head_dim: int
    q_gate_width: int = 0  # gate scores per query head fused here (0: none)
    kv_gate_width: int = 0  # gate scores per KV head fused here (0: none)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_groups:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be divisible by num_query_groups ({self.num_groups})"
            )

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_groups

    def group_segments(self) -> list[tuple[str, int]]:
        """(name, rows) of one group's block, in order; zero-width gate segments are omitted."""
        npg, hn = self.heads_per_group, self.head_dim
        segments = [
            ("q", npg * hn),
            ("q_gate", npg * self.q_gate_width),
            ("k", hn),
            ("v", hn),
            ("kv_gate", self.kv_gate_width),
        ]
        return [(name, rows) for name, rows in segments if rows > 0]

    @property
    def rows_per_group(self) -> int:
        return sum(rows for _, rows in self.group_segments())

    @property
    def rows(self) -> int:
        return self.num_groups * self.rows_per_group

    @property
    def gate_rows(self) -> int:
        """Rows added to linear_qkv by the fused gate."""
        return self.num_heads * self.q_gate_width + self.num_groups * self.kv_gate_width

    def row_keys(self) -> list[RowKey]:
        """The name of every row, in order (query-side gates are indexed by query head, kv-side by group)."""
        keys: list[RowKey] = []
        npg, hn = self.heads_per_group, self.head_dim
        for g in range(self.num_groups):
            for name, _ in self.group_segments():
                if name == "q":
                    keys += [("q", g * npg + i, c) for i in range(npg) for c in range(hn)]
                elif name == "q_gate":
                    keys += [("q_gate", g * npg + i, c) for i in range(npg) for c in range(self.q_gate_width)]
                elif name == "kv_gate":
                    keys += [("kv_gate", g, c) for c in range(self.kv_gate_width)]
                else:
                    keys += [(name, g, c) for c in range(hn)]
        return keys

    def replicas(self, tp_size: int) -> int:
        """TP ranks that share one KV group: 1 when the groups split over TP, TP / groups when they are fewer."""
        return max(1, tp_size // self.num_groups)

    def local(self, tp_size: int) -> QkvLayout:
        """The layout one tensor-parallel rank splits: its own groups, or, with fewer groups than TP ranks, the one
        group it shares (gathered from the TP ranks first; the rank then keeps its slice of the group's heads)."""
        check_tensor_parallel(self.num_heads, self.num_groups, tp_size)
        if self.replicas(tp_size) > 1 and self.rows % tp_size:
            raise ConfigError(
                f"the fused qkv projection has {self.rows} rows ({self.num_groups} groups x {self.rows_per_group}), "
                f"which tensor_model_parallel_size ({tp_size}) does not divide; with fewer KV groups than TP ranks "
                "the rows must split evenly (use an elementwise gate, or num_query_groups a multiple of TP)"
            )
        groups = max(1, self.num_groups // tp_size)
        return QkvLayout(groups * self.heads_per_group, groups, self.head_dim, self.q_gate_width, self.kv_gate_width)


def qkv_layout(gate: GateConfig, num_heads: int, num_groups: int, head_dim: int) -> QkvLayout:
    """The fused layout for a gate configuration (gates that are not fused leave widths at 0)."""
    width = gate.width(head_dim) if gate.fused_rows else 0
    return QkvLayout(
        num_heads,
        num_groups,
        head_dim,
        q_gate_width=width if gate.on_query_heads else 0,
        kv_gate_width=width if gate.on_kv_heads else 0,
    )


def convert_rows(src: torch.Tensor, src_keys: list[RowKey], dst_keys: list[RowKey]) -> torch.Tensor:
    """Reorder the rows of `src` (named by src_keys) into the order dst_keys names."""
    if len(src_keys) != src.shape[0]:
        raise ValueError(f"src has {src.shape[0]} rows but {len(src_keys)} row names")
    index = {key: i for i, key in enumerate(src_keys)}
    missing = [k for k in dst_keys if k not in index]
    if missing:
        raise ValueError(f"{len(missing)} destination rows have no source, e.g. {missing[0]}")
    return src[torch.tensor([index[k] for k in dst_keys], dtype=torch.long)]


def megatron_output_gate_keys(num_heads: int, num_groups: int, head_dim: int) -> list[RowKey]:
    """Row names of megatron-core's `attention_output_gate=True` linear_qkv: per group [q, gate, k, v]."""
    npg, keys = num_heads // num_groups, []
    for g in range(num_groups):
        heads = range(g * npg, (g + 1) * npg)
        keys += [("q", h, c) for h in heads for c in range(head_dim)]
        keys += [("q_gate", h, c) for h in heads for c in range(head_dim)]
        keys += [("k", g, c) for c in range(head_dim)] + [("v", g, c) for c in range(head_dim)]
    return keys


def qwen3_next_keys(num_heads: int, num_groups: int, head_dim: int) -> list[RowKey]:
    """Row names of Hugging Face Qwen3-Next's concatenated [q_proj; k_proj; v_proj] (q_proj: per head [q | gate])."""
    keys = [(name, h, c) for h in range(num_heads) for name in ("q", "q_gate") for c in range(head_dim)]
    keys += [("k", g, c) for g in range(num_groups) for c in range(head_dim)]
    keys += [("v", g, c) for g in range(num_groups) for c in range(head_dim)]
    return keys


def from_megatron_output_gate(weight: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> torch.Tensor:
    """megatron-core gated linear_qkv (weight or bias) → megagate G1-elementwise linear_qkv."""
    layout = QkvLayout(num_heads, num_groups, head_dim, q_gate_width=head_dim)
    return convert_rows(weight, megatron_output_gate_keys(num_heads, num_groups, head_dim), layout.row_keys())


def to_megatron_output_gate(weight: torch.Tensor, num_heads: int, num_groups: int, head_dim: int) -> torch.Tensor:
    """megagate G1-elementwise linear_qkv → megatron-core `attention_output_gate` linear_qkv."""
    layout = QkvLayout(num_heads, num_groups, head_dim, q_gate_width=head_dim)
    return convert_rows(weight, layout.row_keys(), megatron_output_gate_keys(num_heads, num_groups, head_dim))


GRANULARITY_WIDTH = ("elementwise", "headwise")


def _gate_width(granularity: str, head_dim: int) -> int:
    if granularity not in GRANULARITY_WIDTH:
        raise ConfigError(f"granularity={granularity!r} is not one of {', '.join(GRANULARITY_WIDTH)}")
    return head_dim if granularity == "elementwise" else 1


def qwen3_keys(num_heads: int, num_groups: int, head_dim: int) -> list[RowKey]:
    """Row names of Hugging Face Qwen3's (and Qwen3-MoE's) concatenated [q_proj; k_proj; v_proj] (no gate)."""
    keys = [("q", h, c) for h in range(num_heads) for c in range(head_dim)]
    keys += [("k", g, c) for g in range(num_groups) for c in range(head_dim)]
    keys += [("v", g, c) for g in range(num_groups) for c in range(head_dim)]
    return keys


def paper_keys(num_heads: int, num_groups: int, head_dim: int, granularity: str) -> list[RowKey]:
    """Row names of the paper's released code's [q_proj; k_proj; v_proj]: q_proj per KV group [q of the group's
    heads | their gates] (elementwise: hn gate rows per head; headwise: one)."""
    width = _gate_width(granularity, head_dim)
    npg, keys = num_heads // num_groups, []
    for g in range(num_groups):
        heads = range(g * npg, (g + 1) * npg)
        keys += [("q", h, c) for h in heads for c in range(head_dim)]
        keys += [("q_gate", h, c) for h in heads for c in range(width)]
    keys += [("k", g, c) for g in range(num_groups) for c in range(head_dim)]
    keys += [("v", g, c) for g in range(num_groups) for c in range(head_dim)]
    return keys


def _check_parts(fmt: str, parts: dict[str, torch.Tensor], rows: dict[str, int], sizes: str) -> None:
    """Each HF projection has the rows the format needs and all share their trailing (input) dims."""
    trailing = {tuple(t.shape[1:]) for t in parts.values()}
    for name, tensor in parts.items():
        if tensor.dim() < 1 or tensor.shape[0] != rows[name]:
            raise ConfigError(
                f"{name} has shape {tuple(tensor.shape)}, but the {fmt} layout with {sizes} needs {rows[name]} rows"
            )
    if len(trailing) != 1:
        raise ConfigError(f"q_proj/k_proj/v_proj of the {fmt} layout differ in their input dims: {sorted(trailing)}")


def _check_fused(weight: torch.Tensor, layout: QkvLayout, what: str, sizes: str) -> None:
    if weight.dim() < 1 or weight.shape[0] != layout.rows:
        raise ConfigError(
            f"linear_qkv has shape {tuple(weight.shape)}, but {what} with {sizes} needs {layout.rows} rows"
        )


def _sizes(num_heads: int, num_groups: int, head_dim: int) -> str:
    return f"{num_heads} heads / {num_groups} groups / head_dim {head_dim}"


def _from_hf(
    fmt: str,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    v_proj: torch.Tensor,
    layout: QkvLayout,
    keys: list[RowKey],
) -> torch.Tensor:
    kv_rows = layout.num_groups * layout.head_dim
    q_rows = len(keys) - 2 * kv_rows
    sizes = _sizes(layout.num_heads, layout.num_groups, layout.head_dim)
    _check_parts(
        fmt,
        {"q_proj": q_proj, "k_proj": k_proj, "v_proj": v_proj},
        dict(q_proj=q_rows, k_proj=kv_rows, v_proj=kv_rows),
        sizes,
    )
    return convert_rows(torch.cat([q_proj, k_proj, v_proj], dim=0), keys, layout.row_keys())


def _to_hf(
    fmt: str, weight: torch.Tensor, layout: QkvLayout, keys: list[RowKey]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sizes = _sizes(layout.num_heads, layout.num_groups, layout.head_dim)
    _check_fused(weight, layout, f"megagate's linear_qkv for the {fmt} layout", sizes)
    stacked = convert_rows(weight, layout.row_keys(), keys)
    kv_rows = layout.num_groups * layout.head_dim
    q, k, v = torch.split(stacked, [stacked.shape[0] - 2 * kv_rows, kv_rows, kv_rows], dim=0)
    return q.clone(), k.clone(), v.clone()  # each its own contiguous storage


def from_qwen3(
    q_proj: torch.Tensor, k_proj: torch.Tensor, v_proj: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> torch.Tensor:
    """Hugging Face Qwen3 / Qwen3-MoE q_proj/k_proj/v_proj → megagate baseline (ungated) linear_qkv."""
    layout = QkvLayout(num_heads, num_groups, head_dim)
    return _from_hf("qwen3", q_proj, k_proj, v_proj, layout, qwen3_keys(num_heads, num_groups, head_dim))


def to_qwen3(
    weight: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megagate baseline linear_qkv → Hugging Face Qwen3 / Qwen3-MoE (q_proj, k_proj, v_proj)."""
    layout = QkvLayout(num_heads, num_groups, head_dim)
    return _to_hf("qwen3", weight, layout, qwen3_keys(num_heads, num_groups, head_dim))


def from_qwen3_next(
    q_proj: torch.Tensor, k_proj: torch.Tensor, v_proj: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> torch.Tensor:
    """Hugging Face Qwen3-Next q_proj/k_proj/v_proj → megagate G1-elementwise linear_qkv.

    The paper's elementwise q_proj has the same shape in another row order: use `from_paper` for that one."""
    layout = QkvLayout(num_heads, num_groups, head_dim, q_gate_width=head_dim)
    return _from_hf("qwen3_next", q_proj, k_proj, v_proj, layout, qwen3_next_keys(num_heads, num_groups, head_dim))


def to_qwen3_next(
    weight: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megagate G1-elementwise linear_qkv → Hugging Face Qwen3-Next (q_proj, k_proj, v_proj); the reverse of
    `from_qwen3_next`."""
    layout = QkvLayout(num_heads, num_groups, head_dim, q_gate_width=head_dim)
    return _to_hf("qwen3_next", weight, layout, qwen3_next_keys(num_heads, num_groups, head_dim))


def from_paper(
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    v_proj: torch.Tensor,
    num_heads: int,
    num_groups: int,
    head_dim: int,
    granularity: str,
) -> torch.Tensor:
    """The paper's released-code q_proj/k_proj/v_proj (G1 `granularity` gate) → megagate G1 linear_qkv."""
    layout = QkvLayout(num_heads, num_groups, head_dim, q_gate_width=_gate_width(granularity, head_dim))
    keys = paper_keys(num_heads, num_groups, head_dim, granularity)
    return _from_hf(f"paper {granularity}", q_proj, k_proj, v_proj, layout, keys)


def to_paper(
    weight: torch.Tensor, num_heads: int, num_groups: int, head_dim: int, granularity: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megagate G1 linear_qkv (`granularity` gate) → the paper's released-code (q_proj, k_proj, v_proj)."""
    layout = QkvLayout(num_heads, num_groups, head_dim, q_gate_width=_gate_width(granularity, head_dim))
    keys = paper_keys(num_heads, num_groups, head_dim, granularity)
    return _to_hf(f"paper {granularity}", weight, layout, keys)
