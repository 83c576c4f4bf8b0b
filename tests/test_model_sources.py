"""Models as data: a transformers config.json resolved into a cell's model (harness/models/
sources.py), its layout recognised from its modules, sequence length as a cell option."""

import dataclasses
import json
from typing import get_args

import pytest
import torch

import model_configs  # tests/ is on sys.path (rootdir conftest, prepend import mode)
from harness import models, strategies, suite_files
from harness.config import CellSpec, StrategySpec
from harness.models import layouts, sources
from harness.models.spec import Family
from harness.predict import analytic, plan, traced
from model_configs import CONFIGS, LAYOUTS, LLAMA_LIKE, OWN_HEAD_WIDTH, TASKS


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")
    return {name: sources.resolve(str(model_configs.write(folder, name))) for name in CONFIGS}


def test_six_architectures_beyond_the_built_in_families_are_tested():
    assert len(CONFIGS) >= 6 and len(LLAMA_LIKE) >= 2
    assert not {c["model_type"] for c in CONFIGS.values()} & set(get_args(Family))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_config_resolves_to_its_sizes_layout_and_task_and_trains(resolved, name):
    spec = resolved[name]
    config = CONFIGS[name]
    assert spec.family == "hf_config" and spec.hf.model_type == config["model_type"]
    assert spec.layout == LAYOUTS[name] and spec.task == TASKS.get(name, "causal_lm")
    assert (spec.n_layers, spec.hidden, spec.n_heads) == (2, 64, 4)
    built = models.build(spec)
    # The repeated block is found in the model: the config's own decoder (or encoder) layer class.
    assert built.block_type.__name__.endswith(("DecoderLayer", "Layer")) and built.block_type.__module__.startswith(
        "transformers.models.")
    assert built.n_params == models.analytic_n_params(spec) == models.param_layout(spec).numel
    batch = built.make_batch(torch.Generator().manual_seed(0), 2)
    loss = built.loss(built.module, batch)
    assert torch.isfinite(loss) and loss.item() > 0
    # Nothing draws from an RNG in the forward: the same batch gives the same loss (dropout,
    # layer drop and stochastic depth are off).
    assert built.loss(built.module, batch).item() == loss.item()
    assert not [k for k, v in spec.hf.config.items() if "drop" in k and isinstance(v, float) and v]


def test_the_cell_id_is_short_and_the_record_rebuilds_the_model(resolved):
    spec = resolved["mistral"]
    cell = CellSpec(model=spec, strategy=StrategySpec(name="ddp"), seq_len=32)
    assert cell.cell_id.startswith(f"mistral-{spec.name.split('-')[1]}-") and "/seq32/" in cell.cell_id
    assert len(cell.cell_id.split("/")[0]) <= len("mistral-140k-abcdef")
    record = json.loads(json.dumps(cell.to_dict()))
    assert record["model"]["hf"]["config"]["num_key_value_heads"] == 2  # the whole config, as JSON
    again = CellSpec.from_dict(record)
    assert again == cell and again.cell_id == cell.cell_id


def test_the_same_config_from_another_file_is_the_same_model_and_an_override_is_another(resolved, tmp_path):
    copy = sources.resolve(str(model_configs.write(tmp_path, "mistral")))
    assert copy.name == resolved["mistral"].name
    deeper = sources.resolve({"config": str(model_configs.write(tmp_path, "mistral")), "num_hidden_layers": 4})
    assert deeper.n_layers == 4 and deeper.name != copy.name and deeper.hf.config["num_hidden_layers"] == 4
    # What a plan traces of a real model (predict/plan_work.py): the same config at another depth.
    assert sources.at_depth(copy, 4) == deeper


def test_a_factorys_model_keeps_the_depth_its_code_gives_it():
    with pytest.raises(ValueError, match="a factory's model has the depth its code gives it"):
        sources.at_depth(sources.resolve("factory_model:classifier"), 1)


