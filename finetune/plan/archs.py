"""Decoder architectures the planner knows without downloading anything.

The numbers are the public `config.json` values of each model (hidden_size, intermediate_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size,
tie_word_embeddings). Every model here is a Llama-style decoder: per layer an attention block
(q, k, v, o projections) and a gated MLP (gate, up, down), RMS norms, a token embedding and an
output head (tied to the embedding or not). Pure Python: no torch, no transformers.

    >>> arch = match_hub_id("meta-llama/Meta-Llama-3-8B-Instruct")
    >>> arch.name, f"{arch.total_params:,}"
    ('llama-3-8b', '8,030,261,248')
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from finetune.errors import FinetuneError
from finetune.recipe.references import MODEL_CONFIG

# Projections of one decoder layer, in forward order; LoRA `target_modules` names refer to these.
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Linear:
    name: str
    in_features: int
    out_features: int
    bias: bool = False

    @property
    def weight_numel(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class Arch:
    """Shapes of a Llama-style decoder."""

    name: str
    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    head_dim: int = 0  # 0: hidden // heads (Gemma 2 sets it explicitly)
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v
    norms_per_layer: int = 2  # Gemma 2 adds pre/post feed-forward norms: 4
    attn_softcap: bool = False  # Gemma 2: tanh soft-capping of attention scores (eager keeps one more s^2 tensor)
    logit_softcap: bool = False  # Gemma 2: tanh soft-capping of the logits (one more vocab-sized tensor)
    qk_norm: int = 0  # elements of a layer's q and k norms: Qwen3, Gemma 3 2 x head_dim; OLMo-2 q_dim + kv_dim
    attention_bias: bool = False  # a bias on o_proj too (gpt-oss, Llama's attention_bias)
    sinks: bool = False  # gpt-oss: one learned attention sink per head and layer
    fused: bool = False  # Phi-3/Phi-4: one qkv_proj and one gate_up_proj instead of three and two
    # Tokens a sliding-window layer attends to (Mistral-7B v0.1, Gemma 2/3, gpt-oss), 0: none. From that length on,
    # transformers builds a 4D mask for sdpa even over unpadded rows (masking_utils._ignore_causal_mask_sdpa).
    sliding_window: int = 0
    # Mixture of experts (0 experts: a dense model). Every expert's weights are resident on the GPU;
    # each token runs through `experts_per_token` of them (top-k routing) and the shared expert.
    experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0
    moe_intermediate: int = 0  # width of one routed expert's MLP
    shared_intermediate: int = 0  # width of the shared expert(s) beside the routed ones (Qwen2-MoE, DeepSeek)
    shared_expert_gate: bool = False  # Qwen2-MoE: a sigmoid Linear(hidden, 1) scales the shared expert
    expert_bias: bool = False  # gpt-oss: biases on the router and on each expert's gate_up and down projections
    dense_layers: int = 0  # DeepSeek: the first layers keep a dense MLP (first_k_dense_replace)
    source: str = "built-in table"
    patterns: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the attention output (heads x head_dim); differs from hidden for Gemma 2."""
        return self.heads * self.dim_head

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim_head

    def attention_linears(self) -> tuple[Linear, ...]:
        h = self.hidden
        if self.fused:
            return (Linear("qkv_proj", h, self.q_dim + 2 * self.kv_dim, self.qkv_bias),
                    Linear("o_proj", self.q_dim, h, self.attention_bias))
        return (
            Linear("q_proj", h, self.q_dim, self.qkv_bias),
            Linear("k_proj", h, self.kv_dim, self.qkv_bias),
            Linear("v_proj", h, self.kv_dim, self.qkv_bias),
            Linear("o_proj", self.q_dim, h, self.attention_bias),
        )

    def mlp_linears(self, width: int) -> tuple[Linear, ...]:
        h = self.hidden
        if self.fused:
            return (Linear("gate_up_proj", h, 2 * width), Linear("down_proj", width, h))
        return (Linear("gate_proj", h, width), Linear("up_proj", h, width), Linear("down_proj", width, h))

    def linear_names(self) -> tuple[str, ...]:
        """The names LoRA's all-linear reaches in a layer (of a MoE layer: attention and shared expert)."""
        return tuple(l.name for l in self.layer_linears()) + (("shared_expert_gate",) if self.shared_expert_gate else ())

    @property
    def layer_extras(self) -> int:
        """A layer's parameters beyond its linears and norms: q/k norms and attention sinks."""
        return self.qk_norm + (self.heads if self.sinks else 0)

    def layer_linears(self) -> tuple[Linear, ...]:
        """The nn.Linear layers of a dense decoder layer (of a MoE layer: attention and shared expert)."""
        if self.experts:
            return self.attention_linears() + (self.mlp_linears(self.shared_intermediate)
                                               if self.shared_intermediate else ())
        return self.attention_linears() + self.mlp_linears(self.intermediate)

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def dense_mlp_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def expert_params(self) -> int:
        """One MoE layer's routed experts: gate, up and down of every expert (transformers keeps them
        as two 3D parameters of one `experts` module: gate_up_proj and down_proj)."""
        return self.experts * 3 * self.hidden * self.moe_intermediate

    @property
    def router_params(self) -> int:
        return self.experts * self.hidden + (self.experts if self.expert_bias else 0)

    @property
    def expert_bias_params(self) -> int:
        """gpt-oss's per-expert biases: gate_up_proj_bias (experts x 2 width) and down_proj_bias (experts x hidden)."""
        return self.experts * (2 * self.moe_intermediate + self.hidden) if self.expert_bias else 0

    @property
    def active_mlp_width(self) -> int:
        """MLP width a token runs through: its top-k experts and the shared expert (MoE), or the MLP."""
        if not self.experts:
            return self.intermediate
        return self.experts_per_token * self.moe_intermediate + self.shared_intermediate

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @staticmethod
    def _linear_params(linears: tuple[Linear, ...]) -> int:
        return sum(l.weight_numel + (l.out_features if l.bias else 0) for l in linears)

    @property
    def layer_params(self) -> int:
        """A dense decoder layer (the dense layers of a MoE model)."""
        return (self._linear_params(self.attention_linears() + self.mlp_linears(self.intermediate))
                + self.norms_per_layer * self.hidden + self.layer_extras)

    @property
    def moe_layer_params(self) -> int:
        shared = self._linear_params(self.mlp_linears(self.shared_intermediate)) if self.shared_intermediate else 0
        return (self._linear_params(self.attention_linears()) + self.norms_per_layer * self.hidden + self.layer_extras
                + self.router_params + self.expert_params + self.expert_bias_params + shared
                + (self.hidden if self.shared_expert_gate else 0))

    @property
    def total_params(self) -> int:
        """Unique parameters (a tied head is the embedding, counted once), as model.num_parameters()."""
        head = 0 if self.tied else self.embed_params
        layers = self.dense_mlp_layers * self.layer_params + self.moe_layers * self.moe_layer_params
        return self.embed_params + layers + self.hidden + head

    @property
    def largest_module_params(self) -> int:
        """Largest number of parameters held directly by one module (DeepSpeed's `largest_layer_params`):
        the embedding or the output head, or a MoE layer's `experts` module (all experts' weights)."""
        linears = self.attention_linears() + (self.mlp_linears(self.intermediate) if self.dense_mlp_layers else ()) \
            + (self.mlp_linears(self.shared_intermediate) if self.moe_layers and self.shared_intermediate else ())
        biggest_linear = max(l.weight_numel + (l.out_features if l.bias else 0) for l in linears)
        return max(self.embed_params, biggest_linear,
                   self.expert_params + self.expert_bias_params if self.moe_layers else 0)

    def describe(self) -> str:
        n = self.total_params
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"
        moe = f", {self.experts} experts (top-{self.experts_per_token})" if self.experts else ""
        return (f"{self.name} ({size} params, hidden {self.hidden}, {self.layers} layers, "
                f"{self.heads}/{self.kv_heads} heads, vocab {self.vocab}{moe}{', tied head' if self.tied else ''})")

    def hf_config(self) -> dict:
        """A transformers config dict with these shapes (used by tests to build the real model)."""
        cfg = {"model_type": self.model_type, "hidden_size": self.hidden, "intermediate_size": self.intermediate,
               "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
               "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab,
               "tie_word_embeddings": self.tied}
        if self.head_dim:
            cfg["head_dim"] = self.head_dim
        if self.experts and self.model_type == "mixtral":
            cfg.update(num_local_experts=self.experts, num_experts_per_tok=self.experts_per_token,
                       intermediate_size=self.moe_intermediate)
        elif self.experts and self.model_type == "qwen2_moe":
            cfg.update(num_experts=self.experts, num_experts_per_tok=self.experts_per_token,
                       moe_intermediate_size=self.moe_intermediate,
                       shared_expert_intermediate_size=self.shared_intermediate, decoder_sparse_step=1,
                       mlp_only_layers=[], qkv_bias=self.qkv_bias)
        elif self.experts and self.model_type == "qwen3_moe":
            cfg.update(num_experts=self.experts, num_experts_per_tok=self.experts_per_token,
                       moe_intermediate_size=self.moe_intermediate, decoder_sparse_step=1, mlp_only_layers=[])
        elif self.experts and self.model_type == "gpt_oss":
            cfg.update(num_local_experts=self.experts, num_experts_per_tok=self.experts_per_token,
                       intermediate_size=self.moe_intermediate)
        return cfg


