"""Online RL (PPO, REINFORCE++, GRPO, RLOO; sync and async): the step loop, its setup, role workers."""
