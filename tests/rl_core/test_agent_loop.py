"""Multi-turn rollouts (rl_core/agent): the token layout of a trajectory, call parsing, limits, timeouts, concurrency,
determinism, and the feature switched on without tools giving today's batch.

Most tests drive the loop with ``ScriptedEngine``, a stand-in for the engine's token primitive that returns fixed id
lists (no sampling), so the bookkeeping is checked exactly; the tools are real (the calculator) or small async tools
defined here. The last tests run the real HF engine on the tiny model."""

import asyncio
import contextlib
import random
import time

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rl_core.agent.checks import check_multi_turn
from rl_core.agent.observations import ObservationEncoder, truncate
from rl_core.agent.parsers import ToolCall, parse_calls
from rl_core.agent.runner import MultiTurnRollout
from rl_core.agent.tools.base import BaseTool, ToolResponse
from rl_core.agent.tools.registry import builtin_tool, load_tools, tool_schemas
from rl_core.config import DataConfig, RolloutConfig
from rl_core.config_checks import ConfigValueError
from rl_core.data.dataset import RLDataset
from rl_core.metrics import multi_turn_metrics
from rl_core.models.loading import load_policy_model
from rl_core.rollout import build_rollout_engine
from rl_core.rollout.base import cut_at_stop
from rl_core.sft import SFTExample, encode_example
from tests.conftest import ROOT
from tests.rl_core.helpers import addition_dataset

CALC_TOOLS = str(ROOT / "configs" / "tools" / "calculator.yaml")


class ScriptedEngine:
    """Each prompt's turns are fixed id lists, handed out in order; log-probs -0.5 per token."""

    def __init__(self, turns_by_prompt: dict[tuple[int, ...], list[list[int]]], stop_ids: list[int]):
        self.turns = turns_by_prompt
        self.stop_ids = stop_ids
        self.taken = dict.fromkeys(turns_by_prompt, 0)
        self.calls: list[tuple[list[list[int]], list[int], int]] = []

    @contextlib.contextmanager
    def rollout(self, meta_info):
        yield

    def generate_tokens(self, contexts, max_new_tokens, params, seed):
        self.calls.append((contexts, max_new_tokens, seed))
        samples = []
        for context, budget in zip(contexts, max_new_tokens):
            prompt = next(p for p in self.turns if tuple(context[: len(p)]) == p)
            ids = self.turns[prompt][self.taken[prompt]]
            self.taken[prompt] += 1
            sample = cut_at_stop(ids, self.stop_ids, budget)
            sample.log_probs = [-0.5] * len(sample.token_ids)
            samples.append(sample)
        return samples


class SleepTool(BaseTool):
    """Answers "slept" after ``config['seconds']`` (or a random delay drawn from ``config['seed']``)."""

    def __init__(self, config, tool_schema=None):
        schema = {"type": "function", "function": {"name": "sleep", "parameters": {"required": ["x"]}}}
        super().__init__(config, tool_schema or schema)
        self.rng = random.Random(self.config.get("seed"))

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(self.config.get("seconds", self.rng.uniform(0, 0.05)))
        return ToolResponse(f"slept {parameters.get('x')}"), 0.0, {}


def rollout_config(batching="rounds", **multi_turn):
    config = OmegaConf.structured(RolloutConfig(prompt_length=16, response_length=256, generation_batch_size=2))
    return OmegaConf.merge(config, {"multi_turn": {"enable": True, **multi_turn}, "agent": {"batching": batching}})


def prompts_of(tmp_path, tokenizer, count):
    data = OmegaConf.structured(DataConfig(max_prompt_length=16, max_response_length=160))
    batch = addition_dataset(tmp_path, tokenizer, data, count).collate(list(range(count)), uid_prefix="t-")
    batch.meta_info["global_step"] = 1
    return batch


def turn(tokenizer, text):
    """A turn's canonical ids, ended by <|im_end|>."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def hermes(expression):
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def prompt_keys(batch):
    ids, mask = batch.tensors["input_ids"], batch.tensors["attention_mask"].bool()
    return [tuple(ids[row][mask[row]].tolist()) for row in range(len(batch))]


def batch_rows(prompts, engine):
    """Which prompt rows each of the engine's generate calls sampled, per call."""
    keys = prompt_keys(prompts)
    return [
        sorted(next(row for row, key in enumerate(keys) if tuple(c[: len(key)]) == key) for c in contexts)
        for contexts, _, _ in engine.calls
    ]


