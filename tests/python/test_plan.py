"""Argument checking of moejit.combine, without torch or a GPU: moejit._plan reads only shape,
stride(), dtype and device, so small stand-ins exercise every check the torch path runs."""
import fractions
import numbers

import pytest

from moejit import _capi, _plan


class Device:
    def __init__(self, type_="cuda", index=0):
        self.type, self.index = type_, index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


class DType:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return "torch." + self.name


class T:
    """A tensor stand-in: contiguous unless strides are given."""

    def __init__(self, shape, dtype="bfloat16", strides=None, device=None):
        self.shape = tuple(shape)
        self.dtype = DType(dtype)
        self.device = device or Device()
        if strides is None:
            strides, acc = [], 1
            for s in reversed(self.shape):
                strides.insert(0, acc)
                acc *= s
        self._strides = tuple(strides)

    def stride(self):
        return self._strides


H = 4096


def err(exc, match, **kw):
    expert = kw.pop("expert_hidden", None) or T((66, H))
    with pytest.raises(exc, match=match) as info:
        _plan.plan_combine(expert, **kw)
    assert str(info.value).startswith("moejit.combine: ")
    return info.value


def test_token_major_3d():
    p = _plan.plan_combine(T((33, 2, H)), gates=T((33, 2), "float32"), scale=2.5)
    assert (p.layout, p.num_tokens, p.top_k, p.num_rows, p.hidden_dim) == (
        _capi.LAYOUT_TOKEN_MAJOR, 33, 2, 66, H)
    assert p.out_shape == (33, H) and p.out_dtype_name == "bfloat16" and p.scale == 2.5
    assert p.expert_row_stride == H


def test_token_major_2d_needs_top_k():
    err(ValueError, "top_k is required", layout="token_major")
    p = _plan.plan_combine(T((66, H)), top_k=2, out_dtype=DType("float32"))
    assert p.num_tokens == 33 and p.out_dtype == _capi.DTYPE_FLOAT32
    err(ValueError, "not a multiple of top_k = 4", expert_hidden=T((66, H)), top_k=4)


def test_token_major_rejects_uneven_rows():
    # [T, K, H] slice of a [T, 4, H] tensor: rows t*K+k are not evenly spaced.
    err(ValueError, "evenly spaced", expert_hidden=T((33, 2, H), strides=(4 * H, H, 1)))
    p = _plan.plan_combine(T((33, 2, H), strides=(2 * (H + 64), H + 64, 1)))
    assert p.expert_row_stride == H + 64


def test_gather_map():
    p = _plan.plan_combine(T((70, H)), layout="gather_map", gather_map=T((33, 2), "int64"),
                           gates=T((66,), "float32"))
    assert (p.num_tokens, p.top_k, p.num_rows, p.index_type) == (33, 2, 70, _capi.INDEX_INT64)
    p = _plan.plan_combine(T((70, H)), layout="gather_map", gather_map=T((66,), "int32"),
                           top_k=2)
    assert p.num_tokens == 33
    err(ValueError, "gather_map is required", layout="gather_map")
    err(ValueError, "top_k = 3 but gather_map has shape", layout="gather_map",
        gather_map=T((33, 2), "int32"), top_k=3)
    err(TypeError, "gather_map has dtype torch.float32; allowed: torch.int32 or torch.int64",
        layout="gather_map", gather_map=T((33, 2), "float32"))
    err(ValueError, "must be contiguous", layout="gather_map",
        gather_map=T((33, 2), "int32", strides=(1, 33)))


def test_token_index():
    p = _plan.plan_combine(T((66, H)), layout="token_index", token_idx=T((66,), "int32"),
                           num_tokens=40)
    assert (p.layout, p.num_tokens, p.num_rows, p.top_k) == (_capi.LAYOUT_TOKEN_INDEX, 40, 66, 0)
    p = _plan.plan_combine(T((66, H)), layout="token_index", token_idx=T((66,), "int32"),
                           out=T((40, H)), accumulate=True)
    assert p.num_tokens == 40 and p.accumulate
    err(ValueError, "num_tokens is required", layout="token_index", token_idx=T((66,), "int32"))
    err(ValueError, r"num_tokens = -1; allowed: 0\.\.1099511627776 \(2\^40\)", layout="token_index",
        token_idx=T((66,), "int32"), num_tokens=-1)
    err(ValueError, r"num_tokens = 1099511627777; allowed", layout="token_index",
        token_idx=T((66,), "int32"), num_tokens=(1 << 40) + 1)
    err(ValueError, r"token_idx has shape \(65,\)", layout="token_index",
        token_idx=T((65,), "int32"), num_tokens=4)
    err(ValueError, "does not use it", layout="token_index", token_idx=T((66,), "int32"),
        num_tokens=4, top_k=2)
    err(ValueError, r"gates has shape \(33, 2\); allowed: \[num_rows\]", layout="token_index",
        token_idx=T((66,), "int32"), num_tokens=4, gates=T((33, 2), "float32"))


