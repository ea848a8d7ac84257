"""verl's agentic surface on the multi-turn loop (rl_core/agent): a tool instance per trajectory made from the row's
``tools_kwargs`` and its rewards, interactions (simulated users), a verl-layout multi-turn row and configs run as they
are, each turn's reward on its last token for turn-level advantages, and the ``agent_name`` column. The loop is driven
by test_agent_loop's ``ScriptedEngine`` (fixed id lists), the tools and interactions are small ones defined here."""

import json
import re

import pytest
from omegaconf import OmegaConf

from rl_core.agent.interactions import BaseInteraction
from rl_core.agent.observations import ObservationEncoder
from rl_core.agent.runner import MultiTurnRollout
from rl_core.agent.tools.base import BaseTool, ToolResponse
from rl_core.agent.tools.registry import load_tools
from rl_core.algos.advantage import compute_turn_rloo_advantage
from rl_core.batch import response_turns
from rl_core.config import DataConfig, RewardConfig
from rl_core.data.dataset import RLDataset
from rl_core.data.rows import DatasetError, validate_row
from rl_core.reward.manager import RewardManager
from tests.rl_core.test_agent_loop import (
    CALC_TOOLS,
    ScriptedEngine,
    hermes,
    prompt_keys,
    prompts_of,
    rollout_config,
    run,
    turn,
    write,
)


class AnswerTool(BaseTool):
    """verl's GSM8K tool, in small: an instance holds its row's ground truth (``create_kwargs``); each answer is scored
    (1.0 right, -0.05 wrong: verl's penalty), ``calc_reward`` is the best so far; every lifecycle call is logged."""

    log: list[tuple] = []

    def __init__(self, config=None, tool_schema=None):
        schema = {"type": "function", "function": {"name": "submit", "parameters": {"required": ["answer"]}}}
        super().__init__(config or {}, tool_schema or schema)
        self.instances: dict[str, dict] = {}

    async def create(self, instance_id=None, ground_truth=None, **kwargs):
        instance = await super().create(instance_id)
        self.instances[instance] = {"truth": ground_truth, "best": 0.0}
        self.log.append(("create", ground_truth))
        return instance

    async def execute(self, instance_id, parameters, **kwargs):
        state = self.instances[instance_id]
        right = str(parameters["answer"]) == str(state["truth"])
        state["best"] = max(state["best"], 1.0 if right else 0.0)
        self.log.append(("execute", state["truth"], parameters["answer"], kwargs))
        return ToolResponse("correct" if right else "incorrect"), 1.0 if right else -0.05, {}

    async def calc_reward(self, instance_id, **kwargs):
        self.log.append(("calc_reward", self.instances[instance_id]["truth"], kwargs))
        if kwargs.get("fail"):
            raise RuntimeError("no reward today")
        return self.instances[instance_id]["best"]

    async def release(self, instance_id, **kwargs):
        self.log.append(("release", self.instances.pop(instance_id)["truth"]))


class GuessInteraction(BaseInteraction):
    """verl's GSM8K interaction in small: the last assistant message against the row's ground truth; right ends the
    dialogue (score 1), wrong asks again (score 0); ``ground_truth: raise`` fails. Every call is logged."""

    log: list[tuple] = []

    def __init__(self, config):
        super().__init__(config)
        self.truths: dict[str, str] = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        instance = await super().start_interaction(instance_id)
        self.truths[instance] = str(ground_truth)
        self.log.append(("start", ground_truth, kwargs))
        return instance

    async def generate_response(self, instance_id, messages, **kwargs):
        self.log.append(("reply", [m["role"] for m in messages]))
        if self.truths[instance_id] == "raise":
            raise RuntimeError("the user walked away")
        right = [m for m in messages if m["role"] == "assistant"][-1]["content"].strip() == self.truths[instance_id]
        return right, "correct!" if right else "try again", float(right), {}

    async def finalize_interaction(self, instance_id, **kwargs):
        self.log.append(("finalize", self.truths.pop(instance_id)))


def submit(answer):
    return f'<tool_call>{{"name": "submit", "arguments": {{"answer": "{answer}"}}}}</tool_call>'


