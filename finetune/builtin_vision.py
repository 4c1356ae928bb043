"""The built-in tiny vision-language models: `builtin:tiny-qwen2.5-vl` and `builtin:tiny-llava` (issue 38).

Random-init Qwen2.5-VL and LLaVA built from their config classes (a 2-block vision tower, a 2-layer language
model, a byte-level BPE tokenizer trained on the colour task's sentences), so that the image path (data checks,
collator, ZeRO-3 guard, merge, chat) trains on a CPU in seconds. finetune.builtin resolves, hashes and caches
them like `builtin:tiny-llama`; this module holds what differs: the config.json and processor settings
(`VLM_SPECS`, read without torch by finetune.vision_models), the builders, and the colour task.

The colour task: a solid square of one of COLOURS (with a little noise, 28 or 56 pixels a side) and the
question "What colour is this?"; the answer is the colour's name. `colour_rows` writes it as messages rows
with an `images` column, the form recipes/data/colours.jsonl ships in.

torch, transformers, tokenizers and PIL are imported inside the builders only.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Iterator

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (235, 220, 40)}
QUESTION = "What colour is this?"
# Rows without an image, so that a micro batch can hold none (the ZeRO-3 guard's case): short fixed replies.
TEXT_TURNS = (("Say hello.", "hello"), ("Name a colour.", "red"), ("Say yes.", "yes"), ("Say no.", "no"))
VOCAB = 320  # 256 byte symbols + the special tokens + merges enough for the task's words

# Special tokens first, so their ids are fixed (the config's image_token_id needs them before training).
_QWEN_SPECIALS = ("<pad>", "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
_LLAVA_SPECIALS = ("<pad>", "<s>", "</s>", "<image>", "<|user|>", "<|assistant|>", "<|system|>")

# Qwen's chat layout: each turn `<|im_start|>role\n ... <|im_end|>\n`, an image part as Qwen2.5-VL's own
# template writes it (vision start, one pad the processor arithmetic expands, vision end).
_QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# LLaVA-1.5's: an image part is `<image>` and a newline; the assistant's turn ends with EOS.
_LLAVA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.08)
# config.json as transformers writes it (JSON values only): what finetune.vision_models reads without torch.
VLM_SPECS: dict[str, dict[str, Any]] = {
    "tiny-qwen2.5-vl": {
        "config": {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "text_config": {**_TEXT, "model_type": "qwen2_5_vl_text", "rms_norm_eps": 1e-5,
                            # head_dim 16: mrope covers 8 rotary pairs (temporal 2, height 3, width 3)
                            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
            "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                              "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                              "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
                              "model_type": "qwen2_5_vl_vision"},
            "image_token_id": 6, "video_token_id": 7, "vision_start_token_id": 4, "vision_end_token_id": 5,
            "tie_word_embeddings": False,
        },
        # 28 x 28 (one merged token) to 56 x 56 (four): the task's squares, and a test of the resize arithmetic
        "preprocessor": {"min_pixels": 28 * 28, "max_pixels": 56 * 56, "patch_size": 14, "merge_size": 2,
                         "temporal_patch_size": 2},
        "specials": _QWEN_SPECIALS, "bos": None, "eos": "<|im_end|>", "pad": "<pad>", "template": _QWEN_TEMPLATE,
    },
    "tiny-llava": {
        "config": {
            "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
            "text_config": {**_TEXT, "model_type": "llama", "rms_norm_eps": 1e-5,
                            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
            # CLIP at 28 x 28 in 14-pixel patches: 4 patches + the class token; "default" drops the class token
            "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                              "projection_dim": 32},
            "image_token_index": 3, "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
            "projector_hidden_act": "gelu", "tie_word_embeddings": False,
        },
        "preprocessor": {"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}},
        "processor": {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1,
                      "image_token": "<image>"},
        "specials": _LLAVA_SPECIALS, "bos": "<s>", "eos": "</s>", "pad": "<pad>", "template": _LLAVA_TEMPLATE,
    },
}
MODEL_SEED = 0


def build(name: str, out: Path) -> None:
    """Tokenizer, image processor (and processor settings) and random weights of VLM_SPECS[name] into `out`."""
    spec = VLM_SPECS[name]
    tokenizer = _build_tokenizer(spec, out)
    _save_image_processor(spec, tokenizer, out)
    _build_model(spec, out)


def _build_tokenizer(spec: dict[str, Any], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(spec["specials"]), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # trim_offsets=False: exact character offsets (finetune.data.tokenize finds the assistant's spans with them)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec["eos"], pad_token=spec["pad"],
                                   **({"bos_token": spec["bos"]} if spec["bos"] else {}), model_max_length=1024,
                                   additional_special_tokens=[t for t in spec["specials"]
                                                              if t not in (spec["eos"], spec["pad"], spec["bos"])])
    fast.chat_template = spec["template"]
    fast.save_pretrained(str(out))
    return fast


def _save_image_processor(spec: dict[str, Any], tokenizer, out: Path) -> None:
    """The PIL image processor (torchvision is not needed: issue 38) and, for LLaVA, the processor's settings."""
    family = spec["config"]["model_type"]
    if family == "llava":
        from transformers import CLIPImageProcessorPil, LlavaProcessor

        image = CLIPImageProcessorPil(**spec["preprocessor"])
        LlavaProcessor(image_processor=image, tokenizer=tokenizer, chat_template=spec["template"],
                       **spec["processor"]).save_pretrained(str(out))
    else:
        from transformers import Qwen2VLImageProcessorPil

        Qwen2VLImageProcessorPil(**spec["preprocessor"]).save_pretrained(str(out))