def test_index_for_the_wrong_layout():
    err(ValueError, "token_idx is given but layout = 'gather_map'", layout="gather_map",
        gather_map=T((33, 2), "int32"), token_idx=T((66,), "int32"))
    err(ValueError, "gather_map is given but layout = 'token_major'", top_k=2,
        gather_map=T((33, 2), "int32"))


def test_index_check_of_the_merged_op_argument():
    # combine_op merges gather_map and token_idx into one argument read by layout: it checks which
    # one was given first (a gather map must never be read as token_idx).
    _plan.check_index_args("gather_map", T((33, 2), "int32"), None)
    _plan.check_index_args("token_index", None, T((66,), "int32"))
    with pytest.raises(ValueError, match="gather_map is given but layout = 'token_index'"):
        _plan.check_index_args("token_index", T((66,), "int32"), None)
    with pytest.raises(ValueError, match="token_idx is given but layout = 'gather_map'"):
        _plan.check_index_args("gather_map", None, T((33, 2), "int32"))


def test_top_k_from_the_shapes_is_checked():
    err(ValueError, r"top_k = 100 \(from the shapes: expert_hidden \(4, 100, 8\)\); allowed: 1..64",
        expert_hidden=T((4, 100, 8)))
    err(ValueError, r"top_k = 0 \(from the shapes: .*gather_map \(4, 0\)\)", layout="gather_map",
        gather_map=T((4, 0), "int32"))


def test_scale_must_fit_float32():
    err(ValueError, "scale = 1e\\+39; must be a finite number within float32's range", top_k=2,
        scale=1e39)
    _plan.plan_combine(T((66, H)), top_k=2, scale=3.0e38)


def test_base_of_the_functional_op():
    # combine_op accumulates into a contiguous copy of base: a broadcast or transposed base is
    # fine, and messages name base.
    bias = T((33, H), strides=(0, 1))
    plan = _plan.plan_combine(T((66, H)), top_k=2, out=bias, accumulate=True, out_arg="base",
                              out_copied=True)
    assert plan.out_row_stride == H
    with pytest.raises(ValueError, match=r"base has shape \(33, 4095\)"):
        _plan.plan_combine(T((66, H)), top_k=2, out=T((33, H - 1)), accumulate=True,
                           out_arg="base", out_copied=True)
    err(ValueError, "out has row stride 0", top_k=2, out=bias, accumulate=True)
    # combine_op has no out: the token index's row count comes from num_tokens or base.
    with pytest.raises(ValueError, match="num_tokens is required .*; or pass base$"):
        _plan.plan_combine(T((66, H)), layout="token_index", token_idx=T((66,), "int32"),
                           out_arg="base", out_copied=True)


def test_layout_and_types():
    err(ValueError, "layout = 'sorted'; allowed: 'token_major', 'gather_map', 'token_index'",
        layout="sorted")
    # Not a string, nor hashable: named like any other wrong layout, not "unhashable type".
    err(ValueError, r"layout = \['gather_map'\]; allowed: 'token_major'", layout=["gather_map"])
    with pytest.raises(TypeError, match="expert_hidden must be a torch.Tensor, got list"):
        _plan.plan_combine([[1.0]])
    err(TypeError, "expert_hidden has dtype torch.int8; allowed: torch.float32, torch.float16 "
        "or torch.bfloat16", expert_hidden=T((66, H), "int8"), top_k=2)
    err(TypeError, "top_k must be an int, got float", top_k=2.0)
    err(ValueError, r"top_k = 65; allowed: 1\.\.64", top_k=65)
    err(TypeError, "scale must be a float, got str", top_k=2, scale="2")
    err(ValueError, "scale = inf", top_k=2, scale=float("inf"))
    err(ValueError, "num_tokens = 5 but expert_hidden", top_k=2, num_tokens=5)


