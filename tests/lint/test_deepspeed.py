"""DeepSpeed config rules: lint's verdict must equal what DeepSpeed + HF + accelerate really do.

The expected verdict for every file in tests/ds_corpus/ is produced here, by the real libraries
(when installed): the file goes through the same steps `finetune train` takes

    json.load -> HfTrainerDeepSpeedConfig.trainer_config_process (TrainingArguments fill + mismatches)
    -> accelerate DeepSpeedPlugin (+ set_mixed_precision) -> trainer_config_finalize
    -> accelerate _prepare_deepspeed's fill (deepspeed_config_process) -> DeepSpeedConfig
    -> the engine's optimizer / scheduler construction

for world size 2 and the TrainingArguments of a fixed recipe. `raw_*.json` files go straight to
DeepSpeedConfig(path) (DeepSpeed's own reader, which rejects duplicate keys), as with a plain
`deepspeed.initialize`. Lint must report an error exactly when that pipeline raises, except for the
files in STRICTER, where DeepSpeed/HF accept a real mistake on purpose-built grounds listed there.

The engine steps that need a GPU are the one stand-in: DeepSpeed's fused/CPU optimizer classes cannot
be constructed on CPU, so their real signatures are bound instead (inspect.signature(cls).bind).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from finetune.lint import deepspeed as rules
from finetune.lint.deepspeed import schema as ds_schema
from finetune.lint.deepspeed import DSContext, check_config
from finetune.recipe.yamlio import load_json

CORPUS = Path(__file__).parents[1] / "ds_corpus"
WORLD = 2
HIDDEN = 64  # hidden_size of the stand-in model HF and accelerate read for the bucket-size "auto"s


def _training_args() -> dict:
    from finetune.render import render_training_args
    from finetune.recipe import Recipe

    recipe = Recipe(model={"name_or_path": "org/tiny"}, data={"path": "data.jsonl"},
                    training={"micro_batch_size": 2, "gradient_accumulation_steps": 4, "max_steps": 100})
    return render_training_args(recipe, output_dir="runs/test")


TRAINING_ARGS = _training_args()  # bf16, micro 2, accumulation 4, lr 2e-4, clip 1.0, warmup ratio 0.03

# Files DeepSpeed + HF + accelerate accept although they are mistakes: lint errors on purpose.
STRICTER = {
    "strict_stage_string.json": "DeepSpeed converts \"3\" to stage 3, but HF's is_deepspeed_zero3_enabled() compares "
                                "with the integer 3: no zero.Init, the model loads whole on every GPU",
    "strict_stage_bool.json": "pydantic reads true as stage 1; nobody writes a stage as a boolean on purpose",
    "strict_offload_optimizer_stage0.json": "DeepSpeed builds DeepSpeedCPUAdam for GPU parameters; it fails at the "
                                            "first optimizer step (needs a GPU to reproduce)",
    "strict_offload_param_stage2.json": "offload_param is silently ignored below stage 3",
    "strict_nvme_without_path.json": "NVMe swapping has no directory; it fails when the swapper starts (GPU run)",
    "strict_nvme_path_auto.json": "accelerate fills nvme_path \"auto\" with the string \"none\": a ./none directory",
    "strict_top_level_typo.json": "DeepSpeed ignores unknown top-level keys: `gradient_clippping` does nothing",
    "strict_lenient_section_typo.json": "DeepSpeed reads activation_checkpointing with dict.get: typos are ignored",
    "strict_allgather_odd.json": "the ZeRO-1/2 optimizer asserts an even allgather_bucket_size (GPU run)",
    "strict_prescale_string.json": "DeepSpeed keeps the string \"false\", which is truthy: prescaling turns on",
    "strict_duplicate_key.json": "HF/accelerate read JSON with json.load, which keeps the last duplicate",
    "raw_strict_zero_typo_auto.json": "DeepSpeed drops \"auto\" values before validating: the typo passes",
    "raw_strict_bf16_auto.json": "without HF, \"auto\" is dropped and bf16 silently stays off",
    "raw_strict_stage_auto.json": "without HF, \"auto\" is dropped and the stage silently becomes 0",
}

# The rule each bad/strict corpus file is about (lint may report more, but must report this one).
EXPECT = {
    "bad_fp16_and_bf16.json": "DS120", "bad_batch_arithmetic.json": "DS180", "bad_no_batch_size.json": "DS122",
    "bad_gas_missing_train_auto.json": "DS125", "bad_tensor_parallel_typo.json": "DS103", "bad_micro_string.json": "DS110", "bad_zero_typo.json": "DS103",
    "bad_zero_typo_auto.json": "DS104", "bad_offload_device.json": "DS112", "bad_stage4.json": "DS112",
    "bad_removed_amp.json": "DS102", "bad_removed_mics.json": "DS102", "bad_no_zero_block.json": "DS130",
    "bad_zero_bool.json": "DS110", "bad_fp16_not_object.json": "DS110", "bad_reduce_bucket_zero.json": "DS111",
    "bad_reduce_bucket_string.json": "DS110", "bad_partial_offload_stage2.json": "DS134",
    "bad_compute_grad_norm_stage3.json": "DS135", "bad_allreduce_sum_stage3.json": "DS137",
    "bad_comm_dtype.json": "DS112", "bad_tag_validation.json": "DS112", "bad_deprecated_with_new.json": "DS138",
    "bad_optimizer_type.json": "DS150", "bad_optimizer_max_grad_norm.json": "DS152",
    "bad_optimizer_param_typo.json": "DS151", "bad_optimizer_untested_zero.json": "DS153",
    "bad_optimizer_lowercase_torch.json": "DS150", "bad_scheduler_type.json": "DS160",
    "bad_scheduler_cosine_params.json": "DS161", "bad_scheduler_no_params.json": "DS161",
    "bad_mismatch_lr.json": "DS180", "bad_mismatch_clipping.json": "DS180", "bad_mismatch_micro.json": "DS180",
    "bad_mismatch_bf16_off.json": "DS180", "bad_bf16_string.json": "DS110", "bad_auto_unfilled.json": "DS170",
    "bad_auto_in_list.json": "DS171", "bad_keep_in_fp32_auto.json": "DS170", "bad_offload_pin_auto.json": "DS170",
    "bad_fp16_loss_scale_negative.json": "DS193", "bad_param_dtype_conflict.json": "DS190",
    "bad_hybrid_engine_unknown.json": "DS103", "bad_wall_clock_string.json": "DS110",
    "strict_stage_string.json": "DS115", "strict_stage_bool.json": "DS115",
    "strict_offload_optimizer_stage0.json": "DS131", "strict_offload_param_stage2.json": "DS132",
    "strict_nvme_without_path.json": "DS133", "strict_nvme_path_auto.json": "DS133",
    "strict_top_level_typo.json": "DS105", "strict_lenient_section_typo.json": "DS105",
    "strict_allgather_odd.json": "DS140", "strict_prescale_string.json": "DS110",
    "strict_duplicate_key.json": "DS101", "raw_bad_train_batch_auto.json": "DS175",
    "raw_bad_batch_derived.json": "DS121", "raw_bad_duplicate_key.json": "DS101",
    "raw_strict_zero_typo_auto.json": "DS104", "raw_strict_bf16_auto.json": "DS175",
    "raw_strict_stage_auto.json": "DS175", "bad_cpu_offload_deprecated_client_optimizer.json": "DS156",
}

CORPUS_FILES = sorted(p.name for p in CORPUS.glob("*.json"))


def lint_file(path: Path) -> list:
    raw = path.name.startswith("raw_")
    doc = load_json(path.read_text(), str(path))
    ctx = DSContext(world_size=WORLD, training_args=None if raw else TRAINING_ARGS, hf_integration=not raw,
                    duplicates=list(doc.duplicates))
    return check_config(doc.data, ctx)


# ----------------------------------------------------------------------------------------------
# The oracle: DeepSpeed + transformers + accelerate, the way finetune uses them


class Oracle:
    def __init__(self):
        import deepspeed.comm
        import torch
        from accelerate.utils import DeepSpeedPlugin
        from deepspeed.runtime.config import DeepSpeedConfig
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config
        from transformers.training_args import TrainingArguments

        self.torch, self.comm = torch, deepspeed.comm
        self.DeepSpeedConfig, self.DeepSpeedPlugin = DeepSpeedConfig, DeepSpeedPlugin
        self.HfConfig, self.unset = HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config
        self.get_warmup_steps = TrainingArguments.get_warmup_steps

    @contextlib.contextmanager
    def world(self):
        """DeepSpeedConfig asks deepspeed.comm for rank and world size; there is no process group here."""
        saved = self.comm.get_rank, self.comm.get_world_size
        env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("ACCELERATE_")}
        self.comm.get_rank = lambda *a, **k: 0
        self.comm.get_world_size = lambda *a, **k: WORLD
        try:
            yield
        finally:
            self.comm.get_rank, self.comm.get_world_size = saved
            os.environ.update(env)
            self.unset()

    def args(self) -> types.SimpleNamespace:
        """The TrainingArguments attributes HF's DeepSpeed glue reads (real TrainingArguments refuse bf16 on CPU)."""
        ta = dict(TRAINING_ARGS)
        args = types.SimpleNamespace(world_size=WORLD, fp16_full_eval=False, bf16_full_eval=False,
                                     save_on_each_node=False, **ta)
        args.get_warmup_steps = lambda n: self.get_warmup_steps(args, n)
        return args

    def verdict(self, path: Path) -> str | None:
        """None if the config is accepted, else the first error's text."""
        with self.world():
            try:
                if path.name.startswith("raw_"):
                    config = self.DeepSpeedConfig(str(path))  # DeepSpeed's own reader (hjson, no duplicates)
                    self.engine(config, json.loads(path.read_text()), client_optimizer=False)
                else:
                    self.hf_flow(json.loads(path.read_text()))
            except Exception as exc:  # noqa: BLE001 - any exception is a refusal
                return f"{type(exc).__name__}: {exc}"
        return None

    def hf_flow(self, config: dict) -> None:
        args = self.args()
        # TrainingArguments.__post_init__
        hf = self.HfConfig(copy.deepcopy(config))
        hf.trainer_config_process(args)
        plugin = self.DeepSpeedPlugin(hf_ds_config=hf)
        # Accelerator(...) -> AcceleratorState: mixed precision from TrainingArguments
        plugin.set_mixed_precision("bf16" if args.bf16 else "fp16" if args.fp16 else "no")
        # Trainer.train -> deepspeed_init
        model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=HIDDEN))
        hf.trainer_config_finalize(args, model, args.max_steps)
        cfg = plugin.deepspeed_config
        client_optimizer = "optimizer" not in cfg
        if client_optimizer:  # deepspeed_optim_sched: the Trainer's own optimizer
            cfg["zero_allow_untested_optimizer"] = True
        # accelerator.prepare -> _prepare_deepspeed
        plugin.fill_match("gradient_accumulation_steps", must_match=False,
                          gradient_accumulation_steps=args.gradient_accumulation_steps)
        kwargs = {"gradient_clipping": 1.0, "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
        micro = plugin.get_value("train_micro_batch_size_per_gpu")
        if micro is not None:
            kwargs["train_micro_batch_size_per_gpu"] = micro
            kwargs["train_batch_size"] = micro * plugin.get_value("gradient_accumulation_steps") * WORLD
        buckets = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                   "zero_optimization.stage3_param_persistence_threshold")
        if any(plugin.is_auto(k) for k in buckets):
            kwargs.update(dict(zip(buckets, (HIDDEN * HIDDEN, int(0.9 * HIDDEN * HIDDEN), 10 * HIDDEN))))
        if not client_optimizer:  # DummyOptim
            kwargs.update({"optimizer.params.lr": args.learning_rate, "optimizer.params.weight_decay": args.weight_decay})
        if "scheduler" in cfg:  # DummyScheduler without a callable
            kwargs.update({"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": args.learning_rate,
                           "scheduler.params.warmup_num_steps": 1,
                           "scheduler.params.total_num_steps": math.ceil(args.max_steps / WORLD)})
        plugin.deepspeed_config_process(must_match=False, **kwargs)
        final = copy.deepcopy(plugin.deepspeed_config)
        self.engine(self.DeepSpeedConfig(final), final, client_optimizer)

    def engine(self, ds, cfg: dict, client_optimizer: bool) -> None:
        """deepspeed.initialize after DeepSpeedConfig: _do_sanity_check, optimizer and scheduler construction."""
        from deepspeed.runtime.engine import DeepSpeedEngine

        fake = types.SimpleNamespace(_config=ds, fp16_enabled=lambda: ds.float16_config.enabled,
                                     bfloat16_enabled=lambda: ds.bfloat16_config.enabled)
        DeepSpeedEngine._assert_valid_mixed_precision_config(fake)
        if client_optimizer:
            self.client_optimizer_offload(ds, cfg)
        optimizer = None
        if not client_optimizer and ds.optimizer_name is not None:
            name = ds.optimizer_name
            assert DeepSpeedEngine._is_supported_optimizer(None, name), f"{name} is not a supported DeepSpeed Optimizer"
            if name == "lamb":
                assert ds.float16_config.loss_scale == 0, "DeepSpeed lamb optimizer requires dynamic loss scaling"
            optimizer = self.basic_optimizer(ds)
        if "scheduler" in cfg and ds.scheduler_name is not None:
            self.scheduler(ds)
        return optimizer

    def client_optimizer_offload(self, ds, cfg: dict) -> None:
        """The Trainer's optimizer under optimizer offload: accelerate's swap, then the engine's refusal."""
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero.utils import ZeRORuntimeException

        # Accelerator._prepare_deepspeed swaps in DeepSpeedCPUAdam on exactly this test (inline there,
        # so it is repeated here): the literal offload_optimizer.device, not DeepSpeed's parsed config.
        swapped = cfg["zero_optimization"].get("offload_optimizer", {}).get("device", "none") != "none" \
            and cfg.get("zero_force_ds_cpu_optimizer", True)
        engine = types.SimpleNamespace(_config=ds)
        # DeepSpeedEngine._configure_basic_optimizer's check, with the engine's own predicates
        if DeepSpeedEngine.zero_use_cpu_optimizer(engine) and not swapped \
                and DeepSpeedEngine.zero_force_ds_cpu_optimizer(engine):
            raise ZeRORuntimeException("You are using ZeRO-Offload with a client provided optimizer")

    def basic_optimizer(self, ds):
        """engine._configure_basic_optimizer + _do_optimizer_sanity_check's ZeRO support test."""
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
        from deepspeed.ops.lamb import FusedLamb
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
        from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS, is_zero_supported_optimizer

        torch = self.torch
        params = dict(ds.optimizer_params or {})
        if "max_grad_norm" in params:
            raise ValueError("'max_grad_norm' is not supported as an optimizer parameter")
        offload = ds.zero_config.offload_optimizer is not None and \
            ds.zero_config.offload_optimizer.device in (OffloadDeviceEnum.cpu, OffloadDeviceEnum.nvme)
        weights = [torch.nn.Parameter(torch.zeros(4))]
        name, built, cls = ds.optimizer_name, None, None
        if name in ("adam", "adamw"):
            adam_w_mode = params.pop("adam_w_mode", True)
            torch_adam = params.pop("torch_adam", False)
            fp32_states = params.pop("fp32_optimizer_states", None)
            if torch_adam:
                params.pop("foreach", None)
                built = (torch.optim.AdamW if adam_w_mode or name == "adamw" else torch.optim.Adam)(weights, **params)
            elif offload:
                cls = DeepSpeedCPUAdam
                inspect.signature(cls).bind(weights, **params, adamw_mode=True, fp32_optimizer_states=fp32_states)
            else:
                cls = FusedAdam
                inspect.signature(cls).bind(weights, **params, adam_w_mode=True)
        elif name == "lion":
            cls = DeepSpeedCPULion if offload else FusedLion
            inspect.signature(cls).bind(weights, **params)
        elif name == "adagrad":
            if offload:
                cls = DeepSpeedCPUAdagrad
                inspect.signature(cls).bind(weights, **params)
            else:
                built = torch.optim.Adagrad(weights, **params)
        elif name == "lamb":
            cls = FusedLamb
            inspect.signature(cls).bind(weights, **params)
        elif name in ("muadam", "muadamw", "musgd", "muon"):
            return None
        else:
            built = getattr(torch.optim, name)(weights, **params)
        if ds.zero_enabled:
            supported = is_zero_supported_optimizer(built) if built is not None else cls in ZERO_SUPPORTED_OPTIMIZERS
            assert supported or ds.zero_allow_untested_optimizer, "You are using an untested ZeRO Optimizer"
        return built

    def scheduler(self, ds) -> None:
        """engine._scheduler_from_config, against a real (CPU) torch optimizer."""
        from deepspeed.runtime import lr_schedules

        torch, name = self.torch, ds.scheduler_name
        if hasattr(lr_schedules, name):
            cls = getattr(lr_schedules, name)
        else:
            assert hasattr(torch.optim.lr_scheduler, name), f"DeepSpeed does not recognize LR scheduler {name}"
            cls = getattr(torch.optim.lr_scheduler, name)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=1e-3)
        cls(optimizer, **ds.scheduler_params)