def _arch(name: str, model_type: str, hidden: int, intermediate: int, layers: int, heads: int, kv: int, vocab: int,
          tied: bool, *patterns: str, **extra) -> Arch:
    return Arch(name, model_type, hidden, intermediate, layers, heads, kv, vocab, tied,
                patterns=patterns or (re.escape(name),), **extra)


_QWEN2 = {"qkv_bias": True}
_QWEN2_MOE = {"qkv_bias": True, "shared_expert_gate": True}
_GEMMA2 = {"norms_per_layer": 4, "attn_softcap": True, "logit_softcap": True, "sliding_window": 4096}

_QWEN3 = {"head_dim": 128, "qk_norm": 256}  # per-head q/k RMSNorms of head_dim 128
_GEMMA3 = {"norms_per_layer": 4}
_GPT_OSS = {"head_dim": 64, "qkv_bias": True, "attention_bias": True, "sinks": True, "expert_bias": True,
            "experts_per_token": 4, "moe_intermediate": 2880, "sliding_window": 128}

# The models users bring this year (issue 37), each from its published config.json (hidden, intermediate, layers,
# heads, kv-heads, head_dim, vocab, tie_word_embeddings, experts), read from verbatim copies since the hub is not
# reachable here: huggingface.co/<id>/blob/main/config.json of
#   Qwen/Qwen3-0.6B, -1.7B, -4B, -8B, -14B, -32B, -30B-A3B, -235B-A22B (the 4B-32B and 30B-A3B in
#     github.com/citsjtu2020/LLM-Prof sglang/Model_Config.md; 0.6B, 1.7B and 235B-A22B in other quoted copies);
#   meta-llama/Llama-3.2-1B (unsloth/Llama-3.2-1B-Instruct's, quoted verbatim), Llama-3.2-3B (LLM-Prof),
#     Llama-3.3-70B (a cached LlamaConfig of it; untied like 3.1-70B);
#   google/gemma-3-1b (Gemma3ForCausalLM) and the text decoders of gemma-3-4b/12b/27b (Gemma3ForConditionalGeneration:
#     their vision tower is not counted here), from one file of cached configs;
#   microsoft/phi-4 (model_type phi3: fused qkv_proj and gate_up_proj);
#   openai/gpt-oss-20b (ollama's x/models/gptoss test quotes it) and gpt-oss-120b (36 layers, 128 experts: the
#     defaults of transformers 5.24's GptOssConfig, and two quoted copies); both ship MXFP4 experts, which
#     transformers dequantizes to the model dtype to train;
#   mistralai/Mistral-Small-24B-Instruct-2501 (MistralForCausalLM; 3.1 and 3.2 are image-text models of the
#     same text shapes).
# tests/plan/test_planner.py builds each on the meta device and checks the parameter count.
THIS_YEAR: tuple[Arch, ...] = (
    _arch("qwen3-0.6b", "qwen3", 1024, 3072, 28, 16, 8, 151936, True, r"qwen3-0\.6b", **_QWEN3),
    _arch("qwen3-1.7b", "qwen3", 2048, 6144, 28, 16, 8, 151936, True, r"qwen3-1\.7b", **_QWEN3),
    _arch("qwen3-4b", "qwen3", 2560, 9728, 36, 32, 8, 151936, True, r"qwen3-4b", **_QWEN3),
    _arch("qwen3-8b", "qwen3", 4096, 12288, 36, 32, 8, 151936, False, r"qwen3-8b", **_QWEN3),
    _arch("qwen3-14b", "qwen3", 5120, 17408, 40, 40, 8, 151936, False, r"qwen3-14b", **_QWEN3),
    _arch("qwen3-32b", "qwen3", 5120, 25600, 64, 64, 8, 151936, False, r"qwen3-32b", **_QWEN3),
    _arch("qwen3-30b-a3b", "qwen3_moe", 2048, 6144, 48, 32, 4, 151936, False, r"qwen3-30b-a3b",
          experts=128, experts_per_token=8, moe_intermediate=768, **_QWEN3),
    _arch("qwen3-235b-a22b", "qwen3_moe", 4096, 12288, 94, 64, 4, 151936, False, r"qwen3-235b-a22b",
          experts=128, experts_per_token=8, moe_intermediate=1536, **_QWEN3),
    _arch("llama-3.2-1b", "llama", 2048, 8192, 16, 32, 8, 128256, True, r"llama-?3\.2-1b"),
    _arch("llama-3.2-3b", "llama", 3072, 8192, 28, 24, 8, 128256, True, r"llama-?3\.2-3b"),
    _arch("llama-3.3-70b", "llama", 8192, 28672, 80, 64, 8, 128256, False, r"llama-?3\.3-70b"),
    _arch("gemma-3-1b", "gemma3_text", 1152, 6912, 26, 4, 1, 262144, True, r"gemma-?3-1b", head_dim=256,
          qk_norm=512, sliding_window=512, **_GEMMA3),
    _arch("gemma-3-4b", "gemma3_text", 2560, 10240, 34, 8, 4, 262208, True, r"gemma-?3-4b", head_dim=256,
          qk_norm=512, sliding_window=1024, **_GEMMA3),
    _arch("gemma-3-12b", "gemma3_text", 3840, 15360, 48, 16, 8, 262208, True, r"gemma-?3-12b", head_dim=256,
          qk_norm=512, sliding_window=1024, **_GEMMA3),
    _arch("gemma-3-27b", "gemma3_text", 5376, 21504, 62, 32, 16, 262208, True, r"gemma-?3-27b", head_dim=128,
          qk_norm=256, sliding_window=1024, **_GEMMA3),
    _arch("phi-4", "phi3", 5120, 17920, 40, 40, 10, 100352, False, r"phi-?4(?!-mini|-multimodal)", fused=True),
    _arch("gpt-oss-20b", "gpt_oss", 2880, 2880, 24, 64, 8, 201088, False, r"gpt-oss-20b", experts=32, **_GPT_OSS),
    _arch("gpt-oss-120b", "gpt_oss", 2880, 2880, 36, 64, 8, 201088, False, r"gpt-oss-120b", experts=128, **_GPT_OSS),
    _arch("mistral-small-24b", "mistral", 5120, 32768, 40, 32, 8, 131072, False, r"mistral-small-24b", head_dim=128),
)

