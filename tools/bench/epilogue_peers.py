#!/usr/bin/env python3
"""Peers of the MoE epilogue in one pass (issue 59): combine + residual add + RMSNorm (+ fp8
per-token-group quantization), measured in one process on the same torch tensors.

For every shape (BENCHMARKS.md's prefill shapes; decode at T = 1, 32, 64) and epilogue (norm,
norm-fp8; residual on request), starting from the same expert rows, routing, residual stream and
norm weight:

  combine     libmoejit's plain combine alone (through ctypes, as peers.py calls it): the decode
              target's baseline
  eager       that combine, then torch eager residual.add_(moe_out) and
              torch.nn.functional.rms_norm(residual, weight, eps) (+ a torch per-token-group fp8
              e4m3 quantization: one fp32 scale per token per 128 channels, scale = group amax /
              448, optionally rounded up to a power of two)
  compiled    the same chain with everything after the combine compiled by torch.compile
              (Inductor fuses it into Triton kernels)
  triton      the combine, then a hand-written Triton fused add-RMSNorm (+ quant) kernel, one
              program per token (num_warps tuned per shape)
  fused       libmoejit's one-call epilogue, where the library has it (fused_epilogue_call below:
              the hook the epilogue work fills in; until then the script says it is not available
              and times the others)

Checks, on every contender before it is timed: the residual is restored, the outputs poisoned
(NaN), one run, and the new residual and the output compared with a float64 reference that rounds
where Hugging Face transformers' DeepSeek-V3 / Qwen3-MoE decoder layers round when run in bf16
(epilogue_reference). Timing: peers.py's interleaved rounds (one run of each contender per round
in a random order, each after a GPU sleep and a 256 MB L2 flush, CUDA events), medians and paired
ratios with distribution-free 95% intervals (peers.py's statistics, imported as ab_libs.py does).

The figures the issue's targets need, per shape: the fused call's minimal bytes (K rows and their
routing + residual read + residual write + out write, + scales), a two-pass chain's (the same plus
the combine's output written and read back), their ratio, each contender's % of the copy ceiling
on the fused call's bytes, and the time a fused call must reach: prefill, 90% of the copy ceiling
and faster than the best chain by 0.95 x the bytes ratio; decode, at most 1.15 x the plain combine
and 1.5 x faster than the best chain.

Needs torch, triton and a GPU for the timings (without them it says so and exits 1); libmoejit.so
from --lib or $MOEJIT_LIBRARY (exit 2 without). Exit 3 when libmoejit's own results (the plain
combine, the fused call) fail their check; a peer's failure is printed, and its figures kept. The
reference, the quantization, the checks, the bytes and the Triton kernel (under Triton's
interpreter) are tested on the CPU (tests/python/test_epilogue_peers.py).
"""

import argparse
import datetime
import importlib.util
import json
import math
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
EPILOGUES = ("residual", "norm", "norm-fp8")
LAYOUTS = ("gather_map", "token_index", "token_major")
GROUP = 128  # channels per fp8 scale (DeepSeek-V3's activation quantization)
FP8_MAX = 448.0  # largest finite e4m3 (e4m3fn) value


