"""The names of a run directory's files and folders, once (finetune.rundir.run_dir.RunDir reads them;
this module imports nothing, so checkpoint, lock and resume_key can use the names without a cycle). A model
directory's config.json is not a run directory's name: finetune.recipe.references.MODEL_CONFIG."""

RECIPE_FILE = "recipe.yaml"
# The first words of the recipe.yaml `finetune train` writes into a run directory (finetune.rundir.layout): with
# the other run inputs beside it, what tells a run directory from a folder that merely holds a recipe.yaml.
RECIPE_HEADER = "# The recipe this run trained, written by `finetune train`"
DEEPSPEED_FILE = "deepspeed.json"
TRAINING_ARGS_FILE = "training_args.json"
SUMMARY_FILE = "summary.json"
AUTO_FILE = "auto.json"  # the recipe's `auto` keys as `finetune train` decided them (finetune.plan.auto)
PREPARE_FILE = "prepare.json"  # the launcher's tokenizing and launch time (finetune.run.start), read into summary.json
ENV_FILE = "env.json"
LOGS_DIR = "logs"
# RUN/logs/first-attempt/: the logs of an attempt that ran out of GPU memory where `finetune train` ran the same run
# again from scratch with the memory-safe values (finetune.cli.train)
FIRST_ATTEMPT_LOGS = "first-attempt"
ADAPTER_DIR = "adapter"
MODEL_DIR = "model"
TOKENIZER_DIR = "tokenizer"
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file (peft.utils.CONFIG_NAME): what makes a folder an adapter
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME
MERGED_RECIPE = "finetune_recipe.yaml"  # the run's recipe, copied into a merged model by `finetune merge`
CHECKPOINT_PREFIX = "checkpoint-"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR + "-"
RUN_INPUTS = (RECIPE_FILE, DEEPSPEED_FILE, TRAINING_ARGS_FILE)  # what the runner reads
REPORT_FILE = "report.html"  # finetune.train.report: loss plot, memory, config, versions
PLOT_FILE = "loss.png"  # the loss curve, embedded in report.html
FORMAT_FILE = "format.json"  # the run directory's format version (finetune.rundir.format); none before issue 39
MERGED_FORMAT = "finetune_format.json"  # its copy beside MERGED_RECIPE in a merged model
EVAL_FILE = "eval.json"  # finetune eval: loss and perplexity, base vs fine-tuned (finetune.use.evaluate)
BENCHMARKS_KEY = "benchmarks"  # eval.json's section for `finetune eval --tasks` (finetune.use.benchmark)
DEEPSPEED_EFFECTIVE_FILE = "deepspeed.effective.json"  # the DeepSpeed config as run ("auto" filled; train.callbacks)
ZERO_CHECKPOINT_DIR = "zero_checkpoint"  # a ZeRO-3 run's weights when they were not gathered on save (finetune convert)
TENSORBOARD_DIR = "tensorboard"  # training.report_to: tensorboard's event files
DATA_MIX_FILE = "data_mix.json"  # a mixture's rows and tokens per source (finetune.data.mix)
FINAL_LOGITS_FILE = "final_logits.safetensors"  # logits of a fixed batch after training (verification)
STOP_RECORD = "stopped.json"  # which signal stopped the run, at which step (finetune.rundir.checkpoint)
LAUNCHER_ERROR_FILE = "launcher_error.json"  # in LOGS_DIR: torchrun's own exception (its main is wrapped in @record)
