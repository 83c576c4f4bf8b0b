"""Real data for cells that train on it (``CellSpec.data``), read the way training jobs read
theirs: a ``DistributedSampler`` and a ``DataLoader`` with worker processes on every rank.

- ``synthetic`` (the default): random tokens drawn up front from the cell's seed
  (harness/training.py ``local_batches``); what every measurement suite trains on.
- ``stdlib_bytes``: the Python standard library's own top-level modules (``Lib/*.py``, in name
  order) as one byte string, cut into sequences of the model's length; bytes are the tokens
  (a vocabulary of 256). The first ``config.TRAIN_SAMPLES`` train, the next
  ``HELD_OUT_SEQUENCES`` (later files) are held out. Every machine with Python has it; which
  Python's library it was is in the record (``source``, ``sha256``).
- ``digits``: scikit-learn's bundled handwritten digits (``load_digits``: 1,797 8×8 grayscale
  images, 0-16 scaled to [0, 1], ten classes), in the file's order: the first
  ``config.TRAIN_SAMPLES`` train, the rest (later writers) are held out.

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

from harness.config import TRAIN_SAMPLES

HELD_OUT_SEQUENCES = 96
DIGITS_MAX_VALUE = 16.0  # load_digits' pixels count 0-16 set cells of a 4×4 block
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


class Images(Dataset):
    """Images and their class labels as an image classifier's samples."""

    def __init__(self, pixel_values: torch.Tensor, labels: torch.Tensor):
        self.pixel_values, self.labels = pixel_values, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.pixel_values[index], "labels": self.labels[index]}


def splits(source: str, seq_len: int | None) -> tuple[Dataset, Dataset, dict[str, Any]]:
    """The training and held-out sets of ``source`` (``seq_len``: a text source's sequence
    length), and what they are (the record's ``evaluation.data``)."""
    if source == "stdlib_bytes":
        if seq_len is None:
            raise ValueError("data=stdlib_bytes: cut into sequences of the model's seq_len; the model has none")
        return _stdlib_splits(seq_len)
    if source == "digits":
        return _digits_splits()
    raise ValueError(f"data={source!r}: no such real data (stdlib_bytes, digits)")


# Made once a process: a cell reads them for its batches, its held-out set and its record.
@cache
def _stdlib_splits(seq_len: int) -> tuple[ByteSequences, ByteSequences, dict[str, Any]]:
    corpus, source = stdlib_corpus()
    train = TRAIN_SAMPLES["stdlib_bytes"]
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


@cache
def _digits_splits() -> tuple[Images, Images, dict[str, Any]]:
    # Imported here: scikit-learn (and SciPy under it) is only read by cells on the digits.
    import sklearn
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / DIGITS_MAX_VALUE
    labels = torch.tensor(digits.target, dtype=torch.long)
    train = TRAIN_SAMPLES["digits"]
    info = {"name": "digits", "source": f"sklearn.datasets.load_digits (scikit-learn {sklearn.__version__})",
            "sha256": hashlib.sha256(pixels.numpy().tobytes() + labels.numpy().tobytes()).hexdigest(),
            "image_size": pixels.shape[-1], "train_samples": train, "held_out_samples": len(labels) - train,
            "loader_workers": LOADER_WORKERS}
    return (Images(pixels[:train], labels[:train]), Images(pixels[train:], labels[train:]), info)


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
