"""Cumulative counters in an engine's Prometheus text, the one walk both of its readers share:
the KV tiers' (adapters.tiers.tier_counts) and speculative decoding's
(adapters.endpoint.telemetry.spec_counts)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Counters:
    values: dict[str, float] = field(default_factory=dict)  # sample name -> its value summed over label sets
    split: dict[Any, float] = field(default_factory=dict)  # the split counter's value summed by key
    present: set[str] = field(default_factory=set)  # every family and sample name in the text

    def there(self, name: str) -> bool:
        """Whether the text has `name` at all; a counter's family is its sample name without
        `_total`, so a counter declared without samples yet (a labelled counter before its first
        increment) is there, and reads as zero."""
        return name in self.present or (name.endswith("_total") and name[: -len("_total")] in self.present)


def read_counters(text: str, split: str | None = None,
                  key: Callable[[dict[str, str]], Hashable | None] | None = None) -> Counters:
    """Every sample of `text` summed over its label sets (engines, model names), except the
    samples named `split`: those are summed by `key(labels)` instead, and one whose key is None is
    dropped."""
    out = Counters()
    for fam in text_string_to_metric_families(text):
        out.present.add(fam.name)
        for smp in fam.samples:
            out.present.add(smp.name)
            if split and smp.name == split:
                k = key(smp.labels) if key is not None else None
                if k is not None:
                    out.split[k] = out.split.get(k, 0.0) + float(smp.value)
                continue
            out.values[smp.name] = out.values.get(smp.name, 0.0) + float(smp.value)
    return out
