"""llama.cpp's own code on finetune's GGUF exports: its K-quant quantizer (llama_model_quantize) checked weight for
weight against its own ggml_quantize_chunk, and its runtime's tokenization and logits against transformers.

These need llama-cpp-python, which builds llama.cpp from source (8-15 min on an idle 2-core box; README records the
build and these numbers), so they are `full` tests, out of the default run:

    CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install llama-cpp-python==0.3.36
    python -m pytest -q -m full tests/export/test_llama_cpp.py -s     # -s prints the numbers
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.full
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (builds llama.cpp): see the module docstring")
pytest.importorskip("conversion", reason="llama.cpp's converter: pip install 'finetune[export]'")

PROMPTS = ("What is the capital of France?", "Add 7 and 5.", "Name a primary colour.", "Reverse the word cat.")


def _with_demo_recipe(folder: Path) -> Path:
    from finetune.recipe import load_recipe
    from finetune.rundir.layout import dump_yaml, resolved_recipe

    (folder / "finetune_recipe.yaml").write_text(dump_yaml(resolved_recipe(load_recipe(REPO / "recipes" / "demo.yaml").recipe, folder)))
    return folder


def _wide_model(tiny_dir: Path, folder: Path) -> Path:
    """A Llama 256 wide (K-quants take rows of 256: a narrower model falls back to Q5_0/Q8_0 without a word), random
    weights, the tiny model's tokenizer, the demo's recipe."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=768, max_position_embeddings=512, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tiny_dir / name).is_file():
            shutil.copy(tiny_dir / name, folder / name)
    return _with_demo_recipe(folder)


def test_q4_k_m_is_k_quants_and_equals_llama_cpps_own_rounding(tiny_dir, tmp_path):
    import gguf

    from finetune.export.gguf_export import export_gguf

    model = _wide_model(tiny_dir, tmp_path / "wide")
    result = export_gguf(model, "q4_k_m", tmp_path / "q4")
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(result.gguf)).tensors}
    check = result.verify
    print(f"\nq4_k_m of a 256-wide Llama: tensor types {sorted(types)}; KL {check['kl']:.3g} (bound "
          f"{check['kl_bound']:.3g} from llama.cpp's own rounding), max |logit diff| {check['max_abs_logit_diff']:.3g}, "
          f"argmax equal at {check['argmax_agree']} of {check['decided_positions']} decided positions")
    assert {"Q4_K", "Q6_K"} <= types and not types & {"Q4_0", "Q5_0", "Q5_1", "Q8_0"}  # K-quants, no fallback
    assert check["ok"], check
    assert check["weights_equal_rounding"] and check["rounding"] == "the quantizers that wrote the file"
    assert json.loads((tmp_path / "q4" / "export.json").read_text())["verify"]["ok"]
    assert not result.notes  # nothing fell back
    runtime = check["llama_cpp"]  # --verify ran the GGUF in llama.cpp too
    assert runtime["tokens_equal"] and runtime["argmax_agree"] == runtime["decided_positions"] > 0, runtime

    narrow = export_gguf(_with_demo_recipe(Path(shutil.copytree(tiny_dir, tmp_path / "narrow"))), "q4_k_m",
                         tmp_path / "q4-narrow")
    assert narrow.verify["ok"] and narrow.verify["weights_equal_rounding"], narrow.verify
    assert any("not K-quants: their rows (128 wide)" in note for note in narrow.notes), narrow.notes


def test_llama_cpp_tokenizes_and_computes_the_f16_export_as_transformers_does(tiny_dir, tmp_path):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.data.formats import alpaca_prompt
    from finetune.export.gguf_export import export_gguf

    merged = _with_demo_recipe(Path(shutil.copytree(tiny_dir, tmp_path / "merged-demo")))
    result = export_gguf(merged, "f16", tmp_path / "f16")
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    llm = llama_cpp.Llama(model_path=str(result.gguf), n_ctx=512, logits_all=True, verbose=False, n_threads=2)
    kl_sum, positions, max_diff, same_argmax = 0.0, 0, 0.0, 0
    for text in PROMPTS:
        prompt = alpaca_prompt(text)
        ours = tokenizer(prompt, add_special_tokens=True)["input_ids"]  # what finetune chat sends
        theirs = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        assert theirs == ours, (text, theirs, ours)
        llm.reset()
        llm.eval(theirs)
        got = torch.from_numpy(np.array(llm.scores[:len(theirs)], dtype=np.float64))
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ours])).logits[0].to(torch.float64)
        p, q = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
        kl_sum += float((p.exp() * (p - q)).sum())
        positions += len(ours)
        max_diff = max(max_diff, float((want - got).abs().max()))
        same_argmax += int((want.argmax(-1) == got.argmax(-1)).sum())
    kl = kl_sum / positions
    print(f"\nllama.cpp on the f16 export vs transformers (fp32): tokens equal on {len(PROMPTS)} prompts; KL {kl:.3g} "
          f"(the export's f16 bound {result.verify['kl_bound']:.3g}), max |logit diff| {max_diff:.3g}, argmax equal at "
          f"{same_argmax} of {positions} positions")
    assert kl <= result.verify["kl_bound"] * 4, kl  # f16 weights plus llama.cpp's own f16/f32 arithmetic
