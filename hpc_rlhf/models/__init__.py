"""Models: loading (value head ``score``), every forward pass (padded, packed, sequence-parallel), kernels,
LoRA / QLoRA and tiny local models."""
