"""Checks the arguments of moejit.combine and derives the C call's shape fields.

Imports no torch: it reads only what every tensor has (shape, stride(), dtype, device), so it runs
on real tensors, on FakeTensors while torch.compile traces (the custom op's fake implementation
uses it to compute the output shape), and on stand-in objects in the torch-free tests.

Errors name the argument, its value and what is allowed: TypeError for a wrong type or dtype,
ValueError for a wrong shape, stride, device or value.
"""

import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from . import _capi

LAYOUTS = {
    "token_major": _capi.LAYOUT_TOKEN_MAJOR,
    "gather_map": _capi.LAYOUT_GATHER_MAP,
    "token_index": _capi.LAYOUT_TOKEN_INDEX,
}
FLOAT_DTYPES = {
    "float32": _capi.DTYPE_FLOAT32,
    "float16": _capi.DTYPE_FLOAT16,
    "bfloat16": _capi.DTYPE_BFLOAT16,
}
INDEX_DTYPES = {"int32": _capi.INDEX_INT32, "int64": _capi.INDEX_INT64}
# out's dtypes: the float ones, and fp8 e4m3 for the epilogue's quantized output (with scales).
FP8 = "float8_e4m3fn"
OUT_DTYPES = dict(FLOAT_DTYPES, **{FP8: _capi.DTYPE_FLOAT8_E4M3})
GROUP = 128  # channels per fp8 scale

# num_rows for the gather map and the token index (moejit.h: R < 2^31).
MAX_INDEXED_ROWS = (1 << 31) - 1

_FLOATS = "torch.float32, torch.float16 or torch.bfloat16"
_OUTS = _FLOATS + " (or torch.float8_e4m3fn, with scales)"
_INDICES = "torch.int32 or torch.int64"


@dataclass
class CombinePlan:
    layout: int
    num_tokens: Any  # int, or a SymInt while torch.compile traces
    top_k: Any
    num_rows: Any
    hidden_dim: Any
    expert_dtype: int
    expert_row_stride: Any  # elements; 0 means hidden_dim
    indices: Any  # the gather map or token_idx tensor, or None
    index_type: int
    gates: Any
    out_shape: Tuple[Any, Any]
    out_dtype: int
    out_dtype_name: str  # "float32" | "float16" | "bfloat16"
    out_row_stride: Any  # of the given out; 0 when out is allocated (contiguous)
    scale: float
    accumulate: bool
    # The epilogue (docs/python.md): the residual updated in place, the norm's weight and eps, an
    # fp8 out's scales ([T, G] tensor, or None: allocated row-major) and their layout.
    residual: Any = None
    residual_dtype: int = _capi.DTYPE_FLOAT32
    residual_row_stride: Any = 0
    norm_weight: Any = None
    norm_weight_dtype: int = _capi.DTYPE_FLOAT32
    norm_eps: float = 1e-6
    out_scales: Any = None
    scales_shape: Any = None  # (T, G) for an fp8 out, else None
    scales_layout: int = _capi.SCALES_ROW_MAJOR
    scales_pow2: bool = False

    @property
    def fp8(self):
        return self.out_dtype == _capi.DTYPE_FLOAT8_E4M3


def dtype_name(dtype):
    """"bfloat16" for torch.bfloat16 (whose str() is "torch.bfloat16")."""
    s = str(dtype)
    return s[len("torch."):] if s.startswith("torch.") else s


_FLOAT32_MAX = 3.4028234663852886e38


def _fail(exc, message):
    raise exc("moejit.combine: " + message)


def _is_tensor(x):
    return hasattr(x, "shape") and hasattr(x, "stride") and hasattr(x, "dtype")


def _is_int(x):
    # SymInt: an int that torch.compile traces symbolically (e.g. num_tokens=x.shape[0]);
    # numbers.Integral: numpy's integers too.
    return (isinstance(x, numbers.Integral) and not isinstance(x, bool)) or \
        type(x).__name__ == "SymInt"


