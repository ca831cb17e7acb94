"""LoRA adapters in the reference engine: each sequence of a batch served by its own adapter (or by
the base model), in one forward pass, as Punica and S-LoRA batch them (docs/reference-engine.md,
"LoRA adapters").

What a projection computes, for the rows of a batch:

    y = x W^T                                  the base product: once, for every row, by the kernel
                                               the engine chose (unchanged by adapters)
      + s_a (x A_a^T) B_a^T                    the row's own adapter a (none: nothing added)

A is [r, in] and B [out, r] (PEFT's lora_A and lora_B), s the adapter's scaling (alpha / r); it is
folded into B when the adapter is read.

**Slots.** Adapters live in host memory once read (`HostAdapter`, every adapter of `lora_adapters`
at load), and a batch computes with adapters that are *resident*: in one of `max_loras` slots of
stacked weights (`Slots`). A sequence whose adapter is not resident is admitted only when a slot is
free or holds an adapter no running sequence uses; that slot is then loaded (the adapter's matrices
copied in: a *load*), evicting its least recently used adapter (an *eviction*). The scheduler keeps
the others waiting (scheduler.py), as vLLM's does with its max_loras.

**One batch, many adapters.** For one projection of one layer, the slots' A matrices are stacked
along the rank: A_all [S x W, in] (slot s owns rows s W .. (s + 1) W), and their B matrices along
the columns: B_all [out, S x W]. The step builds once a row mask M [T, S x W] that is 1 on the row's
own slot's W columns and 0 elsewhere (all 0 for a base-model row). Then

    y += ((x A_all^T) * M) B_all^T

is each row's x A_a^T B_a^T: the other slots' columns are multiplied by 0 before the second product.
This is the arithmetic of Punica's BGMV (each row through its own adapter's matrices) written as two
skinny dense products over the resident slots, four operators per projection whatever the number of
adapters in the batch; the wasted work is the other slots' columns of ranks r, small beside the base
product (in x out per row). A batch with no adapter row adds nothing at all.

**Widths.** The engine fuses projections (Q, K and V in one [q + 2 kv, hidden] weight; gate and up
in one [2 I, hidden]), so one slot of the fused projection holds the parts' adapters side by side:
W = 3 R columns for QKV (its B block-diagonal: Q's rank rows feed only Q's outputs), 2 R for gate-up,
R for the output and down projections, R the largest rank given (`max_lora_rank`); a module an
adapter does not target, or a lower rank, is zeros. So that one mask serves every projection, every
group is W_max = 3 R wide (the narrower groups' extra columns are zeros).

Prefix caching: a sequence's block hashes start from its adapter's name (scheduler / block_manager),
so blocks computed with one adapter are never reused by another or by the base model.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.core.lora import CONFIG_FILE, MODULES, TENSOR_KEY, WEIGHTS_FILE

# the engine's fused projections and the PEFT modules each holds, in its output order
GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                      "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
PARTS = 3  # the widest group's modules: every group is PARTS x rank wide


def group_sizes(cfg: Any) -> dict[str, tuple[int, list[int]]]:
    """(in features, [out features of each module]) of each fused projection of a layer."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [i, i]), "down": (i, [h])}