@pytest.mark.parametrize("change, message", [
    ({"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}, "shardbench runs no remote code"),
    ({"model_type": "not_a_model"}, "model_type='not_a_model' is not one this transformers knows"),
    ({"architectures": ["MistralForTokenClassification"]}, "is not a causal LM, masked LM or image classifier"),
    # An encoder-decoder with no architectures entry: one line, not AutoModelForCausalLM's list.
    ({"model_type": "t5", "architectures": None}, r"no causal_lm class for model_type='t5', which a config naming no"),
    # transformers takes the config but its model's code cannot be built from it: one line too.
    ({"pad_token_id": 1000}, "transformers cannot build its model from it: AssertionError: Padding_idx must be within"),
    ({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}, "vision_config": {}},
     r"a composite config \(text_config beside vision_config\).* \(model_type 'gemma3_text'\)$"),
])
def test_a_config_that_cannot_be_built_here_is_refused_with_the_reason(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        sources.resolve(str(model_configs.write(tmp_path, "mistral", **change)))


def test_an_override_of_a_key_the_config_lacks_is_refused(tmp_path):
    path = str(model_configs.write(tmp_path, "mistral"))
    with pytest.raises(ValueError, match="num_layers are not keys of the config"):
        sources.resolve({"config": path, "num_layers": 4})
    with pytest.raises(ValueError, match=r"unknown model 'gpt2-huge': not a preset"):
        sources.resolve("gpt2-huge")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layout_strategies_take_recognised_layouts_and_refuse_the_rest_before_launch(resolved, name):
    spec = resolved[name]
    for strategy in ("tp", "pp_gpipe", "megatron"):
        options = {"attention": "eager"} if strategy == "megatron" else {}
        cell = CellSpec(model=spec, strategy=StrategySpec(name=strategy), **options)
        problem = strategies.incompatibility(cell)
        if strategy == "megatron" and name in OWN_HEAD_WIDTH:
            assert problem is not None and "kv_channels" in problem
        elif strategy == "tp" and models.param_layout(spec).qk_norm and not models.param_layout(spec).qk_norms_per_head:
            assert problem is not None and "query and key norms are not one norm each" in problem  # OLMo2's
        elif LAYOUTS[name] == "llama":
            assert problem is None, problem
        else:
            assert problem is not None and "layout" in problem
    for strategy in ("ddp", "fsdp_full", "deepspeed_zero3", "zero1"):
        for checkpointing in ("none", "full"):
            cell = CellSpec(model=spec, strategy=StrategySpec(name=strategy, checkpointing=checkpointing))
            assert strategies.incompatibility(cell) is None
            assert "peak_bytes" in analytic.predict(cell)


def test_a_configs_own_head_width_and_query_key_norms_are_read_from_it(resolved):
    # Qwen3's heads are 32 wide at hidden 64 and 4 heads, and it normalises each head's queries
    # and keys (the analytic peak with both against the trace: the decoder kinds below).
    spec = resolved["qwen3"]
    assert spec.head_dim == 32 and models.param_layout(spec).qk_norm


def test_a_config_whose_class_has_no_sdpa_attention_is_refused_sdpa_and_planned_eager(tmp_path):
    # Gemma2's class computes attention without torch's SDPA (its soft-capped scores):
    # transformers refuses attn_implementation="sdpa" for it.
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], **model_configs._TEXT,
                                "intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16,
                                "max_position_embeddings": 64, "sliding_window": 32, "query_pre_attn_scalar": 16}))
    spec = sources.resolve(str(path))
    assert (spec.hf.model_class, spec.hf.sdpa) == ("Gemma2ForCausalLM", False)
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM computes attention without .* set attention = 'eager'"):
        CellSpec(model=spec, strategy=StrategySpec(name="ddp"))
    eager = CellSpec(model=spec, strategy=StrategySpec(name="ddp"), attention="eager")
    assert "peak_bytes" in analytic.predict(eager)
    # Its first block alone, as `plan --calibration` traces it: its layer_types cut to match.
    assert sources.at_depth(spec, 1).n_layers == 1
    built = models.build(spec, attention="eager")
    assert torch.isfinite(built.loss(built.module, built.make_batch(torch.Generator().manual_seed(0), 2)))
    # plan takes the model's own attention and says why; --attention sdpa is refused up front.
    result = plan.plan(plan.PlanRequest(model=spec, gpus=2, gpu_mem_bytes=2**30))
    assert result["recommended"]["cell"].attention == "eager"
    assert "eager attention (transformers' Gemma2ForCausalLM has no SDPA attention)" in plan.as_table(result, False)
    with pytest.raises(ValueError, match=r"--attention sdpa: .* plan it with --attention eager"):
        plan.PlanRequest(model=spec, gpus=2, gpu_mem_bytes=2**30, attention="sdpa")


