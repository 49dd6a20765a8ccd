"""Thin entry points (``main(argv=None)``, run with ``python -m``) and their one start-up path (``startup``)."""