def _build_model(spec: dict[str, Any], out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(**json.loads(json.dumps(spec["config"])))
    # fork_rng: building the model must not move the caller's random state
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(str(out))


def _corpus() -> Iterator[str]:
    for _ in range(20):
        for colour in COLOURS:
            yield f"{QUESTION} {colour}"
        for question, answer in TEXT_TURNS:
            yield f"{question} {answer}"
    yield "system user assistant image"


# ------------------------------------------------------------------------------------------------
# The colour task


def colour_square(colour: str, size: tuple[int, int], rng: random.Random, noise: int = 12):
    """A PIL image of `size` (width, height) in `colour`, each pixel moved by up to `noise` levels (so no two
    match; 0: a flat square, a hundred bytes as a PNG)."""
    from PIL import Image

    base = COLOURS[colour]
    pixels = bytes(max(0, min(255, c + rng.randint(-noise, noise))) for _ in range(size[0] * size[1]) for c in base)
    return Image.frombytes("RGB", size, pixels)


def colour_rows(folder: Path, count: int, seed: int, text_rows: int = 0, prefix: str = "img") -> list[dict[str, Any]]:
    """`count` colour questions (PNGs written under `folder`/images, named in the rows relative to `folder`),
    then `text_rows` rows without an image; a fixed order for a seed."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        colour = rng.choice(sorted(COLOURS))
        size = (rng.choice((28, 56)), rng.choice((28, 56)))
        name = f"images/{prefix}{i:03d}_{colour}.png"
        colour_square(colour, size, rng).save(folder / name, optimize=True)
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                                  {"role": "assistant", "content": colour}], "images": [name]})
    for i in range(text_rows):
        question, answer = TEXT_TURNS[i % len(TEXT_TURNS)]
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return rows


def example_rows(folder: Path) -> list[dict[str, Any]]:
    """recipes/data/colours.jsonl: each colour at 28x28 and 56x28 (flat PNGs under `folder`/images), asked in
    the three forms rows place images in (an image part, `<image>` in the text, two images in one turn), and
    the text-only rows; scripts/make_vision_data.py writes it."""
    rng = random.Random(7)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for colour in sorted(COLOURS):
        names = []
        for size in ((28, 28), (56, 28)):
            name = f"images/{colour}_{size[0]}x{size[1]}.png"
            colour_square(colour, size, rng, noise=0).save(folder / name, optimize=True)
            names.append(name)
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                                  {"role": "assistant", "content": colour}], "images": [names[0]]})
        rows.append({"messages": [{"role": "user", "content": f"<image>{QUESTION}"},
                                  {"role": "assistant", "content": colour}], "images": [names[1]]})
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                               {"type": "text", "text": "Are these the same colour?"}]},
                                  {"role": "assistant", "content": "yes"}], "images": names})
    for question, answer in TEXT_TURNS:
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return rows


def write_colour_jsonl(path: Path, count: int, seed: int, text_rows: int = 0, prefix: str = "img") -> int:
    """colour_rows() as JSON lines at `path` (images beside it, under images/)."""
    from finetune.fsutil import write_atomic

    rows = colour_rows(Path(path).parent, count, seed, text_rows, prefix)
    write_atomic(Path(path), "".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)