def test_flash_attention_is_planned_for_the_gpu_nodes_and_refused_where_the_class_has_none(tmp_path):
    """plan prices GPU nodes, whose flash-attn this host cannot see: a class with a
    flash_attention_2 implementation is planned with it (the header says the package is
    needed there); Bloom's has none, and the cell and --attention flash are refused."""
    mistral = sources.resolve(str(model_configs.write(tmp_path, "mistral")))
    assert mistral.hf.flash
    result = plan.plan(plan.PlanRequest(model=mistral, gpus=8, gpu_mem_bytes=80 * 2**30, attention="flash"))
    assert result["rows"] and all(r["cell"].attention == "flash" for r in result["rows"])
    assert "flash attention (flash-attn's kernels: the package installed on every node)" in plan.as_table(result, False)
    bloom = tmp_path / "bloom.json"
    bloom.write_text(json.dumps({"model_type": "bloom", **model_configs._TEXT, **model_configs.UNCHECKED["bloom"]}))
    spec = sources.resolve(str(bloom))
    assert not spec.hf.flash
    with pytest.raises(ValueError, match="BloomForCausalLM has no flash_attention_2 implementation; set attention"):
        CellSpec(model=spec, strategy=StrategySpec(name="ddp", precision="bf16"), attention="flash")
    with pytest.raises(ValueError, match="--attention flash: transformers' BloomForCausalLM has no flash_attention_2"):
        plan.PlanRequest(model=spec, gpus=8, gpu_mem_bytes=80 * 2**30, attention="flash")


def test_a_qwen_moe_config_names_its_experts_and_their_width_its_own_way(tmp_path):
    # Qwen3-MoE (and OLMoE) count experts as num_experts and size them by
    # moe_intermediate_size, where Mixtral has num_local_experts and intermediate_size.
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                                **model_configs._TEXT, "intermediate_size": 128, "moe_intermediate_size": 32,
                                "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                                "num_experts_per_tok": 2, "max_position_embeddings": 64}))
    spec = sources.resolve(str(path))
    assert (spec.layout, spec.n_experts, spec.top_k, spec.ffn) == ("mixtral", 4, 2, 32)
    cell = CellSpec(model=spec, strategy=StrategySpec(name="single"), world_size=1, micro_batch=4)
    assert analytic.predict(cell, device_type="cpu")["peak_bytes"] == pytest.approx(
        traced.trace(cell)["peak_bytes"], rel=0.02)


def test_a_configs_mixture_of_experts_counts_in_its_flops_the_experts_a_token_is_routed_to(tmp_path):
    # Mixtral-8x7B as a config.json: the preset's FLOPs, 12.9B of its 46.7B parameters active
    # (counted on the built model, not by the preset's formula).
    path = tmp_path / "mixtral.json"
    preset = models.get_preset("mixtral-8x7b")
    path.write_text(json.dumps({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                                "hidden_size": preset.hidden, "num_hidden_layers": preset.n_layers,
                                "num_attention_heads": preset.n_heads, "num_key_value_heads": preset.n_kv_heads,
                                "intermediate_size": preset.ffn, "vocab_size": preset.vocab_size,
                                "num_local_experts": preset.n_experts, "num_experts_per_tok": preset.top_k,
                                "max_position_embeddings": 32768}))
    spec = dataclasses.replace(sources.resolve(str(path)), seq_len=preset.seq_len)
    assert models.flops_per_sample(spec) == models.flops_per_sample(preset)
    # DeepSeek's dense first block and shared expert pass every token: of the second block's
    # four routed experts (gate_up 4×64×64, down 4×64×32) two are idle for each token.
    path = tmp_path / "deepseek.json"
    path.write_text(json.dumps({"model_type": "deepseek_v3", **model_configs._DECODER,
                                **model_configs.PREDICTED_TEXT_MODELS["deepseek_v3"]}))
    count = models.hf_config.count_params(sources.resolve(str(path)))
    assert count.inactive == (4 * 64 * 64 + 4 * 64 * 32) * (4 - 2) // 4


