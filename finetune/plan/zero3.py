"""ZeRO-3's gathered parameters: a replay of DeepSpeed's prefetch / release over the module trace."""

from __future__ import annotations

import functools

from finetune.plan.params import ParamGroup, param_groups
from finetune.plan.setup import Setup


def zero3_live_params(setup: Setup, groups: list[ParamGroup]) -> int:
    """Peak number of gathered (full) parameter elements on a GPU in a steady-state ZeRO-3 step.

    Replays partitioned_param_coordinator.py over the module trace (forward, then backward in reverse,
    with each layer's forward recomputed first under gradient checkpointing):
    - fetch_sub_module gathers the module's parameters, then prefetches the next ones in trace
      order, up to stage3_prefetch_bucket_size elements per call while fewer than
      stage3_max_live_parameters are available. Every call moves the prefetch frontier further, so
      in a steady-state step the gathered parameters grow to about max_live_parameters (1e9 by
      default: 2 GB in 16-bit), plus whatever single module crosses the limit;
    - release_sub_module frees them, except parameters used again within stage3_max_reuse_distance
      elements of trace (__params_to_release) or already prefetched for a later step.
    Parameters at or under stage3_param_persistence_threshold are never gathered (counted elsewhere).
    """
    # The trace depends only on these (param_groups is a function of the same fields).
    key = (setup.arch, setup.params, setup.method, setup.lora_r, setup.lora_targets, setup.modules_to_save,
           setup.param_persistence_threshold, setup.gradient_checkpointing, setup.lora_experts, setup.lora_router,
           setup.moe_leaf)
    return _live_cached(key, setup.prefetch_bucket_size, setup.max_live_parameters, setup.max_reuse_distance)


@functools.lru_cache(maxsize=64)
def _live_cached(key: tuple, prefetch: int, max_live: int, reuse: int) -> int:
    trace = _trace_cached(key)
    return _replay_zero3(trace, prefetch, max_live, reuse) if trace else 0


@functools.lru_cache(maxsize=16)
def _trace_cached(key: tuple) -> list:
    arch, params, method, r, targets, saved, threshold, ckpt, experts, router, moe_leaf = key
    setup = Setup(arch=arch, params=params, method=method, lora_r=r, lora_targets=targets, modules_to_save=saved,
                  param_persistence_threshold=threshold, gradient_checkpointing=ckpt, stage=3, lora_experts=experts,
                  lora_router=router, moe_leaf=moe_leaf)
    return _module_trace(setup, param_groups(setup))


