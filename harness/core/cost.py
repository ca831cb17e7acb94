"""What a million tokens cost, counting only the good ones (docs/metrics.md, "Cost").

The price of the resources a point held, per hour, comes from the run's `cost:` settings: one price
for an engine's whole deployment (`price_per_hour`), a price per GPU-hour or per core-hour times the
GPUs or cores the point held, or a device of the price table (`prices.yaml` beside this module:
list prices with their source and date; a user's own table adds to it). Every row records the
price it used and where it came from.

For a point that served W seconds of wall time (its measured interval: first scheduled arrival to
last completion for served requests, one iteration's end-to-end latency for a sweep), holding
resources priced P per hour:

    cost of the point           C = P * W / 3600
    cost per million tokens     C / tokens * 1e6      (input, output and total tokens: each the whole C)
    cost per good Mtok          C / good tokens * 1e6

A good token is a token of a request that met the point's SLO (each of its TTFT, TPOT and E2EL
bounds, per request: the goodput of docs/metrics.md) and, where the point has a correctness
verdict (speculative decoding's lossless check, structured output's validation, LoRA's outputs
check), passed it. 1,000 output tok/s at 2.00 per hour
is 2 / (1000 * 3600 / 1e6) = 0.5556 per million output tokens; a point where half the requests
missed the SLO costs twice as much per good Mtok as per Mtok.

Energy: measured (harness.core.energy: NVML, RAPL) where the row has it, else modelled from a
rated power (the table's per GPU, or `rated_power_w`) times the wall time, labelled as modelled;
priced at `price_per_kwh`. What cannot be known is null with the reason, never 0.

Standard library and PyYAML only; the harness's own process computes it (harness.runner).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from harness.core.schema import check, spec

PRICE_TABLE = Path(__file__).with_name("prices.yaml")
PRICES = ("price_per_hour", "price_per_device_hour", "price_per_core_hour")
UNIT_NAMES = {"deployment": "hour", "device": "GPU-hour", "core": "core-hour"}
_CURRENCY = re.compile(r"^[A-Z]{3}$")


@dataclass
class CostSettings:
    """One set of price settings: the run's (`cost.*`) or one engine's (`cost.engines.<engine>.*`)."""

    device: str | None = spec(None, help="a device of the price table (a GPU kind: h100-sxm, a100-sxm-80gb, "
                                         "h200-sxm, b200; a CPU instance: aws-c7i-xlarge), or auto: the run's GPU")
    offer: str | None = spec(None, help="which of the device's offers in the table (default: its first)")
    price_per_hour: float | None = spec(None, help="your price per hour of each engine's whole deployment (a "
                                                   "server's instance): the resources it held are not counted")
    price_per_device_hour: float | None = spec(None, help="your price per GPU-hour, times the GPUs a point held")
    price_per_core_hour: float | None = spec(None, help="your price per CPU core-hour, times the cores a point "
                                                        "held (cpus=; a core is a logical CPU, a cloud vCPU)")
    currency: str | None = spec(None, help="ISO 4217 code of your prices (default USD, the shipped table's)")
    source: str | None = spec(None, help="where your prices come from: recorded in every row beside the price")
    price_per_kwh: float | None = spec(None, help="electricity price per kWh, for the energy cost")
    rated_power_w: float | None = spec(None, help="rated power of an engine's deployment in W, for modelled energy "
                                                  "where none is measured (default: the table's, per GPU)")


@dataclass
class CostConfig(CostSettings):
    """`cost:` of conf/config.yaml."""

    table: str | None = spec(None, help="a price table of your own (YAML, as harness/core/prices.yaml): its "
                                        "devices are added to the shipped table, replacing those of the same name")
    engines: dict[str, Any] = spec({}, help="per engine: any of the settings above, overriding the run's "
                                            "(price_per_hour: the engine's deployment, e.g. an attached server)")

    def given(self) -> bool:
        """Whether any price (or a device of the table) was given: otherwise no cost is computed."""
        return any(getattr(self, k) is not None for k in (*PRICES, "device")) or any(
            isinstance(e, dict) and any(e.get(k) is not None for k in (*PRICES, "device")) for e in self.engines.values())


@dataclass
class Price:
    """The price an engine's rows are costed at: `rate` per `unit`-hour (deployment, device or
    core), its currency and where it came from."""

    rate: float
    unit: str  # deployment | device | core
    currency: str
    source: str
    label: str | None = None  # the table's device and offer, or the user's device name
    price_per_kwh: float | None = None
    rated_power_w: float | None = None  # per unit of `rated_power_per`
    rated_power_per: str | None = None  # device (the table's, per GPU) | deployment (the user's, in total)
    rated_power_source: str | None = None

    def basis(self, units: int) -> str:
        """'2 cores × 0.05 USD/core-hour = 0.1 USD/h' (what the row was costed at)."""
        what = f" ({self.label})" if self.label else ""
        if self.unit == "deployment":
            return f"{fmt(self.rate)} {self.currency}/h for the deployment{what}"
        noun = {"device": "GPU", "core": "core"}[self.unit]
        return (f"{units} {noun}{'s' if units != 1 else ''} × {fmt(self.rate)} {self.currency}/{UNIT_NAMES[self.unit]}"
                f"{what} = {fmt(self.rate * units)} {self.currency}/h")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def fmt(x: float) -> str:
    return f"{x:.6g}"


# ---- the price table -------------------------------------------------------------------------
def load_table(path: Path | str = PRICE_TABLE, where: str = "harness/core/prices.yaml") -> tuple[dict[str, Any], list[str]]:
    """A price table {currency, devices: {name: entry}} and its problems (each naming the file)."""
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as e:
        return {}, [f"{where}: cannot read the price table ({e.strerror or e}). Give an existing YAML file."]
    except yaml.YAMLError as e:
        return {}, [f"{where}: not valid YAML ({str(e).splitlines()[0]}). See harness/core/prices.yaml for the format."]
    problems = []
    if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
        return {}, [f"{where}: a price table is a mapping with `currency` and `devices` (see harness/core/prices.yaml)."]
    currency = data.get("currency")
    if not isinstance(currency, str) or not _CURRENCY.match(currency):
        problems.append(f"{where}: currency={currency!r}: give the table's currency as an ISO 4217 code, e.g. USD.")
    for name, entry in data["devices"].items():
        at = f"{where}: devices.{name}"
        if not isinstance(entry, dict) or entry.get("kind") not in ("gpu", "cpu"):
            problems.append(f"{at}: give kind: gpu or kind: cpu.")
            continue
        if entry["kind"] == "cpu" and not (isinstance(entry.get("vcpus"), int) and entry["vcpus"] > 0):
            problems.append(f"{at}: a CPU instance needs vcpus (its logical CPUs), a whole number above 0.")
        offers = entry.get("offers")
        if not isinstance(offers, list) or not offers:
            problems.append(f"{at}: give at least one offer (name, price, per, what, vendor_page, read_on, checked).")
            continue
        for i, o in enumerate(offers):
            price = o.get("price") if isinstance(o, dict) else None
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                problems.append(f"{at}.offers[{i}]: give its name.")
            elif isinstance(price, bool) or not isinstance(price, (int, float)) or not price > 0:
                problems.append(f"{at}.offers.{o['name']}.price={price!r}: a price must be a number greater than 0.")
            elif o.get("per") != ("gpu" if entry["kind"] == "gpu" else "instance"):
                problems.append(f"{at}.offers.{o['name']}.per={o.get('per')!r}: a {entry['kind']} device's offer is "
                                f"per {'gpu' if entry['kind'] == 'gpu' else 'instance'}.")
    return data, problems


def _offer_source(name: str, entry: dict[str, Any], offer: dict[str, Any], table: str) -> str:
    """Where a table price comes from, as every row records it."""
    parts = [f"price table {table}: {name}, offer {offer['name']}: {offer.get('what') or ''}".rstrip(": "),
             f"vendor page {offer.get('vendor_page') or 'unknown'}"
             + (f" read {offer['read_on']}" if offer.get("read_on") else " (no date)")]
    if offer.get("via"):
        parts.append(f"via {offer['via']}")
    parts.append(str(offer.get("checked") or "not checked"))
    return "; ".join(parts)


# ---- the run's prices ------------------------------------------------------------------------
def check_config(raw: dict[str, Any] | None) -> tuple[CostConfig | None, list[str]]:
    """`cost:` checked: the schema, then every price > 0 and a currency code, per engine too."""
    cfg, problems = check(CostConfig, raw or {}, "cost")
    if cfg is None:
        return None, [_price_fix(p) for p in problems]
    problems += _settings_problems(cfg, "cost")
    for engine, e in cfg.engines.items():
        where = f"cost.engines.{engine}"
        if not isinstance(e, dict):
            problems.append(f"{where}={e!r}: give a mapping of price settings, e.g. {where}.price_per_hour=2.5.")
            continue
        sub, probs = check(CostSettings, e, where)
        problems += [_price_fix(p) for p in probs]
        if sub is not None:
            problems += _settings_problems(sub, where)
    return (cfg if not problems else None), problems


def _price_fix(problem: str) -> str:
    return problem + (" Give a price per hour as a number, e.g. 2.5." if "price" in problem.split(":")[0] else "")


EXAMPLES = {"price_per_hour": "2.5", "price_per_device_hour": "2.5", "price_per_core_hour": "0.05",
            "price_per_kwh": "0.15"}


def _settings_problems(s: CostSettings, where: str) -> list[str]:
    out = []
    for key in (*PRICES, "price_per_kwh", "rated_power_w"):
        v = getattr(s, key)
        if v is not None and not v > 0:
            what = "a power" if key == "rated_power_w" else "a price"
            out.append(f"{where}.{key}={v:g}: {what} must be greater than 0. Give "
                       + ("the deployment's rated power in watts, e.g. 700" if key == "rated_power_w" else
                          f"what the resource costs per {'kWh' if key == 'price_per_kwh' else 'hour'}, e.g. "
                          f"{where}.{key}={EXAMPLES[key]}")
                       + ", or leave it unset.")
    if s.currency is not None and not _CURRENCY.match(s.currency):
        out.append(f"{where}.currency={s.currency}: give an ISO 4217 currency code in capitals, e.g. USD or EUR.")
    if s.offer is not None and s.device is None:
        out.append(f"{where}.offer={s.offer}: an offer is one of a table device's prices; give {where}.device too.")
    return out


def _merged(cfg: CostConfig, engine: str) -> CostSettings:
    """The run's settings with the engine's own (cost.engines.<engine>) over them."""
    own = cfg.engines.get(engine) or {}
    base = {f.name: getattr(cfg, f.name) for f in fields(CostSettings)}
    return CostSettings(**{**base, **{k: v for k, v in own.items() if v is not None}})


def _where(cfg: CostConfig, engine: str, key: str) -> str:
    own = cfg.engines.get(engine) or {}
    return f"cost.engines.{engine}.{key}" if own.get(key) is not None else f"cost.{key}"


def resolve_prices(cfg: CostConfig, engines: list[str], device: str, gpu_names: list[str],
                   attached: set[str]) -> tuple[dict[str, Price], list[str]]:
    """Each engine's price, or every problem: an unknown table device without a user price, a
    device of the wrong kind for the run, a currency mix, an attached server (its resources are
    unknown) without a deployment price, an engine left without any price. Nothing when no price
    was given at all (cfg.given() false)."""
    if not cfg.given():
        return {}, []
    table, problems = load_table()
    shipped_currency = table.get("currency")
    tables = {name: (entry, "harness/core/prices.yaml", shipped_currency) for name, entry in (table.get("devices") or {}).items()}
    if cfg.table:
        own, probs = load_table(cfg.table, f"cost.table={cfg.table}")
        problems += probs
        for name, entry in (own.get("devices") or {}).items():
            tables[name] = (entry, cfg.table, own.get("currency"))
    out: dict[str, Price] = {}
    currencies: dict[str, str] = {}
    gpu = device.startswith("cuda")
    for engine in engines:
        s = _merged(cfg, engine)
        currency = s.currency or "USD"
        price, probs = _engine_price(cfg, engine, s, currency, gpu, device, gpu_names, tables, engine in attached)
        problems += probs
        if price is not None:
            out[engine] = price
            currencies[engine] = price.currency
    if len(set(currencies.values())) > 1:
        listed = ", ".join(f"{e}: {c}" for e, c in currencies.items())
        problems.append(f"cost: a currency mix ({listed}): every price of a run must be in one currency so that its "
                        "rows compare. Give every price in one currency (cost.currency and cost.engines.<engine>."
                        "currency), or a table in that currency (cost.table).")
    return (out if not problems else {}), list(dict.fromkeys(problems))


def _engine_price(cfg: CostConfig, engine: str, s: CostSettings, currency: str, gpu: bool, device: str,
                  gpu_names: list[str], tables: dict[str, tuple[dict[str, Any], str, str]],
                  attached: bool) -> tuple[Price | None, list[str]]:
    power = {"price_per_kwh": s.price_per_kwh, "rated_power_w": s.rated_power_w,
             "rated_power_per": "deployment" if s.rated_power_w else None,
             "rated_power_source": f"user: {_where(cfg, engine, 'rated_power_w')}" if s.rated_power_w else None}
    user = f"user: {{}}{f' ({s.source})' if s.source else ''}"
    if s.price_per_hour is not None:
        return Price(s.price_per_hour, "deployment", currency, user.format(_where(cfg, engine, "price_per_hour")),
                     s.device if s.device not in (None, "auto") else None, **power), []
    if attached:
        return None, [f"cost: {engine} is an attached server (endpoints.{engine}.url): the harness does not know what "
                      f"it runs on. Give its deployment's price: cost.engines.{engine}.price_per_hour=..."]
    own = s.price_per_device_hour if gpu else s.price_per_core_hour
    unit = "device" if gpu else "core"
    label = s.device if s.device not in (None, "auto") else None
    if own is not None:
        entry = tables.get(s.device or "", (None,))[0]
        if entry and entry.get("rated_power_w") and not s.rated_power_w and gpu:
            power.update(rated_power_w=float(entry["rated_power_w"]), rated_power_per="device",
                         rated_power_source=entry.get("rated_power_source"))
        key = "price_per_device_hour" if gpu else "price_per_core_hour"
        return Price(own, unit, currency, user.format(_where(cfg, engine, key)), label, **power), []
    if s.device is None:
        other = s.price_per_core_hour if gpu else s.price_per_device_hour
        where = "cost.engines." + engine if cfg.engines.get(engine) else "cost"
        if other is not None:
            return None, [f"{_where(cfg, engine, 'price_per_core_hour' if gpu else 'price_per_device_hour')} prices "
                          f"{'CPU cores' if gpu else 'GPUs'}, but this run is on {device}: give "
                          f"{where}.{'price_per_device_hour' if gpu else 'price_per_core_hour'}=... (or "
                          f"{where}.price_per_hour for the whole deployment)."]
        return None, [f"cost: no price for {engine}: give {where}.{'price_per_device_hour' if gpu else 'price_per_core_hour'}"
                      f"=..., {where}.price_per_hour=... or {where}.device=<a device of the price table>."]
    name = s.device
    where_dev = _where(cfg, engine, "device")
    if name == "auto":
        if not gpu:
            return None, [f"{where_dev}=auto: a CPU run's instance cannot be told from here. Give "
                          f"cost.price_per_core_hour=... or cost.device=<a CPU instance of the price table: "
                          f"{', '.join(n for n, t in tables.items() if t[0].get('kind') == 'cpu')}>."]
        name = next((n for n, (e, _, _) in tables.items() if e.get("kind") == "gpu"
                     and any(g in (e.get("names") or []) or n == g.lower() for g in gpu_names)), None)
        if name is None:
            return None, [f"{where_dev}=auto: this run's GPU ({', '.join(gpu_names) or 'unknown'}) is not in the price "
                          f"table. Give cost.price_per_device_hour=..., or add it with cost.table=FILE."]
    if name not in tables:
        known = ", ".join(sorted(tables))
        return None, [f"{where_dev}={name}: not in the price table (known: {known}), and no price of your own. Give "
                      f"cost.{'price_per_device_hour' if gpu else 'price_per_core_hour'}=... (your price), or add "
                      f"{name} with cost.table=FILE."]
    entry, table_file, table_currency = tables[name]
    if entry["kind"] != ("gpu" if gpu else "cpu"):
        return None, [f"{where_dev}={name} is a {entry['kind'].upper()} in the price table, but this run is on "
                      f"{device}. Give a {'GPU' if gpu else 'CPU instance'} of the table or a price of your own "
                      f"(cost.{'price_per_device_hour' if gpu else 'price_per_core_hour'})."]
    offers = entry["offers"]
    offer = offers[0] if s.offer is None else next((o for o in offers if o.get("name") == s.offer), None)
    if offer is None:
        return None, [f"{_where(cfg, engine, 'offer')}={s.offer}: {name} has no such offer in the price table "
                      f"(its offers: {', '.join(o.get('name') for o in offers)})."]
    if table_currency != currency:
        return None, [f"cost: a currency mix: {_where(cfg, engine, 'currency')}={currency} but the price table's "
                      f"{name} ({table_file}) is in {table_currency}. Give your own price in {currency} "
                      f"(cost.{'price_per_device_hour' if gpu else 'price_per_core_hour'}=...) or set "
                      f"cost.currency={table_currency}."]
    rate = float(offer["price"]) if gpu else float(offer["price"]) / int(entry["vcpus"])
    if gpu and entry.get("rated_power_w") and not s.rated_power_w:
        power.update(rated_power_w=float(entry["rated_power_w"]), rated_power_per="device",
                     rated_power_source=entry.get("rated_power_source"))
    label = f"{name}, {offer['name']}" + ("" if gpu else f": {fmt(float(offer['price']))} {currency}/h ÷ {entry['vcpus']} vCPUs")
    return Price(rate, unit, currency, _offer_source(name, entry, offer, table_file), label, **power), []


# ---- one row's cost ---------------------------------------------------------------------------
NO_PRICE = ("no price given: set cost.price_per_core_hour (CPU), cost.price_per_device_hour (GPU), "
            "cost.price_per_hour or cost.device (docs/metrics.md, \"Cost\")")


@dataclass
class Tokens:
    """What a row's point served: its wall time and tokens, all of them and the good ones."""

    wall_s: float
    input: int | None
    output: int
    good_input: int | None
    good_output: int | None
    good_basis: str
    measured_output: int | None  # the energy's denominator (the measured interval's output tokens)


