"""Models, training backends and generation engines.

    models.py    HF causal LMs from a local directory or a preset config; token log-probs
    sampler.py   the built-in batched KV-cache generation engine
    fsdp.py      the FSDP2 training backend (+ tensor parallelism on a (dp, tp) mesh)
    zero.py      the DeepSpeed ZeRO-2/3 training backend (same interface)
    engine.py    the hybrid engine: train <-> generate on the same ranks
    roles.py     Policy, Rollout, Reference workers
    turns.py     multi-turn rollouts: an environment's observations between turns
    fn_pool.py   a user's function (a reward, an environment) in child processes, timed out
    user_fn.py   a user's function's inputs from a batch's columns; local tokenizers
    vllm_engine.py  the vLLM generation engine (GPU; never imported on CPU paths)
    vllm_options.py the vLLM adapter's option and sampling checks (no vLLM import)
    export.py    a policy's checkpoint as a Hugging Face model directory (`asyncrl export`)
"""
