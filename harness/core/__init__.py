"""The bottom layer of infer-bench: what every other part builds on, and nothing else.

Statistics (`stats`), metric definitions (`metrics`), the KV-cache estimator (`kvcalc`),
model shapes and presets (`presets`), typed config schemas (`schema`), the results schema,
writer and loader (`results`), regression comparisons (`compare`), memory sampling
(`memory`), roofline ceilings (`roofline`), the environment record (`env`), user errors
(`errors`) and where files live (`paths`).

Nothing here imports `adapters`, `workloads`, `reports` or the rest of `harness`
(`lint-imports` checks it). Worker processes, which may run under an engine's own Python
environment, use this package: it needs numpy, psutil and PyYAML only (scipy is imported by
`bootstrap` and `compare`, which only the harness's own process uses).
"""