def load_peers():
    """peers.py as a module (its Moejit binding, timing and paired statistics; needs no torch)."""
    spec = importlib.util.spec_from_file_location("peers", os.path.join(HERE, "peers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- shapes --------------------------------------------------------------------------------------

def _shape(t, k, h, dt, label, eps):
    return {"T": t, "K": k, "H": h, "dtype": dt, "label": label, "eps": eps}


# rms_norm_eps of each model's config.
MODELS = {
    "DeepSeek-V3": (8, 7168, 1e-6),
    "Mixtral-8x7B": (2, 4096, 1e-5),
    "Qwen3-30B-A3B": (8, 2048, 1e-6),
    "gpt-oss-120b": (4, 2880, 1e-5),
}


def prefill_shapes():
    """BENCHMARKS.md's prefill shapes (the original scatter-add problem is no decoder layer)."""
    out = []
    for model, t, dt in (("DeepSeek-V3", 4096, "bf16"), ("DeepSeek-V3", 4096, "fp16"),
                         ("Mixtral-8x7B", 8192, "bf16"), ("Mixtral-8x7B", 8192, "fp32"),
                         ("Qwen3-30B-A3B", 16384, "bf16"), ("gpt-oss-120b", 4096, "bf16")):
        k, h, eps = MODELS[model]
        out.append(_shape(t, k, h, dt, f"{model} prefill", eps))
    return out


def decode_shapes():
    """BENCHMARKS.md's decode models (DeepSeek-V3, Mixtral) at T = 1, 32 and 64."""
    out = []
    for model in ("DeepSeek-V3", "Mixtral-8x7B"):
        k, h, eps = MODELS[model]
        out += [_shape(t, k, h, "bf16", f"{model} decode", eps) for t in (1, 32, 64)]
    return out


def builtin_shapes(which, quick):
    shapes = []
    if which in ("all", "prefill"):
        shapes += prefill_shapes()[:1] if quick else prefill_shapes()
    if which in ("all", "decode"):
        shapes += [s for s in decode_shapes() if not quick or s["label"].startswith("DeepSeek")]
    return shapes


def parse_case(text):
    """T,K,H,dtype[,eps]"""
    f = text.split(",")
    if len(f) not in (4, 5) or f[3] not in ("fp32", "fp16", "bf16"):
        raise argparse.ArgumentTypeError(f"--case {text}: expected T,K,H,dtype[,eps] (dtype "
                                         "fp32|fp16|bf16)")
    try:
        t, k, h = (int(x) for x in f[:3])
        eps = float(f[4]) if len(f) == 5 else 1e-6
    except ValueError:
        raise argparse.ArgumentTypeError(f"--case {text}: T, K, H must be integers and eps a "
                                         "number") from None
    if min(t, k, h) < 1 or not (eps > 0 and math.isfinite(eps)):
        raise argparse.ArgumentTypeError(f"--case {text}: T, K, H must be positive, eps > 0")
    return _shape(t, k, h, f[3], "", eps)


def parse_epilogues(text):
    names = text.split(",")
    bad = [n for n in names if n not in EPILOGUES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--epilogue {text}: expected a comma-separated subset "
                                         f"of {', '.join(EPILOGUES)}")
    return names


def shape_text(s):
    return f"T{s['T']} K{s['K']} H{s['H']} {s['dtype']}"


def is_decode(shape):
    return shape["T"] <= 64


# ---- bytes and targets ---------------------------------------------------------------------------

def scale_groups(h):
    return (h + GROUP - 1) // GROUP


def fused_bytes(shape, epilogue):
    """The fused call's minimal bytes: the K rows of every token and their routing (R*H*in + R*8,
    as BENCHMARKS.md counts the combine), the residual read and written, the output written (the
    combine's result for "residual", the normed rows otherwise, fp8 for norm-fp8), and the fp32
    scales. The norm weight (H elements, read once per block) is left out."""
    t, k, h = shape["T"], shape["K"], shape["H"]
    r, size = t * k, DTYPE_BYTES[shape["dtype"]]
    out = DTYPE_BYTES["fp8"] if epilogue == "norm-fp8" else size
    scales = t * scale_groups(h) * 4 if epilogue == "norm-fp8" else 0
    return r * h * size + r * 8 + 2 * t * h * size + t * h * out + scales


def chain_bytes(shape, epilogue):
    """A two-pass chain's minimal bytes: the fused call's plus the combine's output written and read
    back (a combine, then one fused add-norm kernel; an eager chain moves more). "residual": the
    combine's output is the out it writes and the add reads it: once more."""
    t, h, size = shape["T"], shape["H"], DTYPE_BYTES[shape["dtype"]]
    extra = t * h * size if epilogue == "residual" else 2 * t * h * size
    return fused_bytes(shape, epilogue) + extra


def fused_target_us(shape, epilogue, ceiling_gbps, best_chain_us, combine_us):
    """The time issue 59's targets allow the fused call, and what sets it. Prefill: 90% of the
    copy ceiling on its bytes, and faster than the best chain by 0.95 x the bytes ratio. Decode:
    at most 1.15 x the plain combine and 1.5 x faster than the best chain. None where a figure is
    missing."""
    limits = {}
    if is_decode(shape):
        if combine_us:
            limits["1.15 x combine"] = 1.15 * combine_us
        if best_chain_us:
            limits["best chain / 1.5"] = best_chain_us / 1.5
    else:
        if ceiling_gbps:
            limits["90% of ceiling"] = fused_bytes(shape, epilogue) / (0.9 * ceiling_gbps * 1e3)
        if best_chain_us:
            ratio = chain_bytes(shape, epilogue) / fused_bytes(shape, epilogue)
            limits["best chain / (0.95 x bytes ratio)"] = best_chain_us / (0.95 * ratio)
    if not limits:
        return None, None
    name = min(limits, key=limits.get)
    return limits[name], name


def pct_ceiling(nbytes, us, ceiling_gbps):
    return 100 * nbytes / (us * 1e-6) / 1e9 / ceiling_gbps if us and ceiling_gbps else None


# ---- the float64 reference -----------------------------------------------------------------------
# Formats: (significand bits after the leading one, least normal exponent, largest finite value).
FORMATS = {
    "fp32": (23, -126, None),
    "fp16": (10, -14, None),
    "bf16": (7, -126, None),
    "e4m3": (3, -6, FP8_MAX),
}


def round_to(torch, v, fmt):
    """float64 tensor v rounded to nearest-even in fmt (subnormals included), as float64. e4m3
    saturates at +-448 (what the quantization's clamp does); the others have no overflow handling
    (the epilogue's values stay far from it). Exact: torch's float64 -> bfloat16 conversion goes
    through float32 and can round twice."""
    mantissa, min_exponent, largest = FORMATS[fmt]
    _, e = torch.frexp(v)  # |v| in [2^(e-1), 2^e)
    step = torch.clamp(e - 1, min=min_exponent) - mantissa
    quantum = torch.ldexp(torch.ones_like(v), step)
    r = torch.round(v / quantum) * quantum  # torch.round: halves to even
    r = torch.where(v == 0, v, r)
    if largest is not None:
        r = r.clamp(-largest, largest)
    return r


def pow2_ceil(torch, scale):
    """The least power of two >= each positive (normal) scale, exactly (float64)."""
    m, e = torch.frexp(scale)
    return torch.where(m == 0.5, scale, torch.ldexp(torch.ones_like(scale), e))


def quantize_reference(torch, y, pow2):
    """Per-token-group fp8 e4m3 quantization of y ([T, H] float64 holding the values the
    quantization reads): per token and 128 channels (the last group may be short) amax =
    max |y| (at least 1e-10), scale = amax / 448 as fp32 (rounded up to a power of two if pow2),
    q = e4m3(y / scale), saturated. Returns (q, scales [T, G]), float64."""
    t, h = y.shape
    g = scale_groups(h)
    padded = torch.zeros((t, g * GROUP), dtype=torch.float64, device=y.device)
    padded[:, :h] = y
    groups = padded.view(t, g, GROUP)
    amax = groups.abs().amax(dim=-1).clamp(min=1e-10)
    scale = round_to(torch, amax / FP8_MAX, "fp32")
    if pow2:
        scale = pow2_ceil(torch, scale)
    q = round_to(torch, groups / scale[..., None], "e4m3").view(t, g * GROUP)[:, :h]
    return q, scale


def epilogue_reference(torch, moe, residual, weight, eps, epilogue, res_fmt, round_moe=True,
                       pow2=False):
    """The epilogue in float64 with the rounding points of Hugging Face transformers' DeepSeek-V3 /
    Qwen3-MoE decoder layers run in res_fmt (bf16, say):
      h = residual + moe, rounded to res_fmt: the new residual (HF: residual + hidden_states);
      the norm reads that rounded h: n = h * rsqrt(mean(h^2) + eps), rounded to res_fmt (HF's
        RMSNorm: hidden_states.to(input_dtype));
      y = weight * n: the output before its final rounding (HF: self.weight * hidden_states, in
        res_fmt; the check holds the output to one rounding of y);
      norm-fp8: the quantization reads y rounded to res_fmt (the layer's bf16 output), then
        quantize_reference.
    moe is the combine's exact result; round_moe rounds it to res_fmt first, as HF's MoE block
    returns it in the layer's dtype and as a chain that starts with the plain combine reads it.
    (The fused call adds the unrounded fp32 combine result: round_moe=False.) Inputs float64
    tensors ([T, H]; weight [H]). Returns a dict: residual (the new residual, exact in res_fmt),
    residual_sum (the same before its rounding), out (float64 before the output's rounding: y, or moe for "residual"), and for norm-fp8 q,
    scales and dequant = q * scale."""
    m = round_to(torch, moe, res_fmt) if round_moe else moe
    h = round_to(torch, residual + m, res_fmt)
    if epilogue == "residual":
        return {"residual": h, "residual_sum": residual + m, "out": moe}
    inv = 1.0 / torch.sqrt((h * h).mean(dim=-1, keepdim=True) + eps)
    n = round_to(torch, h * inv, res_fmt)
    y = weight * n
    result = {"residual": h, "residual_sum": residual + m, "out": y}
    if epilogue == "norm-fp8":
        q, scales = quantize_reference(torch, round_to(torch, y, res_fmt), pow2)
        per_channel = scales.repeat_interleave(GROUP, dim=1)[:, :y.shape[1]]
        result.update(q=q, scales=scales, dequant=q * per_channel)
    return result


# ---- the checks ----------------------------------------------------------------------------------
# How far each contender may land from the reference, in units of what one rounding of the reference
# to the output's dtype costs (rho). One that rounds where the reference does lands on about 1 rho:
# the fused call (against the reference without round_moe) and the Triton chain (with it) are held
# to 1.25 rho, as moejit-bench holds the combine. torch's rms_norm rounds once (x * rsqrt * weight)
# where HF rounds twice (the normed rows, then times the weight), and Inductor may read the new
# residual before its rounding: on random inputs those land 1.4 and 1.8 rho from the reference, so
# the torch chains are held to 2.5 rho: a missing weight, residual or mean is still far past it.
OUT_TOLERANCE = {"fused": 1.25, "triton": 1.25, "eager": 2.5, "compiled": 2.5, "combine": 1.25}
# The new residual is exact in its dtype: a contender's may differ only where the fp32 sums it
# starts from fall on the other side of a rounding tie (a few elements in 10^5); a quarter of one
# rounding's error catches a residual left alone, updated twice, or added to an unrounded sum where
# the contender's semantics round it (or the reverse).
RESIDUAL_TOLERANCE = 0.25
# fp8: a group's scale may differ from the reference's by 2^-6 (the amax of bf16 rows that differ by
# an ulp or two), and by a power of two when rounded up to one next to a power of two; at most 1% of
# the groups may differ more. The dequantized rows are held to 1.25 times the reference's own
# quantization error on top of the output's tolerance.
SCALE_TOLERANCE = 2.0 ** -6
SCALE_GROUPS_OFF = 0.01


def relative_error(torch, got, ref):
    """(||got - ref|| / ||ref||, NaN or Inf elements of got); the norms in float64."""
    nonfinite = int((~torch.isfinite(got)).sum().item())
    norm = torch.linalg.vector_norm(ref).item() or 1.0
    return torch.linalg.vector_norm(got.double() - ref).item() / norm, nonfinite


def rounding_error(torch, v, fmt):
    """What rounding v once to fmt costs, relative to ||v||: overall and per token (row)."""
    d = round_to(torch, v, fmt) - v
    norm = torch.linalg.vector_norm(v).item() or 1.0
    return (torch.linalg.vector_norm(d).item() / norm, torch.linalg.vector_norm(d, dim=-1),
            torch.linalg.vector_norm(v, dim=-1))


def check_epilogue(torch, ref, residual, out, scales, epilogue, res_fmt, out_fmt, tolerance):
    """A contender's new residual, output (and fp8 scales) against the reference's
    (epilogue_reference). Returns a dict of figures, with "passed" and, if not, "why"."""
    why = []
    r = {}
    res_err, res_nonfinite = relative_error(torch, residual, ref["residual"])
    rho_h = rounding_error(torch, ref["residual_sum"], res_fmt)[0]
    r.update(residual_rel_err=res_err, residual_bound=RESIDUAL_TOLERANCE * rho_h + 1e-6)
    if res_nonfinite or not res_err <= r["residual_bound"]:
        why.append(f"residual off: rel_err {res_err:.2e} (bound {r['residual_bound']:.2e}, "
                   f"{res_nonfinite} NaN or Inf)")
    if epilogue == "norm-fp8":
        dq_ref, y = ref["dequant"], ref["out"]
        g = scale_groups(y.shape[1])
        per_channel = scales.double().repeat_interleave(GROUP, dim=1)[:, :y.shape[1]]
        dequant = out.double() * per_channel
        err, nonfinite = relative_error(torch, dequant, y)
        q_err = relative_error(torch, dq_ref, y)[0]
        rho = rounding_error(torch, y, res_fmt)[0]
        bound = 1.25 * q_err + tolerance * rho + 1e-6
        off = (scales.double() - ref["scales"]).abs() > SCALE_TOLERANCE * ref["scales"]
        off = off | ~torch.isfinite(scales)
        groups_off = int(off.sum().item())
        r.update(rel_err=err, rel_err_bound=bound, quantization_rel_err=q_err,
                 scale_groups_off=groups_off, scale_groups=y.shape[0] * g)
        if nonfinite or not err <= bound:
            why.append(f"fp8 output off: rel_err {err:.2e} (bound {bound:.2e}, {nonfinite} NaN)")
        if groups_off > SCALE_GROUPS_OFF * y.shape[0] * g:
            why.append(f"{groups_off} of {y.shape[0] * g} scales off the reference's")
    else:
        y = ref["out"]
        err, nonfinite = relative_error(torch, out, y)
        rho, token_rho, token_norm = rounding_error(torch, y, out_fmt)
        bound = tolerance * rho + 1e-6
        token_err = torch.linalg.vector_norm(out.double() - y, dim=-1)
        bad = int((~(token_err <= tolerance * token_rho + 1e-6 * token_norm)).sum().item())
        r.update(rel_err=err, rel_err_bound=bound, rounding_rel_err=rho, tokens_over_bound=bad)
        if nonfinite or not err <= bound or bad:
            why.append(f"output off: rel_err {err:.2e} (bound {bound:.2e}), {bad} tokens over "
                       f"their bound, {nonfinite} NaN or Inf")
    r["passed"] = not why
    if why:
        r["why"] = "; ".join(why)
    return r


# ---- the torch peers (the same functions eager and under torch.compile) ---------------------------

def group_quant(torch, y, pow2):
    """Per-token-group fp8 e4m3 quantization in torch: y [T, H] (bf16, say) -> (q [T, H]
    float8_e4m3fn, scales [T, ceil(H/128)] fp32 row-major); scale = amax / 448 (amax at least
    1e-10) in fp32, rounded up to a power of two if pow2 (on the bits: exact), q = y / scale,
    clamped to +-448. A short last group (H not a multiple of 128) gets its own amax. (Compiled
    for the CPU by torch 2.15's Inductor, such a short group leaves the residual's tail un-updated
    and NaN in q: the check reports it; its Triton code for the GPU is a different code path.)"""
    t, h = y.shape
    full = h // GROUP * GROUP
    yf = y.float()
    amax = yf[:, :full].view(t, full // GROUP, GROUP).abs().amax(dim=-1)
    if full < h:
        amax = torch.cat([amax, yf[:, full:].abs().amax(dim=-1, keepdim=True)], dim=1)
    scale = amax.clamp(min=1e-10) / FP8_MAX
    if pow2:
        bits = scale.view(torch.int32)
        scale = ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    per_channel = scale.repeat_interleave(GROUP, dim=1)[:, :h] if full < h else (
        scale.view(t, full // GROUP, 1).expand(t, full // GROUP, GROUP).reshape(t, h))
    q = (yf / per_channel).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def post_combine(torch, residual, moe_out, weight, eps, epilogue, pow2):
    """What a torch user writes after the combine: the residual updated in place, then the next
    layer's RMSNorm (+ quantization). Returns the output (or (q, scales))."""
    residual.add_(moe_out)
    if epilogue == "residual":
        return moe_out
    y = torch.nn.functional.rms_norm(residual, (residual.shape[-1],), weight, eps)
    if epilogue == "norm":
        return y
    return group_quant(torch, y, pow2)


# ---- the Triton peer -----------------------------------------------------------------------------
# At module level: Triton resolves the names a kernel uses (tl) in its module's globals.
try:
    import triton
    import triton.language as tl
except ImportError as _triton_import_error:
    triton, tl = None, None
    TRITON_MISSING = str(_triton_import_error)
else:
    TRITON_MISSING = None

if triton is not None:
    @triton.jit
    def add_rms_norm_kernel(res_ptr, moe_ptr, w_ptr, out_ptr, scale_ptr, H, eps,
                            BLOCK: tl.constexpr, NORM: tl.constexpr, QUANT: tl.constexpr,
                            POW2: tl.constexpr, GROUP_SIZE: tl.constexpr):
        # One token per program, its whole row in registers. Rounds (to nearest even) where HF's
        # decoder layer does (epilogue_reference): the new residual in its dtype, the normed row in
        # it, the weight's product in it; the quantization reads that product. IEEE square root
        # and division, so the only differences from the float64 reference are its ties.
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        dt: tl.constexpr = res_ptr.dtype.element_ty
        res = tl.load(res_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
        moe = tl.load(moe_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32)
        h = (res + moe).to(dt, fp_downcast_rounding="rtne")
        tl.store(res_ptr + t * H + offs, h, mask=mask)
        if NORM:
            hf = h.to(tl.float32)
            mean = tl.math.div_rn(tl.sum(hf * hf, axis=0), H * 1.0)
            inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean + eps))
            n = (hf * inv).to(dt, fp_downcast_rounding="rtne").to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = (w * n).to(dt, fp_downcast_rounding="rtne")
            if QUANT:
                groups = tl.reshape(y.to(tl.float32), (BLOCK // GROUP_SIZE, GROUP_SIZE))
                amax = tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-10)
                scale = tl.math.div_rn(amax, 448.0)
                if POW2:  # up to a power of two, on the bits (exact for normal positives)
                    bits = scale.to(tl.int32, bitcast=True)
                    scale = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
                q = tl.math.div_rn(groups, scale[:, None])
                q = tl.minimum(tl.maximum(q, -448.0), 448.0)
                q = q.to(tl.float8e4nv, fp_downcast_rounding="rtne")
                tl.store(out_ptr + t * H + offs, tl.reshape(q, (BLOCK,)), mask=mask)
                g = tl.arange(0, BLOCK // GROUP_SIZE)
                n_groups = (H + GROUP_SIZE - 1) // GROUP_SIZE
                tl.store(scale_ptr + t * n_groups + g, scale, mask=g < n_groups)
            else:
                tl.store(out_ptr + t * H + offs, y, mask=mask)


def triton_block(h):
    """The row's block: a power of two, at least one fp8 group."""
    return max(GROUP, 1 << (h - 1).bit_length())


# ---- libmoejit's one-call epilogue: THE HOOK -----------------------------------------------------
# issue 59's fields of moejit_combine_args. Until python/moejit/_capi.py's CombineArgs (the mirror
# this script and peers.py use) has them, the fused call is not available, and the script says so.
EPILOGUE_FIELDS = ("residual", "norm_weight", "norm_eps", "out_scales")


def mirror_fields():
    """The field names of the ctypes mirror of moejit_combine_args (python/moejit/_capi.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "python"))
    from moejit._capi import CombineArgs
    return {name for name, _ in CombineArgs._fields_}


class FusedUnavailable(Exception):
    """Why libmoejit's fused call cannot be timed in this run."""


def fused_unavailable_reason():
    """Why this build's binding cannot express the fused call, or None."""
    missing = [f for f in EPILOGUE_FIELDS if f not in mirror_fields()]
    if missing:
        return ("libmoejit's moejit_combine_args (as python/moejit/_capi.py mirrors it) has no "
                f"epilogue fields ({', '.join(missing)} missing): the fused call is not available")
    return None


def fused_epilogue_call(lib, inp, epilogue, pow2):
    """HOOK for the epilogue work (issue 59): return a function of no arguments that runs
    libmoejit's one-call epilogue on `inp` (an Inputs: inp.combine_args(lib, out) gives the plain
    combine's args for any out; inp.residual, inp.weight, inp.eps, inp.out, inp.scales, inp.stream)
    with the same semantics as the chains: inp.residual updated in place, inp.out written with the
    normed rows (fp8 e4m3 for norm-fp8, with one fp32 scale per token per 128 channels in
    inp.scales, row-major, rounded up to a power of two if pow2), or, for "residual", with the
    combine's result. It is checked against epilogue_reference without round_moe (the fused call
    adds the fp32 combine result to the residual) and timed like every contender.

    Raise FusedUnavailable(reason) when the library cannot do it; never fake it with other calls.
    """
    reason = fused_unavailable_reason()
    if reason:
        raise FusedUnavailable(reason)
    from moejit import _capi
    dtype = {"fp32": _capi.DTYPE_FLOAT32, "fp16": _capi.DTYPE_FLOAT16,
             "bf16": _capi.DTYPE_BFLOAT16}[inp.shape["dtype"]]
    args = epilogue_args(inp.combine_args(lib, inp.out), epilogue, pow2, dtype,
                         residual=inp.residual.data_ptr(), weight=inp.weight.data_ptr(),
                         eps=inp.eps, scales=inp.scales.data_ptr())

    def fused():
        lib.combine(args, inp.stream)
    return fused


def epilogue_args(args, epilogue, pow2, dtype, residual, weight, eps, scales):
    """The plain combine's args (a _capi.CombineArgs) with issue 59's epilogue: the residual
    (updated in place) for every epilogue; the norm weight and eps for "norm" and "norm-fp8"; for
    "norm-fp8" an fp8 e4m3 out with row-major scales (rounded up to powers of two if pow2). The
    residual and weight are of the model's dtype (`dtype`, a moejit_dtype), row-major."""
    from moejit import _capi
    args.residual, args.residual_dtype, args.residual_row_stride = residual, dtype, 0
    if epilogue != "residual":
        args.norm_weight, args.norm_weight_dtype, args.norm_eps = weight, dtype, eps
    if epilogue == "norm-fp8":
        args.out_dtype = _capi.DTYPE_FLOAT8_E4M3
        args.out_scales = scales
        args.out_scales_layout = _capi.SCALES_ROW_MAJOR
        args.out_scales_pow2 = 1 if pow2 else 0
    return args


# ---- everything below needs torch and a GPU ------------------------------------------------------

class Inputs:
    """One shape's tensors on the GPU: expert rows in the chosen layout, gates, routing, the
    residual stream (a pristine copy and the working one), the norm weight, the combine's own
    output buffer (moe_out) and the epilogue's outputs (out, scales); and the float64 combine result
    the reference starts from."""

    def __init__(self, torch, shape, epilogue, layout, seed, device):
        t, k, h = shape["T"], shape["K"], shape["H"]
        r = t * k
        dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[shape["dtype"]]
        self.torch, self.shape, self.layout, self.dtype = torch, shape, layout, dt
        self.eps = shape["eps"]
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + t * 1_000_003 + k * 1_009 + h)

        def rows(n):  # magnitudes in [1/16, 2), random signs: never zero, as peers.py
            x = torch.rand((n, h), generator=gen, device=device) * (2 - 1 / 16) + 1 / 16
            return torch.where(torch.rand((n, h), generator=gen, device=device) < 0.5, -x, x)

        x_tm = rows(r).to(dt)
        u = torch.rand((t, k), generator=gen, device=device) * 0.95 + 0.05
        if k > 1:  # a top-k softmax's gates sum to 1; at K = 1 a router's score (as peers.py)
            u = u / u.sum(dim=1, keepdim=True)
        self.gates = u.reshape(r).contiguous()
        perm = torch.randperm(r, generator=gen, device=device)
        self.x_sorted = x_tm[perm].contiguous()
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(r, device=device)
        self.gather_map = inverse.to(torch.int32)
        self.token_idx = (perm // k).to(torch.int32)
        self.gates_by_row = self.gates[perm].contiguous()
        self.x_tm = x_tm
        self.moe = (x_tm.double().view(t, k, h) * self.gates.double().view(t, k, 1)).sum(dim=1)
        self.residual0 = rows(t).to(dt)
        self.residual = self.residual0.clone()
        self.weight = (torch.rand(h, generator=gen, device=device) + 0.5).to(dt)
        self.moe_out = torch.empty((t, h), dtype=dt, device=device)
        fp8 = epilogue == "norm-fp8"
        self.out = torch.empty((t, h), dtype=torch.float8_e4m3fn if fp8 else dt, device=device)
        self.scales = torch.empty((t, scale_groups(h)), dtype=torch.float32, device=device)
        self.stream = torch.cuda.current_stream(device).cuda_stream
        self._keep = []

    def combine_args(self, lib, out):
        """libmoejit's plain combine of this input into `out` (a [T, H] tensor of the dtype)."""
        s, t, k, h = self.shape, self.shape["T"], self.shape["K"], self.shape["H"]
        x, g, idx = {"token_major": (self.x_tm, self.gates, None),
                     "gather_map": (self.x_sorted, self.gates, self.gather_map),
                     "token_index": (self.x_sorted, self.gates_by_row, self.token_idx)}[self.layout]
        a = lib.args(self.layout, t, k, t * k, h, x.data_ptr(), s["dtype"], g.data_ptr(),
                     None if idx is None else idx.data_ptr(), out.data_ptr(), s["dtype"])
        ws_bytes = lib.workspace_size(a)
        if ws_bytes:
            ws = self.torch.empty(ws_bytes, dtype=self.torch.uint8, device=out.device)
            self._keep.append(ws)
            a.workspace, a.workspace_bytes = ws.data_ptr(), ws_bytes
        return a

    def reset(self):
        self.residual.copy_(self.residual0)

    def poison(self):
        """All-ones bytes: NaN in every dtype (e4m3fn included), as moejit-bench poisons."""
        for buf in (self.moe_out, self.out, self.scales):
            buf.view(self.torch.uint8).fill_(0xFF)


class Contender:
    """run(): one epilogue on the input's current state. outputs(): (the residual, the output,
    the scales or None) it left. round_moe: whether its reference rounds the combine's result
    first (a chain reads the plain combine's output in the layer's dtype). config: how it was
    tuned."""

    def __init__(self, run, outputs, round_moe, config=None):
        self.run, self.outputs, self.round_moe, self.config = run, outputs, round_moe, config


def contenders(torch, lib, inp, epilogue, pow2, compile_chain, tune):
    """The contenders on one input, by name, and the reasons of those that cannot run here."""
    eps, weight = inp.eps, inp.weight
    combine_args = inp.combine_args(lib, inp.moe_out)
    scales = inp.scales if epilogue == "norm-fp8" else None

    def combine():
        lib.combine(combine_args, inp.stream)

    found, errors = {}, {}
    found["combine"] = Contender(combine, lambda: (None, inp.moe_out, None), True)
    held = {}

    def returned():  # the torch chains return their output (and scales)
        o = held.get("out")
        return (inp.residual, o[0], o[1]) if isinstance(o, tuple) else (inp.residual, o, None)

    def eager():
        combine()
        held["out"] = post_combine(torch, inp.residual, inp.moe_out, weight, eps, epilogue, pow2)
    found["eager"] = Contender(eager, returned, True)

    if compile_chain:
        def post(residual, moe_out, w):
            return post_combine(torch, residual, moe_out, w, eps, epilogue, pow2)
        torch._dynamo.reset()  # each shape compiles afresh: no recompile limit, no stale guards
        compiled_post = torch.compile(post, fullgraph=True, dynamic=False)

        def compiled():
            combine()
            held["out"] = compiled_post(inp.residual, inp.moe_out, weight)
        found["compiled"] = Contender(compiled, returned, True)
    else:
        errors["compiled"] = "skipped (--no-compile)"

    if triton is None:
        errors["triton"] = f"triton unavailable ({TRITON_MISSING})"
    else:
        t, h = inp.shape["T"], inp.shape["H"]
        block = triton_block(h)
        out = inp.moe_out if epilogue == "residual" else inp.out

        def launcher(num_warps):
            def kernel():
                add_rms_norm_kernel[(t,)](
                    inp.residual, inp.moe_out, weight, out, inp.scales, h, eps, BLOCK=block,
                    NORM=epilogue != "residual", QUANT=epilogue == "norm-fp8", POW2=pow2,
                    GROUP_SIZE=GROUP, num_warps=num_warps)
            return kernel
        try:
            warps = tune({w: launcher(w) for w in (4, 8, 16) if 32 * w <= block})
            kernel = launcher(warps)

            def triton_chain():
                combine()
                kernel()
            found["triton"] = Contender(triton_chain, lambda: (inp.residual, out, scales), True,
                                        f"num_warps={warps}")
        except Exception as e:
            errors["triton"] = f"{type(e).__name__}: {e}"

    try:
        fused = fused_epilogue_call(lib, inp, epilogue, pow2)
        found["fused"] = Contender(fused, lambda: (inp.residual, inp.out, scales), False)
    except FusedUnavailable as e:
        errors["fused"] = f"not available: {e}"
    return found, errors


def main_gpu(args, shapes):
    try:
        import torch
    except ImportError as e:
        print(f"epilogue_peers.py: needs torch (and triton) on a machine with a GPU: {e}",
              file=sys.stderr)
        return 1
    peers = load_peers()
    if not torch.cuda.is_available():
        print("epilogue_peers.py: no GPU found (torch.cuda.is_available() is False): nothing "
              "measured", file=sys.stderr)
        return 1
    if triton is None:
        print(f"epilogue_peers.py: triton unavailable ({TRITON_MISSING}): no Triton chain",
              file=sys.stderr)
    lib_path = args.lib or os.environ.get("MOEJIT_LIBRARY")
    if not lib_path:
        print("epilogue_peers.py: every chain starts with libmoejit's plain combine: give --lib or "
              "MOEJIT_LIBRARY", file=sys.stderr)
        return 2
    lib = peers.Moejit(lib_path)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.empty(1, device=device)  # the primary context, current on this thread
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    lead = int(args.lead_us * peers.sleep_cycles_per_us(torch))

    def interleaved(fns, rounds, warmup=3):
        return peers.time_interleaved(torch, fns, rounds, warmup, random.Random(args.seed), flush,
                                      lead)[0]

    def tune(fns):
        series = interleaved(fns, 30)
        return min(series, key=lambda c: statistics.median(series[c]))

    def copy_ceiling():  # 1 GiB each way, as peers.py measures it
        n = 1 << 30
        src = torch.full((n,), 0x5A, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        us = statistics.median(interleaved({"copy": lambda: dst.copy_(src)}, 20)["copy"])
        return 2 * n / (us * 1e-6) / 1e9

    ceiling = copy_ceiling()
    fused_note = fused_unavailable_reason() or (
        "the binding has the epilogue fields; each case says whether fused_epilogue_call() "
        "serves it")
    print(f"epilogue_peers.py on {torch.cuda.get_device_name(device)}: torch {torch.__version__}, "
          f"triton {getattr(triton, '__version__', 'n/a')}, libmoejit {lib.version} ({args.layout}"
          f" combine); copy ceiling {ceiling:.0f} GB/s (1 GiB torch copy)")
    print(f"fused call: {fused_note}")

    report = {
        "tool": "epilogue_peers.py",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": torch.cuda.get_device_name(device),
        "torch_version": torch.__version__,
        "triton_version": getattr(triton, "__version__", None),
        "libmoejit_version": lib.version,
        "libmoejit_path": lib.path,
        "layout": args.layout,
        "scale_pow2": args.scale_pow2,
        "copy_ceiling_gbps": ceiling,
        "fused_call": fused_note,
        "method": "peers.py's interleaved rounds: one run of each contender per round in a random "
                  "order, each after a GPU sleep and a 256 MB fill (L2 flushed), CUDA events; "
                  "medians; paired: per round ratios, median and distribution-free 95% interval",
        "cases": [],
    }
    failed = []
    for shape in shapes:
        for epilogue in args.epilogue:
            case = run_case(torch, peers, lib, shape, epilogue, args, device, interleaved, tune,
                            ceiling)
            print_case(case)
            sys.stdout.flush()
            report["cases"].append(case)
            failed += [(shape_text(shape), epilogue, c["name"]) for c in case["contenders"]
                       if c["name"] in ("combine", "fused") and c.get("check", {}).get("passed")
                       is False]
            torch.cuda.empty_cache()
    print_summary(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(finite(report), f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    if failed:
        print(f"epilogue_peers.py: libmoejit failed its check on {failed}")
        return 3
    return 0


def finite(v):
    """JSON has no NaN or Infinity: None instead."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [finite(x) for x in v]
    return v


def run_case(torch, peers, lib, shape, epilogue, args, device, interleaved, tune, ceiling):
    inp = Inputs(torch, shape, epilogue, args.layout, args.seed, device)
    res_fmt = shape["dtype"]
    refs = {}

    def reference(round_moe):
        if round_moe not in refs:
            refs[round_moe] = epilogue_reference(
                torch, inp.moe, inp.residual0.double(), inp.weight.double(), inp.eps, epilogue,
                res_fmt, round_moe, args.scale_pow2)
        return refs[round_moe]

    found, errors = contenders(torch, lib, inp, epilogue, args.scale_pow2, not args.no_compile,
                               tune)
    entries, timed = [], {}
    for name, c in found.items():
        entry = {"name": name}
        if c.config:
            entry["config"] = c.config
        try:
            inp.reset()
            inp.poison()
            c.run()
            torch.cuda.synchronize()
            residual, out, scales = c.outputs()
            if name == "combine":
                err, nonfinite = relative_error(torch, out, inp.moe)
                rho = rounding_error(torch, inp.moe, res_fmt)[0]
                ok = nonfinite == 0 and err <= 1.25 * rho + 1e-6
                entry["check"] = {"rel_err": err, "rel_err_bound": 1.25 * rho + 1e-6,
                                  "passed": ok}
                if not ok:
                    entry["check"]["why"] = f"rel_err {err:.2e}, {nonfinite} NaN or Inf"
            else:
                entry["check"] = check_epilogue(torch, reference(c.round_moe), residual, out,
                                                scales, epilogue, res_fmt, res_fmt,
                                                OUT_TOLERANCE[name])
            timed[name] = c.run
        except Exception as e:  # one failing contender must not hide the others
            entry["error"] = f"{type(e).__name__}: {e}"
            torch.cuda.synchronize()
        entries.append(entry)
    for name, why in errors.items():
        entries.append({"name": name, "error": why})
    inp.reset()

    rounds = args.rounds or (500 if is_decode(shape) else 100)
    series = interleaved(timed, rounds, args.warmup) if timed else {}
    fb, cb = fused_bytes(shape, epilogue), chain_bytes(shape, epilogue)
    for e in entries:
        if e["name"] in series:
            e["us"] = statistics.median(series[e["name"]])
            e["pct_ceiling_fused_bytes"] = pct_ceiling(fb, e["us"], ceiling)
    us = {e["name"]: e["us"] for e in entries if "us" in e}
    chains = [n for n in ("eager", "compiled", "triton") if n in us]
    best = min(chains, key=us.get) if chains else None
    paired = []
    if "combine" in series:
        paired += [dict(lib="combine", peer=n, **peers.paired_summary(series["combine"],
                                                                      series[n]))
                   for n in chains]
    if "fused" in series:
        paired.append(dict(lib="fused", peer="combine",
                           **peers.paired_summary(series["fused"], series["combine"])))
        if best:
            paired.append(dict(lib="fused", peer=best,
                               **peers.paired_summary(series["fused"], series[best])))
    target, target_from = fused_target_us(shape, epilogue, ceiling, us.get(best),
                                          us.get("combine"))
    return dict(shape, epilogue=epilogue, layout=args.layout, rounds=rounds, fused_bytes=fb,
                chain_bytes=cb, bytes_ratio=cb / fb, best_chain=best, fused_target_us=target,
                fused_target_from=target_from, contenders=entries, paired=paired)


def print_case(case):
    print(f"\n== {shape_text(case)}  {case['label']}  epilogue {case['epilogue']}  (fused call "
          f"{case['fused_bytes'] / 1e6:.1f} MB, two-pass chain {case['chain_bytes'] / 1e6:.1f} MB: "
          f"x{case['bytes_ratio']:.3f})")
    print(f"{'contender':<10}{'us':>10}{'%ceil':>8}{'x combine':>11}  check")
    combine_us = next((c.get("us") for c in case["contenders"] if c["name"] == "combine"), None)
    for c in case["contenders"]:
        if "us" not in c:
            print(f"{c['name']:<10}  {c.get('error', 'not timed')}")
            continue
        check = c.get("check", {})
        text = "ok" if check.get("passed") else f"FAIL: {check.get('why', '?')}"
        text += f" (rel_err {check.get('rel_err', float('nan')):.2e})"
        if c.get("config"):
            text += f"  {c['config']}"
        ratio = f"{c['us'] / combine_us:.2f}" if combine_us else "-"
        pct = c.get("pct_ceiling_fused_bytes")
        print(f"{c['name']:<10}{c['us']:>10.2f}{pct:>7.1f}%{ratio:>11}  {text}")
    if case["fused_target_us"]:
        print(f"target for the fused call: <= {case['fused_target_us']:.2f} us "
              f"({case['fused_target_from']}; best chain: {case['best_chain']})")
    for p in case["paired"]:
        lo, hi = p["ci95"] if p["ci95"] else (float("nan"), float("nan"))
        print(f"  paired {p['peer']} / {p['lib']}: {p['peer_over_lib']:.3f} [{lo:.3f}, {hi:.3f}] "
              f"({p['rounds']} rounds)")


def print_summary(report):
    print(f"\nSummary (us; copy ceiling {report['copy_ceiling_gbps']:.0f} GB/s; fused call: "
          f"{report['fused_call']})")
    names = ["combine", "eager", "compiled", "triton", "fused"]
    print(f"{'shape':<24}{'epilogue':<10}" + "".join(f"{n:>10}" for n in names) +
          f"{'target':>10}  needs")
    for case in report["cases"]:
        us = {c["name"]: c.get("us") for c in case["contenders"]}
        cells = "".join(f"{us[n]:>10.2f}" if us.get(n) else f"{'-':>10}" for n in names)
        target = case["fused_target_us"]
        print(f"{shape_text(case):<24}{case['epilogue']:<10}{cells}"
              f"{target:>10.2f}  {case['fused_target_from']}" if target else
              f"{shape_text(case):<24}{case['epilogue']:<10}{cells}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", help="path of libmoejit.so (default: $MOEJIT_LIBRARY)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--case", action="append", type=parse_case, default=[],
                   help="T,K,H,dtype[,eps] (repeatable; eps default 1e-6): replaces the built-in "
                        "shapes")
    p.add_argument("--shapes", choices=("all", "prefill", "decode"), default="all",
                   help="which built-in shapes (default all)")
    p.add_argument("--epilogue", type=parse_epilogues, default=["norm", "norm-fp8"],
                   help="comma-separated: residual, norm, norm-fp8 (default norm,norm-fp8)")
    p.add_argument("--layout", choices=LAYOUTS, default="gather_map",
                   help="the combine's layout (default gather_map)")
    p.add_argument("--scale-pow2", action="store_true",
                   help="fp8 scales rounded up to a power of two (UE8M0-style)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile chain")
    p.add_argument("--quick", action="store_true",
                   help="DeepSeek-V3's shapes only (one prefill, three decode)")
    p.add_argument("--rounds", type=int, default=0,
                   help="interleaved rounds (default 500 at decode sizes, T <= 64; else 100)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lead-us", type=float, default=200.0,
                   help="GPU sleep before each run, so that host time never shows inside the "
                        "events (the compiled and eager chains enqueue for tens of us)")
    p.add_argument("--seed", type=int, default=20261130)
    a = p.parse_args(argv)
    if a.rounds and a.rounds < 6:
        p.error("--rounds: at least 6 (fewer give no 95% interval)")
    if a.rounds < 0 or a.warmup < 0 or not a.lead_us >= 0:
        p.error("--rounds, --warmup and --lead-us must not be negative")
    return a


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    shapes = args.case or builtin_shapes(args.shapes, args.quick)
    return main_gpu(args, shapes)


if __name__ == "__main__":
    sys.exit(main())