def run(tokenizer, prompts, script, tools, batching="rounds", **multi_turn):
    engine = ScriptedEngine(dict(zip(prompt_keys(prompts), script)), [tokenizer.eos_token_id])
    rollout = MultiTurnRollout(engine, tokenizer, rollout_config(batching, **multi_turn), tools)
    return rollout.generate_sequences(prompts), engine


# ---------------------------------------------------------------------------------------------- the token layout
def test_a_tool_trajectory_is_the_full_render_with_the_policys_tokens_alone_trained(tmp_path, tokenizer):
    prompts = prompts_of(tmp_path, tokenizer, 1)
    first, last = hermes("37*48"), "1776"
    out, _ = run(tokenizer, prompts, [[turn(tokenizer, first), turn(tokenizer, last)]], load_tools(CALC_TOOLS))
    messages = [*prompts.non_tensors["raw_prompt"][0], {"role": "assistant", "content": first}]
    messages += [{"role": "tool", "content": "1776"}, {"role": "assistant", "content": last}]
    full = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    full = full[: full.index(tokenizer.eos_token_id, len(full) - 3) + 1]  # the render, up to the last <|im_end|>
    prompt = list(prompt_keys(prompts)[0])
    length = len(full) - len(prompt)
    responses, mask = out.tensors["responses"][0], out.tensors["response_mask"][0]
    assert full[: len(prompt)] == prompt and responses[:length].tolist() == full[len(prompt) :]
    # the mask: 1 on both turns (each with its <|im_end|>), 0 on the tool's answer and the template's glue
    first_ids, last_ids = turn(tokenizer, first), turn(tokenizer, last)
    observation = length - len(first_ids) - len(last_ids)
    assert mask[:length].tolist() == [1] * len(first_ids) + [0] * observation + [1] * len(last_ids)
    assert "1776" in tokenizer.decode(responses[len(first_ids) : len(first_ids) + observation])
    assert mask[length:].sum() == 0 and torch.all(responses[length:] == tokenizer.pad_token_id)
    P = prompts.tensors["input_ids"].shape[1]
    attention = out.tensors["attention_mask"][0, P:]
    assert attention[:length].all() and not attention[length:].any()  # the tool's answer is attended to
    positions = out.tensors["position_ids"][0]
    assert torch.equal(positions[P:] - positions[P - 1], torch.arange(1, positions.shape[0] - P + 1))
    log_probs = out.tensors["rollout_log_probs"][0]
    assert torch.equal(log_probs, -0.5 * mask.float())  # the sampler's on the policy's tokens, 0 elsewhere
    info = out.non_tensors["multi_turn"][0]
    assert out.non_tensors["num_turns"][0] == 4 and info["finish_reason"] == "stop"
    assert info["final_answer"] == "1776" and info["tool_calls"][0]["answer"] == "1776"


def test_the_policys_ids_are_kept_as_sampled_even_when_not_canonical(tmp_path, tokenizer):
    """Ids that decode and re-encode to other ids (one id per character of a word the tokenizer merges) stay as
    drawn."""
    prompts = prompts_of(tmp_path, tokenizer, 1)
    spelled = [tokenizer.convert_tokens_to_ids(c) for c in "assistant"] + [tokenizer.eos_token_id]
    assert tokenizer(tokenizer.decode(spelled[:-1]), add_special_tokens=False)["input_ids"] != spelled[:-1]
    out, _ = run(tokenizer, prompts, [[spelled]], load_tools(CALC_TOOLS))
    assert out.tensors["responses"][0, : len(spelled)].tolist() == spelled