def _is_flag(x):
    """A bool, or 0 / 1 as any integer, numpy's bool too (numpy.bool_ is no numbers.Integral: told
    by its dtype's kind, as a 0-d scalar). A SymInt is not: its value is not known here."""
    if isinstance(x, numbers.Integral):
        return int(x) in (0, 1)
    kind = getattr(getattr(x, "dtype", None), "kind", None)
    return kind == "b" and getattr(x, "shape", None) == () and not _is_tensor(x)


def plain_int(x):
    """A numpy (or other Integral) integer as a Python int, for the C call and the op's schema;
    anything else (None, a SymInt, a wrong type left for the checks to name) as it is."""
    if isinstance(x, numbers.Integral) and not isinstance(x, (bool, int)) and \
            type(x).__name__ != "SymInt":  # int() would specialize a traced size
        return int(x)
    return x


def checked_scale(scale):
    """scale as a Python float: any real number (numpy's floats too) that float32 holds finitely."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        _fail(TypeError, f"scale must be a float, got {type(scale).__name__}")
    value = float(scale)
    # The library takes a float32: a larger magnitude would arrive as infinity.
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        _fail(ValueError, f"scale = {scale}; must be a finite number within float32's range "
              f"(|scale| <= {_FLOAT32_MAX:.7g})")
    return value


def _require_tensor(name, x):
    if not _is_tensor(x):
        _fail(TypeError, f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _require_dtype(name, x, allowed, allowed_text):
    if dtype_name(x.dtype) not in allowed:
        _fail(TypeError, f"{name} has dtype {x.dtype}; allowed: {allowed_text}")


def _require_device(name, x, device, meta_ok=False):
    # device: expert_hidden's, which every other tensor must share (None for expert_hidden itself).
    # meta_ok: shape inference only (the op's fake implementation), where expert_hidden may be a
    # meta tensor and every other tensor then too.
    kind = device.type if device is not None else x.device.type
    if x.device.type != "cuda" and not (x.device.type == "meta" and kind == "meta" and
                                        (meta_ok or device is not None)):
        _fail(ValueError, f"{name} is on device {x.device}; moejit needs CUDA "
              "tensors")
    if device is not None and (x.device.type != device.type or x.device.index != device.index):
        _fail(ValueError, f"{name} is on device {x.device} but expert_hidden is "
              f"on {device}; all tensors must be on the same device")


def _contiguous(shape, strides):
    expected = 1
    for size, stride in zip(reversed(tuple(shape)), reversed(tuple(strides))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _require_contiguous(name, x):
    if not _contiguous(x.shape, x.stride()):
        _fail(ValueError, f"{name} with shape {tuple(x.shape)} has strides {tuple(x.stride())}; it "
              "must be contiguous (call .contiguous())")


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _row_stride(name, x, rows, hidden):
    """Row pitch (elements) of a [rows, hidden] matrix whose inner stride must be 1; 0 (= hidden)
    when there is at most one row, whose pitch no kernel ever uses."""
    inner, outer = x.stride()[-1], x.stride()[0]
    if hidden > 1 and inner != 1:
        _fail(ValueError, f"{name} has strides {tuple(x.stride())}; the last dimension must have "
              "stride 1 (rows may be padded, elements may not)")
    if rows <= 1:
        return 0
    if outer < hidden:
        _fail(ValueError, f"{name} has row stride {outer} < hidden_dim {hidden}; rows must not "
              "overlap (stride 0 / expanded tensors are not supported)")
    return outer


def _check_indices(name, x, device):
    _require_tensor(name, x)
    _require_dtype(name, x, INDEX_DTYPES, _INDICES)
    _require_device(name, x, device)
    _require_contiguous(name, x)


def check_index_args(layout, gather_map, token_idx):
    """gather_map goes with layout='gather_map' and token_idx with 'token_index' only (combine_op
    merges them into one argument, so it checks before merging)."""
    for name, value, used_by in (("gather_map", gather_map, "gather_map"),
                                 ("token_idx", token_idx, "token_index")):
        if value is not None and layout != used_by:
            _fail(ValueError, f"{name} is given but layout = {layout!r}; {name} is only used by "
                  f"layout={used_by!r}")


def checked_eps(eps):
    """eps as a Python float: a finite real number >= 0 that float32 holds."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        _fail(TypeError, f"eps must be a float, got {type(eps).__name__}")
    value = float(eps)
    if not math.isfinite(value) or value < 0 or value > _FLOAT32_MAX:
        _fail(ValueError, f"eps = {eps}; must be a finite number >= 0 (the RMSNorm's epsilon)")
    return value