def test_devices():
    err(ValueError, "expert_hidden is on device cpu; moejit needs CUDA tensors",
        expert_hidden=T((66, H), device=Device("cpu", None)), top_k=2)
    err(ValueError, "gates is on device cuda:1 but expert_hidden is on cuda:0", top_k=2,
        gates=T((66,), "float32", device=Device("cuda", 1)))
    err(ValueError, "out is on device cpu", top_k=2, out=T((33, H), device=Device("cpu", None)))


def test_gates():
    err(TypeError, "gates has dtype torch.bfloat16; allowed: torch.float32", top_k=2,
        gates=T((33, 2)))
    err(ValueError, r"gates has shape \(66, 1\)", top_k=2, gates=T((66, 1), "float32"))


def test_strides():
    err(ValueError, "the last dimension must have stride 1", layout="gather_map",
        expert_hidden=T((66, H), strides=(1, 66)), gather_map=T((33, 2), "int32"))
    err(ValueError, "row stride 0 < hidden_dim", layout="gather_map",
        expert_hidden=T((66, H), strides=(0, 1)), gather_map=T((33, 2), "int32"))
    p = _plan.plan_combine(T((66, H), strides=(H + 8, 1)), layout="gather_map",
                           gather_map=T((33, 2), "int32"), out=T((33, H), strides=(2 * H, 1)))
    assert p.expert_row_stride == H + 8 and p.out_row_stride == 2 * H
    # One row: its pitch is never used, whatever torch reports.
    p = _plan.plan_combine(T((1, 1, H), strides=(7, 7, 1)), out=T((1, H), strides=(1, 1)))
    assert p.expert_row_stride == 0 and p.out_row_stride == 0


def test_out():
    err(ValueError, r"out has shape \(33, 4095\); must be \[num_tokens, hidden\] = \(33, 4096\)",
        top_k=2, out=T((33, H - 1)))
    err(ValueError, "out_dtype = torch.float32 but out has dtype torch.bfloat16", top_k=2,
        out=T((33, H)), out_dtype=DType("float32"))
    err(ValueError, "accumulate=True adds into out", top_k=2, accumulate=True)
    err(TypeError, "out_dtype = torch.int32", top_k=2, out_dtype=DType("int32"))
    err(TypeError, "accumulate must be a bool", top_k=2, out=T((33, H)), accumulate=3)
    err(TypeError, "accumulate must be a bool", top_k=2, out=T((33, H)), accumulate=Integer(2))
    assert _plan.plan_combine(T((66, H)), top_k=2, out=T((33, H)),
                              accumulate=Integer(1)).accumulate is True


def test_hidden_limits():
    err(ValueError, "hidden size 70000", expert_hidden=T((2, 70000)), top_k=2)


def test_fill_args():
    p = _plan.plan_combine(T((66, H)), layout="token_index", token_idx=T((66,), "int64"),
                           num_tokens=33, gates=T((66,), "float32"), scale=0.5)
    a = _plan.fill_args(_capi.new_combine_args(), p, 0x1000, 0x2000, 0x3000, 0x4000)
    assert (a.layout, a.num_tokens, a.num_rows, a.hidden_dim) == (2, 33, 66, H)
    assert (a.expert_hidden, a.gates, a.indices, a.out) == (0x1000, 0x2000, 0x3000, 0x4000)
    assert (a.index_type, a.scale, a.accumulate) == (_capi.INDEX_INT64, 0.5, 0)
    assert _capi.combine_workspace_size(a) > 0


class Integer:
    """An integer that is not an int: numbers.Integral, as numpy's integers are."""

    def __init__(self, value):
        self.value = value

    def __int__(self):
        return self.value

    __index__ = __int__


numbers.Integral.register(Integer)


def test_numeric_types_beyond_int_and_float():
    # numpy's scalars are numbers.Real / numbers.Integral, not float / int: a scale read from a
    # config array, a top_k from an array's shape or sum.
    p = _plan.plan_combine(T((66, H)), top_k=Integer(2), scale=fractions.Fraction(1, 2))
    assert (p.top_k, p.scale) == (2, 0.5) and type(p.top_k) is int and type(p.scale) is float
    a = _plan.fill_args(_capi.new_combine_args(), p, 0x1000, 0, 0, 0x4000)
    assert (a.top_k, a.scale) == (2, 0.5)
    p = _plan.plan_combine(T((66, H)), layout="token_index", token_idx=T((66,), "int32"),
                           num_tokens=Integer(33))
    assert p.num_tokens == 33 and type(p.num_tokens) is int
    assert _plan.checked_scale(fractions.Fraction(3, 4)) == 0.75
    # Still refused: a string (which float() would take), a bool, a float top_k.
    for bad in ("2", True):
        with pytest.raises(TypeError, match="scale must be a float"):
            _plan.checked_scale(bad)
    err(TypeError, "top_k must be an int, got float", top_k=2.0)


