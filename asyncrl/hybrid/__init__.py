"""Models, training backends and generation engines.

    models.py    HF causal LMs from a local directory or a preset config; token log-probs
    sampler.py   the built-in batched KV-cache generation engine
    fsdp.py      the FSDP2 training backend (+ tensor parallelism on a (dp, tp) mesh)
    zero.py      the DeepSpeed ZeRO-2/3 training backend (same interface)
    engine.py    the hybrid engine: train <-> generate on the same ranks
    roles.py     Policy, Rollout, Reference workers
    vllm_engine.py  the vLLM generation engine (GPU; never imported on CPU paths)
    export.py    a policy's checkpoint as a Hugging Face model directory (`asyncrl export`)
"""
