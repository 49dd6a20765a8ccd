"""Runtime facades: DeepSpeed training/inference engines (deepspeed_engine) and rollout engines."""