def test_numpy_scalars():
    np = pytest.importorskip("numpy")
    p = _plan.plan_combine(T((66, H)), top_k=np.int64(2), scale=np.float32(0.5))
    assert (p.top_k, p.scale) == (2, 0.5) and type(p.top_k) is int and type(p.scale) is float
    # accumulate: numpy's bools and 0 / 1 integers, as Python's are taken.
    for flag, expected in ((np.True_, True), (np.False_, False), (np.int64(1), True),
                           (np.int32(0), False)):
        p = _plan.plan_combine(T((66, H)), top_k=2, out=T((33, H)), accumulate=flag)
        assert p.accumulate is expected
    for bad in (np.int64(2), np.array([True]), np.float32(1.0)):
        err(TypeError, "accumulate must be a bool", top_k=2, out=T((33, H)), accumulate=bad)


def test_indexed_layouts_take_fewer_than_two_to_the_31_rows():
    # A stand-in: no memory behind it. Refused as a ValueError here, before the library.
    rows = 1 << 31
    err(ValueError, r"expert_hidden has 2147483648 rows; allowed for layout 'gather_map': at most "
        r"2147483647", expert_hidden=T((rows, 8)), layout="gather_map",
        gather_map=T((4, 2), "int32"))
    err(ValueError, "allowed for layout 'token_index': at most", expert_hidden=T((rows, 8)),
        layout="token_index", token_idx=T((rows,), "int32"), num_tokens=4)
    _plan.plan_combine(T((rows - 1, 8)), layout="gather_map", gather_map=T((4, 2), "int32"))


def test_meta_tensors_for_shape_inference_only():
    meta = Device("meta", None)
    expert = T((66, H), device=meta)
    kw = dict(layout="gather_map", gather_map=T((33, 2), "int32", device=meta),
              gates=T((33, 2), "float32", device=meta))
    # The fake implementation's planning (no launch follows): the output shape.
    assert _plan.plan_combine(expert, shape_only=True, **kw).out_shape == (33, H)
    # A launch needs CUDA tensors.
    err(ValueError, "expert_hidden is on device meta; moejit needs CUDA tensors",
        expert_hidden=expert, **kw)
    # Meta and CUDA tensors do not mix, either way round.
    with pytest.raises(ValueError, match="gates is on device cuda:0 but expert_hidden is on meta"):
        _plan.plan_combine(expert, shape_only=True, layout="gather_map",
                           gather_map=T((33, 2), "int32", device=meta),
                           gates=T((33, 2), "float32"))
    err(ValueError, "gates is on device meta; moejit needs CUDA tensors", top_k=2,
        gates=T((33, 2), "float32", device=meta))


# ---- the epilogue (residual=, norm_weight=, eps=, out_scales=, out_scales_pow2=) ----------------

def gm(**kw):
    """A gather-map call of 33 tokens, K 2, H 4096 with the given epilogue arguments."""
    return _plan.plan_combine(T((70, H)), layout="gather_map", gather_map=T((33, 2), "int32"), **kw)


def test_epilogue_defaults_are_off():
    p = gm()
    assert (p.residual, p.norm_weight, p.out_scales, p.scales_shape) == (None, None, None, None)
    assert p.norm_eps == 1e-6 and not p.fp8 and not p.scales_pow2


def test_residual_and_norm_weight():
    p = gm(residual=T((33, H), "float32", strides=(H + 8, 1)), norm_weight=T((H,), "float16"),
           eps=1e-5)
    assert p.residual_dtype == _capi.DTYPE_FLOAT32 and p.residual_row_stride == H + 8
    assert p.norm_weight_dtype == _capi.DTYPE_FLOAT16 and p.norm_eps == 1e-5
    err(ValueError, r"residual has shape \(33, 4095\); must be \[num_tokens, hidden\] = \(33, 4096\)",
        layout="gather_map", gather_map=T((33, 2), "int32"), residual=T((33, H - 1)))
    err(TypeError, "residual has dtype torch.int32",
        layout="gather_map", gather_map=T((33, 2), "int32"), residual=T((33, H), "int32"))
    err(ValueError, "residual is on device cpu",
        layout="gather_map", gather_map=T((33, 2), "int32"),
        residual=T((33, H), device=Device("cpu")))
    err(ValueError, "residual has strides",
        layout="gather_map", gather_map=T((33, 2), "int32"), residual=T((33, H), strides=(H, 2)))
    err(ValueError, r"norm_weight has shape \(4096, 1\); must be \[hidden\] = \(4096,\)",
        layout="gather_map", gather_map=T((33, 2), "int32"), norm_weight=T((H, 1)))
    err(ValueError, "norm_weight with shape",
        layout="gather_map", gather_map=T((33, 2), "int32"), norm_weight=T((H,), strides=(2,)))
    for bad, exc in ((float("nan"), ValueError), (-1e-6, ValueError), (float("inf"), ValueError),
                     ("1e-6", TypeError), (True, TypeError)):
        err(exc, "eps", layout="gather_map", gather_map=T((33, 2), "int32"), eps=bad)


