"""Vision-language models (issue 38): recognised from config.json, image rows checked before launch, tokenized with
each image's token run as the processor makes it, never trained on image tokens, every batch through the tower
under the guard, a colour task learnt, the planner's trained-tower activations, merge equal to peft.

The multi-process run (ZeRO-3, one rank's batch without an image) is tests/launches/test_vision.py.
"""

from __future__ import annotations

import copy
import os
import json
import random
from pathlib import Path

import pytest

from finetune.builtin_vision import COLOURS, QUESTION, VLM_SPECS, colour_rows, write_colour_jsonl
from finetune.vision_models import ImageSizing, VisionModelError, find_vision_model, is_vlm_config
from tests.conftest import REPO
from tests.vision_fixtures import entered_modules, saved_bytes, tokenized, vlm_pieces, vlm_recipe

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> Path:
    """8 colour questions (28 or 56 pixels a side) and 4 text-only rows."""
    folder = tmp_path_factory.mktemp("colours")
    write_colour_jsonl(folder / "colours.jsonl", 8, seed=1, text_rows=4)
    return folder / "colours.jsonl"


# ------------------------------------------------------------------------------------------------
# Recognised without torch; sized as transformers' processors size images


def test_a_vlm_is_recognised_from_its_config_and_a_text_model_is_not(tmp_path):
    assert find_vision_model("builtin:tiny-qwen2.5-vl").family.name == "qwen2_5_vl"
    assert find_vision_model("builtin:tiny-llava").sizing.fixed_tokens == 4
    published = find_vision_model("Qwen/Qwen2.5-VL-7B-Instruct")
    assert published.image_token_id == 151655 and published.sizing.max_pixels == 12845056
    # 32 blocks of width 1280 and the merger: the 7B's vision encoder is 0.68B parameters
    assert round((published.tower.tower_params() + published.tower.projector_params()) / 1e9, 2) == 0.68
    assert find_vision_model("builtin:tiny-llama") is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "idefics3", "vision_config": {}, "image_token_id": 5}))
    assert is_vlm_config(json.loads((tmp_path / "config.json").read_text()))
    with pytest.raises(VisionModelError, match="idefics3 vision-language models are not supported"):
        find_vision_model(str(tmp_path))


