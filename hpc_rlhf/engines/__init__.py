"""Runtime facades: DeepSpeed training / frozen engines (``deepspeed_engine``, the only deepspeed import with
its ``deepspeed_topology`` and ``state_gather`` helpers) and rollout engines (transformers, vLLM)."""
