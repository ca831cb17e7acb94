"""Our own paged-KV inference engine, small enough to read top to bottom.

Read it in this order (the plain-PyTorch path, which holds the reference semantics):

    config.py         the options (engine_options.reference.<name>) and their checks
    model.py          the decoder over a flat batch of tokens: LLaMA, Mistral, Qwen2/3, Qwen3-MoE,
                      Mixtral (qk-norm, experts, per-layer windows), DeepSeek-V3's dense layers
    kv_cache.py       the KV pool: one pre-allocated tensor split into blocks; int8/fp8 storage
    block_manager.py  block ownership (reference counts, free list) and the prefix cache
    scheduler.py      continuous batching: chunks per step, token budget, preemption
    attention.py      attention through the block table (prefill, cached prefix, decode, windows)
    layer_groups.py   layers grouped by window: a pool, blocks and tables per group; windows free blocks
    mla.py            latent attention (DeepSeek-V3) over a paged latent cache
    gemma.py          Gemma 3 on model.py's decoder: its norms, MLP, attention scale, two RoPE tables
    runner.py         one step: inputs in, greedy tokens out
    llm_engine.py     the engine: all of the above wired together, with the online API a server
                      drives (add_request / step / abort; harness/serve.py) and score()
    engine.py         the harness's Engine interface: a thin adapter onto llm_engine.py

then, if you want the fast paths (each tested against the plain one):

    kernels.py                 which kernels run on this device, chosen and recorded at load
    kernels_cpu.py             oneDNN-packed matrix products (torch's private mkldnn ops, contained)
    cpu_decode.py              fused paged decode attention for CPUs (a C kernel built at load)
    kernels_cuda.py            SDPA prefill and paged decode on CUDA
    triton_paged_attention.py  the Triton paged decode kernel (imported only when used)
    cuda_graphs.py             decode steps replayed from CUDA graphs, one per batch bucket

docs/reference-engine.md describes all of it, with measured figures.
"""