def test_fp8_out_and_its_scales():
    p = gm(out_dtype=DType("float8_e4m3fn"))
    assert p.fp8 and p.out_dtype == _capi.DTYPE_FLOAT8_E4M3 and p.scales_shape == (33, 32)
    assert p.scales_layout == _capi.SCALES_ROW_MAJOR and p.out_scales is None
    row = T((33, 32), "float32")
    assert gm(out_dtype=DType("float8_e4m3fn"), out_scales=row).scales_layout == \
        _capi.SCALES_ROW_MAJOR
    # DeepGEMM's: torch.empty(32, 36).t()[:33] has strides (1, 36).
    column = T((33, 32), "float32", strides=(1, 36))
    p = gm(out=T((33, H), "float8_e4m3fn"), out_scales=column, out_scales_pow2=True)
    assert p.scales_layout == _capi.SCALES_COLUMN_MAJOR_ALIGNED4 and p.scales_pow2
    err(ValueError, r"out_scales with shape \(33, 32\) has strides \(1, 33\); allowed: row-major "
        r"\(32, 1\), or column-major \(1, 36\)", layout="gather_map",
        gather_map=T((33, 2), "int32"), out_dtype=DType("float8_e4m3fn"),
        out_scales=T((33, 32), "float32", strides=(1, 33)))
    err(ValueError, r"out_scales has shape \(33, 31\)", layout="gather_map",
        gather_map=T((33, 2), "int32"), out_dtype=DType("float8_e4m3fn"),
        out_scales=T((33, 31), "float32"))
    err(TypeError, "out_scales has dtype torch.bfloat16", layout="gather_map",
        gather_map=T((33, 2), "int32"), out_dtype=DType("float8_e4m3fn"),
        out_scales=T((33, 32), "bfloat16"))
    err(ValueError, "out_scales is given but the output's dtype is bfloat16",
        layout="gather_map", gather_map=T((33, 2), "int32"), out_scales=row)
    err(TypeError, "out_scales_pow2 must be a bool", layout="gather_map",
        gather_map=T((33, 2), "int32"), out_dtype=DType("float8_e4m3fn"), out_scales_pow2=2)
    # Column-major scales need whole groups: H 4000 gives 32 groups, the last one short.
    with pytest.raises(ValueError, match="column-major"):
        _plan.plan_combine(T((70, 4000)), layout="gather_map", gather_map=T((33, 2), "int32"),
                           out_dtype=DType("float8_e4m3fn"),
                           out_scales=T((33, 32), "float32", strides=(1, 36)))
    # Rows are never fp8.
    err(TypeError, "expert_hidden has dtype torch.float8_e4m3fn",
        expert_hidden=T((66, H), "float8_e4m3fn"), top_k=2)


def test_epilogue_args_reach_the_c_struct():
    p = gm(residual=T((33, H), "bfloat16"), norm_weight=T((H,), "bfloat16"), eps=0.5,
           out_dtype=DType("float8_e4m3fn"), out_scales=T((33, 32), "float32", strides=(1, 36)),
           out_scales_pow2=True)
    a = _plan.fill_epilogue_args(_capi.CombineArgs(), p, 0x1000, 0x2000, 0x3000)
    assert (a.residual, a.norm_weight, a.out_scales) == (0x1000, 0x2000, 0x3000)
    assert (a.residual_dtype, a.norm_weight_dtype, a.residual_row_stride) == (
        _capi.DTYPE_BFLOAT16, _capi.DTYPE_BFLOAT16, H)
    assert a.norm_eps == 0.5 and a.out_scales_layout == _capi.SCALES_COLUMN_MAJOR_ALIGNED4
    assert a.out_scales_pow2 == 1
