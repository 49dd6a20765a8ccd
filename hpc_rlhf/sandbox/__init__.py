"""Running model-written code: isolation levels, limits, a local pool and a SandboxFusion client.

See docs/rewards.md ("Code rewards and the sandbox") for the isolation each level gives.
"""
