"""Multi-turn episodes carried across weight updates (``hpc_rlhf.agents.in_flight``): versions per token, rounds
that finish the older batch while the newer one advances, checkpoint state that restarts unfinished episodes."""

from __future__ import annotations

import pickle

import pytest

from hpc_rlhf.agents.in_flight import InFlightEpisodes, in_flight_pool, versions_spanned
from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.models.tiny import build_char_tokenizer
from hpc_rlhf.rollout.base import GenerationResult, SamplingParams, Trajectory
from hpc_rlhf.trainers.rl.async_loop import token_version_metrics


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


class TurnsAgent(AgentInstanceBase):
    """Done after ``label`` turns; feedback "+" between turns; reward = turns taken."""

    def __init__(self):
        self.turn = 0

    async def step(self, states):
        self.turn += 1
        done = self.turn >= int(states["label"])
        return {"rewards": float(self.turn), "environment_feedback": "" if done else "+", "done": done}


class Engine:
    """Answers every sample with "ab"; logprob of a token = -version / 10 (the weights it was sampled with)."""

    def __init__(self, tok):
        self.tok, self.version, self.calls, self.seeds = tok, 0, [], []

    def __call__(self, requests):
        self.calls.append(sum(r.n for r in requests))
        results = []
        for i, request in enumerate(requests):
            self.seeds.append((tuple(request.prompt_ids), request.params.seed))
            for _ in range(request.n):
                ids = self.tok.encode("ab", add_special_tokens=False)
                results.append(GenerationResult(prompt_ids=list(request.prompt_ids), output_ids=ids,
                                                output_logprobs=[-self.version / 10] * len(ids),
                                                finish_reason="stop", request_index=i))
        return results


def executor(tok):
    return MultiTurnAgentExecutor(TurnsAgent, tok, 16, max_turns=10, step_timeout_s=5.0)


def prompts(turns):
    return [Prompt(text=f"{i}=", label=str(t), source="t", index=i) for i, t in enumerate(turns)]


def check_versions(trajectories: list[Trajectory]) -> None:
    for t in trajectories:
        assert t.token_versions is not None and len(t.token_versions) == len(t.response_ids)
        assert t.policy_version == min(t.token_versions)
        for version, logprob, mask in zip(t.token_versions, t.rollout_logprobs, t.action_mask, strict=True):
            if mask:  # the engine's logprob of each token is the one of the weights that sampled it
                assert logprob == pytest.approx(-version / 10)


def test_older_batch_finishes_while_the_newer_advances_across_an_update(tok):
    engine = Engine(tok)
    pool = InFlightEpisodes(executor(tok))
    sampling = SamplingParams(max_new_tokens=4, seed=7)
    pool.add(prompts([1, 3]), sampling, 2, step=1)
    assert pool.advance(engine, version=0) == []  # one round for the new batch; nothing older to return
    assert pool.num_batches == 1
    engine.version = 1  # the weight update lands between turns
    pool.add(prompts([5, 1]), sampling, 2, step=2)
    first = pool.advance(engine, version=1)
    assert [t.extra_logs["num_turns"] for t in first] == [1, 1, 3, 3]
    assert [t.group_index for t in first] == [0, 0, 1, 1]
    check_versions(first)
    # The 3-turn episodes: turn 1 under version 0, turns 2-3 under version 1.
    assert [versions_spanned(t) for t in first] == [1, 1, 2, 2]
    assert first[2].token_versions[:2] == [0, 0] and first[2].token_versions[-1] == 1
    # The newer batch ran alongside: two rounds together with the older batch's 3-turn episodes.
    assert engine.calls == [4, 6, 4]
    engine.version = 2
    second = pool.advance(engine, version=2, finish_all=True)
    check_versions(second)
    assert [t.extra_logs["num_turns"] for t in second] == [5, 5, 1, 1]
    assert [t.policy_version for t in second] == [1, 1, 1, 1]
    assert versions_spanned(second[0]) == 2 and pool.num_batches == 0
    metrics = token_version_metrics(second, trained_version=2)
    assert metrics["async/token_staleness_max"] == 1.0
    assert metrics["async/versions_per_episode_max"] == 2.0
    assert metrics["async/tokens_lag_1"] + metrics["async/tokens_lag_0"] == sum(sum(t.action_mask) for t in second)
    pool.close()


def test_restored_state_restarts_unfinished_episodes_from_their_first_turn_with_their_seeds(tok):
    sampling = SamplingParams(max_new_tokens=4, seed=11)
    engine = Engine(tok)
    pool = InFlightEpisodes(executor(tok))
    pool.add(prompts([1, 4]), sampling, 1, step=3)
    pool.advance(engine, version=0)
    state = pickle.loads(pickle.dumps(pool.state()))  # what a checkpoint keeps: no agent objects
    assert len(state) == 1 and sorted(state[0]["done"]) == [0]
    pool.close()
    # The uninterrupted run's seeds for episode 1, turn by turn, and the resumed run's.
    uninterrupted = engine.seeds[:]
    pool.advance(engine, version=0, finish_all=True)
    resumed_engine = Engine(tok)
    resumed = InFlightEpisodes(executor(tok))
    resumed.restore(state)
    out = resumed.advance(resumed_engine, version=1, finish_all=True)
    assert [t.extra_logs["num_turns"] for t in out] == [1, 4]
    assert out[0].token_versions == [0, 0]  # finished before the checkpoint: kept, not regenerated
    assert set(out[1].token_versions) == {1}  # restarted from its first turn
    # Episode 1's first turn has the seed it had before the checkpoint (same step seed, episode, turn).
    episode1_turn1 = [s for p, s in uninterrupted if p == tuple(tok.encode("1=", add_special_tokens=False))]
    assert resumed_engine.seeds[0][1] == episode1_turn1[0]
    resumed.close()