def test_a_configs_heads_are_read_as_its_model_builds_them(tmp_path):
    # Falcon-7B's multi-query attention: one key/value head, whatever num_kv_heads says; Bloom
    # names its heads n_head, num_attention_heads being an alias of its attribute_map.
    falcon = tmp_path / "falcon.json"
    falcon.write_text(json.dumps({"model_type": "falcon", **model_configs._DECODER, "multi_query": True,
                                  "new_decoder_architecture": False, "num_kv_heads": 2}))
    bloom = tmp_path / "bloom.json"
    bloom.write_text(json.dumps({"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4,
                                 "vocab_size": 512}))
    assert [(spec.n_heads, spec.kv_heads) for spec in map(sources.resolve, (str(falcon), str(bloom)))] == [(4, 1),
                                                                                                           (4, 4)]


def test_a_blocks_sliding_window_is_read_as_transformers_builds_it(tmp_path):
    # Mistral's on every block; Gemma3's on the blocks its layer_types calls sliding (five in
    # six); none for Qwen2 unless use_sliding_window, nor for a key LLaMA's class does not define.
    def windows(model_type: str, **own: object) -> tuple:
        path = tmp_path / f"{model_type}-{len(own)}.json"
        path.write_text(json.dumps({"model_type": model_type, **model_configs._DECODER, "num_hidden_layers": 6,
                                    **own}))
        return sources.attention_windows(sources.resolve(str(path)))

    assert windows("mistral", sliding_window=64) == (64,) * 6
    assert windows("gemma3_text", sliding_window=64, head_dim=16) == (64,) * 5 + (None,)
    assert windows("qwen2", sliding_window=64) == (None,) * 6
    assert windows("llama", sliding_window=64) == (None,) * 6


def test_deepseeks_blocks_and_latent_attention_are_read_from_the_built_model(tmp_path):
    # A dense first block (intermediate_size wide), then experts with a shared one
    # (n_shared_experts × moe_intermediate_size); the latent attention's projections' widths.
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "deepseek_v3", **model_configs._DECODER,
                                **model_configs.PREDICTED_TEXT_MODELS["deepseek_v3"]}))
    spec = sources.resolve(str(path))
    layout = models.param_layout(spec)
    assert (spec.layout, layout.expert_blocks, layout.dense_ffn, layout.shared_expert_width) == (None, (False, True),
                                                                                                 128, 32)
    assert not layout.shared_expert_gated and layout.input_linears == (2, 2)
    # Two RMSNorms, the latents' norms being the attention's: each keeps an fp32 copy of its
    # input and the normalised value (8 bytes an element, 6 from a 16-bit input) and each
    # token's reciprocal root (4 bytes a token of 64 channels).
    assert [(norm.fp32, norm.half) for norm in layout.block_norms] == [(8 + 4 / 64, 6 + 4 / 64)] * 2
    heads = spec.n_heads
    assert layout.latent_attention == models.built.LatentAttention(q_rank=32, kv_latent=16 + 8, rope=8,
                                                                   kv_up=heads * (16 + 16), query=heads * (16 + 8),
                                                                   value=heads * 16)
    # The experts' 3-D weights, saved transposed for the grouped matmul (gate_up, down).
    assert sorted(layout.shapes[p] for p in layout.saved_as_views) == [(4, 64, 32), (4, 64, 64)]