def test_the_template_delta_is_the_suffix_of_the_full_render(tokenizer):
    encoder = ObservationEncoder(tokenizer, [tokenizer.eos_token_id], 256, 64, "middle")
    delta = tokenizer.decode(encoder.encode(["12", "ok"]))
    assert delta == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    """A template whose render of the first turns changes once tool messages follow (here: it prints how many
    messages there are) cannot take answers as token deltas."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = "{{ messages | length }}" + tokenizer.chat_template
    encoder = ObservationEncoder(tokenizer, [tokenizer.eos_token_id], 256, 64, "middle")
    with pytest.raises(ValueError, match="renders the conversation differently"):
        encoder.encode(["12"])


@pytest.mark.parametrize("side, kept", [("left", "...56789"), ("right", "01234..."), ("middle", "012...789")])
def test_tool_answers_are_cut_on_the_chosen_side(side, kept):
    assert truncate("0123456789", 5 if side != "middle" else 6, side) == kept


def test_a_long_answer_is_capped_in_tokens_too(tokenizer):
    encoder = ObservationEncoder(tokenizer, [tokenizer.eos_token_id], 10_000, 8, "left")
    text, truncated = encoder.cap("1" * 100 + "2345")
    assert truncated and text.endswith("2345") and len(tokenizer(text)["input_ids"]) <= 8 + 3


# ---------------------------------------------------------------------------------------------- calls
CALC = "calculator"
NOT_JSON = "the tool call is not valid JSON (Expecting property name enclosed in double quotes)"


@pytest.mark.parametrize(
    "text, expected",
    [
        (hermes("1+2"), [ToolCall(CALC, {"expression": "1+2"})]),
        (
            hermes("1") + " and " + hermes("2"),
            [ToolCall(CALC, {"expression": "1"}), ToolCall(CALC, {"expression": "2"})],
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>',
            [ToolCall(CALC, {"expression": "3"})],
        ),
        ("<tool_call>{not json}</tool_call>", [ToolCall(None, None, NOT_JSON)]),
        (
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
            [ToolCall(CALC, None, f"the arguments of {CALC} must be an object, not list")],
        ),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            [ToolCall(None, None, 'a tool call is {"name": ..., "arguments": {...}}')],
        ),
        ('<tool_call>{"name": "calculator"', [ToolCall(None, None, "a <tool_call> without </tool_call>")]),
        ("no call here", []),
    ],
)
def test_hermes_calls_are_read_or_explained(text, expected):
    assert parse_calls(text, "hermes", []) == expected


def test_tag_calls_fill_the_only_tools_one_argument():
    schema = builtin_tool("calculator").tool_schema
    assert parse_calls("<call> 37*48 </call>", "tag", [schema]) == [ToolCall("calculator", {"expression": "37*48"})]
    assert parse_calls("<call>37*48", "tag", [schema])[0].error == "a <call> without </call>"


def test_malformed_and_extra_calls_are_answered_with_errors_and_recorded(tmp_path, tokenizer):
    prompts = prompts_of(tmp_path, tokenizer, 3)
    script = [
        [turn(tokenizer, "<tool_call>{oops}</tool_call>"), turn(tokenizer, "done")],
        [turn(tokenizer, '<tool_call>{"name": "search", "arguments": {}}</tool_call>'), turn(tokenizer, "done")],
        [turn(tokenizer, hermes("1+1") + hermes("2+2")), turn(tokenizer, "done")],
    ]
    out, _ = run(tokenizer, prompts, script, load_tools(CALC_TOOLS))
    calls = [info["tool_calls"] for info in out.non_tensors["multi_turn"]]
    assert [c["error"] for c in calls[0]] == ["parse"] and "not valid JSON" in calls[0][0]["answer"]
    assert [c["error"] for c in calls[1]] == ["unknown"] and "no tool named 'search'" in calls[1][0]["answer"]
    assert [(c["error"], c["answer"]) for c in calls[2]] == [(None, "2"), ("limit", "error: at most 1 calls per turn")]
    assert all(info["finish_reason"] == "stop" for info in out.non_tensors["multi_turn"])

    stopped, _ = run(tokenizer, prompts[:1], script[:1], load_tools(CALC_TOOLS), on_parse_error="stop")
    assert stopped.non_tensors["multi_turn"][0]["finish_reason"] == "parse_error"
    assert stopped.non_tensors["num_turns"][0] == 2


def test_turn_limits_and_the_response_budget_end_trajectories_on_a_policy_token(tmp_path, tokenizer):
    prompts = prompts_of(tmp_path, tokenizer, 2)
    call = turn(tokenizer, hermes("2*3"))
    script = [[call] * 5, [call] * 5]
    out, _ = run(tokenizer, prompts, script, load_tools(CALC_TOOLS), max_assistant_turns=2)
    assert list(out.non_tensors["num_turns"]) == [4, 4]  # prompt, call, answer, call (not executed)
    assert {info["finish_reason"] for info in out.non_tensors["multi_turn"]} == {"max_turns"}
    out, _ = run(tokenizer, prompts, script, load_tools(CALC_TOOLS), max_user_turns=1)
    assert list(out.non_tensors["num_turns"]) == [4, 4]
    # 256 tokens take three calls and two answers, not a third answer: that answer is dropped, the response ends
    out, _ = run(tokenizer, prompts, script, load_tools(CALC_TOOLS))
    for row, info in enumerate(out.non_tensors["multi_turn"]):
        mask = out.tensors["response_mask"][row]
        real = out.tensors["attention_mask"][row, 16:]
        assert info["finish_reason"] == "length" and mask.sum() == 3 * len(call)
        assert mask[int(real.sum()) - 1] == 1 and torch.equal(mask * real, mask)  # ends on a policy token
    # a turn cut by the budget ends the trajectory without running its call
    short = OmegaConf.structured(RolloutConfig(prompt_length=16, response_length=len(call) - 1))
    short.multi_turn.enable, short.agent.batching = True, "rounds"
    engine = ScriptedEngine(dict(zip(prompt_keys(prompts), script)), [tokenizer.eos_token_id])
    out = MultiTurnRollout(engine, tokenizer, short, load_tools(CALC_TOOLS)).generate_sequences(prompts)
    assert [info["tool_calls"] for info in out.non_tensors["multi_turn"]] == [[], []]
    assert out.tensors["response_mask"].sum() == 2 * (len(call) - 1)


# ---------------------------------------------------------------------------------------------- timing
def test_a_hanging_tool_is_answered_with_a_timeout_in_time(tmp_path, tokenizer):
    prompts = prompts_of(tmp_path, tokenizer, 1)
    slow = {"sleep": SleepTool({"seconds": 60})}
    started = time.perf_counter()
    call = '<tool_call>{"name": "sleep", "arguments": {"x": 1}}</tool_call>'
    out, _ = run(tokenizer, prompts, [[turn(tokenizer, call), turn(tokenizer, "ok")]], slow, tool_timeout_s=0.5)
    assert time.perf_counter() - started < 1.5
    (record,) = out.non_tensors["multi_turn"][0]["tool_calls"]
    assert record["error"] == "timeout" and record["answer"] == "error: sleep timed out after 0.5 s"


def test_tool_calls_of_many_chunks_overlap(tmp_path, tokenizer):
    """8 one-row chunks whose calls each take 0.2 s: they run together, not one after the other, and timing_s/tools
    counts only the wait that was not overlapped (about one call's)."""
    prompts = prompts_of(tmp_path, tokenizer, 8)
    call = turn(tokenizer, '<tool_call>{"name": "sleep", "arguments": {"x": 1}}</tool_call>')
    script = [[call, turn(tokenizer, "ok")]] * 8
    tools = {"sleep": SleepTool({"seconds": 0.2})}
    started = time.perf_counter()
    out, _ = run(tokenizer, prompts, script, tools, max_concurrent_tools=8)
    assert time.perf_counter() - started < 0.6 * 8 * 0.2
    assert all(info["tool_calls"][0]["answer"] == "slept 1" for info in out.non_tensors["multi_turn"])
    waited = multi_turn_metrics(list(out.non_tensors["num_turns"]), list(out.non_tensors["multi_turn"]))
    assert 0.1 <= waited["timing_s/tools"] < 0.6 * 8 * 0.2


def test_the_batch_does_not_depend_on_the_tools_timing(tmp_path, tokenizer):
    prompts = prompts_of(tmp_path, tokenizer, 6)
    call = turn(tokenizer, '<tool_call>{"name": "sleep", "arguments": {"x": 2}}</tool_call>')
    script = [[call, turn(tokenizer, "ok")] if row % 2 else [turn(tokenizer, "no")] for row in range(6)]
    batches, seeds = [], []
    for delay_seed in (1, 2):
        out, engine = run(tokenizer, prompts, script, {"sleep": SleepTool({"seed": delay_seed})})
        batches.append(out)
        seeds.append([(contexts, budgets, seed) for contexts, budgets, seed in engine.calls])
    assert all(torch.equal(batches[0].tensors[k], batches[1].tensors[k]) for k in batches[0].tensors)
    assert seeds[0] == seeds[1]  # the same chunks, in the same order, with the same seeds


def test_continuous_batching_assembles_the_trajectories_the_rounds_do(tmp_path, tokenizer):
    """The same scripted policy (its turns do not depend on the batch) in rounds and continuously: the same ids,
    masks, log-probs, messages and finish reasons; only which batch generated which turn differs."""
    prompts = prompts_of(tmp_path, tokenizer, 6)
    call = turn(tokenizer, '<tool_call>{"name": "sleep", "arguments": {"x": 2}}</tool_call>')
    three, two, one = [call, call, turn(tokenizer, "ok")], [call, turn(tokenizer, "ok")], [turn(tokenizer, "no")]
    script = [[three, two, one][row % 3] for row in range(6)]
    tools = {"sleep": SleepTool({"seed": 3})}
    rounds, _ = run(tokenizer, prompts, script, tools)
    continuous, engine = run(tokenizer, prompts, script, tools, batching="continuous")
    assert set(continuous.tensors) == set(rounds.tensors)
    assert all(torch.equal(rounds.tensors[key], continuous.tensors[key]) for key in rounds.tensors)
    assert list(continuous.non_tensors["num_turns"]) == list(rounds.non_tensors["num_turns"]) == [6, 4, 2] * 2
    for mode in (rounds, continuous):
        for info in mode.non_tensors["multi_turn"]:  # the calls' timings differ
            info.pop("tool_wait_s"), info.pop("batch_sizes")
            info["tool_calls"] = [{**record, "latency_s": None} for record in info["tool_calls"]]
    assert list(continuous.non_tensors["multi_turn"]) == list(rounds.non_tensors["multi_turn"])
    assert sum(len(contexts) for contexts, _, _ in engine.calls) == 3 + 2 + 1 + 3 + 2 + 1


def test_with_continuous_batching_a_trajectory_waiting_on_its_tool_holds_no_one(tmp_path, tokenizer):
    """Row 0 calls a tool that answers after 1 s, rows 1 and 2 a quick one twice before answering. In rounds, row 0's
    second turn is generated with rows 1 and 2's (they waited for its answer); continuously, rows 1 and 2 take all
    three turns meanwhile and row 0's last turn is generated alone, last."""
    prompts = prompts_of(tmp_path, tokenizer, 3)
    slow_schema = {"type": "function", "function": {"name": "slow", "parameters": {"required": ["x"]}}}
    tools = {"sleep": SleepTool({"seconds": 0.01}), "slow": SleepTool({"seconds": 1.0}, slow_schema)}
    slow = turn(tokenizer, '<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>')
    quick = turn(tokenizer, '<tool_call>{"name": "sleep", "arguments": {"x": 1}}</tool_call>')
    script = [
        [slow, turn(tokenizer, "ok")],
        [quick, quick, turn(tokenizer, "ok")],
        [quick, quick, turn(tokenizer, "ok")],
    ]
    batches = {}
    for batching in ("rounds", "continuous"):
        out, engine = run(tokenizer, prompts, script, tools, batching=batching, max_concurrent_tools=4)
        batches[batching] = batch_rows(prompts, engine)
        assert [info["finish_reason"] for info in out.non_tensors["multi_turn"]] == ["stop"] * 3
        # generation waited about the slow call's second, once: not the quick calls' time, not the slow one per row
        waited = multi_turn_metrics(list(out.non_tensors["num_turns"]), list(out.non_tensors["multi_turn"]))
        assert 0.9 <= waited["timing_s/tools"] < 1.5, batching
        # each turn counts the size of the call that sampled it
        sizes = [len(batch) for batch in batches[batching]]
        assert waited["multi_turn/batch_size/mean"] == sum(size * size for size in sizes) / sum(sizes)
    assert batches["rounds"] == [[0, 1], [2], [0, 1], [2], [1, 2]]
    assert batches["continuous"][-1] == [0]
    earlier = [row for batch in batches["continuous"][:-1] for row in batch]
    assert earlier.count(0) == 1 and earlier.count(1) == earlier.count(2) == 3


# ---------------------------------------------------------------------------------------------- the real engine
def test_multi_turn_without_tools_gives_the_single_turn_batch(tmp_path, config):
    model, tokenizer = load_policy_model(config.actor_rollout_ref.model)
    rollout = config.actor_rollout_ref.rollout
    rollout.generation_batch_size = 4
    prompts = addition_dataset(tmp_path, tokenizer, config.data, count=6).collate(list(range(6)), uid_prefix="s-")
    prompts = prompts.repeat_interleave(2)
    prompts.meta_info["global_step"] = 3
    single = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=rollout)
    expected = single.generate_sequences(prompts)
    rollout.multi_turn.enable = True
    out = MultiTurnRollout(single, tokenizer, rollout, tools={}).generate_sequences(prompts)
    assert set(out.tensors) == set(expected.tensors)
    assert all(torch.equal(out.tensors[k], expected.tensors[k]) for k in expected.tensors)
    assert set(out.non_tensors["num_turns"]) == {2}


