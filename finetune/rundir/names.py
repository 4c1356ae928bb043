"""The names of a run directory's files and folders, once (finetune.rundir.run_dir.RunDir is their owner;
this module imports nothing, so checkpoint, lock and resume_key can use the names without a cycle)."""

RECIPE_FILE = "recipe.yaml"
DEEPSPEED_FILE = "deepspeed.json"
TRAINING_ARGS_FILE = "training_args.json"
SUMMARY_FILE = "summary.json"
ENV_FILE = "env.json"
LOGS_DIR = "logs"
ADAPTER_DIR = "adapter"
MODEL_DIR = "model"
TOKENIZER_DIR = "tokenizer"
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file (peft.utils.CONFIG_NAME): what makes a folder an adapter
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME
MODEL_CONFIG = "config.json"  # transformers' CONFIG_NAME: what makes a folder a model
MERGED_RECIPE = "finetune_recipe.yaml"  # the run's recipe, copied into a merged model by `finetune merge`
CHECKPOINT_PREFIX = "checkpoint-"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR + "-"
RUN_INPUTS = (RECIPE_FILE, DEEPSPEED_FILE, TRAINING_ARGS_FILE)  # what the runner reads