@pytest.fixture(scope="module")
def oracle():
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return Oracle()


# ----------------------------------------------------------------------------------------------
# The corpus


def test_corpus_is_complete():
    assert len(CORPUS_FILES) >= 40
    for name in CORPUS_FILES:
        assert name.split("_")[0] in ("good", "bad", "strict", "raw"), name
        if name.startswith(("bad_", "strict_", "raw_bad_", "raw_strict_")):
            assert name in EXPECT, f"{name}: say which rule it is about"
        assert (name in STRICTER) == ("strict_" in name), name
    assert set(EXPECT) <= set(CORPUS_FILES) and set(STRICTER) <= set(CORPUS_FILES)


@pytest.mark.parametrize("name", CORPUS_FILES)
def test_corpus_verdict_matches_deepspeed(oracle, name):
    path = CORPUS / name
    findings = lint_file(path)
    errors = [f for f in findings if f.severity == "error"]
    refusal = oracle.verdict(path)
    shown = "\n".join(f"  {f.rule} {f.severity} {'.'.join(map(str, f.key))}: {f.message}" for f in findings)
    if name in STRICTER:
        assert refusal is None, f"{name}: listed as lint-stricter, but DeepSpeed/HF refuse it now: {refusal}"
        assert errors, f"{name}: lint must error ({STRICTER[name]})\n{shown}"
    elif refusal is None:
        assert not errors, f"{name}: DeepSpeed/HF accept it, lint errors:\n{shown}"
    else:
        assert errors, f"{name}: DeepSpeed/HF refuse it ({refusal[:300]}), lint finds no error:\n{shown}"
    if name in EXPECT:
        assert EXPECT[name] in {f.rule for f in errors}, f"{name}: expected {EXPECT[name]}\n{shown}"
    if name.startswith(("good_", "raw_good_")):
        assert refusal is None, f"{name} is meant to be good: {refusal}"