# Patterns are searched in a lower-cased hub id with `_` read as `-`; a size is never followed by
# another digit, so `llama-2-7b` does not match `llama-2-70b`.
BUILTIN: tuple[Arch, ...] = (
    _arch("llama-2-7b", "llama", 4096, 11008, 32, 32, 32, 32000, False, r"llama-?2-7b"),
    _arch("llama-2-13b", "llama", 5120, 13824, 40, 40, 40, 32000, False, r"llama-?2-13b"),
    _arch("llama-2-70b", "llama", 8192, 28672, 80, 64, 8, 32000, False, r"llama-?2-70b"),
    _arch("llama-3-8b", "llama", 4096, 14336, 32, 32, 8, 128256, False, r"llama-?3-8b"),
    _arch("llama-3-70b", "llama", 8192, 28672, 80, 64, 8, 128256, False, r"llama-?3-70b"),
    _arch("llama-3.1-8b", "llama", 4096, 14336, 32, 32, 8, 128256, False, r"llama-?3\.1-8b"),
    _arch("llama-3.1-70b", "llama", 8192, 28672, 80, 64, 8, 128256, False, r"llama-?3\.1-70b"),
    _arch("qwen2.5-0.5b", "qwen2", 896, 4864, 24, 14, 2, 151936, True, r"qwen2\.5-0\.5b", **_QWEN2),
    _arch("qwen2.5-1.5b", "qwen2", 1536, 8960, 28, 12, 2, 151936, True, r"qwen2\.5-1\.5b", **_QWEN2),
    _arch("qwen2.5-3b", "qwen2", 2048, 11008, 36, 16, 2, 151936, True, r"qwen2\.5-3b", **_QWEN2),
    _arch("qwen2.5-7b", "qwen2", 3584, 18944, 28, 28, 4, 152064, False, r"qwen2\.5-7b", **_QWEN2),
    _arch("qwen2.5-14b", "qwen2", 5120, 13824, 48, 40, 8, 152064, False, r"qwen2\.5-14b", **_QWEN2),
    _arch("qwen2.5-32b", "qwen2", 5120, 27648, 64, 40, 8, 152064, False, r"qwen2\.5-32b", **_QWEN2),
    _arch("qwen2.5-72b", "qwen2", 8192, 29568, 80, 64, 8, 152064, False, r"qwen2\.5-72b", **_QWEN2),
    # v0.3 extended the vocabulary to 32768; v0.1/v0.2 have 32000. Check v0.3 first.
    _arch("mistral-7b-v0.3", "mistral", 4096, 14336, 32, 32, 8, 32768, False, r"mistral-7b(-instruct)?-v0\.3"),
    _arch("mistral-7b", "mistral", 4096, 14336, 32, 32, 8, 32000, False, r"mistral-7b", sliding_window=4096),
    _arch("gemma-2-2b", "gemma2", 2304, 9216, 26, 8, 4, 256000, True, r"gemma-?2-2b", head_dim=256, **_GEMMA2),
    _arch("gemma-2-9b", "gemma2", 3584, 14336, 42, 16, 8, 256000, True, r"gemma-?2-9b", head_dim=256, **_GEMMA2),
    _arch("gemma-2-27b", "gemma2", 4608, 36864, 46, 32, 16, 256000, True, r"gemma-?2-27b", head_dim=128, **_GEMMA2),
    # Mixture of experts: `intermediate` is one expert's width for Mixtral (its config's
    # intermediate_size), Qwen1.5-MoE's config gives both (5632 = the shared expert).
    _arch("mixtral-8x7b", "mixtral", 4096, 14336, 32, 32, 8, 32000, False, r"mixtral-8x7b",
          experts=8, experts_per_token=2, moe_intermediate=14336),
    _arch("qwen1.5-moe-a2.7b", "qwen2_moe", 2048, 5632, 24, 16, 16, 151936, False, r"qwen1\.5-moe-a2\.7b",
          experts=60, experts_per_token=4, moe_intermediate=1408, shared_intermediate=5632, **_QWEN2_MOE),
    *THIS_YEAR,
)
BY_NAME = {a.name: a for a in BUILTIN}