BAD_INTERACTION = "interaction:\n  - {name: x, class_name: rl_core.agent.tools.calculator.CalculatorTool}\n"


def write(path, text):
    path.write_text(text)
    return path


def test_the_config_refuses_what_multi_turn_cannot_run(tmp_path):
    rollout = rollout_config(tool_config_path=CALC_TOOLS)
    check_multi_turn(rollout)
    check_multi_turn(OmegaConf.merge(rollout, {"name": "vllm"}))  # its token primitive: tests/rl_core/test_vllm_cpu.py
    for change, message in [
        ({"name": "vllm", "tensor_model_parallel_size": 2}, "tensor_model_parallel_size=2: the agent loop"),
        ({"multi_turn": {"max_user_turns": 0}}, "max_user_turns=0: at least 1"),
        ({"multi_turn": {"tool_config_path": str(tmp_path / "none.yaml")}}, "none.yaml: cannot read it"),
        ({"multi_turn": {"format": "tag", "tool_config_path": None}}, "needs exactly one tool"),
        (
            {"agent": {"default_agent_loop": "react_agent"}},
            r"default_agent_loop=react_agent: no agent loop of that name \(single_turn_agent, tool_agent",
        ),
        (
            {"agent": {"default_agent_loop": "tool_agent"}, "multi_turn": {"enable": False}},
            "default_agent_loop=tool_agent: tool_agent needs actor_rollout_ref.rollout.multi_turn.enable=true",
        ),
        (
            {"multi_turn": {"interaction_config_path": CALC_TOOLS}},
            "interaction_config_path: .*calculator.yaml: expected `interaction:` with a list",
        ),
        (
            {"multi_turn": {"interaction_config_path": str(write(tmp_path / "i.yaml", BAD_INTERACTION))}},
            "entry 0: rl_core.agent.tools.calculator.CalculatorTool is not a BaseInteraction",
        ),
    ]:
        with pytest.raises(ConfigValueError, match=message):
            check_multi_turn(OmegaConf.merge(rollout, change))


