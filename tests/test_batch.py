"""The step's batch container: indexing, combining, data-parallel chunking and their round trips."""

import pickle

import numpy as np
import pytest
import torch

from rl_core.batch import Batch


def make_batch(size=5):
    return Batch(
        tensors={
            "input_ids": torch.arange(size * 3).reshape(size, 3),
            "scores": torch.arange(size, dtype=torch.float32),
        },
        non_tensors={"uid": [f"p{i}" for i in range(size)], "extra": [{"row": i} for i in range(size)]},
        meta_info={"temperature": 1.0},
    )


def test_sizes_must_agree_and_the_error_names_the_fields():
    with pytest.raises(ValueError, match=r"tensors\['a'\]: 2.*non_tensors\['uid'\]: 3"):
        Batch({"a": torch.zeros(2)}, {"uid": ["x", "y", "z"]})


def test_nested_lists_stay_one_object_per_sample():
    batch = Batch(non_tensors={"messages": [[{"role": "user"}], [{"role": "user"}, {"role": "assistant"}]]})
    assert len(batch) == 2 and len(batch.non_tensors["messages"][1]) == 2


def test_indexing_by_int_slice_list_and_mask():
    batch = make_batch()
    assert batch[2].non_tensors["uid"].tolist() == ["p2"] and len(batch[2]) == 1
    assert batch[1:3].tensors["scores"].tolist() == [1.0, 2.0]
    picked = batch[[4, 0]]
    assert picked.tensors["input_ids"][0].tolist() == [12, 13, 14] and picked.non_tensors["extra"][1] == {"row": 0}
    masked = batch[torch.tensor([True, False, True, False, False])]
    assert masked.non_tensors["uid"].tolist() == ["p0", "p2"]
    assert masked.meta_info == {"temperature": 1.0}


def test_select_and_pop():
    batch = make_batch()
    selected = batch.select(["scores"], ["uid"])
    assert set(selected.tensors) == {"scores"} and set(selected.non_tensors) == {"uid"}
    with pytest.raises(KeyError, match="no field.*'values'"):
        batch.select(["values"])
    popped = batch.pop(["scores"])
    assert "scores" not in batch and "scores" in popped


@pytest.mark.parametrize("size,world", [(5, 2), (7, 3), (4, 4), (3, 8), (6, 1)])
def test_pad_chunk_concat_unpad_round_trip(size, world):
    batch = make_batch(size)
    padded, pad_size = batch.pad_to_multiple(world)
    assert len(padded) % world == 0 and pad_size == (-size) % world
    chunks = padded.chunk(world)
    assert all(len(c) == len(padded) // world for c in chunks)
    back = Batch.concat(chunks).unpad(pad_size)
    assert torch.equal(back.tensors["input_ids"], batch.tensors["input_ids"])
    assert back.non_tensors["uid"].tolist() == batch.non_tensors["uid"].tolist()
    assert back.non_tensors["extra"].tolist() == batch.non_tensors["extra"].tolist()


def test_chunk_rejects_indivisible_sizes():
    with pytest.raises(ValueError, match="not divisible by 2; pad_to_multiple"):
        make_batch(5).chunk(2)


def test_concat_checks_fields():
    with pytest.raises(ValueError, match="batch 1 has fields"):
        Batch.concat([make_batch(2), make_batch(2).select(["scores"], ["uid"])])


def test_repeat_interleave_groups_samples_of_one_prompt():
    batch = make_batch(3).repeat_interleave(2)
    assert batch.non_tensors["uid"].tolist() == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert batch.tensors["scores"].tolist() == [0, 0, 1, 1, 2, 2]


def test_split_into_micro_batches():
    pieces = make_batch(5).split(2)
    assert [len(p) for p in pieces] == [2, 2, 1]
    assert torch.equal(Batch.concat(pieces).tensors["scores"], make_batch(5).tensors["scores"])


def test_union_merges_and_checks_consistency():
    left = make_batch(3).select(["input_ids"], ["uid"])
    right = make_batch(3).select(["input_ids", "scores"], ["extra"])
    merged = left.union(right)
    assert set(merged.tensors) == {"input_ids", "scores"} and set(merged.non_tensors) == {"uid", "extra"}
    different = make_batch(3).select(["input_ids"])
    different.tensors["input_ids"] = different.tensors["input_ids"] + 1
    with pytest.raises(ValueError, match="tensor 'input_ids' is in both batches with different values"):
        make_batch(3).union(different)
    with pytest.raises(ValueError, match="sizes differ"):
        make_batch(3).union(make_batch(2))
    with pytest.raises(ValueError, match="meta_info 'temperature'"):
        make_batch(3).union(Batch(meta_info={"temperature": 0.5}))


def test_device_move_keeps_values():
    batch = make_batch(2).to("meta")  # a real second device on a CPU-only machine
    assert all(t.device.type == "meta" for t in batch.tensors.values())
    assert isinstance(batch.non_tensors["uid"], np.ndarray)


def test_pickling_round_trips_every_field_and_sends_a_slice_alone():
    batch = make_batch(8)
    batch.tensors["weights"] = torch.rand(8, 3, dtype=torch.bfloat16)  # numpy has no bfloat16: torch pickles it
    batch.tensors["grad"] = torch.rand(8, requires_grad=True)
    batch.tensors["flags"] = torch.rand(8) > 0.5
    restored = pickle.loads(pickle.dumps(batch))
    for key, tensor in batch.tensors.items():
        assert restored.tensors[key].dtype == tensor.dtype and torch.equal(restored.tensors[key], tensor), key
    assert restored.tensors["grad"].requires_grad
    assert restored.non_tensors["uid"].tolist() == batch.non_tensors["uid"].tolist()
    assert restored.meta_info == batch.meta_info
    # a rank's chunk is a view of the whole batch's tensors: only its rows travel
    big = Batch({"x": torch.zeros(1000, 256)})
    assert len(pickle.dumps(big[:10])) < len(pickle.dumps(big)) / 50


def test_unpickled_tensors_are_writable_from_read_only_buffers():
    """Ray's object store hands out read-only zero-copy buffers (pickle protocol 5, out of band): the stages write
    into their batches' tensors, so the unpickled tensor must own writable memory."""
    batch = make_batch(4)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert buffers  # the arrays went out of band
    restored = pickle.loads(data, buffers=[memoryview(bytes(b.raw())) for b in buffers])  # bytes: read-only
    restored.tensors["scores"][0] = 42
    assert restored.tensors["scores"][0] == 42 and batch.tensors["scores"][0] != 42
