import pytest

from hpc_rlhf.config import load_config
from hpc_rlhf.world.placement import PlacementError, build_placement, enabled_roles


def cfg(*overrides):
    return load_config(None, list(overrides))


def test_roles_follow_the_algorithm():
    assert enabled_roles(cfg()) == ["actor", "rollout"]  # group_norm, no KL, reward function
    assert enabled_roles(cfg("algo.advantage_estimator=gae", "rollout.n_samples_per_prompt=1",
                             "algo.kl.init_coef=0.01")) == ["actor", "ref", "critic", "rollout"]
    assert "reward" in enabled_roles(cfg("reward.pretrain=/rm"))
    assert "reward" not in enabled_roles(cfg("reward.pretrain=/rm", "reward.remote_url=[http://h:5000]"))


def test_colocated_puts_every_role_everywhere():
    p = build_placement(cfg("algo.kl.init_coef=0.01", "rollout.tensor_parallel_size=2"), 8)
    assert p.layout == "colocated"
    assert all(g.ranks == tuple(range(8)) for g in p.roles.values())
    assert p.roles["rollout"].tp_groups == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert p.roles_of(3) == ["actor", "ref", "rollout"]


def test_colocated_engine_mismatch_says_what_to_change():
    with pytest.raises(PlacementError, match=r"rollout.num_engines=3 .* set rollout.num_engines=4"):
        build_placement(cfg("rollout.num_engines=3", "rollout.tensor_parallel_size=2"), 8)
    with pytest.raises(PlacementError, match="actor.num_ranks"):
        build_placement(cfg("actor.num_ranks=4"), 8)


def test_disaggregated_ranges_and_grid():
    c = cfg("train.colocate_all=false", "algo.kl.init_coef=0.01", "ds.tensor_parallel_size=2",
            "actor.num_ranks=8", "ref.num_ranks=2", "rollout.tensor_parallel_size=2")
    p = build_placement(c, 16)
    assert p.layout == "disaggregated"
    assert p.roles["actor"].ranks == tuple(range(8))
    assert p.roles["ref"].ranks == (8, 9)
    assert p.roles["rollout"].ranks == tuple(range(10, 16))  # the one role without a size takes the rest
    actor = p.roles["actor"]
    assert actor.dp_size == 4
    assert actor.tp_groups == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert actor.dp_groups == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert actor.dp_leaders() == (0, 2, 4, 6)
    assert [actor.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_sequence_parallel_grid():
    p = build_placement(cfg("ds.ring_attn_size=2", "ds.tensor_parallel_size=2"), 8)
    actor = p.roles["actor"]
    assert actor.dp_size == 2
    assert actor.sp_groups == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert actor.dp_groups == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_partial_colocation():
    c = cfg("train.colocate_all=false", "train.colocate_actor_ref=true", "train.colocate_critic_reward=true",
            "algo.advantage_estimator=gae", "algo.kl.init_coef=0.01", "reward.pretrain=/rm",
            "actor.num_ranks=4", "critic.num_ranks=2", "rollout.num_engines=2")
    p = build_placement(c, 8)
    assert p.layout == "partial"
    assert p.roles["ref"].ranks == p.roles["actor"].ranks == (0, 1, 2, 3)
    assert p.roles["reward"].ranks == p.roles["critic"].ranks == (4, 5)
    assert p.roles["rollout"].ranks == (6, 7)


@pytest.mark.parametrize(
    "overrides,world,match",
    [
        (["actor.num_ranks=4", "rollout.num_engines=2"], 8, r"needs 6 ranks .* world has 8"),
        (["algo.kl.init_coef=0.1", "actor.num_ranks=4"], 8, "missing: ref.num_ranks, rollout.num_engines"),
        (["actor.num_ranks=8"], 8, "leaving none for rollout"),
        (["actor.num_ranks=3", "ds.tensor_parallel_size=2"], 8, "actor has 3 ranks, not a multiple"),
        (["actor.num_ranks=4", "rollout.tensor_parallel_size=3"], 8, "not a multiple of rollout.tensor_parallel"),
    ],
)
def test_disaggregated_errors(overrides, world, match):
    with pytest.raises(PlacementError, match=match):
        build_placement(cfg("train.colocate_all=false", *overrides), world)


@pytest.mark.parametrize("layout", [
    ["actor.num_ranks=4", "rollout.num_engines=4"],  # disaggregated
    ["train.colocate_actor_ref=true", "algo.kl.init_coef=0.1", "actor.num_ranks=4"],  # partial: actor+ref share
])
def test_zero3_needs_the_colocated_layout(layout):
    """DeepSpeed's ZeRO-3 runs world-wide collectives that ranks outside the role never join."""
    with pytest.raises(PlacementError, match=r"ds.zero_stage=3 needs train.colocate_all=true.* actor"):
        build_placement(cfg("train.colocate_all=false", "ds.zero_stage=3", *layout), 8)
    assert build_placement(cfg("train.colocate_all=false", "ds.zero_stage=2", *layout), 8).layout != "colocated"
    assert build_placement(cfg("ds.zero_stage=3"), 8).layout == "colocated"


@pytest.mark.parametrize("layout", [
    ["actor.num_ranks=4"],  # disaggregated: rollout on ranks 4-7
    ["train.colocate_actor_ref=true", "algo.kl.init_coef=0.1", "actor.num_ranks=6"],  # partial
    ["actor.num_ranks=4", "train.async_train=true"],  # asynchronous
])
def test_vllm_external_launcher_needs_every_rank(layout):
    """vLLM's external launcher builds its groups over the whole world: rollout on a subset needs its own
    processes. The transformers engine runs anywhere; the colocated layout keeps vLLM in-process."""
    subset = ["train.colocate_all=false", "rollout.backend=vllm", *layout]
    with pytest.raises(PlacementError, match=r"rollout.vllm_mode=external_launcher .* of 8 ranks; set "
                                             r"rollout.vllm_mode=server_process"):
        build_placement(cfg(*subset, "rollout.vllm_mode=external_launcher"), 8)
    assert build_placement(cfg(*subset, "rollout.vllm_mode=server_process"), 8).layout != "colocated"
    assert build_placement(cfg(*subset), 8).layout != "colocated"  # auto: server_process off the colocated layout
    assert build_placement(cfg(*subset, "rollout.backend=transformers"), 8).layout != "colocated"
    assert build_placement(cfg("rollout.backend=vllm"), 8).layout == "colocated"
    with pytest.raises(PlacementError, match="set rollout.vllm_mode=external_launcher"):
        build_placement(cfg("rollout.backend=vllm", "rollout.vllm_mode=server_process"), 8)


def test_server_process_engines_are_single_gpu_for_now():
    """Each rollout rank starts its own server_process engine: one over several GPUs is refused up front."""
    subset = ["train.colocate_all=false", "rollout.backend=vllm", "rollout.vllm_mode=server_process",
              "actor.num_ranks=4"]
    with pytest.raises(PlacementError, match="rollout.tensor_parallel_size=2 is not supported there yet"):
        build_placement(cfg(*subset, "rollout.tensor_parallel_size=2"), 8)
    assert build_placement(cfg(*subset, "rollout.tensor_parallel_size=1"), 8).layout == "disaggregated"
    assert build_placement(cfg("rollout.backend=vllm", "rollout.tensor_parallel_size=2"), 8).layout == "colocated"