def test_shipped_templates_are_clean(oracle):
    """ds_configs/ (generated from recipes) pass the oracle and produce no lint findings at all."""
    shipped = sorted((Path(__file__).parents[2] / "ds_configs").glob("*.json"))
    assert shipped
    for path in shipped:
        doc = load_json(path.read_text(), str(path))
        ctx = DSContext(world_size=WORLD, training_args=TRAINING_ARGS)
        assert check_config(doc.data, ctx) == [], path.name
        assert oracle.verdict(path) is None, path.name  # not raw_*: judged through the HF flow


# ----------------------------------------------------------------------------------------------
# Drift: lint's copy of DeepSpeed's schema against the installed DeepSpeed


def _model_fields(model) -> dict:
    out = {}
    for name, info in model.model_fields.items():
        out[info.alias or name] = info
        if info.alias:
            out[name] = info
    return out


def test_schema_tables_match_deepspeed(oracle):
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.inference.config import WeightQuantConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPConfig, TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                        DeepSpeedZeroOffloadParamConfig)
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    models = {"zero_optimization": DeepSpeedZeroConfig, "offload_param": DeepSpeedZeroOffloadParamConfig,
              "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig, "fp16": DeepSpeedFP16Config,
              "bf16": DeepSpeedBF16Config, "hybrid_engine": HybridEngineConfig, "tensorboard": TensorBoardConfig,
              "wandb": WandbConfig, "csv_monitor": CSVConfig, "comet": CometConfig, "comms_logger": CommsLoggerConfig,
              "compile": CompileConfig, "throughput": DeepSpeedThroughputTimerConfig,
              "tensor_parallel": TPTrainingConfig, "tp": TPConfig, "weight_quantization": WeightQuantConfig}
    for section, model in models.items():
        assert set(ds_schema.SECTIONS[section]) == set(_model_fields(model)), section
        for key, info in _model_fields(model).items():
            extra = info.json_schema_extra or {}
            assert bool(ds_schema.SECTIONS[section][key].deprecated) == bool(extra.get("deprecated")), (section, key)
            for bound in ("gt", "ge", "lt", "le"):
                theirs = [getattr(m, bound) for m in info.metadata if getattr(m, bound, None) is not None]
                assert getattr(ds_schema.SECTIONS[section][key], bound) == (theirs[0] if theirs else None), (section, key)


