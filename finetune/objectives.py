"""The one table of training objectives (recipe `objective`): what each reads, what its rows look like, and
which TRL classes train it. Schema, lint, plan, data and train read their facts from here.

TRL pairs a config class with a trainer per objective (`dpo_config.py` + `dpo_trainer.py`); this light core
cannot import TRL, so the record names them, and tests/test_objectives.py checks the names against the
installed TRL and that lint's keys are exactly the keys training passes to it (finetune.train.objective_steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# TRL's loss variants per objective (trl 1.16: DPOConfig.loss_type, KTOConfig.loss_type, GRPOConfig.loss_type);
# ORPO has one loss, SimPO is CPOConfig(loss_type="simpo"), the reward model's loss is Bradley-Terry.
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sigmoid_norm")
KTO_LOSSES = ("kto", "apo_zero_unpaired")
GRPO_LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")

PAIRED_COLUMNS = ("prompt", "chosen", "rejected")
KTO_COLUMNS = ("prompt", "completion", "label")
_PAIR_ROWS = "chosen + rejected rows"


@dataclass(frozen=True)
class Objective:
    name: str
    doc: str
    columns: tuple[str, ...] = ()  # the row columns TRL reads (sft: the data format decides)
    row_format: Optional[str] = None  # the registered row format (finetune.data.formats) every source is read with
    data_formats: tuple[str, ...] = ()  # data.format values it accepts (empty: row_format alone, data.format unused)
    rows_per_example: int = 1  # sequences one example puts through the trained forward (planner)
    row_label: str = ""  # what those rows are, as `plan` says it
    section: Optional[str] = None  # the recipe section of its own settings
    keys: frozenset[str] = frozenset()  # the keys of that section it reads (lint refuses the others)
    losses: tuple[str, ...] = ()  # `loss_type` values (empty: one loss)
    reference: Optional[str] = None  # "preference": preference.reference decides; "beta": a reference when beta > 0
    trl_module: Optional[str] = None
    trl_config: Optional[str] = None
    trl_trainer: Optional[str] = None
    fused_logprob: bool = False  # scores tokens through TRL's fused LM head (planner: no full logits)
    score_head: bool = False  # a one-score head replaces the LM head (planner: no vocabulary-sized logits; not a chat model)
    train_module: str = "preference"  # the module of finetune.train with its steps (finetune.train.objective_steps)
    # What commands branch on (true for sft alone today, `generates` for grpo); each says why it differs.
    pretokenized: bool = False  # the launcher tokenizes its data into the cache (finetune.run.start, `prepare`)
    perplexity: bool = False  # its loss is next-token cross-entropy on the data: `eval` scores loss and perplexity
    plain_trainer: bool = False  # tested under transformers' Trainer without DeepSpeed (deepspeed.enabled: false)
    sized_by_plan: bool = False  # `auto` micro_batch_size / loss_kernel are sized by the plan (its own loss)
    sequence_parallel: bool = False  # Ulysses averages the slices' loss (deepspeed_sp_compute_loss); TRL's do not
    vision: bool = False  # reads rows with images for a vision-language model (TRL's trainers would drop them)
    generates: bool = False  # completions are generated in the step and scored by reward functions (grpo section)

    @property
    def uses_trl(self) -> bool:
        return self.trl_trainer is not None

    @property
    def reads_data_format(self) -> bool:
        """data.format decides how its rows read and how the trained model is prompted (else its own rows)."""
        return bool(self.data_formats)

    @property
    def format_decides(self) -> bool:
        """The data's format decides what trains (sft): no columns of its own, so commands name the format."""
        return not self.columns


SFT = Objective("sft", "next-token loss on the data (the data's format decides what trains)",
                data_formats=("alpaca", "messages", "sharegpt", "text"), train_module="sft", pretokenized=True,
                perplexity=True, plain_trainer=True, sized_by_plan=True, sequence_parallel=True, vision=True)
OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    SFT,
    # DPO, ORPO and SimPO run chosen and rejected as one concatenated batch of 2 x micro_batch rows.
    Objective("dpo", "direct preference optimisation on prompt/chosen/rejected rows", PAIRED_COLUMNS, "pairs",
              rows_per_example=2, row_label=_PAIR_ROWS, section="preference", keys=frozenset({"beta", "loss_type", "label_smoothing", "reference"}),
              losses=DPO_LOSSES, reference="preference", trl_module="trl", trl_config="DPOConfig",
              trl_trainer="DPOTrainer", fused_logprob=True),
    Objective("orpo", "odds-ratio preference optimisation (no reference) on prompt/chosen/rejected rows",
              PAIRED_COLUMNS, "pairs", rows_per_example=2, row_label=_PAIR_ROWS, section="preference",
              keys=frozenset({"beta", "max_completion_length"}), trl_module="trl.experimental.orpo",
              trl_config="ORPOConfig", trl_trainer="ORPOTrainer"),
    # KTO runs its completions as one batch plus a KL batch under no_grad, which saves nothing for backward.
    Objective("kto", "Kahneman-Tversky optimisation on prompt/completion/label rows", KTO_COLUMNS, "kto",
              row_label="completion rows", section="preference", keys=frozenset({"beta", "loss_type", "reference", "desirable_weight",
                                                    "undesirable_weight"}),
              losses=KTO_LOSSES, reference="preference", trl_module="trl", trl_config="KTOConfig",
              trl_trainer="KTOTrainer", fused_logprob=True),
    Objective("simpo", "SimPO (TRL's CPOTrainer, loss simpo) on prompt/chosen/rejected rows", PAIRED_COLUMNS, "pairs",
              rows_per_example=2, row_label=_PAIR_ROWS, section="preference",
              keys=frozenset({"beta", "label_smoothing", "max_completion_length", "simpo_gamma", "cpo_alpha"}),
              trl_module="trl.experimental.cpo", trl_config="CPOConfig", trl_trainer="CPOTrainer"),
    Objective("grpo", "online RL: completions generated per prompt, scored by reward functions (the `grpo` section)",
              ("prompt",), "prompts", data_formats=("prompt", "messages", "sharegpt", "alpaca"), row_label="completions", section="grpo",
              keys=frozenset({"num_generations", "max_completion_length", "temperature", "beta", "loss_type",
                              "scale_rewards", "num_iterations", "epsilon", "rewards", "vllm"}),
              losses=GRPO_LOSSES, reference="beta", trl_module="trl", trl_config="GRPOConfig",
              trl_trainer="GRPOTrainer", fused_logprob=True,  # grpo_trainer.py: model(..., fused_lm_head=True)
              train_module="grpo", generates=True),
    # RewardTrainer scores chosen and rejected as one batch of 2 x micro_batch rows through a one-logit head.
    Objective("reward", "a reward model (sequence classification, one score) on prompt/chosen/rejected rows",
              PAIRED_COLUMNS, "pairs", rows_per_example=2, row_label=_PAIR_ROWS, trl_module="trl", trl_config="RewardConfig",
              trl_trainer="RewardTrainer", score_head=True, train_module="reward"),
)}
NAMES = tuple(OBJECTIVES)
# The objectives with a `preference` section: the preference-optimisation family.
PREFERENCE = tuple(o.name for o in OBJECTIVES.values() if o.section == "preference")
TRL = tuple(o.name for o in OBJECTIVES.values() if o.uses_trl)


# Data and training keys the SFT data path reads and TRL's trainers do not (lint R119 warns about them; a run's
# recorded recipe leaves them out: finetune.rundir.layout.recorded_recipe).
TRL_IGNORED: dict[tuple[str, str], str] = {
    ("data", "packing"): "TRL's trainers keep each example apart in its own padded rows",
    ("data", "padding_free"): "TRL's trainers keep each example apart in its own padded rows",
    ("data", "mask_prompt"): "these losses score only the answers",
    ("data", "pad_to_multiple_of"): "TRL's collators pad their own rows",
    ("training", "loss_kernel"): "TRL's trainers compute their own log-probabilities",
    ("training", "loss_chunk_tokens"): "TRL's trainers compute their own log-probabilities",
}

# The settings of a grpo.rewards entry each built-in reward reads (a user function reads only the data's columns).
REWARD_SETTINGS: dict[str, frozenset[str]] = {
    "exact_match": frozenset({"column"}), "number_match": frozenset({"column"}), "regex": frozenset({"pattern"}),
    "length": frozenset({"target"}), "think_format": frozenset()}
REWARD_SETTING_KEYS = ("column", "pattern", "target")


def get(name: str) -> Objective:
    return OBJECTIVES[name]


def users_of(section: str, key: str) -> list[str]:
    """The objectives that read `section.key`."""
    return [o.name for o in OBJECTIVES.values() if o.section == section and key in o.keys]


def doc() -> str:
    return "; ".join(f"{o.name}: {o.doc}" for o in OBJECTIVES.values())