def test_each_trajectory_has_its_own_tool_instances_made_from_its_rows_tools_kwargs(tmp_path, tokenizer):
    """verl's tool lifecycle: an instance per trajectory and tool, created from the row's
    extra_info.tools_kwargs.<tool>.create_kwargs on its first call, every later call on it (execute_kwargs), then
    calc_reward and release once; the step rewards and the final ones reach the reward function's extra_info."""
    prompts = prompts_of(tmp_path, tokenizer, 3)
    prompts.non_tensors["extra_info"][0] = {"tools_kwargs": {"submit": {"create_kwargs": {"ground_truth": 7}}}}
    prompts.non_tensors["extra_info"][1] = {
        "tools_kwargs": {
            "submit": {"create_kwargs": {"ground_truth": 9}, "execute_kwargs": {"attempt": 1}},
            "calculator": {},
        }
    }
    prompts.non_tensors["extra_info"][2] = {
        "tools_kwargs": {"submit": {"create_kwargs": {"ground_truth": 4}, "calc_reward_kwargs": {"fail": True}}}
    }
    script = [
        [turn(tokenizer, submit(6)), turn(tokenizer, submit(7)), turn(tokenizer, "done")],
        [turn(tokenizer, submit(9)), turn(tokenizer, "done")],
        [turn(tokenizer, submit(4)), turn(tokenizer, "done")],
    ]
    AnswerTool.log.clear()
    tools = {"submit": AnswerTool(), **load_tools(CALC_TOOLS)}
    out, _ = run(tokenizer, prompts, script, tools)
    infos = list(out.non_tensors["multi_turn"])
    assert [info["tool_rewards"] for info in infos] == [[-0.05, 1.0], [1.0], [1.0]]
    assert [info["rollout_reward_scores"] for info in infos] == [{"submit": 1.0}, {"submit": 1.0}, {"submit": 0.0}]
    assert infos[2]["tool_problems"] == ["submit.calc_reward: RuntimeError: no reward today"]
    assert "tool_problems" not in infos[0]
    log = AnswerTool.log
    assert sorted(entry[1] for entry in log if entry[0] == "create") == [4, 7, 9]  # one instance per trajectory
    assert ("execute", 9, "9", {"attempt": 1}) in log and ("execute", 7, "6", {}) in log
    assert sorted(entry[1] for entry in log if entry[0] == "release") == [4, 7, 9]
    assert tools["submit"].instances == {}  # every instance released
    for row, info in enumerate(infos):  # the reward function reads them as verl passes them
        merged = {**prompts.non_tensors["extra_info"][row], **info}
        assert merged["rollout_reward_scores"] == info["rollout_reward_scores"]


@pytest.mark.parametrize("batching", ["rounds", "continuous"])
def test_a_simulated_user_answers_turns_without_calls_until_it_ends_the_dialogue(tmp_path, tokenizer, batching):
    """verl's interactions: a row's extra_info.interaction_kwargs picks the interaction of interaction_config_path; a
    turn without calls gets its reply as a user message (mask 0) and the policy speaks again, until it ends the
    dialogue; its scores reach extra_info as turn_scores; a failing one ends the trajectory, named."""
    config = tmp_path / "interactions.yaml"
    config.write_text(
        "interaction:\n  - name: guess\n    class_name: tests.rl_core.test_agent_surface.GuessInteraction\n"
        "    config: {}\n"
    )
    prompts = prompts_of(tmp_path, tokenizer, 3)
    prompts.non_tensors["extra_info"][0] = {"interaction_kwargs": {"name": "guess", "ground_truth": 7}}
    prompts.non_tensors["extra_info"][2] = {"interaction_kwargs": {"name": "guess", "ground_truth": "raise"}}
    script = [
        [turn(tokenizer, "6"), turn(tokenizer, "7"), turn(tokenizer, "unused")],
        [turn(tokenizer, "done")],
        [turn(tokenizer, "1"), turn(tokenizer, "unused")],
    ]
    GuessInteraction.log.clear()
    out, _ = run(tokenizer, prompts, script, {}, batching, interaction_config_path=str(config))
    infos = list(out.non_tensors["multi_turn"])
    assert [info["finish_reason"] for info in infos] == ["interaction", "stop", "interaction"]
    assert [info["turn_scores"] for info in infos] == [[0.0, 1.0], [], [0.0]]
    assert list(out.non_tensors["num_turns"]) == [4, 2, 2]
    assert infos[0]["messages"] == [
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "try again"},
        {"role": "assistant", "content": "7"},
    ]
    assert infos[2]["tool_problems"] == ["guess.generate_response: RuntimeError('the user walked away')"]
    # the layout: turn "6", the user's reply as the template renders it (mask 0), turn "7"
    encoder = ObservationEncoder(tokenizer, [tokenizer.eos_token_id], 256, 64, "middle")
    reply = encoder.encode(["try again"], role="user")
    expected = turn(tokenizer, "6") + reply + turn(tokenizer, "7")
    length = int(out.tensors["attention_mask"][0, 16:].sum())
    assert out.tensors["responses"][0, :length].tolist() == expected
    mask = [1] * len(turn(tokenizer, "6")) + [0] * len(reply) + [1] * len(turn(tokenizer, "7"))
    assert out.tensors["response_mask"][0, :length].tolist() == mask
    log = GuessInteraction.log
    assert ("start", 7, {"name": "guess"}) in log
    assert ("reply", ["user", "assistant"]) in log  # the prompt's messages first
    assert sorted(str(entry[1]) for entry in log if entry[0] == "finalize") == ["7", "raise"]

    row = {"name": "nobody", "ground_truth": 1}
    prompts.non_tensors["extra_info"][1] = {"interaction_kwargs": row}
    with pytest.raises(ValueError, match="'nobody', which names no interaction of .*configured: guess"):
        run(tokenizer, prompts, script, {}, interaction_config_path=str(config))


