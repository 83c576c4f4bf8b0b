"""Real data for cells that train on it (``CellSpec.data``), read the way training jobs read
theirs: a ``DistributedSampler`` and a ``DataLoader`` with worker processes on every rank.

- ``synthetic`` (the default): random tokens drawn up front from the cell's seed
  (harness/training.py ``local_batches``); what every measurement suite trains on.
- ``stdlib_bytes``: the Python standard library's own top-level modules (``Lib/*.py``, in name
  order) as one byte string, cut into sequences of the model's length; bytes are the tokens
  (a vocabulary of 256). The first ``config.TRAIN_SEQUENCES`` train, the next
  ``HELD_OUT_SEQUENCES`` (later files) are held out. Every machine with Python has it; which Python's library it was
  is in the record (``source``, ``sha256``).

Each rank reads its share through a ``DistributedSampler`` over the data-parallel ranks
(shuffled from the cell's seed, reshuffled each epoch by ``set_epoch``, ``drop_last``) and a
``DataLoader`` with ``LOADER_WORKERS`` worker processes. Over an epoch the ranks' samplers
partition the training set, and the samples all ranks take in optimizer step t are the ones
the one-process reference takes in its step t: positions [t·B, (t+1)·B) of the epoch's
permutation, B the global batch (rank r's k-th sample is position k·W + r), however the step
is cut into micro-steps (tests/test_data.py checks both). The batches are drawn before the
first step, as the synthetic ones are, so no step is timed with the loader's work in it.

The held-out sequences are evaluated whole on every rank (every strategy's forward needs all
of its ranks), in batches of ``EVAL_BATCH``: the held-out loss is the mean over all of them.
"""

from __future__ import annotations

import hashlib
import sysconfig
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from harness.config import TRAIN_SEQUENCES

HELD_OUT_SEQUENCES = 96
LOADER_WORKERS = 2
EVAL_BATCH = 32


@cache
def stdlib_corpus() -> tuple[bytes, str]:
    """The standard library's top-level modules, concatenated in name order, and where they are."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    return b"".join(path.read_bytes() for path in sorted(folder.glob("*.py"))), str(folder)


class ByteSequences(Dataset):
    """Fixed-length byte sequences as a causal LM's samples (HF shifts the labels itself)."""

    def __init__(self, sequences: torch.Tensor):
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.sequences[index].long()
        return {"input_ids": ids, "labels": ids}


@cache
def splits(seq_len: int) -> tuple[ByteSequences, ByteSequences, dict[str, Any]]:
    """The training and held-out sets of ``stdlib_bytes`` at ``seq_len``, and what they are
    (made once a process: a cell reads them for its batches, its held-out set and its record)."""
    corpus, source = stdlib_corpus()
    train = TRAIN_SEQUENCES["stdlib_bytes"]
    n = train + HELD_OUT_SEQUENCES
    used = corpus[:n * seq_len]
    if len(used) < n * seq_len:
        raise ValueError(f"data=stdlib_bytes: the standard library at {source} has {len(corpus):,} bytes, fewer than"
                         f" {n} sequences of {seq_len}")
    sequences = torch.frombuffer(bytearray(used), dtype=torch.uint8).view(n, seq_len)
    info = {"name": "stdlib_bytes", "source": source, "sha256": hashlib.sha256(used).hexdigest(),
            "seq_len": seq_len, "train_sequences": train, "held_out_sequences": HELD_OUT_SEQUENCES,
            "loader_workers": LOADER_WORKERS}
    return ByteSequences(sequences[:train]), ByteSequences(sequences[train:]), info


def sampler_batches(dataset: Dataset, batch_size: int, batches: int, replicas: int, rank: int, seed: int,
                    workers: int = LOADER_WORKERS) -> list[dict[str, torch.Tensor]]:
    """This rank's next ``batches`` batches through a DistributedSampler and a DataLoader,
    epoch after epoch (``set_epoch`` at each)."""
    sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=True,
                                                     seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, num_workers=workers,
                        persistent_workers=workers > 0)
    out: list[dict[str, torch.Tensor]] = []
    epoch = 0
    while len(out) < batches:
        sampler.set_epoch(epoch)
        for batch in loader:
            out.append(batch)
            if len(out) == batches:
                break
        epoch += 1
    return out


def eval_batches(dataset: Dataset) -> list[dict[str, torch.Tensor]]:
    """The whole held-out set, in order, in batches of EVAL_BATCH (no workers: read once)."""
    return list(DataLoader(dataset, batch_size=EVAL_BATCH, shuffle=False))
