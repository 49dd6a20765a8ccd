"""Rollout engines behind one protocol (``base``: ``RolloutEngine``, ``Trajectory``): the transformers engine, vLLM
inside every rank (external launcher) or in processes of its own, and the table of vLLM names they use.

vLLM is imported only inside the vLLM modules; importing this package pulls in neither vLLM nor DeepSpeed."""
