"""The row fields of an endpoint's point (docs/results-schema.md, "Endpoint fields").

`point_fields(states)`: what the client saw of every request the point sent - failures and their
reasons, the server's token counts against the client's, stream chunking, send lag.
`endpoint_fields(...)`: who served it - the server's identity and version, how it was launched
(command, options, settings that differ from its defaults), TLS and auth facts, the prompt format
and API, the /metrics time series scraped during the point, speculation's aggregates, and its
exit where it died. A new per-request field is read from `ReqState` (stream.py) here.
"""

from __future__ import annotations

import collections
from typing import Any

from adapters.endpoint.config import EndpointConfig
from adapters.endpoint.kinds import KINDS, Speculation
from adapters.endpoint.options import given
from adapters.endpoint.plan import LaunchPlan
from adapters.endpoint.server import Server
from adapters.endpoint.stream import ITL_CHUNKING, ReqState
from harness.core.stats import summarize


def point_fields(states: list[ReqState]) -> dict[str, Any]:
    """Row fields about every request of a point, from what the client saw."""
    sent = [s for s in states if not (s.cancelled and not s.token_ids and s.sent_ns is None)]
    failed = [s for s in sent if s.error is not None]
    reasons: dict[str, int] = collections.Counter(s.error_class for s in failed)  # type: ignore[assignment]
    examples = {}
    for s in failed:
        examples.setdefault(s.error_class, s.error)
    counted = [s for s in sent if s.usage_completion is not None]
    mismatches = [{"request_id": s.request_id, "server": s.usage_completion, "client": len(s.token_ids)}
                  for s in counted if s.usage_completion != len(s.token_ids)]
    prompt_mismatch = [{"request_id": s.request_id, "server": s.usage_prompt, "client": s.prompt_len}
                       for s in sent if s.usage_prompt is not None and s.usage_prompt != s.prompt_len]
    sizes = [n for s in sent for n in s.chunk_sizes]
    gaps = [(b - a) / 1e9 for s in sent for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    lags = [(s.sent_ns - s.scheduled_ns) / 1e9 for s in sent if s.sent_ns is not None and s.scheduled_ns]
    g = summarize(gaps)
    return {
        "requests_sent": len(sent),
        "requests_cancelled": sum(1 for s in sent if s.cancelled),
        "failed_requests": len(failed),
        "failed_request_reasons": dict(reasons),
        "failed_request_examples": examples or None,
        "output_tokens_server": sum(s.usage_completion for s in counted) if counted else None,  # type: ignore[misc]
        "output_tokens_client": sum(len(s.token_ids) for s in counted) if counted else sum(len(s.token_ids) for s in sent),
        "output_tokens_client_all": sum(len(s.token_ids) for s in sent),
        "requests_without_usage": len(sent) - len(counted),
        "token_count_mismatch": bool(mismatches),
        "token_count_mismatches": mismatches[:20] or None,
        "input_tokens_server": sum(s.usage_prompt for s in sent if s.usage_prompt is not None) or None,  # type: ignore[misc]
        "input_tokens_client": sum(s.prompt_len for s in sent),
        "input_token_count_mismatches": prompt_mismatch[:20] or None,
        "token_count_source": ",".join(sorted({s.count_source for s in sent if s.count_source})) or None,
        "stream_chunks": len(sizes),
        "tokens_per_chunk_mean": sum(sizes) / len(sizes) if sizes else None,
        "tokens_per_chunk_max": max(sizes) if sizes else None,
        "multi_token_chunk_frac": sum(1 for n in sizes if n > 1) / len(sizes) if sizes else None,
        "itl_chunk_s": g["p50"], "itl_chunk_s_p90": g["p90"], "itl_chunk_s_p99": g["p99"],
        "itl_chunk_s_mean": g["mean"], "itl_chunk_s_count": g["count"],
        "client_send_lag_s_max": max(lags) if lags else None,
        **server_timing_fields(sent),
    }


def server_timing_fields(states: list[ReqState]) -> dict[str, Any]:
    """The server's own per-response `timings` (llama-server), summed over the point's requests, beside the
    client's times: prompt and generation milliseconds, tokens taken from the prompt cache, draft tokens
    proposed and accepted. Empty where the server sends none."""
    timed = [s.server_timings for s in states if s.server_timings]
    if not timed:
        return {}
    keys = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n", "draft_n", "draft_n_accepted")
    total = {k: sum(t[k] for t in timed if isinstance(t.get(k), (int, float))) for k in keys
             if any(isinstance(t.get(k), (int, float)) for t in timed)}
    return {"server_timings": {"requests": len(timed), **total}}


def endpoint_fields(states: list[ReqState], cfg: EndpointConfig, server: Server, model_name: str | None,
                    plan: LaunchPlan | None, series: dict[str, Any] | None, scrape_errors: int,
                    speculation: Speculation | None, spec_error: str | None) -> dict[str, Any]:
    """The point's row fields: `point_fields(states)`, then who served it and how (the module's
    docstring). `plan`: a launched server's launch plan (None: attached, or not launched yet);
    `series`: the /metrics samples of the point (None: not scraped). Not yet redacted."""
    kind = KINDS[cfg.kind]
    fields = point_fields(states)
    fields.update(
        transport="http", endpoint_kind=cfg.kind, endpoint_url=server.redactor.text(server.base),
        server_version=server.version, server_model=model_name, launch_command=server.command,
        tls_verify=bool(cfg.verify_tls), auth=cfg.auth(),
        prompt_format=("ids" if kind.prompt_ids else "text") if cfg.prompt_format == "auto" else cfg.prompt_format,
        server_argv=server.argv, server_extra_options=server.extra_options,
        server_options=(dict(plan.options_used) if plan else {}) if cfg.launched else dict(given(cfg.attached_options)),
        options_differing_from_defaults=plan.differing if plan else None,
        server_settings=plan.settings if plan else None,
        itl_chunking=ITL_CHUNKING, prefix_cache_reset=server.prefix_reset, api=cfg.api,
        chat_template=None if cfg.api != "chat" else (
            f"separator {cfg.chat_separator!r}" if cfg.chat_separator is not None
            else "endpoints.<name>.chat_template" if cfg.chat_template is not None else "the checkpoint's own"),
        output_token_ids=token_ids_text(fields.get("token_count_source")),
        server_metrics=series, server_metrics_interval_s=cfg.metrics_interval_s if series is not None else None,
        server_metrics_errors=scrape_errors if series is not None else None,
    )
    if speculation is not None:
        gauges = kind.spec_metrics.gauges if kind.spec_metrics else ()
        last = {g: series[g][-1][1] for g in gauges if series and series.get(g)}
        fields["spec_decode_aggregates"] = last or None  # what the server reports only in aggregate
        fields["spec_decode_error"] = spec_error
    if cfg.ca_bundle:
        fields["ca_bundle"] = str(cfg.ca_bundle)
    if server.compute_threads is not None:
        fields["server_compute_threads"] = server.compute_threads
    if server.process is not None and not server.process.alive():
        fields["server_exit"] = server.process.exit_text()
    return fields


def token_ids_text(sources: str | None) -> str | None:
    """Whether the point's output token ids are the server's: a server that sends none
    (trtllm-serve over the OpenAI API, an SGLang older than its `return_token_ids`) gives the
    client counts and times, and -1 for every id in prefill(), decode() and serve(); greedy
    tokens cannot be compared with it."""
    if not sources:
        return None
    with_ids = {"token_ids", "logprobs_ids", "verbose_tokens"}  # the ways a chunk names its tokens' ids
    return ("from the server" if set(sources.split(",")) <= with_ids
            else "unknown: the server sends none (-1 in the results)")
