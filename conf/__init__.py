"""infer-bench's Hydra configs, shipped as package data: `config.yaml` and the groups
`engine/`, `model/`, `workload/`, `endpoint/`. `harness.core.paths.CONF_DIR` finds them through
this package, so an installed (non-editable) infer-bench finds its configs from any directory."""