def test_sft_encodes_a_tool_conversation_as_the_rollout_builds_it(tmp_path, tokenizer):
    """The warm start's encoding of a conversation with tool messages is the rollout's trajectory, mask included; a
    message of weight 0 is context, not a target."""
    prompts = prompts_of(tmp_path, tokenizer, 1)
    first, last = hermes("6*7"), "42"
    out, _ = run(tokenizer, prompts, [[turn(tokenizer, first), turn(tokenizer, last)]], load_tools(CALC_TOOLS))
    messages = [
        {"role": "assistant", "content": first},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": last},
    ]
    ids, mask = encode_example(tokenizer, SFTExample(list(prompts.non_tensors["raw_prompt"][0]), messages))
    prompt = list(prompt_keys(prompts)[0])
    length = len(ids) - len(prompt)
    assert ids[: len(prompt)] == prompt and set(mask[: len(prompt)]) == {0}
    assert out.tensors["responses"][0, :length].tolist() == ids[len(prompt) :]
    assert out.tensors["response_mask"][0, :length].tolist() == mask[len(prompt) :]
    messages[0]["weight"] = 0
    _, context_mask = encode_example(tokenizer, SFTExample(list(prompts.non_tensors["raw_prompt"][0]), messages))
    assert sum(context_mask) == len(turn(tokenizer, last))


