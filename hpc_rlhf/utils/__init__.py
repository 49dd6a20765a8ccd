"""Logging, timers and small helpers shared by the trainers."""
