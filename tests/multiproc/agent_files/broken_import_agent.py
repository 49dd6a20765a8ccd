"""An agent file that fails on import, as one with a missing dependency does."""

raise ModuleNotFoundError("No module named 'my_lab_env'")