def test_execute_overrides_and_openai_agents_are_refused_clearly(tok):
    class Wrapping(MultiTurnAgentExecutor):
        async def execute(self, prompt, label, sampling_params=None, *args, **kwargs):
            return await super().execute(prompt, label, sampling_params)

    with pytest.raises(ValueError, match="overrides execute"):
        InFlightEpisodes(Wrapping(TurnsAgent, tok, 16))
    with pytest.raises(ValueError, match="OpenAI-client"):
        in_flight_pool(object())


class SeededEngine:
    """Answers sample j of a request from the request's seed and prompt alone (digits of seed * (j + 1), as many as
    the prompt length picks), so the trajectories show which seed every turn of every episode was sampled with."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, requests):
        results = []
        for i, request in enumerate(requests):
            for j in range(request.n):
                text = str(request.params.seed * (j + 1))[: 2 + len(request.prompt_ids) % 5]
                ids = self.tok.encode(text, add_special_tokens=False)
                results.append(GenerationResult(prompt_ids=list(request.prompt_ids), output_ids=ids,
                                                output_logprobs=[-t / 100 for t in ids], finish_reason="stop",
                                                request_index=i))
        return results


class DigitAgent(AgentInstanceBase):
    """Done when the action starts with the label's digit or after 4 turns; raises on a "7" action (a failure)."""

    def __init__(self):
        self.turn = 0

    async def step(self, states):
        self.turn += 1
        action = states["action_text"]
        if "7" in action[:1]:
            raise RuntimeError("seven")
        done = action.startswith(states["label"]) or self.turn >= 4
        return {"rewards": float(self.turn) + len(action) / 10, "environment_feedback": "" if done else "+",
                "done": done}


def test_in_flight_episodes_match_the_executor_run_token_for_token(tok):
    """The asynchronous trainer's episodes and ``MultiTurnAgentExecutor.run`` share one episode logic: the same
    prompts and step seed give the same trajectories, failures included."""
    batch = [Prompt(text=f"{i}{'=' * i}", label=str(i % 10), source="t", index=i) for i in range(6)]
    sampling = SamplingParams(max_new_tokens=6, seed=1234)

    def make():
        return MultiTurnAgentExecutor(DigitAgent, tok, 16, max_len=40, max_turns=4, step_timeout_s=5.0)

    ran = make().run(batch, SeededEngine(tok), sampling, 3)
    pool = InFlightEpisodes(make())
    pool.add(batch, sampling, 3, step=1)
    carried = pool.advance(SeededEngine(tok), version=0, finish_all=True)
    pool.close()

    assert len(carried) == len(ran) == 18
    for a, b in zip(ran, carried, strict=True):
        assert b.token_versions == [0] * len(b.response_ids) and b.policy_version == 0
        b.token_versions, b.policy_version = a.token_versions, a.policy_version  # what only the pool stamps
        assert a == b
    # Not a vacuous match: each sample drew its own seeds, episodes ran several turns, and some failed.
    assert len({tuple(t.response_ids) for t in ran}) == len(ran)
    assert max(t.extra_logs["num_turns"] for t in ran) > 1
    assert 0 < sum(t.failure is not None for t in ran) < len(ran)


class ResetFailsAgent(TurnsAgent):
    """``reset`` raises for the prompt labelled "x"; otherwise a ``TurnsAgent``."""

    async def reset(self, states, **kwargs):
        if states["label"] == "x":
            raise RuntimeError("environment unavailable")
        return {"observation": states["observation"]}


def test_an_episode_whose_reset_fails_is_stamped_the_current_version_not_zero(tok):
    """A reset failure admitted after a weight update is as fresh as any episode finished then: version 0 would
    inflate ``async/staleness_max`` and, under ``staleness_policy=drop``, drop the episode out of its group."""
    pool = InFlightEpisodes(MultiTurnAgentExecutor(ResetFailsAgent, tok, 16, max_turns=10, step_timeout_s=5.0))
    engine = Engine(tok)
    engine.version = 3
    pool.add([Prompt(text="0=", label="x", source="t", index=0), Prompt(text="1=", label="1", source="t", index=1)],
             SamplingParams(max_new_tokens=4, seed=7), 1, step=4)
    out = pool.advance(engine, version=3, finish_all=True)
    assert [t.finish_reason for t in out] == ["agent_error", "stop"]
    assert [t.policy_version for t in out] == [3, 3]
    assert out[0].token_versions == [3] * len(out[0].response_ids)