def row_tokens(row: dict[str, Any]) -> tuple[Tokens | None, str | None]:
    """The row's served tokens, or (None, why not) for a row that served some but cannot be costed;
    (None, None) for a row that is not a measurement of served tokens (parity, a conclusion)."""
    if row.get("total_output_tokens") is not None and "duration_s" in row:  # served requests
        wall = row.get("duration_s")
        if not wall or not row["total_output_tokens"]:
            return None, "no completed request: nothing to cost"
        good_out = row.get("good_output_tokens")
        return Tokens(float(wall), row.get("total_input_tokens"), int(row["total_output_tokens"]),
                      row.get("good_input_tokens"), good_out, good_basis(row),
                      row.get("measured_output_tokens")), None
    if row.get("e2e_latency_s") and row.get("batch_size") and row.get("output_len"):  # a sweep's batch
        b, o, p = int(row["batch_size"]), int(row["output_len"]), row.get("prompt_len")
        inp = b * int(p) if p else None
        return Tokens(float(row["e2e_latency_s"]), inp, b * o, inp, b * o,
                      "every sequence of the batch (offline: no SLO)", row.get("measured_output_tokens")), None
    return None, None


def good_basis(row: dict[str, Any]) -> str:
    """Which tokens count as good for this row, in words."""
    parts = []
    slo = row.get("slo") if isinstance(row.get("slo"), dict) else {}
    bounds = [f"{label} ≤ {slo[k]:g} s" for k, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2el_s", "E2EL"))
              if slo.get(k) is not None]
    if bounds:
        parts.append("met the SLO (" + ", ".join(bounds) + ", per request)")
    if row.get("good_verdict"):
        parts.append(f"passed the {row['good_verdict']}")
    return ("completed requests that " + " and ".join(parts)) if parts else "every completed request (no SLO given)"