def test_tool_output_gets_no_gradient_and_does_not_enter_the_loss(config):
    """A response with a hole (policy tokens, 6 tool tokens, policy tokens): values at the hole (old log-probs,
    advantages) leave the loss and every gradient bit-identical, and the logits that predict tool tokens get no
    gradient; the tool's tokens still reach the policy's later tokens through attention."""
    from rl_core.algos.policy_loss import get_policy_loss_fn
    from rl_core.models.logprob import response_log_probs

    model, _ = load_policy_model(config.actor_rollout_ref.model)
    torch.manual_seed(0)
    P, R = 4, 14
    input_ids = torch.randint(3, 300, (2, P + R))
    attention = torch.ones(2, P + R, dtype=torch.long)
    positions = torch.arange(P + R).expand(2, -1)
    mask = torch.tensor([[1] * 4 + [0] * 6 + [1] * 4] * 2)
    loss_fn = get_policy_loss_fn("vanilla")

    def loss_and_grads(old, advantages, ids=input_ids):
        model.zero_grad()
        captured = {}
        hook = model.lm_head.register_forward_hook(lambda m, i, out: captured.update(logits=out) or out.retain_grad())
        log_probs, _ = response_log_probs(model, ids, attention, positions, R, remove_padding=False)
        hook.remove()
        loss, _ = loss_fn(old, log_probs, advantages, mask, "token-mean", config.actor_rollout_ref.actor)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, captured["logits"].grad

    old, advantages = -torch.rand(2, R), torch.randn(2, R)
    loss, grads, logit_grads = loss_and_grads(old, advantages)
    hole = mask == 0
    loss2, grads2, _ = loss_and_grads(old + 5 * hole, advantages + 9 * hole)
    assert torch.equal(loss, loss2) and all(torch.equal(grads[n], grads2[n]) for n in grads)
    # the response's logits (from the prompt's last position on) predict the next token: those predicting the tool's
    # tokens get no gradient
    predicting_hole = torch.zeros(2, R + 1, dtype=torch.bool)
    predicting_hole[:, :R] = hole
    assert logit_grads[predicting_hole].abs().max() == 0 and logit_grads[~predicting_hole].abs().max() > 0
    # with advantages on the first turn only, what the tool said does not change any gradient ...
    first_turn = advantages * (torch.arange(R) < 4)
    _, grads, _ = loss_and_grads(old, first_turn)
    other_output = input_ids.clone()
    other_output[:, P + 4 : P + 10] = torch.randint(3, 300, (2, 6))
    _, grads2, _ = loss_and_grads(old, first_turn, other_output)
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)
    # ... while on the later turn it does (the tool's answer is attended to)
    _, grads, _ = loss_and_grads(old, advantages)
    _, grads2, _ = loss_and_grads(old, advantages, other_output)
    assert not all(torch.equal(grads[n], grads2[n]) for n in grads)


def test_the_prompt_shows_the_policy_its_tools(tmp_path, tokenizer):
    """A chat template that renders the tools' schemas gets them from the run's tool YAML."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}" + tokenizer.chat_template
    data = OmegaConf.structured(DataConfig(max_prompt_length=64))
    path = tmp_path / "rows.jsonl"
    path.write_text('{"data_source": "ppoflow/calc", "prompt": [{"role": "user", "content": "2*3="}], '
                    '"reward_model": {"ground_truth": "6"}}\n')  # fmt: skip
    schemas = tool_schemas(rollout_config(tool_config_path=CALC_TOOLS).multi_turn)
    with_tools = RLDataset(str(path), tokenizer, data, tools=schemas).prompt_ids[0]
    assert tokenizer.decode(with_tools).startswith("[calculator]<|im_start|>user")
    assert "[calculator]" not in tokenizer.decode(RLDataset(str(path), tokenizer, data).prompt_ids[0])