def test_experts_stored_transposed_are_saved_without_a_view(tmp_path):
    """gpt-oss keeps its experts' weights as (experts, in, out): the grouped matmul takes them
    as they are, and what it saves is the parameter itself, which DeepSpeed's release frees."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt_oss", **model_configs._DECODER,
                                **model_configs.PREDICTED_TEXT_MODELS["gpt_oss"]}))
    layout = models.param_layout(sources.resolve(str(path)))
    assert any(layout.expert_blocks) and layout.saved_as_views == frozenset()


def test_a_config_that_states_its_head_width_need_not_divide_hidden_by_heads(tmp_path):
    """GLM-4.5-Air: 96 heads of 128 on a 4096-wide stream (here 6 of 16 on 64)."""
    path = model_configs.write(tmp_path, "glm4_moe", num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    spec = sources.resolve(str(path))
    assert (spec.hidden, spec.n_heads, spec.head_dim) == (64, 6, 16)
    cell = CellSpec(model=spec, strategy=StrategySpec(name="fsdp_full", precision="bf16"), seq_len=16)
    assert analytic.predict(cell)["peak_bytes"] > 0


def test_the_model_types_plan_calls_checked_are_the_ones_tested_here():
    assert set(model_configs.PREDICTED_TEXT_MODELS) == analytic.HELD_AGAINST_TRACE


def test_plan_says_when_a_configs_model_type_was_never_held_against_a_trace(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "bloom", **model_configs._DECODER, **model_configs.UNCHECKED["bloom"]}))
    result = plan.plan(plan.PlanRequest(model=sources.resolve(str(path)), gpus=2, gpu_mem_bytes=2**30))
    assert ("has not been held against a trace for model_type bloom: --traced traces"
            in plan.as_table(result, False).splitlines()[0])
    preset = plan.plan(plan.PlanRequest(model="llama-1b", gpus=2, gpu_mem_bytes=80 * 2**30))
    assert "held against a trace" not in plan.as_table(preset, False)
    # Falcon is held, but not with ALiBi (Falcon-RW), whose float mask is heads times larger.
    falcon = {"model_type": "falcon", **model_configs._DECODER, **model_configs.PREDICTED_TEXT_MODELS["falcon"]}
    for alibi, held in ((False, True), (True, False)):
        path = tmp_path / f"falcon-alibi-{alibi}.json"
        path.write_text(json.dumps({**falcon, "alibi": alibi}))
        assert (analytic.unheld(sources.resolve(str(path))) is None) == held


def test_the_analytic_peak_of_each_kind_of_text_model_is_its_traced_one(tmp_path):
    """What sets a model's activations apart (its head width, its norms, a gated MLP,
    soft-capping, experts, a fused QKV projection, a masked LM's head), read from its config
    and its built block: the analytic peak within
    5 % of the traced one, fp32 and bf16, with the attention the test's config asks for
    (``attn_implementation``, else the class's SDPA where it has one). Traced by trace_cells, a
    process per core, each fresh: each builds its models on the meta device inside the fake
    mode first (Gemma's embedding scale, a tensor its __init__ makes, must not come out a meta
    tensor there: models/common.py, on_meta)."""
    cells = []
    for model_type, own in model_configs.PREDICTED_TEXT_MODELS.items():
        config = {"model_type": model_type, **model_configs._DECODER, **own}
        attention = config.pop("attn_implementation", None)
        path = tmp_path / model_type / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(config))
        spec = sources.resolve(str(path))
        cells += [CellSpec(model=spec, strategy=StrategySpec(name="single", precision=precision), world_size=1,
                           micro_batch=4, attention=attention or ("sdpa" if spec.hf.sdpa else "eager"))
                  for precision in ("fp32", "bf16")]
    traced_peaks = traced.trace_cells(cells)
    ratios = {cell.cell_id: analytic.predict(cell, device_type="cpu")["peak_bytes"]
              / traced_peaks[cell.cell_id]["peak_bytes"] for cell in cells}
    print("\n".join(f"{ratio:.3f} {cell_id}" for cell_id, ratio in ratios.items()))  # with -s
    assert {cell_id: ratio for cell_id, ratio in ratios.items() if abs(ratio - 1) > 0.05} == {}


def test_a_masked_lm_cast_to_bf16_by_its_engine_keeps_its_logits_in_bf16(tmp_path):
    """RoBERTa's loss takes the logits as the model computed them (transformers upcasts a
    causal LM's only): in bf16 where FSDP's mixed precision or DeepSpeed casts the model, so
    they and the loss's gradients are half the causal LM's fp32 (1.31 and 1.28 of the traced
    peak while counted in fp32; 0.97-1.00 at RoBERTa-large's size, 512 tokens on 8 GPUs)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "roberta", **model_configs._DECODER,
                                **model_configs.PREDICTED_TEXT_MODELS["roberta"]}))
    spec = sources.resolve(str(path))
    cells = [CellSpec(model=spec, strategy=StrategySpec(name=name, precision="bf16"), world_size=8, micro_batch=1)
             for name in ("fsdp_full", "deepspeed_zero3")]
    traced_peaks = traced.trace_cells(cells, kernels="cuda")
    for cell in cells:
        ratio = analytic.predict(cell)["peak_bytes"] / traced_peaks[cell.cell_id]["peak_bytes"]
        assert ratio == pytest.approx(1, abs=0.05), (cell.cell_id, ratio)