@pytest.mark.parametrize("batching", ["rounds", "continuous"])
def test_a_verl_multi_turn_row_and_its_tool_and_interaction_configs_run_unchanged(tmp_path, tokenizer, batching):
    """A row as verl's GSM8K multi-turn preprocessing writes it (system + user prompt, ``need_tools_kwargs``,
    ``tools_kwargs.<tool>.create_kwargs.ground_truth``, ``interaction_kwargs`` with ``name``, ``query`` and
    ``ground_truth``), a tool YAML and an interaction YAML in verl's layout: read by the dataset as they are, and the
    rollout gives the tool its ground truth and the interaction its row."""
    question = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?"
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "You are a math expert. Call `submit` with your answer."},
            {"role": "user", "content": question},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {
            "split": "train",
            "index": 0,
            "answer": "Natalia sold 48/2 = 24 clips in May. #### 72",
            "question": question,
            "need_tools_kwargs": True,
            "tools_kwargs": {"submit": {"create_kwargs": {"ground_truth": "72"}}},
            "interaction_kwargs": {"name": "gsm8k", "query": question, "ground_truth": "72"},
        },
    }
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    tools_yaml = write(
        tmp_path / "tools.yaml",
        "tools:\n  - class_name: tests.rl_core.test_agent_surface.AnswerTool\n    config:\n      type: native\n"
        "    tool_schema:\n      type: function\n      function:\n        name: submit\n"
        "        description: Submit the answer\n        parameters:\n          type: object\n"
        "          properties:\n            answer: {type: string, description: the answer}\n"
        "          required: [answer]\n",
    )
    interactions_yaml = write(
        tmp_path / "interactions.yaml",
        'interaction:\n  - name: "gsm8k"\n    class_name: "tests.rl_core.test_agent_surface.GuessInteraction"\n'
        "    config: {}\n",
    )
    data = OmegaConf.structured(DataConfig(max_prompt_length=192, max_response_length=160))
    dataset = RLDataset(str(tmp_path / "train.jsonl"), tokenizer, data)
    prompts = dataset.collate([0], uid_prefix="v-")
    prompts.meta_info["global_step"] = 1
    AnswerTool.log.clear()
    GuessInteraction.log.clear()
    script = [[turn(tokenizer, submit(70)), turn(tokenizer, "70"), turn(tokenizer, "72"), turn(tokenizer, "unused")]]
    engine = ScriptedEngine(dict(zip(prompt_keys(prompts), script)), [tokenizer.eos_token_id])
    settings = {"tool_config_path": str(tools_yaml), "interaction_config_path": str(interactions_yaml)}
    config = OmegaConf.merge(rollout_config(batching, **settings), {"prompt_length": 192})
    out = MultiTurnRollout(engine, tokenizer, config, load_tools(tools_yaml)).generate_sequences(prompts)
    info = out.non_tensors["multi_turn"][0]
    assert info["finish_reason"] == "interaction" and info["turn_scores"] == [0.0, 1.0]
    assert info["tool_rewards"] == [-0.05] and info["rollout_reward_scores"] == {"submit": 0.0}
    assert ("create", "72") in AnswerTool.log
    assert ("start", "72", {"name": "gsm8k", "query": question}) in GuessInteraction.log
    assert ("reply", ["system", "user", "assistant", "tool", "assistant"]) in GuessInteraction.log


