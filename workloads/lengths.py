"""Length distributions for requests, with their exact ranges stated.

    fixed      every length is `mean`
    uniform    integers drawn uniformly from [min, max], both ends included
    normal     round(Normal(mean, std)), clipped to [min, max]
    lognormal  round(exp(Normal(mu, sigma))) with mu = ln(mean) - sigma^2/2 (so the mean of the
               unclipped distribution is `mean`), clipped to [min, max]

For normal and lognormal, min defaults to 1 and max to 2 x mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.core.schema import check, spec

DISTS = ("fixed", "uniform", "normal", "lognormal")


@dataclass
class LengthDist:
    dist: str = spec("fixed", choices=DISTS, help="fixed | uniform | normal | lognormal")
    mean: int | None = spec(None, ge=1, help="fixed value, or the mean (normal, lognormal)")
    min: int | None = spec(None, ge=1, help="smallest length (uniform range start; clip bound)")
    max: int | None = spec(None, ge=1, help="largest length (uniform range end; clip bound)")
    std: float | None = spec(None, gt=0, help="standard deviation (normal)")
    sigma: float | None = spec(None, gt=0, help="shape: std of the underlying normal (lognormal)")

    def bounds(self) -> tuple[int, int]:
        if self.dist == "fixed":
            return self.mean, self.mean  # type: ignore[return-value]
        if self.dist == "uniform":
            return self.min, self.max  # type: ignore[return-value]
        return self.min or 1, self.max or 2 * self.mean  # type: ignore[operator]

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        lo, hi = self.bounds()
        if self.dist == "fixed":
            x = np.full(n, self.mean)
        elif self.dist == "uniform":
            x = rng.integers(lo, hi + 1, size=n)
        elif self.dist == "normal":
            x = np.rint(rng.normal(self.mean, self.std, size=n))
        else:
            mu = np.log(self.mean) - self.sigma**2 / 2  # type: ignore[operator]
            x = np.rint(np.exp(rng.normal(mu, self.sigma, size=n)))
        return [int(v) for v in np.clip(x, lo, hi)]

    def describe(self) -> str:
        lo, hi = self.bounds()
        return {"fixed": f"{self.mean}", "uniform": f"uniform[{lo},{hi}]",
                "normal": f"normal({self.mean},{self.std})∈[{lo},{hi}]",
                "lognormal": f"lognormal(mean {self.mean}, sigma {self.sigma})∈[{lo},{hi}]"}[self.dist]


def parse_length(value: Any, field: str) -> tuple[LengthDist | None, list[str]]:
    """A length setting: an integer (fixed) or a mapping {dist, mean, min, max, std, sigma}."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"dist": "fixed", "mean": value}
    if not isinstance(value, dict):
        return None, [f"{field}={value!r}: give a number of tokens or {{dist: uniform, min: .., max: ..}} "
                      f"(dist one of {', '.join(DISTS)})."]
    d, problems = check(LengthDist, value, field)
    if d is None:
        return None, problems
    need = {"fixed": ("mean",), "uniform": ("min", "max"), "normal": ("mean", "std"),
            "lognormal": ("mean", "sigma")}[d.dist]
    missing = [k for k in need if getattr(d, k) is None]
    if missing:
        return None, [f"{field}: dist={d.dist} needs {', '.join(missing)} (e.g. {field}.{missing[0]}=...)."]
    lo, hi = d.bounds()
    if lo > hi:
        return None, [f"{field}: min {lo} is larger than max {hi}."]
    return d, []
