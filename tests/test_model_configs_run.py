"""Architectures beyond the built-in families, from config files written here, trained for
real on 2 gloo ranks (one of each kind: ``RUN``): each through fsdp_full (which shards by
the blocks the harness finds in it; DDP wraps any model whole, and runs on configs in the
default suite), a decoder and an encoder through deepspeed_zero3, a LLaMA-like decoder
with tied embeddings through tp and a pipeline, and Qwen3 (query and key norms a head) through
tp with sequence parallelism and the vocabulary-parallel loss, gated against its
single-process reference, with the analytic and traced predictions recorded beside the
measurement."""

import pytest

import model_configs  # tests/ is on sys.path (rootdir conftest, prepend import mode)
from harness.config import CellSpec, StrategySpec
from harness.models import sources

DATA_PARALLEL = ("fsdp_full",)
# DeepSpeed ZeRO-3 on a decoder and an encoder: its partitioning does not depend on the layout
# beyond that (the default suite runs it on LLaMA and GPT-2), and each of its cells costs an
# engine's start-up.
DEEPSPEED_ON = ("gpt_neox", "roberta")
LAYOUT_STRATEGIES = ("tp", "pp_gpipe")
# On the LLaMA-like config with tied embeddings, the harder case for both (the head shares the
# embedding's weight across a split): untied, the layout is the llama-tiny preset's, which the
# default suite and tests/test_tensor_parallel.py run through them.
LAYOUT_ON = ("qwen2",)
# Qwen3's query and key norms, one head's channels each, split with the heads; with torchtitan's
# plan options (the sequence and the vocabulary split too).
PLAN_OPTIONS_ON = ("qwen3",)
SEQ_LEN = 16  # short: the point is that each architecture trains the same model, not its speed


# Run here: a LLaMA-like decoder with tied embeddings, another decoder, an encoder and a vision
# model; OPT and Phi, decoders like GPT-NeoX to the data-parallel strategies, and Mistral, a
# LLaMA with its own head as the llama-tiny preset is (tests/test_runs.py runs that one through
# fsdp_full), are resolved and built in test_model_sources.py.
RUN = ("qwen2", "gpt_neox", "roberta", "deit", *PLAN_OPTIONS_ON)


def TRACED_MATRIX_CELLS(tmp_path) -> list[CellSpec]:
    """The cells tests/conftest.py's shared_traced_matrix runs for this module, their config
    files written under ``tmp_path`` (a function, not a list, for that reason)."""
    cells = []
    for name in RUN:
        model = sources.resolve(str(model_configs.write(tmp_path / "configs", name)))
        seq_len = SEQ_LEN if model.seq_len is not None else None
        if name in PLAN_OPTIONS_ON:
            cells.append(CellSpec(model=model, strategy=StrategySpec(name="tp", sequence_parallel=True,
                                                                     loss_parallel=True), seq_len=seq_len, steps=6))
            continue
        names = (DATA_PARALLEL + (("deepspeed_zero3",) if name in DEEPSPEED_ON else ())
                 + (LAYOUT_STRATEGIES if name in LAYOUT_ON else ()))
        cells += [CellSpec(model=model, strategy=StrategySpec(name=s), seq_len=seq_len, steps=6) for s in names]
    return cells


@pytest.fixture(scope="module")
def records(shared_traced_matrix, tmp_path_factory):
    # The same cells again: a config's model is named by its content, not by its file's path.
    return TRACED_MATRIX_CELLS(tmp_path_factory.mktemp("configs")), shared_traced_matrix.records


def test_every_architecture_trains_the_reference_model_under_every_strategy(records):
    cells, by_id = records
    assert len({c.model_name for c in cells}) == len(RUN)
    for cell in cells:
        record = by_id[cell.cell_id]
        assert record["status"] == "ok", (cell.cell_id, record["reason"])
        assert record["equivalence"]["passed"], (cell.cell_id, record["equivalence"])
        assert record["cell"]["model"]["hf"]["config"]["model_type"] == cell.model_spec.hf.model_type


def test_both_predictions_are_recorded_beside_each_measurement(records):
    cells, by_id = records
    for cell in cells:
        predicted = by_id[cell.cell_id]["predicted"]
        assert predicted["analytic"].get("peak_bytes", 0) > 0, (cell.cell_id, predicted["analytic"])
        # The pipelines too: rank 0 answers its stages' neighbours' shape metadata (traced.py).
        assert predicted["traced"].get("peak_bytes", 0) > 0, (cell.cell_id, predicted["traced"])