def test_top_level_keys_match_deepspeed(oracle):
    """Every key DeepSpeedConfig reads is known to lint (traced through a recording dict)."""
    from deepspeed.runtime import config as ds_config

    read: set = set()

    class Recording(dict):
        def get(self, key, default=None):
            read.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            read.add(key)
            return super().__contains__(key)

        def keys(self):
            outer = self

            class Keys:
                def __contains__(self, key):
                    read.add(key)
                    return dict.__contains__(outer, key)

                def __iter__(self):
                    return iter(dict.keys(outer))

            return Keys()

        def __copy__(self):
            return self

    with oracle.world():
        ds_config.DeepSpeedConfig(Recording(train_micro_batch_size_per_gpu=1))
    removed = set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    assert removed == set(ds_schema.REMOVED_TOP)
    assert set(ds_config._REMOVED_ZERO_CONFIG_KEYS) == set(ds_schema.REMOVED_ZERO)
    assert read - removed <= set(ds_schema.TOP), sorted(read - removed - set(ds_schema.TOP))


def test_optimizer_and_scheduler_tables_match(oracle):
    import torch
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lamb import FusedLamb
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    assert set(ds_schema.DEEPSPEED_OPTIMIZERS) == set(DEEPSPEED_OPTIMIZERS)
    torch_optimizers = {n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"}
    assert torch_optimizers <= set(ds_schema.TORCH_OPTIMIZERS)
    classes = {"FusedAdam": FusedAdam, "DeepSpeedCPUAdam": DeepSpeedCPUAdam, "FusedLion": FusedLion,
               "DeepSpeedCPULion": DeepSpeedCPULion, "DeepSpeedCPUAdagrad": DeepSpeedCPUAdagrad,
               "FusedLamb": FusedLamb, "torch.optim.AdamW": torch.optim.AdamW,
               "torch.optim.Adagrad": torch.optim.Adagrad}
    given_by_deepspeed = {"DeepSpeedCPUAdam": {"adamw_mode", "fp32_optimizer_states"}, "FusedAdam": {"adam_w_mode"}}
    for name, cls in classes.items():
        params = set(list(inspect.signature(cls).parameters)[1:]) - given_by_deepspeed.get(name, set())
        assert ds_schema.OPTIMIZER_PARAMS[name] == params, name
    assert set(ds_schema.DEEPSPEED_SCHEDULERS) == set(lr_schedules.VALID_LR_SCHEDULES)
    for name, signature in ds_schema.DEEPSPEED_SCHEDULERS.items():
        theirs = list(inspect.signature(getattr(lr_schedules, name)).parameters.values())[1:]
        assert signature == {p.name: p.default is inspect.Parameter.empty for p in theirs}, name


# ----------------------------------------------------------------------------------------------
# One unit test per rule id (no DeepSpeed needed)

HF = DSContext(world_size=2, training_args=TRAINING_ARGS)
HF_NO_ARGS = DSContext(world_size=2)
RAW = DSContext(world_size=2, hf_integration=False)


def base(**extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
    config.update(extra)
    return config


def zero(**extra) -> dict:
    return base(zero_optimization={"stage": 2, **extra})


def found(config, ctx=HF) -> dict:
    return {(f.rule, f.key): f for f in check_config(config, ctx)}


def rules_of(config, ctx=HF, severity=None) -> set:
    return {f.rule for f in check_config(config, ctx) if severity is None or f.severity == severity}


CASES = [
    # (rule, severity, config, ctx, key)
    ("DS100", "error", [1, 2], HF, ()),
    ("DS101", "error", base(), DSContext(duplicates=[(("zero_optimization", "stage"), 5, 5)]), ("zero_optimization", "stage")),
    ("DS102", "error", base(sparse_attention={"mode": "fixed"}), HF, ("sparse_attention",)),
    ("DS103", "error", zero(overlap_com=True), HF, ("zero_optimization", "overlap_com")),
    ("DS103", "error", base(tensor_parallel={"autotp_sise": 2}), HF, ("tensor_parallel", "autotp_sise")),
    ("DS104", "error", zero(reduce_bucket_sise="auto"), HF, ("zero_optimization", "reduce_bucket_sise")),
    ("DS105", "error", base(wall_clock_breakdwon=True), HF, ("wall_clock_breakdwon",)),
    ("DS105", "warning", base(my_note="x"), HF, ("my_note",)),
    ("DS105", "info", base(_comment="ZeRO-2 for 8 GPUs"), HF, ("_comment",)),
    ("DS110", "error", base(train_micro_batch_size_per_gpu=[2]), HF, ("train_micro_batch_size_per_gpu",)),
    ("DS110", "error", base(tensor_parallel={"autotp_size": 2, "dtype": "bf16"}), HF, ("tensor_parallel", "dtype")),
    ("DS111", "error", zero(sub_group_size=-1), HF, ("zero_optimization", "sub_group_size")),
    ("DS112", "error", zero(offload_optimizer={"device": "CPU"}), HF, ("zero_optimization", "offload_optimizer", "device")),
    ("DS113", "warning", zero(overlap_comm=1), HF, ("zero_optimization", "overlap_comm")),
    ("DS115", "error", zero(stage="3"), HF, ("zero_optimization", "stage")),
    ("DS120", "error", base(bf16={"enabled": True}, fp16={"enabled": True}), HF_NO_ARGS, ("fp16", "enabled")),
    ("DS121", "error", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                        "zero_optimization": {"stage": 0}}, HF_NO_ARGS, ("train_batch_size",)),
    ("DS122", "error", {"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 1}, HF, ()),
    ("DS123", "error", base(gradient_accumulation_steps=0), HF_NO_ARGS, ("gradient_accumulation_steps",)),
    ("DS124", "error", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                        "zero_optimization": {"stage": 0}}, DSContext(), ("train_batch_size",)),
    ("DS125", "error", {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "zero_optimization": {"stage": 1}}, HF, ()),
    ("DS125", "warning", {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 1}}, HF, ()),
    ("DS125", "warning", {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}, HF_NO_ARGS, ()),
    ("DS130", "error", {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}, HF, ()),
    ("DS131", "error", base(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}), HF,
     ("zero_optimization", "offload_optimizer")),
    ("DS132", "error", zero(offload_param={"device": "nvme", "nvme_path": "/nvme"}), HF, ("zero_optimization", "offload_param")),
    ("DS133", "error", base(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "none"}}), HF,
     ("zero_optimization", "offload_param", "nvme_path")),
    ("DS134", "error", zero(offload_optimizer={"device": "cpu", "ratio": 0.3}), HF, ("zero_optimization", "offload_optimizer", "ratio")),
    ("DS135", "error", base(zero_optimization={"stage": 0, "compute_grad_norm": False}), HF, ("zero_optimization", "compute_grad_norm")),
    ("DS136", "error", base(bf16={"enabled": "auto", "bf16_optimizer_states": True}), HF, ("bf16", "bf16_optimizer_states")),
    ("DS137", "error", base(zero_optimization={"stage": 3}, gradient_allreduce_op="SUM"), HF, ("gradient_allreduce_op",)),
    ("DS138", "warning", zero(cpu_offload_param=False), HF, ("zero_optimization", "cpu_offload_param")),
    ("DS139", "info", zero(stage3_max_live_parameters=1e9), HF, ("zero_optimization", "stage3_max_live_parameters")),
    ("DS140", "error", base(zero_optimization={"stage": 1, "allgather_bucket_size": 0}), HF, ("zero_optimization", "allgather_bucket_size")),
    ("DS150", "error", base(optimizer={"type": "Adamw8bit", "params": {}}), HF, ("optimizer", "type")),
    ("DS151", "error", base(optimizer={"type": "Lion", "params": {"lr": "auto", "eps": "auto"}}), HF, ("optimizer", "params", "eps")),
    ("DS152", "error", base(optimizer={"type": "Adam", "params": {"max_grad_norm": 1.0}}), HF, ("optimizer", "params", "max_grad_norm")),
    ("DS153", "error", base(optimizer={"type": "lamb", "params": {}}), HF, ("optimizer", "type")),
    ("DS154", "error", base(zero_optimization={"stage": 0}, optimizer={"type": "Lamb"}, fp16={"enabled": "auto", "loss_scale": 128}),
     HF, ("fp16", "loss_scale")),
    ("DS155", "warning", zero(offload_optimizer={"device": "cpu"}), HF, ("zero_optimization", "offload_optimizer")),
    ("DS156", "error", zero(cpu_offload=True), HF, ("zero_optimization", "cpu_offload")),
    ("DS157", "warning", base(optimizer={"type": "AdamW", "params": {"torch_adam": "false"}}), HF,
     ("optimizer", "params", "torch_adam")),
    ("DS160", "error", base(scheduler={"type": "cosine", "params": {}}), HF, ("scheduler", "type")),
    ("DS161", "error", base(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}}), HF, ("scheduler", "params")),
    ("DS170", "error", base(steps_per_print=10, dump_state="auto"), HF, ("dump_state",)),
    ("DS171", "error", base(optimizer={"type": "AdamW", "params": {"betas": [0.9, "auto"]}}), HF, ("optimizer", "params", "betas")),
    ("DS172", "warning", zero(offload_param={"device": "auto"}), HF, ("zero_optimization", "offload_param", "device")),
    ("DS175", "error", {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": "auto"}}, RAW, ("fp16", "enabled")),
    ("DS175", "warning", {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
     RAW, ("zero_optimization", "reduce_bucket_size")),
    ("DS180", "error", base(gradient_accumulation_steps=8), HF, ("gradient_accumulation_steps",)),
    ("DS190", "error", base(data_types={"param_dtype": "bf16"}, bf16={"enabled": False}, fp16={"enabled": False}), HF_NO_ARGS, ("data_types", "param_dtype")),
    ("DS191", "error", {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
     RAW, ("data_types", "grad_accum_dtype")),
    ("DS192", "error", base(gradient_clipping=-1.0), HF_NO_ARGS, ("gradient_clipping",)),
    ("DS193", "error", base(bf16={"enabled": False}, fp16={"enabled": True, "min_loss_scale": 0}), HF_NO_ARGS,
     ("fp16", "min_loss_scale")),
]


def test_every_rule_has_a_unit_case():
    assert {case[0] for case in CASES} == set(rules.RULES)


@pytest.mark.parametrize("rule,severity,config,ctx,key", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_rule(rule, severity, config, ctx, key):
    findings = check_config(config, ctx)
    match = [f for f in findings if f.rule == rule and f.key == key]
    assert match, f"{rule} at {key} not reported: {[(f.rule, f.key, f.message) for f in findings]}"
    assert match[0].severity == severity
    assert match[0].message and match[0].rule in rules.RULES


def test_clean_configs_have_no_findings():
    assert check_config(base(), HF) == []
    assert check_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                         "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, RAW) == []


def test_did_you_mean_uses_real_names_and_aliases():
    hits = found(zero(stage3_prefetch_bucket_sise="auto", contigous_gradients=True, overlap_comms=True))
    fixes = {key[-1]: f.fix for (rule, key), f in hits.items()}
    assert "stage3_prefetch_bucket_size" in fixes["stage3_prefetch_bucket_sise"]
    assert "contiguous_gradients" in fixes["contigous_gradients"]
    assert "overlap_comm" in fixes["overlap_comms"]
    top = found(base(micro_batch_size=2))
    assert "train_micro_batch_size_per_gpu" in top[("DS105", ("micro_batch_size",))].fix


def test_field_name_and_alias_both_given():
    hits = found(base(zero_optimization={"stage": 3, "stage3_prefetch_bucket_size": 10, "prefetch_bucket_size": 5}))
    assert ("DS103", ("zero_optimization", "prefetch_bucket_size")) in hits
    assert rules_of(base(zero_optimization={"stage": 3, "prefetch_bucket_size": 5}), severity="error") == set()


def test_stage_string_is_only_a_warning_without_hf():
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": "3"}}
    assert rules_of(config, RAW) == {"DS113"}


def test_auto_means_different_things_with_and_without_hf():
    config = base(fp16={"enabled": "auto"})
    assert rules_of(config, HF, "error") == set()
    raw = check_config(config, RAW)
    assert {f.key for f in raw if f.rule == "DS175" and f.severity == "error"} >= {
        ("train_batch_size",), ("train_micro_batch_size_per_gpu",), ("gradient_accumulation_steps",),
        ("bf16", "enabled"), ("fp16", "enabled")}


def test_batch_arithmetic_follows_deepspeeds_derivation():
    # train 10, micro 4, world 2: DeepSpeed derives accumulation 10 // 4 // 2 = 1, then 10 != 4 * 1 * 2
    hits = found({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}, RAW)
    assert "10 // 4 // 2 = 1" in hits[("DS121", ("train_batch_size",))].message
    ok = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}
    assert rules_of(ok, RAW) == set()
    # world size unknown: only what no world size can fix is an error
    assert rules_of(ok, DSContext(hf_integration=False)) == set()


def test_training_args_mismatch_uses_hfs_comparison():
    # HF compares with !=, so 1 == 1.0 and the betas list equals [beta1, beta2]
    config = base(gradient_clipping=1, optimizer={"type": "AdamW", "params": {"lr": 0.0002, "betas": [0.9, 0.999]}})
    assert rules_of(config, HF, "error") == set()
    world_only = found(base(train_batch_size=32), HF)
    assert "16" in world_only[("DS180", ("train_batch_size",))].message
    assert rules_of(base(train_batch_size=32), HF_NO_ARGS, "error") == set()


def test_recipe_rendered_configs_are_clean():
    from finetune.render import render_deepspeed, render_training_args
    from finetune.recipe import Recipe

    for stage, offload in ((0, "none"), (1, "cpu"), (2, "cpu"), (3, "cpu"), (3, "nvme")):
        deepspeed = {"stage": stage, "offload_optimizer": offload if stage else "none"}
        if stage == 3:
            deepspeed["offload_param"] = offload
        if offload == "nvme":
            deepspeed["nvme_path"] = "/local_nvme"
        recipe = Recipe(model={"name_or_path": "m"}, data={"path": "d.jsonl"}, deepspeed=deepspeed)
        for world in (None, 2):
            ctx = DSContext(world_size=world, training_args=render_training_args(recipe), from_recipe=True)
            assert check_config(render_deepspeed(recipe, world), ctx) == [], (stage, offload, world)


def test_all_problems_are_reported_at_once():
    config = {"train_batch_size": "16", "zero_optimization": {"stage": 7, "overlap_com": True},
              "fp16": {"enabled": True}, "bf16": {"enabled": True}, "amp": {}, "optimizer": {"type": "Adamm"}}
    assert rules_of(config, HF) >= {"DS110", "DS112", "DS103", "DS120", "DS102", "DS150"}


def test_every_finding_is_well_formed():
    for path in sorted(CORPUS.glob("*.json")):
        for f in lint_file(path):
            assert f.rule in rules.RULES and f.severity in ("error", "warning", "info")
            assert isinstance(f.key, tuple) and f.message


def test_no_crash_on_arbitrary_json():
    from hypothesis import given

    from tests.fuzzing import fuzz
    from hypothesis import strategies as st

    keys = ["zero_optimization", "stage", "offload_optimizer", "offload_param", "device", "nvme_path", "fp16", "bf16",
            "enabled", "loss_scale", "optimizer", "scheduler", "type", "params", "betas", "train_batch_size",
            "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "ratio", "data_types", "param_dtype",
            "checkpoint", "tag_validation", "gradient_clipping", "allgather_bucket_size", "warmup_num_steps"]
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**66), 2**66), st.floats(allow_nan=True),
                        st.text(max_size=6), st.sampled_from(["auto", "3", "cpu", "nvme", "AdamW", "WarmupLR", "fp16"]))
    values = st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(keys) | st.text(max_size=5), inner, max_size=5)),
        max_leaves=20)

    @fuzz(200)
    @given(doc=st.dictionaries(st.sampled_from(keys), values, max_size=7), hf=st.booleans(), world=st.sampled_from([None, 1, 3]))
    def run(doc, hf, world):
        ctx = DSContext(world_size=world, training_args=TRAINING_ARGS if hf else None, hf_integration=hf)
        for f in check_config(doc, ctx):
            assert f.rule in rules.RULES and f.severity in ("error", "warning", "info")

    run()