# The Hub ids of each architecture above (base and instruct/chat): preflight's did-you-mean for a hub id the Hub
# does not know (finetune.run.hub; tests/plan/test_planner.py checks each maps back to its architecture, and that every
# shipped recipe's hub model is here).
HUB_IDS: dict[str, tuple[str, ...]] = {
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-7b-chat-hf"),
    "llama-2-13b": ("meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-13b-chat-hf"),
    "llama-2-70b": ("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-chat-hf"),
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct"),
    "llama-3-70b": ("meta-llama/Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-70B-Instruct"),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct"),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct"),
    **{f"qwen2.5-{size.lower()}": (f"Qwen/Qwen2.5-{size}", f"Qwen/Qwen2.5-{size}-Instruct")
       for size in ("0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B")},
    "mistral-7b-v0.3": ("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
    "mistral-7b": ("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.2"),
    "gemma-2-2b": ("google/gemma-2-2b", "google/gemma-2-2b-it"),
    "gemma-2-9b": ("google/gemma-2-9b", "google/gemma-2-9b-it"),
    "gemma-2-27b": ("google/gemma-2-27b", "google/gemma-2-27b-it"),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
    "qwen1.5-moe-a2.7b": ("Qwen/Qwen1.5-MoE-A2.7B", "Qwen/Qwen1.5-MoE-A2.7B-Chat"),
    # this year's (THIS_YEAR): Qwen3 publishes no base model of the 32B and the 235B-A22B, Meta none of Llama-3.3-70B
    **{f"qwen3-{size.lower()}": (f"Qwen/Qwen3-{size}", f"Qwen/Qwen3-{size}-Base")
       for size in ("0.6B", "1.7B", "4B", "8B", "14B", "30B-A3B")},
    "qwen3-32b": ("Qwen/Qwen3-32B",),
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B",),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct"),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B-Instruct"),
    "llama-3.3-70b": ("meta-llama/Llama-3.3-70B-Instruct",),
    **{f"gemma-3-{size}": (f"google/gemma-3-{size}-pt", f"google/gemma-3-{size}-it") for size in ("1b", "4b", "12b", "27b")},
    "phi-4": ("microsoft/phi-4",),
    "gpt-oss-20b": ("openai/gpt-oss-20b",),
    "gpt-oss-120b": ("openai/gpt-oss-120b",),
    "mistral-small-24b": ("mistralai/Mistral-Small-24B-Base-2501", "mistralai/Mistral-Small-24B-Instruct-2501"),
}


