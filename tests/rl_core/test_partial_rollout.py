"""Partial rollout (async_training.partial_rollout): a generation takes newer weights between two tokens and its
unfinished rows go on under them. The HF engine's stitched samples against the same composition done by hand (the
first tokens drawn by the old weights, the rest continued by the new ones from the segment's seed), and a fully
asynchronous run over real gloo channels whose generation in flight is interrupted by the actor's next weights."""

import copy
import time

import pytest
import torch

from infra.weight_transport import CollectiveTransport
from rl_core.agent.runner import MultiTurnRollout
from rl_core.batch_fields import RESPONSE_MASK, ROLLOUT_LOG_PROBS, ROLLOUT_VERSION
from rl_core.models.loading import load_policy_model
from rl_core.ppo_step import StepWorkers, generation_on, run_ppo_step
from rl_core.rollout import build_rollout_engine
from rl_core.rollout.base import continuation_seed, prompt_contexts, sampling_params, sampling_seed
from rl_core.rollout.partial import NewerWeights
from rl_core.rollout_schedule import GenerationWindow
from rl_core.separate_rollout import SeparateRollout
from rl_core.workers import ActorRolloutRefWorker
from tests.rl_core.helpers import addition_dataset
from tests.rl_core.test_workers import build_workers, step_inputs


class OfferAtToken:
    """Newer weights (version 1: ``weights``) offered as the generation asks for the ``token``-th time."""

    def __init__(self, model, weights, token):
        self.model, self.weights, self.token, self.asked, self.version = model, weights, token, 0, 0

    def offered(self):
        self.asked += 1
        return 1 if self.asked >= self.token else 0

    def take(self):
        self.model.load_state_dict(self.weights)
        self.version = 1
        return 1


@pytest.fixture()
def engine_and_prompts(tmp_path, config):
    model, tokenizer = load_policy_model(config.actor_rollout_ref.model)
    rollout = copy.deepcopy(config.actor_rollout_ref.rollout)
    rollout.response_length, rollout.calculate_log_probs = 8, True
    engine = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=rollout)
    prompts = addition_dataset(tmp_path, tokenizer, config.data, count=6).collate(list(range(6)), uid_prefix="s0-")
    return engine, prompts.repeat_interleave(3)


def newer_weights_of(model, seed):
    generator = torch.Generator().manual_seed(seed)
    return {
        name: value + 0.3 * torch.randn(value.shape, generator=generator) for name, value in model.state_dict().items()
    }


def test_nothing_offered_draws_the_same_samples_all_of_the_held_version(engine_and_prompts):
    engine, prompts = engine_and_prompts
    plain = engine.generate_sequences(prompts)
    engine.newer_weights = NewerWeights(held=lambda: 4, offered=lambda: 4, take=lambda: 4, every_s=0)
    partial = engine.generate_sequences(prompts)
    for key in ("responses", "response_mask", ROLLOUT_LOG_PROBS):
        assert torch.equal(plain.tensors[key], partial.tensors[key]), key
    mask = partial.tensors[RESPONSE_MASK].bool()
    assert (partial.tensors[ROLLOUT_VERSION][mask] == 4).all()


@pytest.mark.parametrize("token", [1, 3])
def test_weights_offered_mid_generation_continue_the_unfinished_rows_under_them(engine_and_prompts, token):
    engine, prompts = engine_and_prompts
    model, budget = engine.model, engine.response_length
    old, new = copy.deepcopy(model.state_dict()), newer_weights_of(model, seed=token)
    params = sampling_params(engine.config, prompts.meta_info)
    seed = sampling_seed(engine.config, prompts.meta_info, 0, 0)
    contexts = prompt_contexts(prompts)

    # by hand: the old weights' first `token` tokens (the same random stream), the new weights' continuation
    with engine.rollout(prompts.meta_info):
        full = engine.generate_tokens(contexts, [budget] * len(contexts), params, seed)
    heads = [sample.token_ids[:token] for sample in full]
    open_rows = [row for row, head in enumerate(heads) if engine.stop_token_ids[0] not in head and len(head) < budget]
    model.load_state_dict(new)
    with engine.rollout(prompts.meta_info):
        tails = engine.generate_tokens(
            [contexts[row] + heads[row] for row in open_rows],
            [budget - len(heads[row]) for row in open_rows],
            params,
            continuation_seed(seed, 1),
        )
    model.load_state_dict(old)

    offer = OfferAtToken(model, new, token)
    engine.newer_weights = NewerWeights(held=lambda: offer.version, offered=offer.offered, take=offer.take, every_s=0)
    out = engine.generate_sequences(prompts)
    assert offer.version == 1 and open_rows  # taken, and some rows went on
    tail_of = dict(zip(open_rows, tails))
    for row in range(len(prompts)):
        head = full[row].token_ids[:token] if row in tail_of else full[row].token_ids
        tail = tail_of[row].token_ids if row in tail_of else []
        length = len(head) + len(tail)
        assert out.tensors["responses"][row, :length].tolist() == head + tail, row
        assert out.tensors[RESPONSE_MASK][row].sum() == length
        versions = out.tensors[ROLLOUT_VERSION][row, :length].tolist()
        assert versions == [0] * len(head) + [1] * len(tail), row
        head_log_probs = full[row].log_probs[: len(head)]
        tail_log_probs = tail_of[row].log_probs if row in tail_of else []
        expected = torch.tensor(head_log_probs + tail_log_probs)
        assert torch.allclose(out.tensors[ROLLOUT_LOG_PROBS][row, :length], expected, atol=1e-6), row


