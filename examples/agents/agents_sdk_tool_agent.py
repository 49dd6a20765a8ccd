"""An OpenAI Agents SDK agent with a function tool, trained unchanged through the endpoint.

``Runner.run`` drives the agent with ``OpenAIChatCompletionsModel`` on the client the trainer injects; the
SDK's own loop sends the tools, runs ``solve`` when the model calls it, appends the tool's output and asks the
model again, so an episode that calls the tool is a two-call chat that trains as one sequence (the tool output
masked)::

    train.agent_func_path=examples/agents/agents_sdk_tool_agent.py   (pip install 'hpc-rlhf[agents-sdk]')

The task is the tiny arithmetic set (``a+b=``). ``solve`` returns the answer of the episode's question (it reads
it from the run context), so a policy that calls it and then repeats what it returned is right. Reward: half a
point for calling the tool, a quarter more when the model then answers instead of calling it again, one point
for a right final answer. ``max_turns=2`` lets the model answer once after the tool; an episode that calls the tool
again instead ends without an answer. The recipe's tiny model (``actor.build_tiny: tools``) has the Hermes tool call
``<tool_call>{"name": "solve", "arguments": {}}</tool_call>`` as one token, so RL can find it; a real model emits the
same text token by token.
"""

from dataclasses import dataclass

from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    RunConfig,
    RunContextWrapper,
    Runner,
    function_tool,
)


@dataclass
class Question:
    text: str
    answer: str


@function_tool
def solve(ctx: RunContextWrapper[Question]) -> str:
    """Return the answer to the question being asked."""
    return ctx.context.answer


async def run_episode(client, prompt, label, model="policy", max_turns=2):
    agent = Agent(name="solver", tools=[solve], model=OpenAIChatCompletionsModel(model=model, openai_client=client))
    try:
        # No tracing: the SDK would otherwise try to upload each run's trace to OpenAI.
        result = await Runner.run(agent, prompt, context=Question(prompt, str(label)), max_turns=max_turns,
                                  run_config=RunConfig(tracing_disabled=True))
    except MaxTurnsExceeded as err:  # the tool called on every turn: no final answer
        result, final = err.run_data, None
    else:
        final = str(result.final_output or "").strip()
    items = result.new_items if result is not None else []
    called = float(any(item.type == "tool_call_item" for item in items))
    answered = float(final is not None)
    correct = float(final == str(label))
    return {"reward": called * (0.5 + 0.25 * answered) + correct, "score": correct,
            "extra_logs": {"tool_called": called, "answered": answered, "accuracy": correct}}
