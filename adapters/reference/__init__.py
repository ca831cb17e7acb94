"""Our own paged-KV inference engine, small enough to read top to bottom.

Read it in this order:

    config.py         the options (engine_options.reference.<name>) and their checks
    model.py          a LLaMA-family decoder over a flat batch of tokens
    kv_cache.py       the KV pool: one pre-allocated tensor split into blocks; int8/fp8 storage
    block_manager.py  block ownership (reference counts, free list) and the prefix cache
    scheduler.py      continuous batching: chunks per step, token budget, preemption
    attention.py      attention through the block table (prefill, cached prefix, decode)
    runner.py         one step: inputs in, greedy tokens out
    engine.py         the harness's Engine interface on top of it all
"""