def scales_layout_of(scales, T, H, name="out_scales"):
    """The C layout of a [T, G] fp32 scales tensor (G = ceil(H / 128)), from its strides:
    row-major (G, 1), or DeepGEMM's column-major (1, T4) with T4 = T rounded up to 4 (needs
    hidden % 128 == 0). A stride of a size-1 dimension is any; where both fit, the addresses are
    the same (G == 1): row-major."""
    G = (H + GROUP - 1) // GROUP
    if tuple(scales.shape) != (T, G):
        _fail(ValueError, f"{name} has shape {tuple(scales.shape)}; must be [num_tokens, "
              f"ceil(hidden / 128)] = ({T}, {G})")
    t4 = (T + 3) // 4 * 4
    s0, s1 = tuple(scales.stride())
    if (T <= 1 or s0 == G) and (G <= 1 or s1 == 1):
        return _capi.SCALES_ROW_MAJOR
    if H % GROUP == 0 and (T <= 1 or s0 == 1) and (G <= 1 or s1 == t4):
        return _capi.SCALES_COLUMN_MAJOR_ALIGNED4
    _fail(ValueError, f"{name} with shape {(T, G)} has strides {(s0, s1)}; allowed: row-major "
          f"({G}, 1), or column-major (1, {t4}) with hidden % 128 == 0 (DeepGEMM's: "
          f"torch.empty({G}, {t4}, dtype=torch.float32).t()[:{T}])")