def _units(row: dict[str, Any], unit: str) -> int:
    if unit == "device":  # a tune trial's own options over the run's
        opts = {**(row.get("engine_options") or {}), **(row.get("tune_options") or {})}
        tp = opts.get("tensor_parallel_size")
        return int(tp) if isinstance(tp, int) and tp > 0 else 1
    if unit == "core":
        return len(row.get("cpu_affinity") or []) or int(row.get("compute_threads") or 1)
    return 1


def per_million(amount: float | None, tokens: int | None) -> float | None:
    return amount / tokens * 1e6 if amount is not None and tokens else None


def cost_fields(row: dict[str, Any], price: Price | None) -> dict[str, Any]:
    """The row's cost fields (docs/results-schema.md, "Cost"); {} for a row that served no tokens."""
    tokens, why = row_tokens(row)
    if tokens is None and why is None:
        return {}
    if price is None:
        return {"cost_note": NO_PRICE}
    units = _units(row, price.unit)
    per_hour = price.rate * units
    out: dict[str, Any] = {
        "cost_currency": price.currency, "cost_price_per_hour": per_hour, "cost_price_rate": price.rate,
        "cost_price_unit": UNIT_NAMES[price.unit], "cost_units": units, "cost_price_basis": price.basis(units),
        "cost_price_source": price.source, "cost_note": None}
    if tokens is None:
        out["cost_note"] = why
        return out
    point_cost = per_hour * tokens.wall_s / 3600
    total = (tokens.input or 0) + tokens.output if tokens.input is not None else None
    good_total = ((tokens.good_input or 0) + tokens.good_output
                  if tokens.good_output is not None and tokens.good_input is not None else None)
    out.update(cost_wall_s=tokens.wall_s, cost_point=point_cost,
               cost_per_mtok_input=per_million(point_cost, tokens.input),
               cost_per_mtok_output=per_million(point_cost, tokens.output),
               cost_per_mtok_total=per_million(point_cost, total),
               cost_good_basis=tokens.good_basis,
               cost_good_output_share=(tokens.good_output / tokens.output) if tokens.good_output is not None else None,
               cost_per_good_mtok_input=per_million(point_cost, tokens.good_input),
               cost_per_good_mtok_output=per_million(point_cost, tokens.good_output),
               cost_per_good_mtok_total=per_million(point_cost, good_total))
    if tokens.good_output is None:
        out["cost_note"] = "the row does not say which requests were good (written before good_output_tokens existed)"
    elif tokens.good_output == 0:
        out["cost_note"] = (f"no good token: no request counted as good ({tokens.good_basis}), so the cost per "
                            "good Mtok is unbounded: null")
    out.update(energy_cost_fields(row, price, tokens, units))
    return out