def test_what_a_norm_keeps_is_measured_whatever_the_caller_runs_under_and_whatever_it_takes(tmp_path):
    """The block's norms are run on the meta device: with gradients on and outside a traced
    step's fake mode, whichever asks for the layout first; one whose forward takes more than its
    input (Qwen3-Next's gated RMSNorm) is counted by its class name; the attention's own
    per-head norms (StableLM's list of LayerNorms) are not the block's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    probed = models.param_layout.__wrapped__  # uncached
    llama = models.get_preset("llama-tiny")
    with torch.no_grad(), FakeTensorMode():
        assert probed(llama).block_norms == models.param_layout(llama).block_norms
    assert models.param_layout(llama).block_norms[0] == models.NormKeeps(fp32=8 + 4 / 64, half=6 + 4 / 64)
    stablelm = tmp_path / "stablelm.json"
    stablelm.write_text(json.dumps({"model_type": "stablelm", **model_configs._DECODER,
                                    **model_configs.PREDICTED_TEXT_MODELS["stablelm"], "qk_layernorm": True}))
    assert len(models.param_layout(sources.resolve(str(stablelm))).block_norms) == 2
    path = tmp_path / "qwen3_next.json"
    path.write_text(json.dumps({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                                **model_configs._DECODER, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                                "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                                "linear_value_head_dim": 16, "full_attention_interval": 2}))
    assert models.param_layout(sources.resolve(str(path))).block_norms[0] == models.NormKeeps(fp32=8.0, half=6.0)


def test_every_preset_is_built_with_the_layout_it_declares():
    for name, spec in models.PRESETS.items():
        if spec.n_layers * spec.hidden > 64 * 64:
            continue  # the real sizes are built on the meta device below
        assert layouts.recognise(models.build(spec).module) == spec.layout, name
    with torch.device("meta"):
        assert layouts.recognise(models.built._FAMILIES["llama"].build_module(models.PRESETS["llama3-8b"])) == "llama"


def test_seq_len_is_a_cell_option_the_model_and_predictions_follow():
    short = CellSpec(model="gpt2-124m", strategy=StrategySpec(name="ddp"), seq_len=256)
    assert short.model_spec.seq_len == 256 and short.cell_id.endswith("/seq256/mb2/ws2/seed0")
    own = CellSpec(model="gpt2-124m", strategy=StrategySpec(name="ddp"), seq_len=1024)
    assert own.seq_len is None and "seq" not in own.cell_id  # the preset's own length: the same cell
    long_acts = analytic.predict(own)["activation_bytes"]["layers"]
    assert analytic.predict(short)["activation_bytes"]["layers"] < long_acts / 3
    with pytest.raises(ValueError, match="seq_len=8: applies to text models; vit-tiny"):
        CellSpec(model="vit-tiny", strategy=StrategySpec(name="ddp"), seq_len=8)


def test_a_config_longer_than_its_position_table_is_refused(resolved):
    with pytest.raises(ValueError, match="takes at most 64 tokens"):
        CellSpec(model=resolved["mistral"], strategy=StrategySpec(name="ddp"), seq_len=128)


def test_a_suite_file_names_a_config_beside_it_and_overrides_its_keys(tmp_path):
    model_configs.write(tmp_path, "qwen2")
    suite = tmp_path / "mine.toml"
    suite.write_text('[defaults]\nseq_len = 32\n[[cells]]\nmodel = "qwen2/config.json"\nstrategy = ["single", "ddp"]\n'
                     '[[cells]]\nmodel = { config = "qwen2/config.json", num_hidden_layers = 4 }\nstrategy = "ddp"\n')
    cells = suite_files.cells(suite, world_size=2)
    assert [c.strategy.name for c in cells] == ["single", "ddp", "ddp"]
    assert cells[0].model_name == cells[1].model_name != cells[2].model_name
    assert cells[2].model_spec.n_layers == 4 and all(c.model_spec.seq_len == 32 for c in cells)


def test_a_factory_of_ones_own_is_a_model(tmp_path):
    spec = sources.resolve("factory_model:classifier")
    assert spec.family == "factory" and spec.n_layers == 3 and spec.hidden == 32
    assert spec.name.startswith("classifier-") and spec.layout is None and spec.tokens_per_sample == 1
    built = models.build(spec, seed=3)
    assert built.block_type.__name__ == "Block" and built.n_params == models.analytic_n_params(spec)
    batch = built.make_batch(torch.Generator().manual_seed(0), 4)
    assert built.loss(built.module, batch).item() > 0
    again = models.build(spec, seed=3)  # the seed alone decides the weights
    assert all(torch.equal(a, b) for a, b in zip(built.module.parameters(), again.module.parameters()))
    cell = CellSpec(model=spec, strategy=StrategySpec(name="ddp"))
    assert CellSpec.from_dict(json.loads(json.dumps(cell.to_dict()))) == cell
    assert "family factory: no activation or parameter formula" in analytic.predict(cell)["unavailable"]
    assert strategies.incompatibility(CellSpec(model=spec, strategy=StrategySpec(name="tp"))) is not None
    with pytest.raises(ValueError, match="a factory's, which makes its own batches"):
        CellSpec(model=spec, strategy=StrategySpec(name="ddp"), seq_len=16)


@pytest.mark.parametrize("path, message", [
    ("factory_model:not_a_pair", r"must return \(nn.Module, make_batch"),
    ("factory_model:missing", "has no function missing"),
    ("no_such_package.models:make", "cannot import no_such_package.models"),
])
def test_a_factory_that_breaks_the_contract_is_refused_with_the_reason(path, message):
    with pytest.raises(ValueError, match=message):
        sources.resolve(path)


def test_an_attention_free_config_is_a_model_without_the_attention_axis():
    """Mamba (suites/configs/mamba-tiny.json): no attention heads, so no attention markers or
    option, the marker linear_time, no analytic formula (the trace stands in), and its
    repeated block is the Mamba block."""
    from harness import markers

    spec = sources.config_model("mamba-tiny")
    assert spec.n_heads is None and not spec.has_attention and spec.layout is None
    cell = CellSpec(model=spec, strategy=StrategySpec(name="ddp"), seq_len=32)
    marks = markers.markers_of(cell)
    assert "linear_time" in marks and not [m for m in marks if m.startswith("attn_") or m in ("mha", "gqa", "mqa")]
    assert "attention-free" in analytic.predict(cell, device_type="cpu")["unavailable"]
    with pytest.raises(ValueError, match="has no attention"):
        CellSpec(model=spec, strategy=StrategySpec(name="ddp"), seq_len=32, attention="eager")
    built = models.build(spec)
    assert built.block_type.__name__ == "MambaBlock" and built.attn_implementation is None
    batch = built.make_batch(torch.Generator().manual_seed(0), 2)
    assert torch.isfinite(built.loss(built.module, batch))
