"""Quantize the frozen base weights of a GPT for QLoRA, through bitsandbytes.

The linear layers inside each `Block` (attention q/k/v/o and the MLP) are replaced by bitsandbytes
layers holding the same weights: `Linear4bit` (NF4 or FP4, optionally with double-quantized
statistics) or `Linear8bitLt` (LLM.int8()). Embeddings, norms and `lm_head` stay in `compute_dtype`:
they are a small share of the weights and the head is the layer most sensitive to quantization.

A mixture of experts' routed experts (3-D weights, `llmtrain.moe.GroupedExperts`) become `QuantizedExperts`: one
bitsandbytes layer per expert and projection, each dequantized in its own expert's product. Its router stays in
`compute_dtype` too: it is tiny (n_embd x n_expert), and a quantization error in its logits changes which experts a
token reaches, not just how much.

Order for users: build model -> load weights -> `quantize_model` -> `apply_lora` -> `mark_only_lora_trainable`.

Quantization is done here, explicitly, on the device the weights are on (or on `device`), rather
than by bitsandbytes' "quantize on `.cuda()`" convention, so the same code runs on CPU and GPU.

bitsandbytes is imported only inside the functions that need it; the rest of llmtrain never does.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Literal, Optional, get_args

import torch
import torch.nn as nn

from llmtrain.moe import EXPERT_PROJECTIONS, GroupedExperts, MoE, expert_loop

QuantizeMode = Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.fp4-dq", "bnb.int8-training"]
QUANTIZE_MODES: tuple[str, ...] = get_args(QuantizeMode)

# Values per absmax block for 4-bit weights (bitsandbytes' default, as in the QLoRA paper).
BLOCKSIZE_4BIT = 64
# LLM.int8(): activation columns with any |value| above this are multiplied in 16-bit, not int8.
INT8_OUTLIER_THRESHOLD = 6.0


def quantized_bytes_per_weight(mode: str) -> float:
    """Bytes one quantized weight takes: an int8 code, or a 4-bit code and its share of the fp32 absmax per block."""
    return 1.0 if mode.startswith("bnb.int8") else 0.5 + 4 / BLOCKSIZE_4BIT


def _drop_int8_cast_notice(record: logging.LogRecord) -> bool:
    # LLM.int8() matmuls log "inputs will be cast ... to float16" on every call whose input is not
    # fp16 (bf16/fp32 compute dtypes): once per layer per step. The cast is documented in
    # quantize_model; one line per matmul would bury the training log.
    return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast")


def import_bitsandbytes():
    """Import bitsandbytes, or fail with a message that says how to get it."""
    # NOTE: on CPUs with AVX512-BF16, bitsandbytes logs at import that an optional inference
    # kernel package ("kernels") is missing. Training never uses that kernel; keep the log quiet.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes.autograd._functions").addFilter(_drop_int8_cast_notice)
    try:
        with warnings.catch_warnings():
            # Importing bitsandbytes imports torch.utils.mkldnn, whose torch.jit.script_method use
            # torch itself deprecates: not ours to fix, and not the user's.
            warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method", category=DeprecationWarning)
            import bitsandbytes
    except ImportError as error:
        raise ImportError(
            "Quantization (--quantize bnb.*) needs bitsandbytes: `pip install bitsandbytes`"
        ) from error
    return bitsandbytes


def quantize_model(
    model: nn.Module,
    mode: QuantizeMode,
    compute_dtype: torch.dtype = torch.bfloat16,
    device: Optional[torch.device | str] = None,
) -> nn.Module:
    """Replace the linear layers inside every `Block` of `model` by quantized bitsandbytes layers, in place.

    mode: `bnb.nf4` / `bnb.fp4` store 4-bit weights with one absmax per 64 values; `-dq` also
    quantizes those absmax statistics (double quantization, ~0.4 bit/param less); `bnb.int8-training`
    stores int8 weights with one scale per output row (LLM.int8(), outlier threshold 6.0); its int8
    matmuls take fp16 inputs, so other compute dtypes are cast to fp16 and back on GPU. On CPU,
    bitsandbytes trains int8 layers by dequantizing the weight and multiplying in the input's dtype.
    compute_dtype: the dtype the quantized layers compute in; the model's other parameters
    (embeddings, norms, head) are cast to it too, so activations and LoRA adapters share one dtype.
    device: where to quantize, and where the whole model ends up; default: where the weights are now.
    Loading the weights on CPU and quantizing straight onto the GPU keeps GPU memory at the 4-bit size.

    Returns `model`. Call it after the weights are loaded and before `apply_lora`.
    """
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"--quantize {mode!r} is not supported; choose one of {list(QUANTIZE_MODES)}")
    if any(name.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for name, _ in model.named_parameters()):
        raise ValueError("quantize_model must run before apply_lora: quantize the base model, then add adapters")
    bnb = import_bitsandbytes()
    for block in model.blocks:
        quantize_block(block, mode, compute_dtype, device, bnb)
    _convert_unquantized(model, compute_dtype, device)
    return model


def check_quantizable(block: nn.Module, mode: QuantizeMode, device=None, bnb=None) -> None:
    """Refuse, before any layer is quantized, what bitsandbytes would quantize wrongly.

    On the CPU, bitsandbytes (measured: 0.50) dequantizes a 4-bit weight with the wrong absmax blocks when its rows
    are not whole blocks of 64 values: the relative error was 0.26-0.28 where whole blocks give 0.09. Every layer of
    the zoo's models has a width that is a multiple of 64; a custom model may not.
    """
    if mode == "bnb.int8-training":
        return
    bnb = bnb or import_bitsandbytes()
    for name, module in _quantizable(block):
        weights = ([(name, module.weight)] if isinstance(module, nn.Linear) else
                   [(f"{name}.{projection}", getattr(module, projection)) for projection in EXPERT_PROJECTIONS])
        for weight_name, weight in weights:
            if weight.size(-1) % BLOCKSIZE_4BIT and torch.device(device or weight.device).type == "cpu":
                raise ValueError(
                    f"--quantize {mode}: bitsandbytes {bnb.__version__} dequantizes 4-bit weights wrongly on the CPU "
                    f"where a layer's input width is not a multiple of {BLOCKSIZE_4BIT} ({weight_name}: "
                    f"{weight.size(-1)}). Quantize on a GPU, use --quantize bnb.int8-training, or train LoRA without "
                    "--quantize")


def _quantizable(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of what quantizing replaces in ``block``: its plain linear layers but a mixture of experts'
    router, and its routed experts. NOTE: exact types, so layers already quantized (subclasses) are left alone."""
    routers = {f"{name}.router" for name, module in block.named_modules() if isinstance(module, MoE)}
    return [(name, module) for name, module in block.named_modules()
            if (type(module) is nn.Linear and name not in routers) or type(module) is GroupedExperts]


