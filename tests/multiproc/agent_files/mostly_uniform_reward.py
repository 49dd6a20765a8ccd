"""Reward 1.0 for every sample, except the samples of one prompt in three (by label) get a content-dependent
0/1: most groups are uniform, so dynamic filtering drops them and refill rounds must top the batch up."""


def reward_func(queries, prompts, labels, **kwargs):
    rewards = []
    for query, label in zip(queries, labels):
        varied = int(label) % 3 == 0
        rewards.append(float(sum(map(ord, query)) % 2) if varied else 1.0)
    return {"rewards": rewards}