def energy_cost_fields(row: dict[str, Any], price: Price, tokens: Tokens, units: int) -> dict[str, Any]:
    """Energy per token and its cost: measured where the row measured it (energy_j, valid), else
    modelled from a rated power over the wall time, labelled; else unavailable, with why."""
    out: dict[str, Any] = {"energy_modelled_j": None, "joules_per_output_token_modelled": None}
    watts = None
    if price.rated_power_w:
        watts = price.rated_power_w * (units if price.rated_power_per == "device" else 1)
        out["energy_modelled_j"] = watts * tokens.wall_s
        out["joules_per_output_token_modelled"] = out["energy_modelled_j"] / tokens.output
    measured = row.get("energy_j") if row.get("energy_valid") is not False else None
    if measured and tokens.measured_output:
        joules, per_out = float(measured), tokens.measured_output
        basis = f"measured ({row.get('energy_source')}, {row.get('energy_method') or 'counter'})"
    elif watts:
        joules, per_out = out["energy_modelled_j"], tokens.output
        basis = (f"modelled, not measured: rated {fmt(price.rated_power_w)} W"  # type: ignore[arg-type]
                 + (f" × {units} GPU{'s' if units != 1 else ''}" if price.rated_power_per == "device" else "")
                 + f" × {tokens.wall_s:.4g} s ({price.rated_power_source})")
    else:
        why = row.get("energy_note") or "no energy reading"
        return {**out, "energy_cost_basis": "unavailable", "energy_cost": None, "energy_cost_per_mtok_output": None,
                "energy_cost_per_good_mtok_output": None,
                "energy_cost_note": f"unavailable: no energy measured ({why}) and no rated power to model it "
                                    "(cost.rated_power_w)"}
    share = tokens.good_output / tokens.output if tokens.good_output is not None else None
    if price.price_per_kwh is None:
        return {**out, "energy_cost_basis": basis, "energy_cost": None, "energy_cost_per_mtok_output": None,
                "energy_cost_per_good_mtok_output": None,
                "energy_cost_note": "no electricity price: give cost.price_per_kwh to price the energy"}
    cost = joules / 3.6e6 * price.price_per_kwh
    per_m = per_million(cost, per_out)
    return {**out, "energy_cost_basis": basis, "energy_cost": cost, "energy_cost_per_mtok_output": per_m,
            "energy_cost_per_good_mtok_output": per_m / share if per_m is not None and share else None,
            "energy_cost_note": None, "energy_price_per_kwh": price.price_per_kwh}



