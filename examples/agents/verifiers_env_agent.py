"""A verifiers environment (prime-rl's environment library) trained through the endpoint, its code unchanged.

``load_environment`` is an ordinary verifiers environment: a ``vf.SingleTurnEnv`` whose ``vf.Rubric`` scores the
answer. The five lines of ``run_episode`` below are the whole adapter: verifiers' own rollout code
(``env.run_rollout``) sends the chat request through the client the trainer injects, wrapped in verifiers'
``OpenAIChatCompletionsClient``, and the rubric's weighted sum is the reward::

    train.agent_func_path=examples/agents/verifiers_env_agent.py   (pip install 'hpc-rlhf[verifiers]')

The task is the tiny arithmetic set (``a+b=``); the trainer's prompts and labels become the rollout's prompt and
``answer``. Rubric: one point for an exact answer, half a point times the fraction of digits in it (a format
term, so that a policy starting from random weights gets a signal). verifiers 0.3.x (its classic API).
"""

import verifiers as vf
from datasets import Dataset


def exact_answer(parser, completion, answer, **kwargs) -> float:
    return float((parser.parse_answer(completion) or "").strip() == str(answer))


def digit_fraction(parser, completion, **kwargs) -> float:
    text = (parser.parse_answer(completion) or "").strip()
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


def load_environment(**kwargs) -> vf.Environment:
    # The environment's own dataset is not used for training (the trainer's prompt data is); verifiers wants one.
    dataset = Dataset.from_list([{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)])
    rubric = vf.Rubric(funcs=[exact_answer, digit_fraction], weights=[1.0, 0.5])
    return vf.SingleTurnEnv(dataset=dataset, rubric=rubric, **kwargs)


ENV = load_environment()


async def run_episode(client, prompt, label, model="policy"):
    rollout_input = {"prompt": [{"role": "user", "content": prompt}], "answer": str(label), "example_id": 0}
    output = await ENV.run_rollout(rollout_input, vf.OpenAIChatCompletionsClient(client), model, sampling_args={})
    error = output.get("error") or {}
    if error.get("error") == "EmptyModelResponseError":  # the model answered with nothing: its own doing, reward 0
        return {"reward": 0.0, "extra_logs": {"empty_response": 1.0}}
    if error:  # verifiers records other failures (a refused request, ...) instead of raising: fail the episode
        raise RuntimeError(f"verifiers rollout failed: {error}")
    return {"reward": output["reward"], "score": output["metrics"].get("exact_answer", 0.0),
            "extra_logs": {**output["metrics"], "empty_response": 0.0}}
