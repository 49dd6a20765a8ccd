"""Memory model and model shapes behind ``hpc-rlhf plan``: torch-free, runs on a login node."""
