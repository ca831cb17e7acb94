"""The metric definitions the report states next to its numbers (from docs/metrics.md, the
project's definitions; keep the two in step)."""

from __future__ import annotations

OFFLINE = [
    ("prefill latency", "wall time from submitting the batch until every sequence has its first output token"),
    ("prefill throughput", "B × S / prefill latency (tokens/s), for a batch of B prompts of S tokens"),
    ("decode step latency", "wall time of one decode step (one new token for every live sequence); "
                            "the per-step samples, median and p90/p99 are reported"),
    ("decode throughput", "B / median decode step latency (tokens/s)"),
    ("end-to-end latency", "prefill latency + sum of decode step latencies (checked against the measured total)"),
    ("output throughput", "B × O / end-to-end latency, for O output tokens per sequence"),
]

SERVING = [
    ("TTFT", "first output token time − scheduled arrival"),
    ("E2EL", "last output token time − scheduled arrival"),
    ("TPOT", "(E2EL − TTFT) / (N_out − 1), defined only for N_out > 1; one value per request"),
    ("ITL", "every gap between consecutive output tokens of one request; pooled over all requests "
            "(weighted by token, not by request)"),
    ("queue time", "engine-reported scheduling time − scheduled arrival, where the engine exposes it"),
    ("request throughput", "completed requests / (last completion − first scheduled arrival)"),
    ("output token throughput", "Σ N_out / same duration"),
    ("goodput", "requests meeting every configured SLO (TTFT, TPOT, E2EL) / same duration"),
]

SPECULATIVE = [
    ("acceptance rate", "accepted / proposed draft tokens over the point (the engine's spec-decode counters)"),
    ("mean acceptance length", "1 + accepted / drafts: the tokens a drafting step emits per sequence"),
    ("acceptance at position i", "drafts whose i-th proposed token was accepted / drafts"),
    ("tokens per step", "decode tokens / (decode tokens − accepted tokens): output tokens a sequence gets per engine "
                        "step after its first"),
    ("draft time share", "time the engine says it spent proposing / the point's wall time"),
    ("speed-up", "median TPOT without speculation / median TPOT with it over the same requests (same engine, "
                 "point, run and cores); 95% bootstrap interval with the requests resampled in pairs"),
    ("lossless", "every request's output tokens equal, token for token, to the same engine's output without "
                 "speculation; a difference fails the row, a row that could not be compared is unverified"),
]

MEMORY = [
    ("peak memory", "GPU: NVML memory of this process and all its children (and the framework allocator's "
                    "peak where the engine runs in-process); CPU: resident memory of the process tree "
                    "(psutil). Sampled at a fixed rate (default 100 Hz); timeline and peak are kept"),
    ("KV reserved up front", "a KV pool the engine allocates at load (the reference engine, vLLM, TensorRT-LLM), "
                             "whatever the batch needs; inside the process peak from the start. Engines without "
                             "one (transformers) hold only the live cache"),
    ("KV in use", "the part of the KV cache the batch's sequences hold (blocks in use × bytes per block; "
                  "transformers: its cache tensors)"),
    ("working memory", "the memory compared across engines: on a GPU (NVML counts an allocated pool whole) the "
                       "process peak − KV reserved up front + KV in use; on a CPU (resident memory counts a pool "
                       "only as far as it was written) the process peak as measured"),
    ("device-wide peak", "GPU: the peak used memory of the whole device (NVML), every process on it"),
    ("KV cache (engine)", "what the engine itself reports: pool size in blocks and bytes, blocks in use"),
    ("KV cache (estimate)", "bytes per token = 2 (K and V) × layers × KV heads × head_dim × bytes per element "
                            "(+ per-token scale bytes for quantised caches); paged caches round each sequence "
                            "up to whole blocks"),
]

CLOCKS = [
    ("clock", "one monotonic clock (time.perf_counter_ns) for everything in a run; on a GPU the device is "
              "synchronised before the host clock is read at every boundary a metric needs"),
    ("request start", "a request's clock starts at its scheduled arrival time (no coordinated omission)"),
    ("token counts", "from the token ids the engine returned, never from re-tokenised text"),
    ("output length", "forced: ignore_eos and an explicit maximum; greedy decoding unless the workload says otherwise"),
    ("repeats", "every point runs warm-up iterations first (never 0), then repeats until both a minimum "
                "iteration count and a minimum duration are reached"),
]

CAPACITY = [
    ("open loop", "requests arrive at a scheduled rate whatever the engine does (request_rate)"),
    ("closed loop", "a fixed number of users (concurrency), each sending its next request when the last one ends"),
    ("throughput per device", "Σ output tokens / the point's duration (output tok/s)"),
    ("per-user speed", "output tokens per second of one request: 1 / median TPOT (per_user_tok_s)"),
    ("saturated", "the queue grew through the run: TTFT rising with the arrival index, the load is past what "
                  "the engine sustains"),
    ("capacity", "the largest request rate (or concurrency) at which every configured SLO (p99 TTFT, TPOT, "
                 "E2EL) held on a probe neither saturated nor client-limited, found by bisection between a load "
                 "that met them and one that did not, down to the resolution"),
]

