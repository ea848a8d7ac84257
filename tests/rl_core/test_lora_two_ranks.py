"""A LoRA actor sharded over two gloo ranks (FSDP2): its checkpoint (the adapter) restores on two ranks, giving the
saved policy's log-probs; the merged weights an inference engine gets (rl_core.rollout.vllm.weights) compute them
too."""

import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from tests.rl_core.helpers import run_on_two_gloo_ranks


def save_and_restore(rank: int, config_yaml: str, folder: str, results: dict) -> None:
    from rl_core.batch import Batch
    from rl_core.data.dataset import RLDataset
    from rl_core.data.rows import write_rows
    from rl_core.data.synthetic import addition_rows
    from rl_core.models.loading import load_policy_model
    from rl_core.models.logprob import response_log_probs
    from rl_core.rollout.vllm.weights import inference_weights
    from rl_core.workers import ActorRolloutRefWorker
    from rl_core.workers.fsdp import full_parameters

    config = OmegaConf.create(config_yaml)
    actor = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout")
    actor.init_model()
    data = RLDataset(
        str(write_rows(addition_rows(4, seed=0), f"{folder}/rows-{rank}.parquet")), actor.tokenizer, config.data
    )
    batch = actor.generate_sequences(data.collate([0, 1, 2, 3]))
    batch.union(Batch(actor.compute_log_prob(batch).tensors))
    batch.tensors["advantages"] = (
        torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(0)) * batch.tensors["response_mask"]
    )
    actor.update_actor(batch)
    trained = actor.compute_log_prob(batch).tensors["old_log_probs"]
    actor.save_checkpoint(f"{folder}/lora")
    with full_parameters(actor.module):
        merged = {name: tensor.clone() for name, tensor in inference_weights(actor.module)}
    engine_model, _ = load_policy_model(config.actor_rollout_ref.model)
    engine_model.load_state_dict(merged, strict=False)
    with torch.no_grad():
        from_merged, _ = response_log_probs(
            engine_model.eval(),
            *[batch.tensors[k] for k in ("input_ids", "attention_mask", "position_ids")],
            batch.tensors["responses"].shape[1],
        )
    restored = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout")
    restored.init_model()
    fresh = restored.compute_log_prob(batch).tensors["old_log_probs"]
    restored.load_checkpoint(f"{folder}/lora")
    again = restored.compute_log_prob(batch).tensors["old_log_probs"]
    mask = batch.tensors["response_mask"].bool()
    results[rank] = (
        float((again - trained)[mask].abs().max()),
        float((fresh - trained)[mask].abs().max()),
        float((from_merged - trained)[mask].abs().max()),
    )


def test_a_lora_checkpoint_restores_on_two_ranks(config, tmp_path):
    config.actor_rollout_ref.model.lora_rank = 4
    config.actor_rollout_ref.actor.use_kl_loss = False
    config.actor_rollout_ref.actor.optim.total_training_steps = 1
    config.actor_rollout_ref.actor.optim.lr = 1e-2
    with mp.Manager() as manager:
        results = manager.dict()
        run_on_two_gloo_ranks(save_and_restore, OmegaConf.to_yaml(config, resolve=True), str(tmp_path), results)
        for rank in (0, 1):
            restored_error, untrained_difference, merged_error = results[rank]
            assert restored_error < 1e-5 and untrained_difference > 1e-3 and merged_error < 1e-5, (rank, results[rank])
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists()