@dataclass
class HostAdapter:
    """One adapter in host memory, in the engine's fused layout: per (layer, group), A [W, in] and
    B [out, W] with W = PARTS x rank (the scaling folded into B), or absent where it adds nothing."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def read(cls, name: str, path: str, cfg: Any, rank: int) -> "HostAdapter":
        """Read a PEFT directory into the fused layout of width PARTS x `rank` (the slots' rank: the
        largest of the run's adapters), in float32."""
        from safetensors.torch import load_file
        d = Path(path)
        config = json.loads((d / CONFIG_FILE).read_text())
        r = int(config["r"])
        if r > rank:
            raise ValueError(f"adapter {name} has rank {r}, above max_lora_rank={rank}")
        alpha = float(config.get("lora_alpha", r))
        scaling = alpha / (r ** 0.5 if config.get("use_rslora") else r)
        tensors = load_file(str(d / WEIGHTS_FILE))
        sizes = group_sizes(cfg)
        out = cls(name, r)
        parts: dict[tuple[int, str], dict[str, dict[str, torch.Tensor]]] = {}
        for key, t in tensors.items():
            m = TENSOR_KEY.match(key)
            if m is None or m.group(3) not in MODULES:
                raise ValueError(f"adapter {name}: tensor {key} is not a LoRA matrix the reference engine applies")
            layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
            group = next(g for g, mods in GROUPS.items() if module in mods)
            parts.setdefault((layer, group), {}).setdefault(module, {})[ab] = t.float()
        width = PARTS * rank
        for (layer, group), mods in parts.items():
            n_in, outs = sizes[group]
            a = torch.zeros(width, n_in)
            b = torch.zeros(sum(outs), width)
            row = 0
            for k, (module, n_out) in enumerate(zip(GROUPS[group], outs)):
                if module in mods:  # its rank rows k r .. k r + r feed its own outputs only
                    a[k * rank:k * rank + r] = mods[module]["A"]
                    b[row:row + n_out, k * rank:k * rank + r] = mods[module]["B"] * scaling
                row += n_out
            out.weights[(layer, group)] = (a, b)
        return out


class Slots:
    """`max_loras` slots of stacked adapter weights on the model's device and dtype, per layer and
    projection, stored transposed for the two products: A_all^T [in, S W] and B_all^T [S W, out]. `acquire(name, busy)` makes an adapter
    resident (loading it into a free slot, or into the least recently used slot no running
    sequence uses) and returns its slot, or None when every slot is busy; `loads` and `evictions`
    count what it did since the engine loaded."""

    def __init__(self, cfg: Any, adapters: dict[str, HostAdapter], max_loras: int, rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.adapters, self.max_loras, self.width = adapters, max_loras, PARTS * rank
        self.dtype, self.device = dtype, device
        sizes = group_sizes(cfg)
        span = max_loras * self.width
        self.a = [{g: torch.zeros(sizes[g][0], span, dtype=dtype, device=device) for g in GROUPS}
                  for _ in range(cfg.num_layers)]
        self.b = [{g: torch.zeros(span, sum(sizes[g][1]), dtype=dtype, device=device) for g in GROUPS}
                  for _ in range(cfg.num_layers)]
        self.resident: list[str | None] = [None] * max_loras
        self.recent: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        self.loads = self.evictions = 0

    def slot_of(self, name: str) -> int | None:
        return self.resident.index(name) if name in self.resident else None

    def acquire(self, name: str, busy: set[int]) -> int | None:
        """The slot of adapter `name`, loaded there if it is not resident; None when every slot holds
        an adapter some running sequence uses (`busy`)."""
        if name not in self.adapters:
            raise ValueError(f"reference: adapter {name} is not among lora_adapters ({', '.join(self.adapters)})")
        slot = self.slot_of(name)
        if slot is None:
            free = [s for s in range(self.max_loras) if self.resident[s] is None]
            idle = [s for s in self.recent if s not in busy]  # least recently used first
            if not free and not idle:
                return None
            slot = free[0] if free else idle[0]
            if self.resident[slot] is not None:
                self.evictions += 1
            self._load(slot, self.adapters[name])
        self.recent.pop(slot, None)
        self.recent[slot] = None
        return slot

    def _load(self, slot: int, adapter: HostAdapter) -> None:
        cols = slice(slot * self.width, (slot + 1) * self.width)
        for layer, (a_all, b_all) in enumerate(zip(self.a, self.b)):
            for g in GROUPS:
                w = adapter.weights.get((layer, g))
                if w is None:
                    a_all[g][:, cols].zero_()
                    b_all[g][cols].zero_()
                else:
                    a_all[g][:, cols].copy_(w[0].t().to(self.dtype))
                    b_all[g][cols].copy_(w[1].t().to(self.dtype))
        self.resident[slot] = adapter.name
        self.loads += 1

    def mask(self, row_slots: list[int | None]) -> torch.Tensor | None:
        """The step's row mask [T, S W]: 1 on each row's slot's columns (rows without an adapter: 0);
        None when no row has one (the step adds nothing)."""
        if all(s is None for s in row_slots):
            return None
        sel = torch.zeros(len(row_slots), self.max_loras, dtype=self.dtype)
        for i, s in enumerate(row_slots):
            if s is not None:
                sel[i, s] = 1
        return sel.repeat_interleave(self.width, dim=1).to(self.device)

    def add(self, y: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, layer: int, group: str) -> torch.Tensor:
        """y += ((x A_all^T) * mask) B_all^T, in place; y is returned."""
        h = torch.mm(x, self.a[layer][group]).mul_(mask)
        return y.addmm_(h, self.b[layer][group])

    def stats(self) -> dict[str, Any]:
        return {"loads": self.loads, "evictions": self.evictions, "max_loras": self.max_loras,
                "resident": [n for n in self.resident if n is not None],
                "source": "the reference engine's slots (adapters/reference/lora.py)"}
