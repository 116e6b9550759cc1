"""moejit.combine for torch tensors, and the torch.library custom op "moejit::combine".

Imported by the package (`import moejit`) when torch can be imported; without torch the package
still imports, and moejit.combine says that it needs torch.

Three entry points:
  combine(...)     eager, the fastest path: checks, allocates out unless given, launches on
                   torch.cuda.current_stream(), returns out. Writes into `out` (accumulate=True adds
                   into it), so torch.compile cannot trace it: it graph-breaks there. With the
                   epilogue's arguments (residual=, norm_weight=, eps=, out_scales=) it also
                   updates the residual in place, normalizes, and quantizes to fp8.
  combine_op(...)  the functional custom op torch.ops.moejit.combine: never mutates its inputs
                   (accumulation adds into a copy of `base`), has a fake implementation, so it
                   composes with torch.compile and with CUDA graph capture.
  combine_epilogue_op(...)  the custom op torch.ops.moejit.combine_epilogue: the combine with the
                   epilogue; it mutates `residual` (declared, as a fused add-RMSNorm op does) and
                   returns new tensors for the output and the fp8 scales.
No autograd formula is registered: the combine is for inference.

Workspace (token-index layout): allocated per call with torch.empty on the current stream. The
torch caching allocator is already the cache (a warm allocation costs microseconds and no
cudaMalloc), and it is stream-ordered: a block freed after this call is reused only by work
ordered after it on the same stream, and during CUDA graph capture it comes from the graph's
private pool, as the replay needs. A buffer cached here instead could be shared by two streams
running concurrently, which would be a silent race.
"""

import ctypes
from typing import Optional, Tuple, Union

import torch

from . import _capi, _plan

if not hasattr(torch.library, "custom_op"):
    # Registering the op below needs it; without this check the AttributeError would surface from
    # `moejit.combine`'s lazy lookup, reading as if moejit had no combine.
    raise ImportError(f"moejit.combine needs torch 2.4 or newer (torch.library.custom_op); this is "
                      f"torch {torch.__version__}")

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def _ptr(t):
    return t.data_ptr() if t is not None else None


def _launch(plan, expert_hidden, out, scales=None, residual=None):
    """scales: an fp8 out's (plan.scales_layout); residual: the one to update (plan.residual's,
    or the op's)."""
    device = expert_hidden.device
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        args = _plan.fill_args(_capi.new_combine_args(), plan, expert_hidden.data_ptr(),
                               _ptr(plan.gates), _ptr(plan.indices), out.data_ptr(),
                               out_row_stride=_plan._row_stride("out", out, out.shape[0],
                                                                out.shape[1]))
        residual = plan.residual if residual is None else residual
        _plan.fill_epilogue_args(args, plan, _ptr(residual), _ptr(plan.norm_weight), _ptr(scales))
        if plan.layout == _capi.LAYOUT_TOKEN_INDEX:
            nbytes = _capi.combine_workspace_size(args)
            if nbytes:
                workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
                args.workspace = workspace.data_ptr()
                args.workspace_bytes = nbytes
        status = _capi.load_library().moe_combine(ctypes.byref(args), stream or None)
        if status == _capi.ERROR_NO_DEVICE:
            # libmoejit launches in the thread's current CUDA context. torch binds the device's
            # primary context to a thread lazily, on its first CUDA runtime call there, and
            # selecting a device does not count: a fresh Python thread may have none yet. Any
            # kernel launch binds it; then try once more.
            torch.zeros(1, device=device)
            status = _capi.load_library().moe_combine(ctypes.byref(args), stream or None)
        _capi.check("moe_combine", status)
    return out


