"""Model loading (actor, critic/reward with value head ``score``), logprobs and tiny local models."""