def test_a_generation_in_flight_takes_the_actors_next_weights_over_a_gloo_channel(tmp_path, config):
    """fully_async, staleness_threshold=1 (a window of 2) on one rollout worker: step 2's generation is launched at
    step 1 with version 0 and starts only once step 2 offers version 1 (as step 2 launches step 3's generation): it
    stops after its first token, takes version 1 and goes on: its first tokens are version 0, the rest 1. The last
    step's generation, launched after the last sync, ran whole with version 2."""
    config.trainer.total_training_steps = 4
    actor, _ = build_workers(config, with_critic=False)
    data, sampler, reward, kl = step_inputs(tmp_path, actor, config, count=16)
    actor.weight_transport = CollectiveTransport("gloo", 2**20, 60)
    rollout = ActorRolloutRefWorker(
        config.actor_rollout_ref, "rollout_ref", weight_transport=CollectiveTransport("gloo", 2**20, 60),
        partial_rollout=True,
    )  # fmt: skip
    rollout.init_model()
    generate = generation_on(config, reward)

    def generate_once_offered(role, prompts):
        deadline = time.monotonic() + 30
        while prompts.non_tensors["uid"][0].startswith("2-") and role.weight_transport.offered() < 1:
            assert time.monotonic() < deadline, "the actor never offered version 1"  # step 2's: wait for the offer
            time.sleep(0.001)
        return generate(role, prompts)

    separate = SeparateRollout(
        actor, [rollout], GenerationWindow(2, 1), generate_once_offered, rendezvous=True, partial_rollout=True
    )
    workers = StepWorkers(actor, separate_rollout=separate)
    metrics_of = {}
    try:
        for step in (1, 2, 3, 4):
            batch, metrics_of[step] = run_ppo_step(config, workers, data, sampler, reward, kl, step)
            mask = batch.tensors[RESPONSE_MASK].bool()
            versions = batch.tensors[ROLLOUT_VERSION]
            if step == 2:
                first = versions[:, 0]
                assert (first == 0).all()  # the first token from the weights it was launched with
                assert (versions[mask] <= 1).all() and ((versions == 1) & mask).any(-1).float().mean() > 0.5
    finally:
        separate.close()
    assert metrics_of[2]["fully_async/partial_ratio"] > 0.5 and metrics_of[2]["training/staleness_max"] == 1
    # step 1: launched and run with version 0; step 4: launched once version 2 was taken (no offer after it)
    assert metrics_of[1]["fully_async/partial_ratio"] == 0 and metrics_of[1]["training/staleness_max"] == 0
    assert metrics_of[4]["fully_async/partial_ratio"] == 0 and metrics_of[4]["training/staleness_max"] == 1
    assert rollout.weights_version() == 2


@pytest.mark.parametrize("batching", ["rounds", "continuous"])
def test_multi_turn_trajectories_carry_each_tokens_version(tmp_path, config, batching):
    """The tool loop's trajectories (no tools here: one turn each) interrupted at the third token: in rounds the
    batch is the single-turn engine's under the same offer, versions included; continuously each row's tokens are
    version 0 then 1 too."""
    model, tokenizer = load_policy_model(config.actor_rollout_ref.model)
    rollout = copy.deepcopy(config.actor_rollout_ref.rollout)
    rollout.response_length, rollout.calculate_log_probs, rollout.agent.batching = 8, True, batching
    prompts = addition_dataset(tmp_path, tokenizer, config.data, count=4).collate(list(range(4)), uid_prefix="s-")
    old, new = copy.deepcopy(model.state_dict()), newer_weights_of(model, seed=5)
    engine = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=rollout)

    def interrupted(rollout_engine):
        model.load_state_dict(old)
        offer = OfferAtToken(model, new, 3)
        engine.newer_weights = NewerWeights(
            held=lambda: offer.version, offered=offer.offered, take=offer.take, every_s=0
        )
        out = rollout_engine.generate_sequences(prompts)
        assert offer.version == 1
        return out

    single = interrupted(engine)
    rollout.multi_turn.enable = True
    multi = interrupted(MultiTurnRollout(engine, tokenizer, rollout, tools={}))
    mask = multi.tensors[RESPONSE_MASK].bool()
    versions = multi.tensors[ROLLOUT_VERSION]
    for row in range(len(prompts)):
        tagged = versions[row][mask[row]].tolist()
        assert tagged == sorted(tagged) and set(tagged) <= {0, 1}, row
    assert (versions[mask] == 1).any() and (versions[mask] == 0).any()
    if batching == "rounds":
        for key in ("responses", RESPONSE_MASK, ROLLOUT_LOG_PROBS, ROLLOUT_VERSION):
            assert torch.equal(multi.tensors[key], single.tensors[key]), key
