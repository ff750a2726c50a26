"""The hardware catalog: per-device compute, memory, links, power and price (planner/hardware.yaml).

    cat = load_catalog()                              # the built-in file
    cat = load_catalog(["mine.yaml"], {"H100-SXM": 3.1})   # user entries and price overrides
    cat["H100-SXM"].tflops_bf16

A user file has the same layout as hardware.yaml; an entry whose name exists replaces the keys it
gives, a new name must give them all. Unknown keys and non-positive figures are errors that name
the entry and the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

BUILTIN_CATALOG = Path(__file__).with_name("hardware.yaml")


@dataclass(frozen=True)
class Hardware:
    """One device (a GPU, or one CPU core for `cpu`). Units: TFLOP/s, GB/s, GB, W, USD/h."""

    name: str
    tflops_bf16: float
    hbm_gbps: float
    hbm_gb: float
    intra_node_gbps: float
    inter_node_gbps: float
    power_w: float
    price_per_hour: float
    max_tp: int = 8
    source: str = ""

    @property
    def flops(self) -> float:
        return self.tflops_bf16 * 1e12

    @property
    def mem_bw(self) -> float:
        return self.hbm_gbps * 1e9

    @property
    def mem_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def is_cpu(self) -> bool:
        return self.name.lower() == "cpu"


_NUMERIC = ("tflops_bf16", "hbm_gbps", "hbm_gb", "intra_node_gbps", "inter_node_gbps", "power_w", "price_per_hour")
_KEYS = tuple(f.name for f in fields(Hardware) if f.name != "name")


def _entry(name: str, d: Any, base: Hardware | None, where: str) -> Hardware:
    if not isinstance(d, Mapping):
        raise ValueError(f"{where}: {name}: expected a mapping with keys {', '.join(_KEYS)}")
    unknown = sorted(set(d) - set(_KEYS))
    if unknown:
        raise ValueError(f"{where}: {name}.{unknown[0]}: unknown key; allowed: {', '.join(_KEYS)}")
    if base is None:
        missing = [k for k in _NUMERIC if k not in d]
        if missing:
            raise ValueError(f"{where}: {name}: a new hardware type needs {', '.join(missing)}")
    values: dict[str, Any] = {}
    for k, v in d.items():
        if k in _NUMERIC:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{where}: {name}.{k}: expected a number > 0, got {v!r}")
            values[k] = float(v)
        elif k == "max_tp":
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{where}: {name}.max_tp: expected an integer >= 1, got {v!r}")
            values[k] = v
        else:
            values[k] = str(v)
    return replace(base, **values) if base is not None else Hardware(name=name, **values)


def load_catalog(extra_files: list[str | Path] | None = None,
                 prices: Mapping[str, float] | None = None) -> dict[str, Hardware]:
    """The built-in catalog, then each extra file merged over it, then price overrides."""
    catalog: dict[str, Hardware] = {}
    for path in [BUILTIN_CATALOG, *(extra_files or [])]:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, Mapping):
            raise ValueError(f"{path}: expected a mapping of hardware names to their figures")
        for name, d in raw.items():
            catalog[str(name)] = _entry(str(name), d, catalog.get(str(name)), str(path))
    for name, price in (prices or {}).items():
        if name not in catalog:
            raise ValueError(f"--price {name}: unknown hardware; known: {', '.join(catalog)}")
        if price <= 0:
            raise ValueError(f"--price {name}: expected a price > 0, got {price}")
        catalog[name] = replace(catalog[name], price_per_hour=float(price))
    return catalog


def parse_prices(specs: list[str]) -> dict[str, float]:
    """['H100-SXM=3.1', ...] -> {'H100-SXM': 3.1}."""
    out = {}
    for s in specs:
        name, sep, value = s.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--price {s!r}: expected NAME=USD_PER_HOUR")
    return out