def test_each_turns_reward_lands_on_its_last_token_for_turn_level_advantages(tmp_path, tokenizer):
    """reward.turn_rewards: a turn's tool step rewards and the interaction's score of the reply to it go on the turn's
    last token, the outcome score on the response's last; turn_rloo then gives each turn its own return-to-go."""
    prompts = prompts_of(tmp_path, tokenizer, 2)
    for row in range(2):
        prompts.non_tensors["extra_info"][row] = {"tools_kwargs": {"submit": {"create_kwargs": {"ground_truth": 7}}}}
    script = [
        [turn(tokenizer, submit(6)), turn(tokenizer, submit(7)), turn(tokenizer, "done")],
        [turn(tokenizer, "7")],
    ]
    out, _ = run(tokenizer, prompts, script, {"submit": AnswerTool()})
    assert [info["turn_rewards"] for info in out.non_tensors["multi_turn"]] == [[-0.05, 1.0, 0.0], [0.0]]
    scorer = RewardManager(
        tokenizer, lambda data_source, solution_str, ground_truth, extra_info: 0.5, RewardConfig(turn_rewards=True)
    )
    result = scorer(out)
    mask = out.tensors["response_mask"]
    turns = response_turns(mask)
    ends = [[int((turns[row] == k).nonzero()[-1, 0]) for k in range(int(turns[row].max()) + 1)] for row in range(2)]
    scores = result.token_level_scores
    assert [scores[0, p].item() for p in ends[0]] == pytest.approx([-0.05, 1.0, 0.5])
    assert scores[1, ends[1][0]].item() == pytest.approx(0.5)
    assert int((scores != 0).sum()) == 4
    assert result.metrics["reward/turn_0/mean"] == pytest.approx(-0.025)
    assert result.metrics["reward/turn_1/mean"] == pytest.approx(1.0)
    out.meta_info["validate"] = True  # validation scores the outcome alone
    assert int((scorer(out).token_level_scores != 0).sum()) == 2
    out.meta_info.pop("validate")
    advantages, _ = compute_turn_rloo_advantage(scores, mask, ["q", "q"])
    # returns-to-go 1.45, 1.5, 0.5 for the first sample, 0.5 for the second; turn t's baseline: the other's G_t
    assert advantages[0, ends[0][0]].item() == pytest.approx(1.45 - 0.5)
    assert advantages[0, ends[0][1]].item() == pytest.approx(1.5)
    assert advantages[1, ends[1][0]].item() == pytest.approx(0.5 - 1.45)


def test_a_rows_agent_name_picks_one_turn_or_the_tool_loop(tmp_path, tokenizer):
    """verl's agent_name column: single_turn_agent ends after the first turn even when it calls a tool; tool_agent
    (and a row without one, by default) runs the loop; rollout.agent.default_agent_loop sets the default."""
    prompts = prompts_of(tmp_path, tokenizer, 3)
    prompts.non_tensors["agent_name"][:] = ["single_turn_agent", "tool_agent", ""]
    script = [[turn(tokenizer, hermes("1+1")), turn(tokenizer, "2")]] * 3
    out, engine = run(tokenizer, prompts, script, load_tools(CALC_TOOLS))
    infos = list(out.non_tensors["multi_turn"])
    assert [info["finish_reason"] for info in infos] == ["stop", "stop", "stop"]
    assert [len(info["tool_calls"]) for info in infos] == [0, 1, 1]
    assert list(out.non_tensors["num_turns"]) == [2, 4, 4]

    engine = ScriptedEngine(dict(zip(prompt_keys(prompts), script)), [tokenizer.eos_token_id])
    config = OmegaConf.merge(
        rollout_config(tool_config_path=CALC_TOOLS), {"agent": {"default_agent_loop": "single_turn_agent"}}
    )
    out = MultiTurnRollout(engine, tokenizer, config, load_tools(CALC_TOOLS)).generate_sequences(prompts)
    assert [len(info["tool_calls"]) for info in out.non_tensors["multi_turn"]] == [0, 1, 0]


def tools_kwargs(value):
    return {"extra_info": {"tools_kwargs": value}}


@pytest.mark.parametrize(
    "columns, problem",
    [
        (tools_kwargs([1]), "extra_info.tools_kwargs must map tool names to their kwargs, not list"),
        (
            tools_kwargs({"submit": {"create": {}}}),
            "extra_info.tools_kwargs.submit must be a mapping with some of create_kwargs",
        ),
        (
            tools_kwargs({"submit": {"create_kwargs": 3}}),
            "extra_info.tools_kwargs.submit.create_kwargs must be a mapping, not 3",
        ),
        (
            {"extra_info": {"interaction_kwargs": {"q": 1}}},
            "extra_info.interaction_kwargs must be a mapping with a string 'name'",
        ),
        ({"agent_name": 3}, "agent_name must be a string (an agent loop's name), not 3"),
    ],
)
def test_malformed_agent_columns_are_refused_with_their_row(columns, problem):
    row = {
        "data_source": "x",
        "prompt": [{"role": "user", "content": "1+1"}],
        "reward_model": {"ground_truth": "2"},
        **columns,
    }
    with pytest.raises(DatasetError, match=f"rows.jsonl: row 3: {re.escape(problem)}"):
        validate_row(row, "rows.jsonl: row 3")