def plan_combine(expert_hidden, *, layout="token_major", top_k=None, gather_map=None,
                 token_idx=None, gates=None, num_tokens=None, out=None, out_dtype=None,
                 scale=1.0, accumulate=False, residual=None, norm_weight=None, eps=1e-6,
                 out_scales=None, out_scales_pow2=False, out_arg="out", out_copied=False,
                 shape_only=False) -> CombinePlan:
    """out_arg names `out` in messages; out_copied: the launch writes a contiguous copy of it
    (combine_op's base), so its own strides do not matter; shape_only: no launch follows (the
    op's fake implementation), so meta tensors are accepted too."""
    if not isinstance(layout, str) or layout not in LAYOUTS:  # a list is not even hashable
        _fail(ValueError, f"layout = {layout!r}; allowed: " + ", ".join(repr(k) for k in LAYOUTS))
    _require_tensor("expert_hidden", expert_hidden)
    _require_dtype("expert_hidden", expert_hidden, FLOAT_DTYPES, _FLOATS)
    _require_device("expert_hidden", expert_hidden, None, meta_ok=shape_only)
    device = expert_hidden.device
    shape = tuple(expert_hidden.shape)
    if top_k is not None and not _is_int(top_k):
        _fail(TypeError, f"top_k must be an int, got {type(top_k).__name__}")
    if num_tokens is not None and not _is_int(num_tokens):
        _fail(TypeError, f"num_tokens must be an int, got {type(num_tokens).__name__}")
    top_k, num_tokens = plain_int(top_k), plain_int(num_tokens)
    if top_k is not None and not 1 <= top_k <= _capi.MAX_TOP_K:
        _fail(ValueError, f"top_k = {top_k}; allowed: 1..{_capi.MAX_TOP_K}")
    if num_tokens is not None and not 0 <= num_tokens <= _capi.MAX_NUM_TOKENS:
        _fail(ValueError, f"num_tokens = {num_tokens}; allowed: 0..{_capi.MAX_NUM_TOKENS} (2^40)")

    check_index_args(layout, gather_map, token_idx)

    indices, index_type = None, _capi.INDEX_INT32
    if layout == "token_major":
        if len(shape) == 3:
            T, K, H = shape
            if top_k is not None and top_k != K:
                _fail(ValueError, f"top_k = {top_k} but expert_hidden has shape {shape} = "
                      "[num_tokens, top_k, hidden]")
            R = T * K
            s0, s1, s2 = expert_hidden.stride()
            if H > 1 and s2 != 1:
                _fail(ValueError, f"expert_hidden has strides {(s0, s1, s2)}; the last dimension "
                      "must have stride 1")
            # Rows t*K + k must be evenly spaced: one pitch for the [T*K, H] view.
            pitch = s1 if K > 1 else (s0 if T > 1 else H)
            if (K > 1 and T > 1 and s0 != K * s1) or (R > 1 and pitch < H):
                _fail(ValueError, f"expert_hidden with shape {shape} has strides "
                      f"{(s0, s1, s2)}; the token-major rows must be evenly spaced with a pitch >= "
                      f"hidden (strides [top_k*p, p, 1], p >= {H})")
            row_stride = pitch if R > 1 else 0
        elif len(shape) == 2:
            if top_k is None:
                _fail(ValueError, f"top_k is required when expert_hidden is 2-D {shape} = "
                      "[num_tokens*top_k, hidden] (or pass it 3-D [num_tokens, top_k, hidden])")
            R, H = shape
            K = top_k
            if R % K != 0:
                _fail(ValueError, f"expert_hidden has {R} rows, not a multiple of top_k = {K}")
            T = R // K
            row_stride = _row_stride("expert_hidden", expert_hidden, R, H)
        else:
            _fail(ValueError, f"expert_hidden has shape {shape}; allowed for layout "
                  "'token_major': [num_tokens, top_k, hidden] or [num_tokens*top_k, hidden]")
        if num_tokens is not None and num_tokens != T:
            _fail(ValueError, f"num_tokens = {num_tokens} but expert_hidden {shape} holds {T} tokens")
    else:
        if len(shape) != 2:
            _fail(ValueError, f"expert_hidden has shape {shape}; allowed for layout {layout!r}: "
                  "[num_rows, hidden]")
        R, H = shape
        if R > MAX_INDEXED_ROWS:  # row ids are int32 in the library (a SymInt compares symbolically)
            _fail(ValueError, f"expert_hidden has {R} rows; allowed for layout {layout!r}: at most "
                  f"{MAX_INDEXED_ROWS} (2^31 - 1)")
        row_stride = _row_stride("expert_hidden", expert_hidden, R, H)
        if layout == "gather_map":
            if gather_map is None:
                _fail(ValueError, "gather_map is required for layout='gather_map' ([num_tokens, "
                      "top_k] row indices, -1 for a dropped slot)")
            _check_indices("gather_map", gather_map, device)
            gshape = tuple(gather_map.shape)
            if len(gshape) == 2:
                T, K = gshape
                if top_k is not None and top_k != K:
                    _fail(ValueError, f"top_k = {top_k} but gather_map has shape {gshape} = "
                          "[num_tokens, top_k]")
            elif len(gshape) == 1:
                if top_k is None:
                    _fail(ValueError, f"top_k is required when gather_map is 1-D {gshape} (or pass "
                          "it 2-D [num_tokens, top_k])")
                K = top_k
                if gshape[0] % K != 0:
                    _fail(ValueError, f"gather_map has {gshape[0]} entries, not a multiple of "
                          f"top_k = {K}")
                T = gshape[0] // K
            else:
                _fail(ValueError, f"gather_map has shape {gshape}; allowed: [num_tokens, top_k] "
                      "or [num_tokens*top_k]")
            if num_tokens is not None and num_tokens != T:
                _fail(ValueError, f"num_tokens = {num_tokens} but gather_map {gshape} maps {T} "
                      "tokens")
            indices = gather_map
        else:
            if top_k is not None:
                _fail(ValueError, f"top_k = {top_k} is given but layout='token_index' does not use "
                      "it (any token may receive any number of rows)")
            if token_idx is None:
                _fail(ValueError, "token_idx is required for layout='token_index' ([num_rows] "
                      "token of each row, -1 for a dropped row)")
            _check_indices("token_idx", token_idx, device)
            if tuple(token_idx.shape) != (R,):
                _fail(ValueError, f"token_idx has shape {tuple(token_idx.shape)}; must be "
                      f"[num_rows] = ({R},) like expert_hidden {shape}")
            if num_tokens is not None:
                T = num_tokens
            elif out is not None and _is_tensor(out) and len(out.shape) >= 1:
                T = out.shape[0]
            else:
                _fail(ValueError, "num_tokens is required for layout='token_index' (the number "
                      "of output rows cannot be read from token_idx without a device sync); or "
                      f"pass {out_arg}")
            K = 0
            indices = token_idx
        index_type = INDEX_DTYPES[dtype_name(indices.dtype)]

    # top_k read from a shape is checked like one passed in (the library would refuse it too, but
    # as MoejitError, not the ValueError promised for bad arguments).
    if layout != "token_index" and not 1 <= K <= _capi.MAX_TOP_K:
        _fail(ValueError, f"top_k = {K} (from the shapes: expert_hidden {shape}"
              + (f", gather_map {tuple(gather_map.shape)}" if gather_map is not None else "")
              + f"); allowed: 1..{_capi.MAX_TOP_K}")

    if not 1 <= H <= _capi.MAX_HIDDEN_DIM:
        _fail(ValueError, f"hidden size {H} of expert_hidden {shape} is not in "
              f"1..{_capi.MAX_HIDDEN_DIM}")

    if gates is not None:
        _require_tensor("gates", gates)
        _require_dtype("gates", gates, ("float32",), "torch.float32")
        _require_device("gates", gates, device)
        _require_contiguous("gates", gates)
        gshape = tuple(gates.shape)
        if layout == "token_index":
            ok, allowed = gshape == (R,), f"[num_rows] = ({R},)"
        else:
            ok = gshape in ((T, K), (T * K,))
            allowed = f"[num_tokens, top_k] = ({T}, {K}) or [num_tokens*top_k] = ({T * K},)"
        if not ok:
            _fail(ValueError, f"gates has shape {gshape}; allowed: {allowed}")

    if not _is_flag(accumulate):
        _fail(TypeError, f"accumulate must be a bool, got {accumulate!r}")
    if out is not None:
        _require_tensor(out_arg, out)
        _require_dtype(out_arg, out, OUT_DTYPES, _OUTS)
        _require_device(out_arg, out, device)
        if tuple(out.shape) != (T, H):
            _fail(ValueError, f"{out_arg} has shape {tuple(out.shape)}; must be [num_tokens, "
                  f"hidden] = ({T}, {H})")
        out_row_stride = H if out_copied else _row_stride(out_arg, out, T, H)
        if out_dtype is not None and dtype_name(out_dtype) != dtype_name(out.dtype):
            _fail(ValueError, f"out_dtype = {out_dtype} but {out_arg} has dtype {out.dtype}; "
                  "pass one or make them agree")
        out_name = dtype_name(out.dtype)
    else:
        if accumulate:
            _fail(ValueError, "accumulate=True adds into out, so out must be given")
        out_name = dtype_name(out_dtype) if out_dtype is not None else dtype_name(
            expert_hidden.dtype)
        if out_name not in OUT_DTYPES:
            _fail(TypeError, f"out_dtype = {out_dtype}; allowed: {_OUTS}")
        out_row_stride = 0

    scale = checked_scale(scale)
    plan = CombinePlan(
        layout=LAYOUTS[layout], num_tokens=T, top_k=K, num_rows=R, hidden_dim=H,
        expert_dtype=FLOAT_DTYPES[dtype_name(expert_hidden.dtype)], expert_row_stride=row_stride,
        indices=indices, index_type=index_type, gates=gates, out_shape=(T, H),
        out_dtype=OUT_DTYPES[out_name], out_dtype_name=out_name, out_row_stride=out_row_stride,
        scale=scale, accumulate=bool(accumulate))
    _plan_epilogue(plan, device, residual, norm_weight, eps, out_scales, out_scales_pow2)
    return plan


