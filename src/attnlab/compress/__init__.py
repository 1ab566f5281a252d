"""Model compression: group-wise 4-/8-bit weight-only quantisation (round-to-nearest, GPTQ, HQQ)
in layouts that are GGUF's Q4_0 / Q4_1 / Q8_0 blocks, pruning (magnitude, Wanda; unstructured and
N:M) and the calibration statistics both use. ``attnlab quantize`` and ``attnlab prune`` are the
commands; docs/compression.md the lesson. The int8 per-channel path of :mod:`attnlab.quantize`
(``Int8Linear``, ``quantize_int8``) stays where it is."""
from .gptq import gptq, hqq
from .model import (QUANT_METHODS, calibration_stats, linear_layers, prune_model, quantize_model,
                    save_quantized_gguf, sparsity_of)
from .prune import prune_mask, prune_scores
from .quant import LAYOUTS, Layout, QuantLinear, codes_for, dequantize, layout_for, quantize_rtn

__all__ = ["gptq", "hqq", "QUANT_METHODS", "calibration_stats", "linear_layers", "prune_model", "quantize_model",
           "save_quantized_gguf", "sparsity_of", "prune_mask", "prune_scores", "LAYOUTS", "Layout", "QuantLinear",
           "codes_for", "dequantize", "layout_for", "quantize_rtn"]
