"""What the OpenAI-compatible endpoint costs per call: one rollout of the calc task through the built-in tool loop and
through the demo's calc agent (an ``openai`` client talking to the endpoint over loopback HTTP), alternated, on a tiny
calc model warm-started to call the calculator.

    python bench/endpoint_overhead.py [--prompts 128] [--repeats 5]

Both produce the same batch (checked: the agent plays the loop's part token for token), so the time difference is the
endpoint's: HTTP, JSON, the agents' threads and their client, the per-request rendering. Prints a table (median seconds
per rollout) and, last, one JSON line with ``loop_s``, ``endpoint_s``, ``calls`` (the endpoint calls of a rollout) and
``overhead_ms_per_call``. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from rl_core.agent.runner import MultiTurnRollout
from rl_core.agent.tools.registry import load_tools
from rl_core.config import DataConfig, ModelConfig, RolloutConfig
from rl_core.data.dataset import RLDataset
from rl_core.data.rows import write_rows
from rl_core.data.synthetic import calc_rows, calc_transcript
from rl_core.models.loading import load_policy_model
from rl_core.models.tiny import make_tiny_model
from rl_core.rollout import build_rollout_engine
from rl_core.sft import SFTExample, run_sft

ROOT = Path(__file__).resolve().parent.parent
CALC_TOOLS = ROOT / "configs" / "tools" / "calculator.yaml"
MULTI_TURN = {"enable": True, "format": "tag", "max_assistant_turns": 2, "max_parallel_calls": 4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)  # the calc demo's batch: 16 prompts x 8
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as folder:
        model_path = make_tiny_model(Path(folder) / "calc", task="calc")
        model, tokenizer = load_policy_model(ModelConfig(path=str(model_path)))
        rows = calc_rows(64, seed=0, split="sft")
        examples = [SFTExample(row["prompt"], calc_transcript(row, use_tool=True)) for row in rows]
        run_sft(model, tokenizer, examples, steps=150, batch_size=16, lr=3e-3, seed=0)
        model.eval()
        data = OmegaConf.structured(DataConfig(max_prompt_length=16, max_response_length=32))
        dataset = RLDataset(
            str(write_rows(calc_rows(args.prompts, seed=1), Path(folder) / "rows.parquet")), tokenizer, data
        )
        prompts = dataset.collate(list(range(args.prompts)))
        prompts.meta_info["global_step"] = 1
        config = OmegaConf.merge(
            OmegaConf.structured(RolloutConfig(prompt_length=16, response_length=32)), {"multi_turn": MULTI_TURN}
        )
        engine = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=config)
        loop = MultiTurnRollout(engine, tokenizer, config, load_tools(str(CALC_TOOLS)))
        agent_config = OmegaConf.merge(
            config,
            {
                "agent": {
                    "default_agent_loop": "endpoint_agent",
                    "endpoint": {"function": "rl_core.agent.demo_agents:calc_agent"},
                }
            },
        )
        endpoint = MultiTurnRollout(engine, tokenizer, agent_config, load_tools(str(CALC_TOOLS)))
        times: dict[str, list[float]] = {"loop": [], "endpoint": []}
        batches = {}
        for _ in range(args.repeats):
            for name, rollout in (("loop", loop), ("endpoint", endpoint)):
                started = time.perf_counter()
                batches[name] = rollout.generate_sequences(prompts)
                times[name].append(time.perf_counter() - started)
        same = all(
            torch.equal(batches["loop"].tensors[k], batches["endpoint"].tensors[k]) for k in batches["loop"].tensors
        )
        calls = sum(info["endpoint_calls"] for info in batches["endpoint"].non_tensors["multi_turn"])
    loop_s, endpoint_s = statistics.median(times["loop"]), statistics.median(times["endpoint"])
    overhead_ms = 1000 * (endpoint_s - loop_s) / calls
    print(f"{'rollout of':<12}{'median s':>10}{'min s':>8}{'max s':>8}")
    for name in times:
        print(f"{name:<12}{statistics.median(times[name]):>10.3f}{min(times[name]):>8.3f}{max(times[name]):>8.3f}")
    print(f"{args.prompts} trajectories, {calls} endpoint calls a rollout; the same batch: {same}")
    print(f"overhead per call: {overhead_ms:.2f} ms")
    result = {
        "prompts": args.prompts,
        "calls": calls,
        "loop_s": round(loop_s, 4),
        "endpoint_s": round(endpoint_s, 4),
        "overhead_ms_per_call": round(overhead_ms, 3),
        "same_batch": same,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