TUNING = [
    ("trial", "one configuration of an engine's options, measured like the capacity workload with the engine "
              "reloaded with them; trial 0 is the engine's configured options (its defaults)"),
    ("budget", "the same for every engine: the number of trials, the sampler and its seed, the SLOs, the search and "
               "the load (the same requests at the same loads)"),
    ("best configuration", "the trial with the highest capacity under the SLOs (or goodput at the fixed rate)"),
    ("gain", "the best trial's value / the defaults' value, both from the search"),
    ("confirmation", "best and defaults measured again, interleaved, round by round: the ratio is the geometric mean "
                     "of the rounds' best / default, with its Student-t interval; gain confirmed when the interval "
                     "lies above 1"),
    ("option importance", "Optuna's importance evaluator over the completed trials: the share of the objective's "
                          "variation each option explains (an engine's importances sum to 1)"),
]

CLIENT = [
    ("send lag", "per request, the actual send − when it was due (its scheduled arrival, or when a capped or "
                 "closed-loop slot freed); p50, p99 and max over the point's requests"),
    ("loop lag", "how late a 2 ms timer fired on the client's event loops while streams were active; a loop that "
                 "late reads its sockets that late too (the largest, and p99)"),
    ("client CPU", "the busiest client loop's (or client process's) CPU time / the point's wall time, as a "
                   "fraction of one core"),
    ("achieved rate", "(requests − 1) / the span of the actual sends, beside the offered rate (asked for) and the "
                      "scheduled rate (the same over the times they were due)"),
    ("client-limited", "the load generator did not keep up: send lag p99 or loop-lag p99 (over time) above "
                       "workload.client_lag_limit_s (default 5 ms) or 5 % of the tightest SLO, whichever is smaller, "
                       "or one loop stall above 10 times that, or a client at workload.client_cpu_limit (default 90 %) "
                       "of a core or more. Its latencies are "
                       "partly the client's: treated like saturated, never counted as capacity; raise "
                       "workload.client_processes. '–': no client (an engine in the harness's own process)"),
]

ENERGY = [
    ("energy", "energy the device used while the point ran: NVML's energy counter on a GPU (a GPU without it: its "
               "power sampled and integrated by the trapezoid rule, refused over a 3 s gap), RAPL on a CPU"),
    ("J per output token", "energy / output tokens of the point (its inverse: output tokens per J)"),
]

COST = [
    ("price used", "per engine: one price per hour for its whole deployment, or a price per GPU-hour or per "
                   "core-hour times the GPUs or cores the point held; your cost.* settings, or the price table's "
                   "(harness/core/prices.yaml: each price with its vendor page, date and how far it was checked)"),
    ("cost per Mtok", "price per hour × the point's wall time / 3600, over its input, output or input + output "
                      "tokens × 10^6: each the whole cost, three views of it (1,000 output tok/s at 2.00/h: 0.5556 per "
                      "million output tokens)"),
    ("cost per good Mtok", "the same over the good tokens only: those of requests that met every SLO the point was "
                           "judged on (per request) and passed its correctness check (speculative decoding's lossless "
                           "check); half the requests missing the SLO doubles it. No good token: none (unbounded), "
                           "never 0"),
    ("energy cost", "energy (measured; else modelled from a rated power, labelled) / 3.6 MJ per kWh × the price per "
                    "kWh, per output token; shown beside the hourly price, not added to it"),
]

QUALITY = [
    ("perplexity", "exp(mean −log p(actual token)) over the scored positions of held-out windows, "
                   "teacher-forced (every position predicted from the true tokens before it)"),
    ("Δ perplexity", "perplexity − the float32 reference engine's (float32 KV cache) on the same windows"),
    ("top-1 agreement", "share of positions where the engine's most likely next token is the baseline's"),
    ("mean KL", "mean over positions of KL(baseline ‖ engine) on the baseline's top-k tokens plus one bucket "
                "for all other tokens (a lower bound of the full KL)"),
    ("long context", "the same over each window's last positions (from long_from on), where KV error accumulates"),
    ("KV bytes / token", "the engine's own report of its KV cache's bytes per token at that KV dtype"),
    ("output tok/s", "a short decode at the same settings: batch / median decode step latency"),
]

HTTP = [
    ("token counts", "the server's usage.completion_tokens beside the tokens the client received; a mismatch "
                     "is flagged, never averaged away"),
    ("failed requests", "requests that did not complete (HTTP error, connection closed, stream ended early); "
                        "latency and throughput are over the completed requests only"),
    ("ITL over SSE", "a server may send several tokens in one chunk: the tokens of one chunk share its arrival "
                     "time (as itl_chunking in the rows says)"),
]
