"""QLoRA's model as `finetune plan --trace` builds it (finetune/plan/trace/step.py): bitsandbytes' 4-bit linears
emulated on fake tensors (the packed weight, its quantization state, the dequantized copy while each runs,
bitsandbytes' dtype handling), and the casts of peft's prepare_model_for_kbit_training. Torch is imported
inside functions."""

from __future__ import annotations

from finetune.plan.activations import bnb_uncast
from finetune.plan.constants import BNB_BLOCKSIZE
from finetune.plan.setup import Setup


def four_bit_linears(model, setup: Setup) -> None:
    """bitsandbytes' Linear4bit in place of every decoder-layer nn.Linear (transformers' bnb quantizer
    skips the output head only): a packed uint8 weight of numel / 2 bytes and its quantization state
    (absmax per 64 values, 8-bit with an fp32 second level under double quant). The peft LoRA layer around one
    then takes its input as peft's bitsandbytes layer does under CUDA autocast (activations.bnb_uncast): its
    `_cast_input_dtype` is switched off, since the CPU autocast the trace runs is not what peft asks about."""
    import torch

    uncast = bnb_uncast(setup)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            path = f"{name}.{child_name}"
            if type(child) is torch.nn.Linear and ".layers." in f".{path}" and "lora_" not in path:
                setattr(module, child_name, FourBitLinear.from_linear(child, setup.double_quant))
                if uncast and child_name == "base_layer":
                    module.cast_input_dtype_enabled = False  # peft tuners_utils _cast_input_dtype


def prepare_for_kbit_training(model) -> None:
    """What peft's prepare_model_for_kbit_training does to the dtypes (peft/utils/other.py: "cast all non INT8
    parameters to fp32"): every 16-bit parameter that is not a packed 4-bit weight becomes fp32, the
    embeddings, the output head and the norms (the adapters are fp32 already)."""
    import torch

    for param in model.parameters():
        if param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)


def _make_four_bit_linear():
    import torch

    class DequantMatMul(torch.autograd.Function):
        """bitsandbytes autograd/_functions.py MatMul4Bit: forward dequantizes the weight
        (functional.dequantize_4bit: a 16-bit copy, and the fp32 absmax first under double quant),
        runs F.linear and frees it; it saves the packed weight only, and backward dequantizes again
        for the input's gradient."""

        @staticmethod
        def forward(ctx, x, packed, absmax, shape):
            ctx.shape, ctx.dtype = shape, x.dtype
            ctx.save_for_backward(packed, absmax)
            return torch.nn.functional.linear(x, _dequantize(packed, absmax, shape, x.dtype))

        @staticmethod
        def backward(ctx, grad):
            packed, absmax = ctx.saved_tensors
            weight = _dequantize(packed, absmax, ctx.shape, ctx.dtype)
            return grad @ weight, None, None, None

    def _dequantize(packed, absmax, shape, dtype):
        # The values do not matter to the trace, only what is allocated: the fp32 absmax (double
        # quant) and the 16-bit weight.
        scale = absmax.float() if absmax.dtype == torch.uint8 else absmax
        weight = torch.empty(shape, dtype=dtype, device=packed.device)
        del scale
        return weight

    class FourBitLinear(torch.nn.Module):
        def __init__(self, in_features, out_features, bias, dtype, double_quant):
            super().__init__()
            self.in_features, self.out_features, self.compute_dtype = in_features, out_features, dtype
            numel = in_features * out_features
            blocks = -(-numel // BNB_BLOCKSIZE)
            kw = {"device": "meta"}
            self.weight = torch.nn.Parameter(torch.empty((numel + 1) // 2, dtype=torch.uint8, **kw), requires_grad=False)
            self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8 if double_quant else torch.float32, **kw))
            self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=dtype, **kw), requires_grad=False) if bias else None

        @classmethod
        def from_linear(cls, linear, double_quant):
            return cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype,
                       double_quant)

        def forward(self, x):
            # bitsandbytes nn.Linear4bit.forward: the input cast to the compute dtype (the model's), the
            # output back to the input's dtype (no-ops when the input is already 16-bit).
            dtype = x.dtype
            out = DequantMatMul.apply(x.to(self.compute_dtype), self.weight, self.absmax,
                                      (self.out_features, self.in_features))
            out = out if self.bias is None else out + self.bias.to(self.compute_dtype)
            return out.to(dtype)

    return FourBitLinear


class _Lazy:
    def __init__(self, make):
        self.make, self.value = make, None

    def __getattr__(self, name):
        if self.value is None:
            self.value = self.make()
        return getattr(self.value, name)


FourBitLinear = _Lazy(_make_four_bit_linear)
