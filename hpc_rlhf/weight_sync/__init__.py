"""Actor -> rollout weight sync: the bucket plan, the transport between actor and rollout ranks, the gather of
sharded (ZeRO-3 / AutoTP / LoRA) states, the colocated in-process sync, and the gloo weight-transfer backend for
vLLM in processes of its own."""