def combine(expert_hidden: torch.Tensor, *, layout: str = "token_major", top_k: Optional[int] = None,
            gather_map: Optional[torch.Tensor] = None, token_idx: Optional[torch.Tensor] = None,
            gates: Optional[torch.Tensor] = None, num_tokens: Optional[int] = None,
            out: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
            scale: float = 1.0, accumulate: bool = False,
            residual: Optional[torch.Tensor] = None, norm_weight: Optional[torch.Tensor] = None,
            eps: float = 1e-6, out_scales: Optional[torch.Tensor] = None,
            out_scales_pow2: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """out[t, :] (+)= scale * sum of gates[r] * expert_hidden[r, :] over the rows r of token t.

    layout="token_major": expert_hidden is [T, K, H] (or [T*K, H] with top_k); gates [T, K].
    layout="gather_map":  expert_hidden is [R, H]; gather_map [T, K] (int32/int64) gives the row of
                          slot k of token t, -1 if dropped; gates [T, K].
    layout="token_index": expert_hidden is [R, H]; token_idx [R] (int32/int64) gives each row's
                          token, -1 if dropped; gates [R]; num_tokens (or out) gives T.
    gates: float32 or None (all ones). out: [T, H] float32/float16/bfloat16 (or float8_e4m3fn, see
    below), row stride >= H and unit inner stride; allocated (dtype out_dtype, default
    expert_hidden's) if None. accumulate=True adds into out. Sums in fp32 in a fixed order;
    bitwise deterministic. Runs on torch.cuda.current_stream() of expert_hidden's device and
    returns out.

    The epilogue (moejit.h, "The epilogue"; docs/python.md): residual ([T, H], updated in place
    with residual + the combine's result, rounded to its dtype); norm_weight ([H]) and eps: out
    receives RMSNorm(that) * norm_weight instead of the combine's result; an fp8 out
    (out_dtype=torch.float8_e4m3fn, or an out of that dtype) is quantized per token per 128
    channels with fp32 scales in out_scales ([T, ceil(H/128)], row-major or DeepGEMM's
    column-major torch.empty(G, T4).t()[:T]; allocated row-major if None), rounded up to powers
    of two with out_scales_pow2. With an fp8 out the call returns (out, out_scales).

    Raises TypeError / ValueError for bad arguments (naming the argument, its value and what is
    allowed) and moejit.MoejitError when the library fails (status name + library message).
    """
    plan = _plan.plan_combine(expert_hidden, layout=layout, top_k=top_k, gather_map=gather_map,
                              token_idx=token_idx, gates=gates, num_tokens=num_tokens, out=out,
                              out_dtype=out_dtype, scale=scale, accumulate=accumulate,
                              residual=residual, norm_weight=norm_weight, eps=eps,
                              out_scales=out_scales, out_scales_pow2=out_scales_pow2)
    device = expert_hidden.device
    result = out if out is not None else torch.empty(
        plan.out_shape, dtype=_TORCH_DTYPES[plan.out_dtype_name], device=device)
    scales = None
    if plan.fp8:
        scales = out_scales if out_scales is not None else torch.empty(
            plan.scales_shape, dtype=torch.float32, device=device)
    _launch(plan, expert_hidden, result, scales)
    # The kernels wrote the caller's tensors behind torch's back: bump their version counters, so
    # that autograd refuses a graph that saved one before this call instead of using the new values.
    for written in (out, residual, out_scales):
        if written is not None:
            torch.autograd.graph.increment_version(written)
    return (result, scales) if plan.fp8 else result


# ---- The custom op -------------------------------------------------------------------------------


def _op_plan(expert_hidden, indices, gates, base, layout, top_k, num_tokens, out_dtype, scale,
             shape_only=False):
    # `indices` is the gather map or token_idx by layout (combine_op checked which was given).
    # base: the op accumulates into a contiguous copy, so base's own strides (a broadcast bias,
    # a transposed tensor) are fine.
    index_arg = {"token_idx" if layout == "token_index" else "gather_map": indices}
    return _plan.plan_combine(expert_hidden, layout=layout, top_k=top_k, gates=gates,
                              num_tokens=num_tokens, out=base, out_dtype=out_dtype, scale=scale,
                              accumulate=base is not None, out_arg="base", out_copied=True,
                              shape_only=shape_only, **index_arg)


@torch.library.custom_op("moejit::combine", mutates_args=())
def _combine_op(expert_hidden: torch.Tensor, indices: Optional[torch.Tensor],
                gates: Optional[torch.Tensor], base: Optional[torch.Tensor], layout: str,
                top_k: Optional[int], num_tokens: Optional[int], out_dtype: Optional[torch.dtype],
                scale: float) -> torch.Tensor:
    plan = _op_plan(expert_hidden, indices, gates, base, layout, top_k, num_tokens, out_dtype,
                    scale)
    if base is not None:
        # Functional: accumulate into a fresh copy, never into the caller's tensor.
        out = base.clone(memory_format=torch.contiguous_format)
    else:
        out = torch.empty(plan.out_shape, dtype=_TORCH_DTYPES[plan.out_dtype_name],
                          device=expert_hidden.device)
    return _launch(plan, expert_hidden, out)


@_combine_op.register_fake
def _(expert_hidden, indices, gates, base, layout, top_k, num_tokens, out_dtype, scale):
    # The same checks as the real op, so torch.compile reports bad arguments while tracing; meta
    # tensors are accepted too (shape inference on device="meta", e.g. a model built there).
    plan = _op_plan(expert_hidden, indices, gates, base, layout, top_k, num_tokens, out_dtype,
                    scale, shape_only=True)
    return expert_hidden.new_empty(plan.out_shape, dtype=_TORCH_DTYPES[plan.out_dtype_name])


def combine_op(expert_hidden: torch.Tensor, *, layout: str = "token_major",
               top_k: Optional[int] = None, gather_map: Optional[torch.Tensor] = None,
               token_idx: Optional[torch.Tensor] = None, gates: Optional[torch.Tensor] = None,
               num_tokens: Optional[int] = None, base: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None,
               scale: float = 1.0) -> torch.Tensor:
    """Functional combine through torch.ops.moejit.combine: returns a new tensor
    (base + scale * sum ... when base is given, else scale * sum ...). Same arguments as
    combine(), with `base` instead of out/accumulate. Use this inside torch.compile'd code."""
    if gather_map is not None and token_idx is not None:
        raise ValueError("moejit.combine_op: pass gather_map or token_idx, not both")
    # The op takes one `indices` argument, read by layout: check which one was given first, or a
    # gather map passed with layout='token_index' would be read as token_idx (and the reverse).
    _plan.check_index_args(layout, gather_map, token_idx)
    indices = gather_map if gather_map is not None else token_idx
    # Checked before float(): the op's schema takes a float, and float("2") would pass.
    scale = _plan.checked_scale(scale)
    return torch.ops.moejit.combine(expert_hidden, indices, gates, base, layout,
                                    _plan.plain_int(top_k), _plan.plain_int(num_tokens), out_dtype,
                                    scale)


# ---- The epilogue's custom op --------------------------------------------------------------------


def _epilogue_op_plan(expert_hidden, indices, gates, base, residual, norm_weight, layout, top_k,
                      num_tokens, out_dtype, scale, eps, scales_pow2, shape_only=False):
    index_arg = {"token_idx" if layout == "token_index" else "gather_map": indices}
    return _plan.plan_combine(expert_hidden, layout=layout, top_k=top_k, gates=gates,
                              num_tokens=num_tokens, out=base, out_dtype=out_dtype, scale=scale,
                              accumulate=base is not None, residual=residual,
                              norm_weight=norm_weight, eps=eps, out_scales_pow2=scales_pow2,
                              out_arg="base", out_copied=True, shape_only=shape_only, **index_arg)


def _new_scales(plan, like, column_major):
    """An fp8 out's scales for the op: [T, G] row-major, or [G, T4] whose .t()[:T] is DeepGEMM's
    column-major layout; an empty tensor for other outputs."""
    if not plan.fp8:
        return like.new_empty((0,), dtype=torch.float32)
    T, G = plan.scales_shape
    if column_major:
        return like.new_empty((G, (T + 3) // 4 * 4), dtype=torch.float32)
    return like.new_empty((T, G), dtype=torch.float32)


@torch.library.custom_op("moejit::combine_epilogue", mutates_args=("residual",))
def _combine_epilogue_op(expert_hidden: torch.Tensor, indices: Optional[torch.Tensor],
                         gates: Optional[torch.Tensor], base: Optional[torch.Tensor],
                         residual: Optional[torch.Tensor], norm_weight: Optional[torch.Tensor],
                         layout: str, top_k: Optional[int], num_tokens: Optional[int],
                         out_dtype: Optional[torch.dtype], scale: float, eps: float,
                         scales_column_major: bool,
                         scales_pow2: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    plan = _epilogue_op_plan(expert_hidden, indices, gates, base, residual, norm_weight, layout,
                             top_k, num_tokens, out_dtype, scale, eps, scales_pow2)
    if base is not None:
        out = base.clone(memory_format=torch.contiguous_format)
    else:
        out = torch.empty(plan.out_shape, dtype=_TORCH_DTYPES[plan.out_dtype_name],
                          device=expert_hidden.device)
    scales = _new_scales(plan, expert_hidden, scales_column_major)
    if plan.fp8:
        T, _ = plan.scales_shape
        view = scales.t()[:T] if scales_column_major else scales
        plan.scales_layout = _plan.scales_layout_of(view, *plan.out_shape, name="the scales")
    _launch(plan, expert_hidden, out, scales)
    return out, scales


@_combine_epilogue_op.register_fake
def _(expert_hidden, indices, gates, base, residual, norm_weight, layout, top_k, num_tokens,
      out_dtype, scale, eps, scales_column_major, scales_pow2):
    plan = _epilogue_op_plan(expert_hidden, indices, gates, base, residual, norm_weight, layout,
                             top_k, num_tokens, out_dtype, scale, eps, scales_pow2,
                             shape_only=True)
    out = expert_hidden.new_empty(plan.out_shape, dtype=_TORCH_DTYPES[plan.out_dtype_name])
    return out, _new_scales(plan, expert_hidden, scales_column_major)


def combine_epilogue_op(expert_hidden: torch.Tensor, *, layout: str = "token_major",
                        top_k: Optional[int] = None, gather_map: Optional[torch.Tensor] = None,
                        token_idx: Optional[torch.Tensor] = None,
                        gates: Optional[torch.Tensor] = None, num_tokens: Optional[int] = None,
                        base: Optional[torch.Tensor] = None,
                        out_dtype: Optional[torch.dtype] = None, scale: float = 1.0,
                        residual: Optional[torch.Tensor] = None,
                        norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                        scales_column_major: bool = False, out_scales_pow2: bool = False
                        ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The combine with the epilogue through torch.ops.moejit.combine_epilogue, for torch.compile:
    combine_op's arguments and combine()'s epilogue ones; updates `residual` in place (the op
    declares it) and returns a new output, or for an fp8 output (out_dtype=torch.float8_e4m3fn)
    (out, scales): scales [T, ceil(H/128)] row-major, or with scales_column_major a [G, T4]
    tensor whose .t()[:T] is DeepGEMM's column-major layout."""
    if gather_map is not None and token_idx is not None:
        raise ValueError("moejit.combine_epilogue_op: pass gather_map or token_idx, not both")
    _plan.check_index_args(layout, gather_map, token_idx)
    indices = gather_map if gather_map is not None else token_idx
    scale = _plan.checked_scale(scale)
    eps = _plan.checked_eps(eps)
    for name, flag in (("scales_column_major", scales_column_major),
                       ("out_scales_pow2", out_scales_pow2)):
        if not _plan._is_flag(flag):
            raise TypeError(f"moejit.combine_epilogue_op: {name} must be a bool, got {flag!r}")
    out, scales = torch.ops.moejit.combine_epilogue(
        expert_hidden, indices, gates, base, residual, norm_weight, layout,
        _plan.plain_int(top_k), _plan.plain_int(num_tokens), out_dtype, scale, eps,
        bool(scales_column_major), bool(out_scales_pow2))
    fp8 = out.dtype == torch.float8_e4m3fn
    return (out, scales) if fp8 else out