def _module_trace(setup: Setup, groups: list[ParamGroup]) -> list[tuple[str, int, int]]:
    """[(module key, elements gathered, elements traversed)] for every module DeepSpeed's hooks see in
    one step, containers and parameter-free modules included (each of their pre-forward/backward
    hooks calls fetch_sub_module, which prefetches further). Forward runs in call order; backward
    visits modules in the reverse order of their forward completion; gradient checkpointing re-runs
    each decoder layer's forward just before its backward. peft's LoRA layer runs its base layer, its
    dropout, lora_A and lora_B, each a module with its own hooks.
    """
    arch = setup.arch
    if arch is None:
        return []
    thr = setup.param_persistence_threshold
    units: dict[str, list[ParamGroup]] = {}
    for g in groups:
        units.setdefault(g.unit, []).append(g)

    frozen: set[str] = set()

    def leaf(key: str, members: list[ParamGroup]) -> tuple[str, int, int]:
        gathered = sum(g.storage_numel for g in members if g.storage_numel > thr)
        if gathered and not any(g.trainable for g in members):
            frozen.add(key)
        return key, gathered, sum(g.storage_numel for g in members)

    def container(key: str, children: list) -> tuple:
        return ("call", (key, 0, 0), children)

    def module(prefix: str, unit: str) -> tuple:
        """A projection (with its LoRA modules when it has them), as a call tree."""
        base = leaf(f"{prefix}{unit}", units.get(unit, []))
        if f"{unit}.lora_A" not in units:
            return ("call", base, [])
        return container(f"{prefix}{unit}.wrapper", [
            ("call", base, []), ("call", (f"{prefix}{unit}.dropout", 0, 0), []),
            ("call", leaf(f"{prefix}{unit}.lora_A", units[f"{unit}.lora_A"]), []),
            ("call", leaf(f"{prefix}{unit}.lora_B", units[f"{unit}.lora_B"]), [])])

    def layer(i: int) -> tuple:
        p = f"{i}."
        attn = container(p + "attn", [module(p, lin.name) for lin in arch.attention_linears()]
                         + ([module(p, "attn_extras")] if arch.layer_extras else []))
        gated = [lin.name for lin in arch.mlp_linears(arch.intermediate)]
        mlp = container(p + "mlp", [module(p, gated[0]), ("call", (p + "act", 0, 0), [])]
                        + [module(p, n) for n in gated[1:]])
        if i >= arch.dense_mlp_layers:
            # A MoE block: the router, the experts module (every expert's weights at once), then the
            # shared expert and its gate.
            shared = [module(p, "shared_expert.gate_proj"), ("call", (p + "shared_act", 0, 0), []),
                      module(p, "shared_expert.up_proj"), module(p, "shared_expert.down_proj")] \
                if arch.shared_intermediate else []
            gate = [module(p, "shared_expert_gate")] if arch.shared_expert_gate else []
            mlp = container(p + "mlp", [module(p, "router"), module(p, "experts")] + shared + gate)
            if setup.moe_leaf:
                # A leaf (leaf_module.classes): entering the block fetches all of it, LoRA included, and no
                # hook fires inside it.
                mlp = ("call", leaf(p + "mlp", [g for unit, members in units.items() if _in_moe_block(unit)
                                                 for g in members]), [])
        norms = [module(p, f"norm{k + 1}") for k in range(arch.norms_per_layer)]
        # Gemma 2 wraps attention and MLP in pre/post norms; Llama-style models have one norm before each.
        body = [norms[0], attn] + norms[1:-1] + [mlp] + norms[-1:] if arch.norms_per_layer == 4 else \
            [norms[0], attn, norms[1], mlp]
        return container(p + "layer", body)

    # modules_to_save: the trainable copy runs instead of the original.
    embed = ("call", leaf("embed_tokens", units.get("embed_tokens.copy") or units.get("embed_tokens", [])), [])
    if arch.tied:
        head_base = embed[1]  # one Parameter: gathering it for the head is gathering the embedding
    else:
        head_base = leaf("lm_head", units.get("lm_head.copy") or units.get("lm_head", []))
    if "lm_head.lora_A" in units:
        head = container("lm_head.wrapper", [("call", head_base, []), ("call", ("lm_head.dropout", 0, 0), []),
                                             ("call", leaf("lm_head.lora_A", units["lm_head.lora_A"]), []),
                                             ("call", leaf("lm_head.lora_B", units["lm_head.lora_B"]), [])])
    else:
        head = ("call", head_base, [])
    layers = [layer(i) for i in range(arch.layers)]
    model = container("model", [embed, ("call", ("rotary", 0, 0), [])] + layers
                      + [("call", leaf("final_norm", units.get("final_norm", [])), [])])
    top = container("causal_lm", [model, head])
    if setup.method != "full":
        top = container("peft_model", [top])  # PeftModel (LoraModel calls the model's forward directly)

    def forward(node: tuple, out: list) -> None:
        out.append(node[1])
        for child in node[2]:
            forward(child, out)

    def completion(node: tuple, out: list) -> None:
        for child in node[2]:
            completion(child, out)
        out.append(node)

    trace: list[tuple] = [(*step, False) for step in _walk(top, forward)]
    finished: list[tuple] = []
    completion(top, finished)
    layer_keys = {lay[1][0] for lay in layers}
    # With a frozen embedding no gradient flows into it, nor into layer 0's first norm and the frozen
    # q/k/v base layers that read its output: their backward hooks never fire. Not so with gradient
    # checkpointing: peft (and prepare_model_for_kbit_training) then make the embedding's output
    # require grad (enable_input_require_grads), so every module runs backward.
    no_grad = set()
    if setup.method != "full" and "embed_tokens.copy" not in units and not setup.gradient_checkpointing:
        no_grad = {"embed_tokens", "0.norm1"} | {f"0.{n}{x}" for n in ("q_proj", "k_proj", "v_proj")
                                                  for x in ("", ".dropout")}
    pending = None
    for node in reversed(finished):
        key = node[1][0]
        if key in no_grad:
            continue
        trace.append((*node[1], False))
        if setup.gradient_checkpointing and key in layer_keys:
            pending = node
        elif pending is not None and not node[2]:
            # The first leaf of a checkpointed layer to run backward needs its saved tensors: the
            # layer's forward runs again. Frozen parameters gathered for it stay until that leaf's
            # backward is done (partitioned_param_coordinator.py: ds_recompute_parameters).
            for step in _walk(pending, forward, children_only=True):
                trace.append((*step, step[0] in frozen))
            trace.append(RELEASE_HELD)
            pending = None
    return trace


RELEASE_HELD = ("<release recompute params>", 0, 0, False)
_MOE_BLOCK_UNITS = ("router", "experts", "shared_expert.", "shared_expert_gate")


def _in_moe_block(unit: str) -> bool:
    return unit.startswith(_MOE_BLOCK_UNITS)


def _walk(node: tuple, forward, children_only: bool = False) -> list:
    out: list = []
    for child in (node[2] if children_only else [node]):
        forward(child, out)
    return out


def _replay_zero3(trace: list[tuple], prefetch: int, max_live: int, reuse: int) -> int:
    n = len(trace)
    size = {step[0]: step[1] for step in trace}
    # Where each step's parameters are used next, and the elements of trace before each step.
    next_use = [n] * n
    last_seen: dict[str, int] = {}
    for i in range(n - 1, -1, -1):
        key = trace[i][0]
        next_use[i] = last_seen.get(key, n)
        last_seen[key] = i
    before = [0]
    for step in trace:
        before.append(before[-1] + step[2])
    available: set[str] = set()
    held: set[str] = set()
    live = 0
    fetched_for: dict[str, int] = {}  # most recent step a parameter was (pre)fetched for
    queue = 0  # the prefetch queue walks the trace in order
    peak = 0
    for index, (key, numel, _, hold) in enumerate(trace):
        if key == RELEASE_HELD[0]:
            for k in held & available:
                available.discard(k)
                live -= size[k]
            held.clear()
            continue
        if key not in available:
            available.add(key)
            live += numel
        fetched_for[key] = max(fetched_for.get(key, index), index)
        queue = max(queue, index + 1)
        budget = min(max(0, max_live - live), prefetch)
        prefetched = 0
        while queue < n and prefetched < budget:
            ahead = trace[queue][0]
            if ahead not in available and ahead != RELEASE_HELD[0]:
                available.add(ahead)
                live += size[ahead]
                prefetched += size[ahead]
            fetched_for[ahead] = max(fetched_for.get(ahead, queue), queue)
            queue += 1
        peak = max(peak, live)
        if hold:
            held.add(key)
            continue
        nxt = next_use[index]
        reused = nxt < n and before[nxt] - before[index + 1] < reuse
        if not reused and fetched_for[key] <= index:
            available.discard(key)
            live -= numel
    return peak