# ---- two runs' costs (infer-bench-compare) -------------------------------------------------------
COMPARED_COSTS = ("cost_per_mtok_output", "cost_per_good_mtok_output")


@dataclass
class CostRatio:
    engine: str
    workload: str
    point: str
    metric: str
    baseline: float
    current: float
    ratio: float  # current / baseline: below 1 is cheaper
    currency: str
    note: str | None = None  # the prices differ: the ratio is not the engine's alone


def compare_costs(base_rows: list[dict[str, Any]], cur_rows: list[dict[str, Any]],
                  key: Any) -> tuple[list[CostRatio], list[str]]:
    """Current / baseline of the cost per Mtok and per good Mtok of output, for every point priced
    on both sides (matched by `key(row)`), each noting when the two were priced differently; and
    the problems that forbid a ratio: the two sides priced in different currencies."""
    base = {key(r): r for r in base_rows if r.get("cost_currency") and r.get("point_key")}
    cur = {key(r): r for r in cur_rows if r.get("cost_currency") and r.get("point_key")}
    currencies = ({r["cost_currency"] for r in base.values()}, {r["cost_currency"] for r in cur.values()})
    if base and cur and currencies[0] != currencies[1]:
        return [], [f"--baseline is priced in {', '.join(sorted(currencies[0]))} and --current in "
                    f"{', '.join(sorted(currencies[1]))}: a cost ratio across currencies means nothing. Price both runs "
                    "in one currency (cost.currency, cost.price_*), or pass --no-cost to compare without costs."]
    out = []
    for k in sorted(base.keys() & cur.keys(), key=str):
        b, c = base[k], cur[k]
        differ = [f"{what}: {b.get(f)} -> {c.get(f)}" for f, what in (("cost_price_per_hour", "price per hour"),
                                                                      ("cost_price_source", "source"))
                  if b.get(f) != c.get(f)]
        note = ("priced differently (" + "; ".join(differ) + "): the ratio mixes the price change with the engine's"
                if differ else None)
        for m in COMPARED_COSTS:
            if b.get(m) and c.get(m):
                out.append(CostRatio(str(c.get("engine")), str(c.get("workload")),
                                     str(c.get("point_key") or "").split(":", 1)[-1], m, float(b[m]), float(c[m]),
                                     float(c[m]) / float(b[m]), str(c["cost_currency"]), note))
    return out, []


def format_cost_ratios(ratios: list[CostRatio]) -> str:
    head = ["engine", "workload", "point", "metric", "baseline", "current", "ratio", "note"]
    body = [[r.engine, r.workload, r.point, r.metric, f"{r.baseline:.4g} {r.currency}", f"{r.current:.4g} {r.currency}",
             f"{r.ratio:.3f}", r.note or ""] for r in ratios]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)).rstrip() for b in body]
    return "\n".join(lines)
