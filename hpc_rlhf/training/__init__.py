"""Training runtime: the DeepSpeed facade (``deepspeed_engine``, the only deepspeed import), how role groups reach
DeepSpeed (``topology``), and which Adam implementation a role steps with (``optimizer_choice``)."""
