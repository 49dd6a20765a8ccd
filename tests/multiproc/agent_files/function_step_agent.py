"""OpenRLHF's older function-style agent file: module-level step returning a tuple, plus reset."""

import torch


async def reset(states, **kwargs):
    return {"observation": states["observation"]}


async def step(state, action, label, **kwargs):
    done = "A: " in state  # one retry, then done
    reward = torch.tensor(float(str(label) in action))
    next_state = state + action + ("" if done else "\nA: ")
    return reward, next_state, done, {"step_scale": float(kwargs.get("scale", -1.0))}
