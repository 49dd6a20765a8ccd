"""Thin entry points. Each module has ``main(argv=None)`` and runs with ``python -m``."""
