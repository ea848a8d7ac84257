"""The step's batch container: named tensors sharing a batch dimension, per-sample Python objects, and meta info.

A :class:`Batch` is what flows between PPO stages (verl calls it ``DataProto``). Every tensor in
``tensors`` and every array in ``non_tensors`` has the same first dimension, the batch size;
``non_tensors`` are numpy object arrays (strings, dicts, ...). ``meta_info`` holds step-wide values
(temperature, global step, ...) that are not per-sample.

Data-parallel dispatch uses :meth:`Batch.pad_to_multiple` + :meth:`Batch.chunk` on the way out and
:meth:`Batch.concat` + :meth:`Batch.unpad` on the way back.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

IndexLike = int | slice | Sequence[int] | np.ndarray | torch.Tensor


def _as_object_array(values: Any) -> np.ndarray:
    """A 1-D-or-more numpy array whose first dimension is the batch; lists become object arrays."""
    if isinstance(values, np.ndarray):
        return values
    values = list(values)
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):  # element-wise, so nested lists stay one object per sample
        array[i] = value
    return array


class Batch:
    """Named tensors + per-sample objects with one shared batch dimension, plus step-wide ``meta_info``."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.non_tensors: dict[str, np.ndarray] = {k: _as_object_array(v) for k, v in (non_tensors or {}).items()}
        self.meta_info: dict[str, Any] = dict(meta_info or {})
        self._check_sizes()

    # ------------------------------------------------------------------ invariants
    def _sizes(self) -> dict[str, int]:
        sizes = {f"tensors[{k!r}]": v.shape[0] for k, v in self.tensors.items()}
        sizes.update({f"non_tensors[{k!r}]": len(v) for k, v in self.non_tensors.items()})
        return sizes

    def _check_sizes(self) -> None:
        sizes = self._sizes()
        if len(set(sizes.values())) > 1:
            listing = ", ".join(f"{name}: {size}" for name, size in sizes.items())
            raise ValueError(
                f"Batch fields disagree on the batch size ({listing}); every field needs the same first dimension"
            )

    def __len__(self) -> int:
        sizes = self._sizes()
        return next(iter(sizes.values())) if sizes else 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __repr__(self) -> str:
        tensors = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return (
            f"Batch(size={len(self)}, tensors={tensors}, non_tensors={list(self.non_tensors)}, "
            f"meta_info={list(self.meta_info)})"
        )

    def __getitem__(self, index: IndexLike) -> Batch:
        """Rows picked by an int, a slice, a list/array of ints or a boolean mask. An int keeps the batch dimension."""
        if isinstance(index, int):
            index = slice(index, index + 1) if index != -1 else slice(-1, None)
        if isinstance(index, slice):
            tensor_index, array_index = index, index
        else:
            as_tensor = torch.as_tensor(np.asarray(index) if not isinstance(index, torch.Tensor) else index)
            if as_tensor.dtype == torch.bool:
                as_tensor = as_tensor.nonzero().flatten()
            tensor_index, array_index = as_tensor.long(), as_tensor.long().cpu().numpy()
        return Batch(
            {
                k: v[tensor_index.to(v.device) if isinstance(tensor_index, torch.Tensor) else tensor_index]
                for k, v in self.tensors.items()
            },
            {k: v[array_index] for k, v in self.non_tensors.items()},
            copy.copy(self.meta_info),
        )

    # ------------------------------------------------------------------ field access
    def select(
        self,
        tensor_keys: Iterable[str] = (),
        non_tensor_keys: Iterable[str] = (),
        meta_keys: Iterable[str] | None = None,
    ) -> Batch:
        """A batch with only the named fields (the tensors are shared, not copied)."""
        tensor_keys, non_tensor_keys = list(tensor_keys), list(non_tensor_keys)
        missing = [k for k in tensor_keys if k not in self.tensors] + [
            k for k in non_tensor_keys if k not in self.non_tensors
        ]
        if missing:
            raise KeyError(
                f"Batch has no field(s) {missing}; it has tensors {sorted(self.tensors)} and non_tensors "
                f"{sorted(self.non_tensors)}"
            )
        meta = self.meta_info if meta_keys is None else {k: self.meta_info[k] for k in meta_keys}
        return Batch(
            {k: self.tensors[k] for k in tensor_keys},
            {k: self.non_tensors[k] for k in non_tensor_keys},
            copy.copy(meta),
        )

    def pop(self, tensor_keys: Iterable[str] = (), non_tensor_keys: Iterable[str] = ()) -> Batch:
        """Remove the named fields from this batch and return them as a new batch."""
        taken = self.select(tensor_keys, non_tensor_keys)
        for k in taken.tensors:
            del self.tensors[k]
        for k in taken.non_tensors:
            del self.non_tensors[k]
        return taken

    # ------------------------------------------------------------------ combining
    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Stack batches along the batch dimension; they must have the same fields. meta_info is taken from the
        first."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        for i, other in enumerate(batches[1:], start=1):
            if set(other.tensors) != set(first.tensors) or set(other.non_tensors) != set(first.non_tensors):
                raise ValueError(
                    f"Batch.concat: batch {i} has fields tensors={sorted(other.tensors)} "
                    f"non_tensors={sorted(other.non_tensors)}, batch 0 has tensors={sorted(first.tensors)} "
                    f"non_tensors={sorted(first.non_tensors)}"
                )
        tensors = {k: torch.cat([b.tensors[k] for b in batches], dim=0) for k in first.tensors}
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches], axis=0) for k in first.non_tensors}
        return Batch(tensors, non_tensors, copy.copy(first.meta_info))

    def union(self, other: Batch) -> Batch:
        """Fields of both batches in one (in place, returned). A field present in both must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"Batch.union: sizes differ ({len(self)} vs {len(other)})")
        for k, v in other.tensors.items():
            if k in self.tensors and not (
                self.tensors[k].shape == v.shape and torch.equal(self.tensors[k], v.to(self.tensors[k].device))
            ):
                raise ValueError(f"Batch.union: tensor {k!r} is in both batches with different values")
            self.tensors[k] = v
        for k, v in other.non_tensors.items():
            if k in self.non_tensors and not _object_arrays_equal(self.non_tensors[k], v):
                raise ValueError(f"Batch.union: non-tensor {k!r} is in both batches with different values")
            self.non_tensors[k] = v
        for k, v in other.meta_info.items():
            if k in self.meta_info and not _values_equal(self.meta_info[k], v):
                raise ValueError(
                    f"Batch.union: meta_info {k!r} is in both batches with different values ({self.meta_info[k]!r} vs "
                    f"{v!r})"
                )
            self.meta_info[k] = v
        return self

    # ------------------------------------------------------------------ data-parallel dispatch
    def chunk(self, chunks: int) -> list[Batch]:
        """Split into ``chunks`` equal parts; the size must be divisible (call :meth:`pad_to_multiple` first)."""
        if chunks <= 0:
            raise ValueError(f"Batch.chunk: chunks must be positive, got {chunks}")
        if len(self) % chunks:
            raise ValueError(
                f"Batch.chunk: batch size {len(self)} is not divisible by {chunks}; pad_to_multiple({chunks}) first"
            )
        size = len(self) // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    def split(self, split_size: int) -> list[Batch]:
        """Consecutive pieces of ``split_size`` rows (the last may be shorter): mini- and micro-batches."""
        if split_size <= 0:
            raise ValueError(f"Batch.split: split_size must be positive, got {split_size}")
        return [self[start : start + split_size] for start in range(0, len(self), split_size)]

    def pad_to_multiple(self, multiple: int) -> tuple[Batch, int]:
        """Append copies of the first rows until the size divides by ``multiple``; returns (padded, pad_size).

        The copies carry zero weight: their ``response_mask`` (when the batch has one) is all zeros, so that a
        loss, a token count or a masked metric computed over the padded batch equals the unpadded one's."""
        pad_size = -len(self) % multiple
        if pad_size == 0:
            return self, 0
        if len(self) == 0:
            raise ValueError("Batch.pad_to_multiple: cannot pad an empty batch")
        repeats = [self[: min(pad_size - done, len(self))] for done in range(0, pad_size, len(self))]
        padded = Batch.concat([self, *repeats])
        if "response_mask" in padded.tensors:
            padded.tensors["response_mask"][len(self) :] = 0  # concat made a new tensor: the original is untouched
        return padded, pad_size

    def unpad(self, pad_size: int) -> Batch:
        """Drop the ``pad_size`` rows that :meth:`pad_to_multiple` appended."""
        return self if pad_size == 0 else self[: len(self) - pad_size]

    def repeat_interleave(self, repeats: int) -> Batch:
        """Each row ``repeats`` times in a row (row0, row0, row1, row1, ...): ``n`` samples per prompt."""
        index = np.repeat(np.arange(len(self)), repeats)
        return self[index]

    # ------------------------------------------------------------------ pickling
    def __reduce__(self) -> tuple:
        """Pickled with its CPU tensors as numpy arrays: how a Batch travels between the controller and the workers
        (Ray pickles it). A numpy array's data goes out of band as one buffer, and a slice (a rank's chunk) as its own
        rows only; torch pickles a tensor's whole storage, at ~0.1 ms of Python per tensor. Tensors numpy cannot hold
        (bfloat16, on an accelerator, requiring grad) are pickled by torch."""
        fields = {k: v.numpy() if _numpy_can_hold(v) else v for k, v in self.tensors.items()}
        return _unpickle_batch, (fields, self.non_tensors, self.meta_info)

    # ------------------------------------------------------------------ devices
    def to(self, device: str | torch.device) -> Batch:
        """A Batch with every tensor on ``device`` (the same per-sample objects and meta info; this one is
        unchanged)."""
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensors, self.meta_info)