@pytest.mark.parametrize("block, ctx, message, fix", [
    ("optimizer", HF, "the `optimizer` block has no `type`: DeepSpeed has nothing to build (and HF has already "
     "handed the optimizer over to the config)", 'add "type": "AdamW", or delete the block to use the Trainer\'s optimizer'),
    ("optimizer", RAW, "the `optimizer` block has no `type`: DeepSpeed has nothing to build", 'add "type": "AdamW"'),
    ("scheduler", HF, "the `scheduler` block has no `type`",
     'add "type": "WarmupDecayLR", or delete the block to use the Trainer\'s scheduler'),
    ("scheduler", RAW, "the `scheduler` block has no `type`", 'add "type": "WarmupLR"'),
])
def test_block_without_type_message(block, ctx, message, fix):
    found = [f for f in check_config(base(**{block: {"params": {}}}), ctx) if f.key == (block,)]
    assert [(f.rule, f.severity, f.message, f.fix) for f in found] == \
        [("DS150" if block == "optimizer" else "DS160", "error", message, fix)]


def test_module_imports_without_torch():
    code = ("import sys, finetune.lint.deepspeed as r; "
            "bad = [m for m in ('torch', 'deepspeed', 'transformers', 'accelerate') if m in sys.modules]; "
            "assert not bad, bad; print(len(r.RULES))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