def quantize_block(block: nn.Module, mode: QuantizeMode, compute_dtype: torch.dtype,
                   device: Optional[torch.device | str] = None, bnb=None) -> nn.Module:
    """`quantize_model` for one `Block`: its linear layers quantized, its other parameters cast, all onto `device`.

    Each replaced layer's full-precision weight is freed as soon as its quantized copy exists.
    """
    bnb = bnb or import_bitsandbytes()
    check_quantizable(block, mode, device, bnb)
    for name, module in _quantizable(block):
        parent_name, _, child_name = name.rpartition(".")
        parent = block.get_submodule(parent_name)
        if isinstance(module, GroupedExperts):
            quantized = QuantizedExperts(module, mode, compute_dtype, device, bnb)
        else:
            quantized = quantize_linear(module, mode, compute_dtype, device, bnb)
        setattr(parent, child_name, quantized)
    _convert_unquantized(block, compute_dtype, device)
    return block


def quantize_linear(
    linear: nn.Linear, mode: QuantizeMode, compute_dtype: torch.dtype, device=None, bnb=None
) -> nn.Linear:
    """A bitsandbytes layer holding `linear`'s weights quantized per `mode` (frozen, on `device`)."""
    bnb = bnb or import_bitsandbytes()
    weight = linear.weight.detach()
    if weight.is_meta:
        raise ValueError("quantize_model needs real weights, not meta tensors: load the checkpoint first")
    weight = weight.to(device or weight.device).contiguous()
    if mode == "bnb.int8-training":
        layer = _int8_linear(linear, weight, compute_dtype, bnb)
    else:
        layer = _4bit_linear(linear, weight, mode, compute_dtype, bnb)
    if linear.bias is not None:
        bias = linear.bias.detach().to(device=weight.device, dtype=compute_dtype)
        layer.bias = nn.Parameter(bias, requires_grad=False)
    layer.train(linear.training)
    return layer