def _plan_epilogue(plan, device, residual, norm_weight, eps, out_scales, out_scales_pow2):
    """The epilogue's arguments (residual, norm_weight, eps, out_scales, out_scales_pow2) into the
    plan, checked as the others."""
    T, H = plan.out_shape
    if residual is not None:
        _require_tensor("residual", residual)
        _require_dtype("residual", residual, FLOAT_DTYPES, _FLOATS)
        _require_device("residual", residual, device)
        if tuple(residual.shape) != (T, H):
            _fail(ValueError, f"residual has shape {tuple(residual.shape)}; must be [num_tokens, "
                  f"hidden] = ({T}, {H})")
        plan.residual = residual
        plan.residual_dtype = FLOAT_DTYPES[dtype_name(residual.dtype)]
        plan.residual_row_stride = _row_stride("residual", residual, T, H)
    if norm_weight is not None:
        _require_tensor("norm_weight", norm_weight)
        _require_dtype("norm_weight", norm_weight, FLOAT_DTYPES, _FLOATS)
        _require_device("norm_weight", norm_weight, device)
        if tuple(norm_weight.shape) != (H,):
            _fail(ValueError, f"norm_weight has shape {tuple(norm_weight.shape)}; must be "
                  f"[hidden] = ({H},)")
        _require_contiguous("norm_weight", norm_weight)
        plan.norm_weight = norm_weight
        plan.norm_weight_dtype = FLOAT_DTYPES[dtype_name(norm_weight.dtype)]
    plan.norm_eps = checked_eps(eps)
    if not _is_flag(out_scales_pow2):
        _fail(TypeError, f"out_scales_pow2 must be a bool, got {out_scales_pow2!r}")
    plan.scales_pow2 = bool(out_scales_pow2)
    if not plan.fp8:
        if out_scales is not None:
            _fail(ValueError, f"out_scales is given but the output's dtype is "
                  f"{plan.out_dtype_name}; only an fp8 output (torch.float8_e4m3fn) has scales")
        return
    plan.scales_shape = (T, (H + GROUP - 1) // GROUP)
    if out_scales is not None:
        _require_tensor("out_scales", out_scales)
        _require_dtype("out_scales", out_scales, ("float32",), "torch.float32")
        _require_device("out_scales", out_scales, device)
        plan.scales_layout = scales_layout_of(out_scales, T, H)
        plan.out_scales = out_scales


def fill_args(args, plan: CombinePlan, expert_ptr, gates_ptr, indices_ptr, out_ptr,
              out_row_stride: Optional[int] = None):
    """Writes the plan and the device pointers into a _capi.CombineArgs."""
    args.layout = plan.layout
    args.num_tokens = int(plan.num_tokens)
    args.top_k = int(plan.top_k)
    args.num_rows = int(plan.num_rows)
    args.hidden_dim = int(plan.hidden_dim)
    args.expert_hidden = expert_ptr
    args.expert_dtype = plan.expert_dtype
    args.expert_row_stride = int(plan.expert_row_stride)
    args.gates = gates_ptr
    args.indices = indices_ptr
    args.index_type = plan.index_type
    args.out = out_ptr
    args.out_dtype = plan.out_dtype
    args.out_row_stride = int(plan.out_row_stride if out_row_stride is None else out_row_stride)
    args.scale = plan.scale
    args.accumulate = 1 if plan.accumulate else 0
    return args


def fill_epilogue_args(args, plan: CombinePlan, residual_ptr, weight_ptr, scales_ptr):
    """Writes the plan's epilogue and its device pointers into a _capi.CombineArgs."""
    args.residual = residual_ptr
    args.residual_dtype = plan.residual_dtype
    args.residual_row_stride = int(plan.residual_row_stride)
    args.norm_weight = weight_ptr
    args.norm_weight_dtype = plan.norm_weight_dtype
    args.norm_eps = plan.norm_eps
    args.out_scales = scales_ptr
    args.out_scales_layout = plan.scales_layout
    args.out_scales_pow2 = 1 if plan.scales_pow2 else 0
    return args
