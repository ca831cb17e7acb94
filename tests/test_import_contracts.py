"""The import-layer contracts (.importlinter, checked by `lint-imports` in `make test`) cover every
module of harness/: each is a layer of the layers contract, and both forbidden contracts (reports
import only harness.core; harness.core imports nothing above it) name it. A new module left out
of them would be unchecked - lint-imports passes on what it is not told about - so this fails."""

from __future__ import annotations

import configparser
import re

from harness.core.paths import REPO_ROOT


def harness_modules() -> set[str]:
    """The top-level modules of the harness package, harness.core among them."""
    root = REPO_ROOT / "harness"
    mods = {f"harness.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__"}
    mods |= {f"harness.{p.parent.name}" for p in root.glob("*/__init__.py")}
    return mods


def contracts() -> configparser.ConfigParser:
    cp = configparser.ConfigParser()
    cp.read(REPO_ROOT / ".importlinter")
    return cp


def names(value: str) -> set[str]:
    """The module names in a contract's list (layers: `a | b`, `(optional)`, `a : b`)."""
    return {m for m in re.split(r"[\s|:()]+", value) if m}


def test_every_harness_module_is_in_the_layers_contract():
    layered = names(contracts()["importlinter:contract:layers"]["layers"])
    missing = sorted(harness_modules() - layered)
    assert not missing, f".importlinter: add {', '.join(missing)} to the layers contract (a layer of its own or beside one)"


def test_the_forbidden_lists_name_every_module_above_the_core():
    cp = contracts()
    above_core = harness_modules() - {"harness.core"}
    for contract in ("reports", "core"):
        forbidden = names(cp[f"importlinter:contract:{contract}"]["forbidden_modules"])
        missing = sorted(above_core - forbidden)
        assert not missing, f".importlinter [{contract}]: add {', '.join(missing)} to forbidden_modules"
        assert {"adapters", "workloads"} <= forbidden, contract
    assert "reports" in names(cp["importlinter:contract:core"]["forbidden_modules"])