def _4bit_linear(linear: nn.Linear, weight: torch.Tensor, mode: str, compute_dtype: torch.dtype, bnb) -> nn.Linear:
    quant_type = mode.removeprefix("bnb.").removesuffix("-dq")  # "nf4" | "fp4"
    double_quant = mode.endswith("-dq")
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        weight = weight.float()
    packed, quant_state = bnb.functional.quantize_4bit(
        weight, blocksize=BLOCKSIZE_4BIT, compress_statistics=double_quant, quant_type=quant_type
    )
    layer = bnb.nn.Linear4bit(
        linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=compute_dtype,
        compress_statistics=double_quant, quant_type=quant_type, device="meta",
    )
    layer.weight = bnb.nn.Params4bit(
        packed, requires_grad=False, quant_state=quant_state, blocksize=BLOCKSIZE_4BIT,
        compress_statistics=double_quant, quant_type=quant_type, module=layer, bnb_quantized=True,
    )
    layer.quant_state = quant_state
    # NOTE: on CPUs with AVX512-BF16, a Linear4bit in eval mode under no_grad repacks its weight
    # in place for a bf16 inference kernel. That kernel has no backward, so the next training step
    # silently gets no gradient through the layer (bitsandbytes 0.50), and for non-double-quantized
    # weights the packing cannot be undone exactly. Keep the training layout always.
    layer.support_avx512bf16_for_cpu = False
    return layer


def _int8_linear(linear: nn.Linear, weight: torch.Tensor, compute_dtype: torch.dtype, bnb) -> nn.Linear:
    # LLM.int8() quantizes each output row by its absmax; bitsandbytes takes fp16 input for it.
    int8_weight, row_scales, _ = bnb.functional.int8_vectorwise_quant(weight.to(torch.float16))
    layer = bnb.nn.Linear8bitLt(
        linear.in_features, linear.out_features, bias=linear.bias is not None, has_fp16_weights=False,
        threshold=INT8_OUTLIER_THRESHOLD, device="meta",
    )
    layer.weight = bnb.nn.Int8Params(
        int8_weight, requires_grad=False, has_fp16_weights=False, CB=int8_weight, SCB=row_scales
    )
    # Linear8bitLt has no compute dtype of its own (it computes in the input's); remember it for
    # the LoRA adapters and for dequantizing.
    layer.compute_dtype = compute_dtype
    return layer