NUMPY_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128}
)


def _numpy_can_hold(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype in NUMPY_DTYPES and not tensor.requires_grad


def _unpickle_batch(fields: dict[str, Any], non_tensors: dict[str, np.ndarray], meta_info: dict[str, Any]) -> Batch:
    """The inverse of :meth:`Batch.__reduce__`. An array unpickled from a read-only buffer (Ray's object store hands
    out such zero-copy views) is copied: the stages write into their batches' tensors."""
    tensors = {
        k: torch.from_numpy(v if v.flags.writeable else v.copy()) if isinstance(v, np.ndarray) else v
        for k, v in fields.items()
    }
    return Batch(tensors, non_tensors, meta_info)


def _object_arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and all(_values_equal(x, y) for x, y in zip(a.tolist(), b.tolist()))


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object)))
    return a == b


def response_ends(response_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the index after its last policy token (0 when there is none): where the response ends. A single-turn
    response's mask is a prefix of 1s, so this is its length; a multi-turn one has holes (tool output, masked 0), and
    its score belongs on the last policy token and its text runs up to it."""
    positions = torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)
    return (response_mask.bool() * positions).amax(dim=-1).long()


def response_turns(response_mask: torch.Tensor) -> torch.Tensor:
    """Per response token, the index of the policy turn it belongs to (0, 1, ...), -1 off the policy's tokens. A turn is
    a maximal run of 1s in ``response_mask``: a multi-turn response's turns are separated by what answered them (tool
    output, a user's reply: never empty, masked 0); a single-turn response is turn 0."""
    policy = response_mask.bool()
    starts = policy & ~torch.nn.functional.pad(policy[:, :-1], (1, 0), value=False)
    return torch.where(policy, starts.long().cumsum(dim=-1) - 1, torch.full_like(response_mask, -1, dtype=torch.long))
