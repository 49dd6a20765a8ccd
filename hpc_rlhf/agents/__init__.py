"""Agent execution, token in / token out: the executor interface every rollout goes through (single-turn,
multi-turn ``AgentInstance`` files, OpenAI-client agents) and the OpenAI-compatible endpoint over a rollout engine.

Import the submodules directly; this package imports nothing so that loading one part never pulls in the others.
"""