class QuantizedExperts(nn.Module):
    """Routed experts with quantized weights: ``gate_proj``, ``up_proj`` and ``down_proj`` each hold one bitsandbytes
    layer per expert (bitsandbytes quantizes 2-D weights; one expert's slice is one), and each expert's product
    dequantizes only that expert's weights, as a quantized linear layer does.

    A module list per projection rather than one packed tensor: each slice keeps its own quantization state, so an
    expert is quantized and dequantized exactly as a linear layer of its shape is.
    """

    def __init__(self, experts: GroupedExperts, mode: QuantizeMode, compute_dtype: torch.dtype, device=None,
                 bnb=None) -> None:
        super().__init__()
        self.approximate = experts.approximate
        self.compute_dtype = compute_dtype
        for projection in EXPERT_PROJECTIONS:
            layers = [quantize_linear(plain_linear(weight, None, requires_grad=False), mode, compute_dtype, device, bnb)
                      for weight in getattr(experts, projection).detach()]
            setattr(self, projection, nn.ModuleList(layers))

    def project(self, name: str, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return getattr(self, name)[expert](rows)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return expert_loop(x, tokens_per_expert, self.project, self.approximate)

    def dequantized_weight(self, name: str) -> torch.Tensor:
        """The (n_expert, out_features, in_features) weight of one projection, in float32."""
        return torch.stack([dequantize_weight(layer) for layer in getattr(self, name)])

    def dequantized(self) -> GroupedExperts:
        """Plain :class:`GroupedExperts` holding the dequantized weights, in the compute dtype."""
        weights = {name: self.dequantized_weight(name).to(self.compute_dtype) for name in EXPERT_PROJECTIONS}
        return plain_experts(weights, self.approximate, requires_grad=False)


def plain_experts(weights: dict[str, torch.Tensor], approximate: Optional[str], requires_grad: bool) -> GroupedExperts:
    """:class:`GroupedExperts` holding exactly ``weights`` (gate_proj, up_proj, down_proj: (E, out, in))."""
    n_expert, hidden, dim = weights["gate_proj"].shape
    with torch.device("meta"):
        experts = GroupedExperts(n_expert, dim, hidden, approximate)
    for name, weight in weights.items():
        setattr(experts, name, nn.Parameter(weight.detach(), requires_grad=requires_grad))
    return experts


def _convert_unquantized(model: nn.Module, dtype: torch.dtype, device=None) -> None:
    """Cast the floating parameters outside the quantized layers to `dtype`; move them and the buffers to `device`."""
    quantized = quantized_linear_types()
    for module in model.modules():
        if isinstance(module, quantized):
            continue
        for param in module.parameters(recurse=False):
            param.data = param.data.to(device=device, dtype=dtype if param.is_floating_point() else None)
        if device is not None:
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))


# ---- inspecting and undoing quantization ----------------------------------------------------------


def quantized_linear_types() -> tuple[type, ...]:
    """The bitsandbytes linear classes, or () when bitsandbytes was never imported."""
    # NOTE: a model can only hold bitsandbytes layers if bitsandbytes is imported; asking
    # sys.modules keeps plain LoRA from paying bitsandbytes' import time.
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return ()
    return (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)


def is_quantized_linear(module: nn.Module) -> bool:
    return isinstance(module, quantized_linear_types())


def compute_dtype_of(linear: nn.Linear) -> torch.dtype:
    """The dtype a linear layer computes in: its weight's, or a quantized layer's compute dtype."""
    if is_quantized_linear(linear):
        return getattr(linear, "compute_dtype", None) or torch.float32
    return linear.weight.dtype


def dequantize_weight(linear: nn.Linear) -> torch.Tensor:
    """The (out_features, in_features) weight of a plain or bitsandbytes linear layer, in float32."""
    if not is_quantized_linear(linear):
        return linear.weight.detach().float()
    bnb = sys.modules["bitsandbytes"]
    weight = linear.weight
    if isinstance(linear, bnb.nn.Linear4bit):
        if getattr(weight.quant_state, "packing_format_for_cpu", False):
            raise ValueError(
                "This Linear4bit was repacked by bitsandbytes for CPU inference and cannot be dequantized "
                "exactly; quantize with llmtrain.quantize.quantize_model, which keeps the training layout"
            )
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    # Linear8bitLt keeps the int8 rows in weight.data; the per-row scales move from the weight to
    # the layer's matmul state on the first forward.
    row_scales = weight.SCB if getattr(weight, "SCB", None) is not None else linear.state.SCB
    return bnb.functional.int8_vectorwise_dequant(weight.data, row_scales).float()


def dequantize_linear(linear: nn.Linear) -> nn.Linear:
    """A plain `nn.Linear` with the (dequantized) weights of `linear`, in its compute dtype."""
    dtype = compute_dtype_of(linear)
    return plain_linear(dequantize_weight(linear).to(dtype), linear.bias, requires_grad=linear.weight.requires_grad)


def plain_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], requires_grad: bool) -> nn.Linear:
    """An `nn.Linear` holding exactly `weight` (out, in) and `bias`, cast to the weight's dtype."""
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=requires_grad)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().to(weight.dtype), requires_grad=bias.requires_grad)
    return linear