def match_hub_id(name: str) -> Optional[Arch]:
    """The built-in architecture a hub id (or a table name) refers to, or None.

    `meta-llama/Meta-Llama-3-8B-Instruct` -> llama-3-8b; `Qwen/Qwen2.5-7B-Instruct` -> qwen2.5-7b.
    """
    text = name.strip().lower().replace("_", "-")
    if text in BY_NAME:
        return BY_NAME[text]
    for arch in BUILTIN:
        for pattern in arch.patterns:
            if re.search(rf"(?<![a-z0-9.]){pattern}(?![0-9.])", text.rsplit("/", 1)[-1]) or \
               re.search(rf"(?<![a-z0-9.]){pattern}(?![0-9.])", text):
                return arch
    return None


class ArchError(FinetuneError, ValueError):
    """A config.json the planner cannot read."""


# Keys every Llama-style config.json has; text_config covers multimodal wrappers.
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def arch_from_config(config: dict, source: str) -> Arch:
    """Shapes from a transformers config.json dict (Llama, Mistral, Qwen2, Gemma 2 and look-alikes)."""
    if "text_config" in config and "hidden_size" not in config:
        config = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings",
                                                                            config["text_config"].get("tie_word_embeddings"))}
    missing = [k for k in _REQUIRED if not isinstance(config.get(k), int)]
    if missing:
        raise ArchError(f"{source}: not a decoder config the planner understands (missing {', '.join(missing)})")
    model_type = str(config.get("model_type", "llama"))
    heads = config["num_attention_heads"]
    gemma2 = model_type in ("gemma2", "gemma3_text")
    tied_default = model_type in ("gemma", "gemma2", "gemma3_text")
    tied = config.get("tie_word_embeddings")
    if tied is None:
        tied = tied_default
    head_dim = config.get("head_dim") or 0
    if head_dim and head_dim * heads == config["hidden_size"]:
        head_dim = 0  # the default; keep the Arch minimal
    if config.get("kv_lora_rank"):
        raise ArchError(f"{source}: multi-head latent attention (DeepSeek-V2/V3 kv_lora_rank) is not modelled")
    kv_heads = config.get("num_key_value_heads") or heads
    dim_head = head_dim or config["hidden_size"] // heads
    attention_bias = bool(config.get("attention_bias", model_type == "gpt_oss"))
    return Arch(
        name=str(config.get("_name_or_path") or Path(source).parent.name or model_type),
        model_type=model_type,
        hidden=config["hidden_size"],
        intermediate=config["intermediate_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=kv_heads,
        vocab=config["vocab_size"],
        tied=bool(tied),
        head_dim=head_dim,
        # Qwen2 always has q/k/v biases; Llama-style configs say so with attention_bias.
        qkv_bias=bool(config.get("qkv_bias", model_type in ("qwen2", "qwen2_moe"))) or attention_bias,
        norms_per_layer=4 if gemma2 else 2,
        attn_softcap=bool(config.get("attn_logit_softcapping")) if gemma2 else False,
        logit_softcap=bool(config.get("final_logit_softcapping")) if gemma2 else False,
        qk_norm=_qk_norm(model_type, heads * dim_head, kv_heads * dim_head, dim_head),
        attention_bias=attention_bias,
        sinks=model_type == "gpt_oss",
        fused=model_type == "phi3",
        sliding_window=_sliding_window(config),
        expert_bias=model_type == "gpt_oss",
        source=source,
        **_moe_fields(config),
    )


def _sliding_window(config: dict) -> int:
    """The window of the config's sliding-window layers; 0 when it has none in use (Qwen2/3 carry the key with
    use_sliding_window false; Gemma 2/3 and gpt-oss list the layers that use it in layer_types)."""
    window = config.get("sliding_window")
    if not isinstance(window, int) or config.get("use_sliding_window") is False:
        return 0
    types = config.get("layer_types")
    if isinstance(types, list) and "sliding_attention" not in types:
        return 0
    return window


# Families that normalise q and k: per head (Qwen3, Gemma 3: one head_dim-wide RMSNorm each) or over the whole
# projection (OLMo-2: q_norm over heads x head_dim, k_norm over kv_heads x head_dim).
_QK_NORM_PER_HEAD = ("qwen3", "qwen3_moe", "gemma3_text")
_QK_NORM_FULL = ("olmo2",)


def _qk_norm(model_type: str, q_dim: int, kv_dim: int, head_dim: int) -> int:
    if model_type in _QK_NORM_PER_HEAD:
        return 2 * head_dim
    return q_dim + kv_dim if model_type in _QK_NORM_FULL else 0


def _moe_fields(config: dict) -> dict:
    """Mixture-of-experts shapes from the keys each family uses: Mixtral (num_local_experts, one
    expert's width in intermediate_size), Qwen2/3-MoE (num_experts, moe_intermediate_size,
    shared_expert_intermediate_size, mlp_only_layers), DeepSeek (n_routed_experts, n_shared_experts,
    first_k_dense_replace)."""
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0
    if not experts:
        return {}
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    shared = config.get("shared_expert_intermediate_size") or (config.get("n_shared_experts") or 0) * width
    layers = config["num_hidden_layers"]
    step = config.get("decoder_sparse_step") or 1
    sparse = [i for i in range(layers) if i >= (config.get("first_k_dense_replace") or 0)
              and (i + 1) % step == 0 and i not in (config.get("mlp_only_layers") or [])]
    return {"experts": experts, "experts_per_token": config.get("num_experts_per_tok") or 2,
            "moe_intermediate": width, "shared_intermediate": shared,
            "shared_expert_gate": str(config.get("model_type", "")) == "qwen2_moe",
            "dense_layers": layers - len(sparse)}


def load_config_json(path: Path) -> Arch:
    """Read `path` (a config.json, or a directory holding one)."""
    from finetune.fsutil import SpecialFile, read_json

    file = path / MODEL_CONFIG if path.is_dir() else path
    try:
        data = read_json(file)
    except SpecialFile as exc:
        raise ArchError(str(exc)) from None
    except OSError as exc:
        raise ArchError(f"{file}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ArchError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ArchError(f"{file}: expected a JSON object")
    arch = arch_from_config(data, str(file))
    return replace(arch, name=path.name if path.is_dir() else path.parent.name or arch.name)


def names() -> list[str]:
    return [a.name for a in BUILTIN]