@pytest.mark.parametrize("size", [(28, 28), (56, 28), (100, 37), (4000, 3000), (15, 15), (900, 5), (900, 4)])
def test_image_tokens_are_transformers_smart_resize(size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    sizing = ImageSizing("qwen2_5_vl", 14, 2, 3136, 12845056)
    width, height = size
    if width > 200 * height:  # both refuse it
        with pytest.raises(ValueError):
            smart_resize(height, width, factor=28, min_pixels=3136, max_pixels=12845056)
        with pytest.raises(VisionModelError, match="aspect ratios above 200"):
            sizing.tokens(width, height)
        return
    h, w = smart_resize(height, width, factor=28, min_pixels=3136, max_pixels=12845056)
    assert sizing.resized(width, height) == (w, h)
    assert sizing.tokens(width, height) == (h // 28) * (w // 28)


def test_tower_shapes_count_the_real_modules(tmp_path):
    """TowerShape's parameters (the planner's and the lint's) are the modules transformers builds."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    for name in VLM_SPECS:
        vm = find_vision_model(f"builtin:{name}")
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**copy.deepcopy(VLM_SPECS[name]["config"])))
        params = dict(model.named_parameters())
        projector = sum(p.numel() for n, p in params.items() if n.startswith(vm.family.projector + "."))
        tower = sum(p.numel() for n, p in params.items() if n.startswith(vm.family.tower + ".")) - \
            (projector if vm.family.projector.startswith(vm.family.tower) else 0)
        assert (tower, projector) == (vm.tower.tower_params(), vm.tower.projector_params()), name
        assert torch.is_tensor(next(iter(params.values())))


@pytest.mark.parametrize("recipe,sets,expected", [
    ("vlm_qwen_lora_zero3", [], {("R175", "info")}),
    ("vlm_qwen_lora_zero3", ["data.packing=true"], {("R170", "error"), ("R175", "info")}),
    ("vlm_qwen_lora_zero3", ["parallel.sequence=2"], {("R172", "error"), ("R175", "info")}),
    ("vlm_qwen_lora_zero3", ["vision.max_image_tokens=1000", "data.max_length=512"], {("R174", "warning"), ("R175", "info")}),
    ("vlm_llava_full", ["vision.max_pixels=100000"], {("R173", "warning"), ("R175", "info")}),
    ("lora_zero3", ["vision.freeze_tower=false"], {("R173", "warning")}),
])
def test_lint_says_what_a_vlm_recipe_cannot_do_and_what_an_image_costs(recipe, sets, expected):
    from finetune.lint import LintOptions, lint_paths

    result = lint_paths([REPO / "recipes" / "tiny" / f"{recipe}.yaml"], LintOptions(overrides=sets))
    found = {(f.rule, f.severity) for f in result.findings if f.rule.startswith("R17")}
    assert found == expected, [f.message for f in result.findings]


# ------------------------------------------------------------------------------------------------
# Data: every row checked before launch, named by file and line


def test_bad_image_rows_are_named_by_file_and_line(tmp_path):
    from finetune.data.images import vision_data
    from finetune.data.sources import sources_of
    from finetune.data.validate import validate

    colour_rows(tmp_path, 1, seed=2)  # images/img000_*.png
    image = next((tmp_path / "images").glob("*.png")).relative_to(tmp_path).as_posix()
    outside = tmp_path.parent / f"{tmp_path.name}-outside.png"
    outside.write_bytes((tmp_path / image).read_bytes())
    (tmp_path / "link.png").symlink_to(outside)  # a link out of the data's folder: refused like `..`
    os.mkfifo(tmp_path / "fifo.png")  # never opened: it would block (issue 40)
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    answer = {"role": "assistant", "content": "red"}
    rows = [
        {"messages": [{"role": "user", "content": f"<image><image>{QUESTION}"}, answer], "images": [image]},
        {"messages": [user, answer], "images": ["images/missing.png"]},
        {"messages": [user, answer], "images": [f"../{outside.name}"]},
        {"messages": [user, answer], "images": ["link.png"]},
        {"messages": [{"role": "user", "content": [{"type": "video"}]}, answer]},
        {"messages": [user, answer], "images": ["data.jsonl"]},
        {"messages": [user, answer], "images": [image]},
        {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "hello"}]},
        {"messages": [user, answer], "images": ["fifo.png"]},
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = vlm_recipe("tiny-qwen2.5-vl", data)
    checked = validate(sources_of(recipe.data, vision=vision_data(recipe, download=False)))
    found = "\n".join(checked.messages())
    assert f"{data}:1: 2 image placeholder(s)" in found and "but 1 image(s) in `images`" in found
    assert f"{data}:2: images[0]: no image file {tmp_path / 'images' / 'missing.png'}" in found
    assert f"{data}:3: images[0] (../{outside.name}) leaves the data's folder" in found
    assert f"{data}:4: images[0] (link.png) leaves the data's folder" in found
    assert f"{data}:5: messages[0].content[0] is a `video` part" in found
    assert f"{data}:6: images[0]" in found and "not an image Pillow can read" in found
    assert f"{data}:9: images[0]: {tmp_path / 'fifo.png'} is a named pipe (FIFO), not an image file" in found
    assert checked.total == 7 and list(checked.checks[0].image_tokens) == [1, 0]  # rows 7 and 8 are fine


def test_an_image_is_a_path_bytes_a_data_url_or_datasets_struct(tmp_path):
    import base64

    from finetune.data.images import ImageSpec, read_ref

    colour_rows(tmp_path, 1, seed=2)
    path = next((tmp_path / "images").glob("*.png"))
    data = path.read_bytes()
    vm = find_vision_model("builtin:tiny-qwen2.5-vl")
    spec = ImageSpec(str(tmp_path), vm.sizing, vm.family.markup, vm.family.image_token, vm.image_token_id, vm.special_ids)
    refs = [read_ref(value, spec, "images[0]") for value in (
        path.relative_to(tmp_path).as_posix(), str(path), data, f"data:image/png;base64,{base64.b64encode(data).decode()}",
        {"bytes": data, "path": None}, {"bytes": None, "path": str(path)})]
    assert len({(r.width, r.height, r.tokens) for r in refs}) == 1
    assert [r.path is not None for r in refs] == [True, True, False, False, False, True]


def test_image_rows_check_without_torch(colours):
    """lint and preflight's row checks run where torch is not installed: Pillow reads the headers."""
    import subprocess
    import sys

    code = (f"import sys; from finetune.recipe import Recipe; from finetune.data.images import vision_data\n"
            f"from finetune.data.sources import sources_of; from finetune.data.validate import validate\n"
            f"r = Recipe.model_validate({{'model': {{'name_or_path': 'builtin:tiny-qwen2.5-vl'}}, "
            f"'data': {{'path': {str(colours)!r}, 'format': 'messages'}}}})\n"
            f"c = validate(sources_of(r.data, vision=vision_data(r, download=False)))\n"
            f"print('OK', c.ok, list(c.checks[0].image_tokens), [m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "OK True" in out.stdout and out.stdout.rstrip().endswith("[]"), out.stdout + out.stderr


# ------------------------------------------------------------------------------------------------
# Tokenized as the processor tokenizes; image tokens never trained; never cut inside an image


def processor_ids(name: str, path: str, tokenizer, image_processor, text: str, images: list) -> list[int]:
    """The ids transformers' processor gives `text` with `images`. LLaVA's processor loads as it is; Qwen2.5-VL's
    needs torchvision for its video processor (transformers 5.24), so its own image-token replacement
    (Qwen2_5_VLProcessor.replace_image_token) expands the text, which its tokenizer then encodes."""
    from types import SimpleNamespace

    from transformers import AutoProcessor, Qwen2_5_VLProcessor

    if name == "tiny-llava":
        return AutoProcessor.from_pretrained(path)(text=[text], images=images or None)["input_ids"][0]
    inputs = image_processor(images=images, return_tensors="pt") if images else {}
    qwen = SimpleNamespace(image_processor=image_processor, image_token="<|image_pad|>")
    for index in range(len(images)):
        text = text.replace("<|image_pad|>", "\0" * int(
            len(Qwen2_5_VLProcessor.replace_image_token(qwen, inputs, index)) // len("<|image_pad|>")), 1)
    return tokenizer(text.replace("\0", "<|image_pad|>"), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-llava"])
def test_rows_are_the_processors_ids_and_no_image_token_trains(name, colours, tiny_cache):
    from finetune.train.vlm_collator import open_image
    from finetune.train.vlm_model import load_image_processor

    recipe = vlm_recipe(name, colours)
    tokenizer, path, rows = tokenized(recipe, tiny_cache)
    vm = find_vision_model(recipe.model.name_or_path)
    image_processor = load_image_processor(path, vm)
    raw = [json.loads(line) for line in colours.read_text().splitlines()]
    for row, original in zip(rows, raw):
        images = [open_image(stored) for stored in row["images"]]
        text = tokenizer.apply_chat_template(original["messages"], tokenize=False)
        assert row["input_ids"] == list(processor_ids(name, path, tokenizer, image_processor, text, images))
        trained = [token for token, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert trained and not set(trained) & set(vm.special_ids)
        assert tokenizer.decode(trained).split("<")[0] in (*COLOURS, "hello", "red", "yes", "no")


def test_a_row_is_dropped_rather_than_cut_inside_an_image(colours, tiny_cache):
    """With the whole row trained (mask_prompt: false) a cut anywhere leaves tokens to train: a row is kept when
    every image token lies before the cut, and dropped (counted) when the cut falls inside or before an image."""
    from finetune.data.images import vision_data
    from finetune.data.sources import sources_of
    from finetune.data.tokenize import tokenize_examples

    recipe = vlm_recipe("tiny-qwen2.5-vl", colours, data={"mask_prompt": False})
    tokenizer, _, whole = tokenized(recipe, tiny_cache)
    spec = sources_of(recipe.data, vision=vision_data(recipe, download=False))[0].spec
    raw = [json.loads(line) for line in colours.read_text().splitlines()]
    image_id = find_vision_model("builtin:tiny-qwen2.5-vl").image_token_id
    cut = 5  # <|im_start|> user \n <|vision_start|> and the first pad: a one-token image fits, a larger one does not
    fits = [i for i, row in enumerate(whole) if max((j for j, t in enumerate(row["input_ids"]) if t == image_id), default=0) < cut]
    dropped: list[int] = []
    rows = tokenize_examples(raw, tokenizer, "messages", cut, mask_prompt=False, spec=spec, dropped=dropped)
    assert sorted(dropped) == [i for i in range(len(raw)) if i not in fits] and 0 < len(dropped) < 8
    assert len(rows) == len(fits) and all(len(r["input_ids"]) <= cut for r in rows)


# ------------------------------------------------------------------------------------------------
# The ZeRO-3 guard: every batch enters the same modules in the same order


@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-llava"])
def test_text_and_image_batches_enter_the_same_modules_under_the_guard(name, colours, tiny_cache):
    import torch

    from finetune.train.vlm_guard import TowerGuard

    recipe = vlm_recipe(name, colours, training={"gradient_checkpointing": True})
    _, rows, collator, model = vlm_pieces(recipe, tiny_cache)
    with_image, text_only = collator([rows[0]]), collator([rows[len(rows) - 1]])
    assert "pixel_values" in with_image and "pixel_values" not in text_only
    image_order, plain = entered_modules(model, with_image), entered_modules(model, text_only)
    assert plain != image_order and not any(".visual." in m or "vision_tower" in m for m in plain)
    with torch.no_grad():
        unguarded = model(**text_only).loss
    guard = TowerGuard(model, find_vision_model(recipe.model.name_or_path)).install()
    assert entered_modules(model, text_only) == image_order
    with torch.no_grad():
        assert torch.equal(model(**text_only).loss, unguarded)  # zero-weighted: the loss does not move
    assert guard.dummy_runs == 2
    guard.remove()
    assert entered_modules(model, text_only) == plain
    # a frozen tower keeps nothing for backward: its features need no gradient (transformers' input-gradient hook
    # is kept off its patch embedding), so no graph holds its activations
    pooled = _image_features(model, with_image).pooler_output
    assert not any(t.requires_grad for t in (pooled if isinstance(pooled, (list, tuple)) else [pooled]))


def _image_features(model, batch):
    from finetune.train.vlm_guard import multimodal_model

    inner = multimodal_model(model)
    if "image_grid_thw" in batch:
        return inner.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    return inner.get_image_features(batch["pixel_values"], vision_feature_layer=inner.config.vision_feature_layer,
                                    vision_feature_select_strategy=inner.config.vision_feature_select_strategy)


# ------------------------------------------------------------------------------------------------
# The colour task learns through the frozen tower; chat --image answers with it


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices on a shared box: torch's thread pool costs more than it gives (60 steps: 5 s, not 100)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def colour_learning(name: str, folder: Path, cache: Path, steps: int = 60) -> tuple[int, list[str]]:
    """(held-out answers right of 20, chat's replies): the language model fine-tuned in full for `steps` steps of
    8 rows on 64 colour squares, the tower and projector frozen; chat greedy-decodes the held-out questions."""
    import torch

    from finetune.use.chat import ChatModel, answer
    from finetune.use.conversation import Conversation
    from finetune.use.images import Vision

    write_colour_jsonl(folder / "train.jsonl", 64, seed=3)
    held = colour_rows(folder, 20, seed=4, prefix="held")
    recipe = vlm_recipe(name, folder / "train.jsonl", method="full")
    tokenizer, rows, collator, model = vlm_pieces(recipe, cache)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    order = random.Random(0)
    for _ in range(steps):
        model(**collator([rows[i] for i in order.sample(range(len(rows)), 8)])).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    chat = ChatModel(model, tokenizer, "messages", "cpu", name, Vision(collator.vm, collator.image_processor))
    replies = []
    for row in held:
        conversation = Conversation(tokenizer, "messages", vision=chat.vision)
        replies.append(answer(chat, conversation, QUESTION, max_new_tokens=3, images=(str(folder / row["images"][0]),)).text)
    right = sum(reply.strip() == row["messages"][1]["content"] for reply, row in zip(replies, held))
    return right, replies


def test_the_colour_task_learns_through_the_frozen_tower(tmp_path, tiny_cache):
    right, replies = colour_learning("tiny-qwen2.5-vl", tmp_path, tiny_cache)
    assert right >= 18, replies  # chance: 5 of 20


@pytest.mark.full
def test_the_colour_task_learns_on_llava(tmp_path, tiny_cache):
    right, replies = colour_learning("tiny-llava", tmp_path, tiny_cache)
    assert right >= 18, replies


# ------------------------------------------------------------------------------------------------
# The planner: a trained tower's saved activations, per patch


@pytest.mark.parametrize("dtype,checkpointing,mode,projector", [
    ("float32", False, "full", True), ("bfloat16", False, "full", False), ("bfloat16", True, "full", True),
    ("bfloat16", False, "lora", False), ("float32", True, "lora", False)])
def test_trained_tower_activations_within_2_percent(dtype, checkpointing, mode, projector):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.plan.vision import saved_per_patch

    spec = copy.deepcopy(VLM_SPECS["tiny-qwen2.5-vl"]["config"])
    spec["vision_config"].update(hidden_size=64, intermediate_size=160, num_heads=4, depth=3)
    config = AutoConfig.for_model(**spec)
    config._attn_implementation = "sdpa"
    model = AutoModelForImageTextToText.from_config(config).to(getattr(torch, dtype)).train()
    vm = find_vision_model("builtin:tiny-qwen2.5-vl")
    tower = type(vm.tower)(**{**vm.tower.__dict__, "hidden": 64, "intermediate": 160, "heads": 4, "depth": 3})
    for name, param in model.named_parameters():
        in_tower = name.startswith("model.visual.") and not name.startswith("model.visual.merger")
        param.requires_grad_((in_tower and mode == "full") or (projector and name.startswith("model.visual.merger")))
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        # adapters in the model's dtype, as DeepSpeed keeps them (the recipes' runs)
        model = get_peft_model(model, LoraConfig(r=8, lora_dropout=0.0, target_modules=r"model\.visual\.blocks\.\d+\.("
                                                 r"attn\.(qkv|proj)|mlp\.(gate|up|down)_proj)"), autocast_adapter_dtype=False)
        if projector:
            pytest.skip("a trained projector beside LoRA is modules_to_save")
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    inner = [m for m in model.modules() if type(m).__name__ == "Qwen2_5_VLModel"][0]
    side = 8  # 8 x 8 patches: 16 merged tokens, two 4 x 4 attention windows
    pixels = torch.randn(side * side, vm.tower.patch_dim, dtype=getattr(torch, dtype))
    measured = saved_bytes(model, lambda: inner.get_image_features(pixels, torch.tensor([[1, side, side]])))
    planned = saved_per_patch(tower, mode, projector, 4 if dtype == "float32" else 2, checkpointing, 8, 5) * side * side
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)


@pytest.mark.parametrize("dtype,checkpointing", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_trained_clip_tower_activations_within_2_percent(dtype, checkpointing):
    """LLaVA's CLIP tower trained in full, its projector frozen: the planner's per-position bytes x positions."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from finetune.plan.vision import saved_per_patch

    spec = copy.deepcopy(VLM_SPECS["tiny-llava"]["config"])
    spec["vision_config"].update(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_hidden_layers=3,
                                 image_size=56)
    config = AutoConfig.for_model(**spec)
    config._attn_implementation = "sdpa"
    model = AutoModelForImageTextToText.from_config(config).to(getattr(torch, dtype)).train()
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("model.vision_tower."))
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    vm = find_vision_model("builtin:tiny-llava")
    tower = type(vm.tower)(**{**vm.tower.__dict__, "hidden": 64, "intermediate": 160, "heads": 4, "depth": 3,
                              "positions": 17})
    pixels = torch.randn(1, 3, 56, 56, dtype=getattr(torch, dtype))
    measured = saved_bytes(model, lambda: model.model.get_image_features(
        pixels, vision_feature_layer=-1, vision_feature_select_strategy="default"))
    planned = saved_per_patch(tower, "full", False, 4 if dtype == "float32" else 2, checkpointing) * 17
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)


# ------------------------------------------------------------------------------------------------
# Merge: through transformers' key mapping, equal to peft's merge_and_unload


@pytest.mark.parametrize("name,projector", [("tiny-qwen2.5-vl", False), ("tiny-llava", True)])
def test_merge_equals_peft_merge_and_unload(name, projector, tmp_path, tiny_cache):
    import torch
    from peft import PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from finetune.builtin import ensure_builtin_model
    from finetune.train.model import lora_config
    from finetune.weights.merge import merge

    base = ensure_builtin_model(f"builtin:{name}", tiny_cache)
    recipe = vlm_recipe(name, tmp_path / "unused.jsonl", vision={"freeze_projector": not projector})
    model = get_peft_model(AutoModelForImageTextToText.from_pretrained(base), lora_config(recipe))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name or "modules_to_save" in param_name:
                param.add_(torch.randn_like(param) * 0.1)  # a trained adapter: B is zero at init
    assert not any(".visual." in n or "vision_tower" in n for n, p in model.named_parameters() if "lora_" in n)
    model.save_pretrained(tmp_path / "adapter")
    merge(base, tmp_path / "adapter", tmp_path / "merged")
    reference = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), tmp_path / "adapter")
    reference.merge_and_unload().save_pretrained(tmp_path / "peft")
    ours, theirs = load_file(tmp_path / "merged" / "model.safetensors"), load_file(tmp_path / "peft" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (tmp_path / "merged" / "chat_template.jinja").is_file()
    assert any((tmp_path / "merged" / n).is_file() for n in ("preprocessor_config.json", "processor_config.json"))


def test_the_shipped_colour_data_is_what_its_script_writes(tmp_path):
    """recipes/data/colours.jsonl and its PNGs come from scripts/make_vision_data.py: the same rows, the same pixels."""
    import runpy

    from PIL import Image

    runpy.run_path(str(REPO / "scripts" / "make_vision_data.py"), run_name="make_vision_data")["main"](
        ["--out", str(tmp_path)])
    shipped = REPO / "recipes" / "data"
    assert (tmp_path / "colours.jsonl").read_text() == (shipped / "colours.jsonl").read_text()
    made = sorted(p.name for p in (tmp_path / "images").glob("*.png"))
    assert made and made == sorted(p.name for p in (shipped / "images").glob("*.png"))
    for name in made:
        with Image.open(tmp_path / "images" / name) as ours, Image.open(shipped / "images" / name) as theirs:
            assert ours.tobytes() == theirs.tobytes() and ours.size == theirs.size, name
