"""Rollout routing replay (R3): the transformers engine records each token's experts, the batch carries them,
and the trainer's forward replays them (experts fixed, gate weights from the current router), checked by hand
on a one-layer MoE model whose router was perturbed after the rollout."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hpc_rlhf.agents.executor import SingleTurnExecutor
from hpc_rlhf.algos.moe import route_mismatch
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.models.forward import policy_logprobs
from hpc_rlhf.models.micro_forward import forward_scope
from hpc_rlhf.models.routing_replay import (
    RouteRecorder,
    continue_routes,
    merge_routes,
    not_recorded,
    replay_gate_weights,
    replay_routes,
    route_dtype,
)
from hpc_rlhf.models.tiny import build_char_tokenizer, build_tiny_moe_model
from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine
from hpc_rlhf.trainers.rl.step_batch import StepBatch

NUM_EXPERTS, TOP_K = 4, 2


@pytest.fixture(scope="module")
def one_layer_path(tmp_path_factory):
    return build_tiny_moe_model(tmp_path_factory.mktemp("moe1"), "qwen3_moe", num_experts=NUM_EXPERTS, top_k=TOP_K,
                                num_hidden_layers=1, initializer_range=0.2)


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rollout(one_layer_path):
    """Samples of the unperturbed model with their recorded routes and logprobs."""
    tok = build_char_tokenizer()
    engine = TransformersRolloutEngine(_load(one_layer_path), tok.eos_token_id, tok.pad_token_id, record_routes=True)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
    prompts = [Prompt(text, None, "test", i) for i, text in enumerate(("12+34=", "7+8=", "100+1="))]
    return SingleTurnExecutor(tok, 64).run(prompts, engine.generate, params, n_samples_per_prompt=2)


def _perturbed(path, scale: float = 0.15):
    """The rollout model after a small change of its router only (as an update in async training would make)."""
    model = _load(path)
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.weight.add_(scale * torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(0)))
    return model


def test_gate_weights_of_replayed_experts_by_hand():
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0]])
    p = torch.softmax(logits, dim=-1)[0]
    experts = torch.tensor([[3, 0]])  # not the router's own top-2 ({1, 0})
    plain = replay_gate_weights(logits, experts, renormalise=False)
    assert plain.tolist()[0] == pytest.approx([float(p[3]), float(p[0])])
    norm = replay_gate_weights(logits, experts, renormalise=True)
    assert norm.tolist()[0] == pytest.approx([float(p[3] / (p[3] + p[0])), float(p[0] / (p[3] + p[0]))])
    # Only the experts of recorded positions are replaced.
    own = torch.tensor([[1, 0], [2, 3]])
    recorded = torch.tensor([[3, 2], [not_recorded(torch.uint8)] * 2], dtype=torch.uint8)
    assert merge_routes(own, recorded).tolist() == [[3, 2], [2, 3]]
    assert route_dtype(8) == torch.uint8 and route_dtype(256) == torch.int16


def test_route_mismatch_by_hand():
    # 3 tokens, 2 layers, top-2 of 3 experts. Token 2 is not counted (mask), so only tokens 0 and 1 matter.
    layer0 = torch.tensor([[3.0, 2.0, 0.0], [0.0, 1.0, 2.0], [5.0, 0.0, 0.0]])  # top-2: {0,1}, {2,1}, {0, *}
    layer1 = torch.tensor([[0.0, 2.0, 3.0], [2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])  # top-2: {2,1}, {0,1}, {2, *}
    recorded = torch.tensor([[[1, 0], [1, 2]],   # token 0 agrees in both layers (order ignored)
                             [[2, 1], [0, 2]],   # token 1 differs in layer 1
                             [[0, 1], [0, 1]]], dtype=torch.uint8)
    mask = torch.tensor([True, True, False])
    got = route_mismatch((layer0, layer1), recorded, mask, top_k=2)
    assert got == {"moe/route_mismatch": 0.5, "moe/route_mismatch_layer_mean": 0.25}
    # An unrecorded token is left out of both fractions.
    recorded[1] = not_recorded(torch.uint8)
    assert route_mismatch((layer0, layer1), recorded, mask, top_k=2)["moe/route_mismatch"] == 0.0


def test_engine_records_the_routes_of_every_computed_position(one_layer_path, rollout):
    model = _load(one_layer_path)
    for t in rollout:
        routes = t.routed_experts
        assert routes.shape == (len(t.prompt_ids) + len(t.response_ids), 1, TOP_K) and routes.dtype == torch.uint8
        # The last sampled token is never fed forward: not recorded. Every other position equals what one full
        # forward over the sequence routes (the engine's prefill + decode steps compute the same thing).
        assert (routes[-1] == not_recorded(torch.uint8)).all()
        with RouteRecorder(model, NUM_EXPERTS) as recorder:
            model(input_ids=torch.tensor([t.sequence_ids]))
            full = recorder.take()
        assert torch.equal(full[:-1], routes[:-1])


def _moe_block_by_hand(model, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The sparse MoE block of layer 0 on inputs x (N, H) with the given experts (N, k), written out:
    sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)), w = softmax(router(x)) at the experts, renormalised."""
    block = model.model.layers[0].mlp
    probs = torch.softmax(x @ block.gate.weight.T, dim=-1)
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        chosen = experts[n].long()
        weights = probs[n, chosen] / probs[n, chosen].sum()
        for w, e in zip(weights, chosen):
            gate, up = (block.experts.gate_up_proj[e] @ x[n]).chunk(2)
            out[n] += w * (block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_replay_uses_the_recorded_experts_and_gives_the_logprobs_computed_by_hand(one_layer_path, rollout):
    model = _perturbed(one_layer_path)
    layer = model.model.layers[0]
    captured = {}
    layer.post_attention_layernorm.register_forward_pre_hook(lambda m, args: captured.update(residual=args[0]))
    layer.mlp.register_forward_pre_hook(lambda m, args: captured.update(x=args[0]))
    layer.mlp.experts.register_forward_pre_hook(lambda m, args: captured.update(experts=args[1]))
    differing_tokens, logprob_gaps = 0, []
    for t in rollout:
        ids = torch.tensor([t.sequence_ids])
        p, r = len(t.prompt_ids), len(t.response_ids)
        predicting = slice(p - 1, p + r - 1)  # positions whose output predicts a response token
        with torch.no_grad():
            free = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        own = captured["experts"][predicting]
        recorded = t.routed_experts[predicting, 0].long()
        differing_tokens += int((own.sort(-1).values != recorded.sort(-1).values).any(-1).sum())
        free_lp = free[predicting].gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
        logprob_gaps.append(float((free_lp - torch.tensor(t.rollout_logprobs)).abs().max()))

        with torch.no_grad(), replay_routes(model, t.routed_experts):
            replayed = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        # The trainer's routes are the recorded ones at every recorded position...
        assert torch.equal(captured["experts"][:-1], t.routed_experts[:-1, 0].long())
        # ...and its log-probs are those of the block computed by hand with those experts and the current router.
        x = captured["x"][0]
        experts = t.routed_experts[:, 0].long().clone()
        experts[-1] = captured["experts"][-1]  # the unrecorded last position keeps the router's own choice
        with torch.no_grad():
            hidden = model.model.norm(captured["residual"][0] + _moe_block_by_hand(model, x, experts))
            by_hand = torch.log_softmax(model.lm_head(hidden).float(), -1)
        targets = torch.tensor(t.response_ids)[:, None]
        assert torch.allclose(replayed[predicting].gather(-1, targets), by_hand[predicting].gather(-1, targets),
                              atol=1e-5)
    # The perturbation made the free trainer route some tokens differently, with different log-probs.
    assert differing_tokens > 0
    assert max(logprob_gaps) > 1e-3


@pytest.mark.parametrize("packed", [False, True])
def test_replay_in_the_rl_forward_matches_replay_on_each_sequence(one_layer_path, rollout, packed):
    """The batch layout (left-padded prompts, right-padded responses; or packed) hands each token its own routes."""
    model = _perturbed(one_layer_path)
    batch = StepBatch.from_trajectories(rollout, pad_token_id=0, scored=False)
    assert batch.routed_experts.shape[:2] == batch.sequences.shape
    num_actions = batch.action_mask.shape[1]
    with torch.no_grad(), forward_scope(model, batch.forward_inputs(), packed=packed, replay=True) as fwd:
        logprobs, _ = fwd.policy_logprobs(1.0, with_router=True)
        mismatch = route_mismatch(fwd.router_logits.layers, fwd.recorded_routes, fwd.router_logits.action_mask, TOP_K)
    for i, t in enumerate(rollout):
        with torch.no_grad(), replay_routes(model, t.routed_experts):
            alone = policy_logprobs(model, torch.tensor([t.sequence_ids]), torch.ones(1, len(t.sequence_ids)),
                                    len(t.response_ids))[0][0]
        assert torch.allclose(logprobs[i, : len(t.response_ids)], alone, atol=1e-5)
    # One layer: the replayed router logits are the free ones, so the mismatch is measured against the rollout.
    assert 0 < mismatch["moe/route_mismatch"] < 1
    assert num_actions == max(len(t.response_ids) for t in rollout)


def test_replay_refuses_routes_of_another_model_and_missing_routes(one_layer_path, rollout):
    model = _load(one_layer_path)
    with pytest.raises(ValueError, match="do not match 1 MoE layers"):
        with replay_routes(model, torch.zeros(5, 2, TOP_K, dtype=torch.uint8)):
            pass
    with pytest.raises(ValueError, match="routes 3 tokens but 5 recorded"):
        with replay_routes(model, torch.zeros(5, 1, TOP_K, dtype=torch.uint8)):
            model(input_ids=torch.tensor([[5, 6, 7]]))
    rows = StepBatch.from_trajectories(rollout, 0, scored=False)
    rows.routed_experts = None
    with pytest.raises(ValueError, match="no recorded routes"):
        with forward_scope(model, rows.forward_inputs(), replay=True):
            pass


def test_continued_generation_keeps_the_routes_tokens_were_sampled_with():
    nr = not_recorded(torch.uint8)
    earlier = torch.tensor([[[0, 1]], [[1, 2]], [[nr, nr]]], dtype=torch.uint8)  # last token never fed forward
    continued = torch.tensor([[[3, 2]], [[3, 2]], [[2, 0]], [[1, 0]], [[nr, nr]]], dtype=torch.uint8)
    merged = continue_routes(earlier, continued)
    assert merged[:, 0].tolist() == [[0, 1], [1, 2], [2, 0], [1, 0], [nr, nr]]
    assert continue_routes(None, continued) is None


def test_memory_per_token_is_layers_times_top_k_bytes(rollout):
    t = rollout[0]
    per_token = t.routed_experts.element_size() * math.prod(t.routed_experts.shape[1:])
    assert per_token == 1 * TOP_K  # one layer, uint8


def test_engine_refuses_to_record_routes_of_a_dense_model(tmp_path):
    from hpc_rlhf.models.tiny import build_tiny_model
    dense = _load(build_tiny_model(tmp_path / "dense"))
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        TransformersRolloutEngine(dense, 1, 0, record_routes=True)
    with pytest.raises(TypeError, match="no router modules"):
        RouteRecorder(dense, NUM_EXPERTS)
    assert GenerationRequest  # the request type the engine takes; imported for the fixture's signature


@pytest.mark.parametrize("mode", ["measure", "rollout"])
def test_actor_update_replays_recorded_routes_only_when_asked(mode):
    """train_actor through a (fake, one-rank) training engine: with algo.routing_replay=rollout every MoE layer runs
    the recorded experts; with measure its own, and the mismatch to the recorded ones is logged either way."""
    from hpc_rlhf.config import load_config
    from hpc_rlhf.trainers.rl.workers import UpdateSettings, train_actor
    from tests.unit.test_actor_entropy import _Engine, _shard
    from tests.unit.test_moe import _moe_model

    model = _moe_model(num_experts=4, top_k=2, layers=2)
    shard = _shard()
    rows = shard.rows
    forced = torch.tensor([3, 2], dtype=torch.uint8)  # some tokens' own top-2 differ from it
    rows.routed_experts = forced.expand(*rows.sequences.shape, 2, 2).clone()
    used = []
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_pre_hook(lambda m, args: used.append(args[1].clone()))
    cfg = load_config(None, ["train.micro_train_batch_size=1", f"algo.routing_replay={mode}"])
    stats = train_actor(_Engine(model), shard, cfg.algo, UpdateSettings.from_sections(cfg.train, cfg.rollout, cfg.ds),
                        dp_size=1)
    assert used
    replayed = all(bool((u.sort(-1).values == torch.tensor([2, 3])).all()) for u in used)
    assert replayed == (mode == "rollout")
    assert 0 < stats["moe/route_mismatch"] <= 1


def test_routing_replay_setup_refusals(one_layer_path, tmp_path):
    from hpc_rlhf.config import load_config
    from hpc_rlhf.models.tiny import build_tiny_model
    from hpc_rlhf.trainers.rl.setup import SetupError, check_routing_replay, records_routes

    moe = [f"actor.pretrain={one_layer_path}", "algo.routing_replay=rollout"]
    check_routing_replay(load_config(None, moe))  # transformers engine, single-turn: accepted
    assert records_routes(load_config(None, moe))
    dense = build_tiny_model(tmp_path / "dense")
    with pytest.raises(SetupError, match="not a mixture-of-experts model"):
        check_routing_replay(load_config(None, [f"actor.pretrain={dense}", "algo.routing_replay=rollout"]))
    assert not records_routes(load_config(None, [f"actor.pretrain={dense}"]))
    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    (deepseek / "config.json").write_text(
        '{"model_type": "deepseek_v3", "n_routed_experts": 8, "num_experts_per_tok": 2}')
    with pytest.raises(SetupError, match="DeepSeek-style router"):
        check_routing_replay(load_config(None, [f"actor.pretrain={deepseek}", "algo.routing_replay=rollout"]))
    with pytest.raises(SetupError, match="without a GPU: vLLM returns routed experts only from its V2 model runner"):
        check_routing_replay(load_config(None, [*moe, "rollout.backend=vllm"]))
    # OpenAI-client agents' rows carry no routes: refused once the agent file shows what it is.
    from hpc_rlhf.trainers.rl.setup import _executor
    agent = tmp_path / "openai_agent.py"
    agent.write_text("async def run_episode(client, prompt, label):\n    return 0.0\n")
    with pytest.raises(SetupError, match="OpenAI-client agent's rows carry no recorded routes"):
        _executor(load_config(None, [*moe, f"train.agent_func_path={agent}"]), build_char_tokenizer())
    check_routing_replay(load_config(None, [*moe, "ds.ring_attn_size=2"]))  # each rank replays its chunk
    assert not records_routes(load_config(None, [*moe[:1], "algo.routing_replay=none"]))


def test_vllm_routed_experts_become_routes_of_every_position():
    import numpy as np

    from hpc_rlhf.rollout.vllm_external_launcher import routes_from_vllm

    # vLLM's (seq_len, layers, top_k), here without the last sampled token: padded with the unrecorded marker.
    routed = np.array([[[0, 1], [2, 3]], [[1, 2], [0, 3]]])
    routes = routes_from_vllm(routed, 3, "request 0")
    assert routes.dtype == torch.uint8 and routes.shape == (3, 2, 2)
    assert routes[:2].tolist() == routed.tolist() and (routes[2] == not_recorded(torch.uint8)).all()
    assert routes_from_vllm(None, 3, "request 0") is None
    with pytest.raises(ValueError, match="for a sequence of 1 tokens"):
        routes_from_vllm(routed, 1, "request 0")


def test_multi_turn_episode_carries_the_routes_each_turn_sampled_with(one_layer_path):
    """An agent's turns: each later call prefills the whole episode again; the trajectory keeps every token's routes
    from the call that computed it first (its turn's decode), and the feedback tokens' from the next turn's prefill.
    With unchanged weights that equals one full forward over the episode at every recorded position."""
    from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor

    class TwoTurns(AgentInstanceBase):
        def __init__(self):
            self.turn = 0

        async def reset(self, states):
            return {"observation": states["observation"]}

        async def step(self, states):
            self.turn += 1
            return {"rewards": 1.0, "environment_feedback": f" ok{self.turn} ", "done": self.turn >= 2}

    tok = build_char_tokenizer()
    model = _load(one_layer_path)
    engine = TransformersRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, record_routes=True)
    calls = []

    def generate(requests):
        results = engine.generate(requests)
        calls.append(results)
        return results

    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=11)
    (t,) = MultiTurnAgentExecutor(TwoTurns, tok, 64).run([Prompt("3+4=", None, "test", 0)], generate, params, 1)
    assert len(calls) == 2 and t.routed_experts.shape[0] == len(t.sequence_ids)
    first = calls[0][0]
    turn1 = len(first.prompt_ids) + len(first.output_ids) - 1  # positions the first call computed
    assert torch.equal(t.routed_experts[:turn1], first.routed_experts[:turn1])
    # The final feedback follows the last generation: no route, and no trained log-prob depends on it.
    last = calls[1][0]
    computed = len(last.prompt_ids) + len(last.output_ids) - 1
    assert (t.routed_experts[computed:] == not_recorded(torch.uint8)).all()
    with RouteRecorder(model, NUM_EXPERTS) as recorder:
        model(input_ids=torch.tensor([t.sequence_ids]))
        full = recorder.take()
    assert torch.equal(full[:computed], t.routed_experts[:computed])
