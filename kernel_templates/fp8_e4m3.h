// fp8 e4m3 (OCP E4M3FN: bias 7, three mantissa bits, no infinities, largest finite 448, NaN
// S.1111.111) to and from the bits of an fp32 value, in integer operations only: the epilogue's
// conversion on GPUs without a hardware one (before sm_89), and the host tests' reference, so that
// both are one definition. The hardware conversion (cvt.rn.satfinite.e4m3x2.f32) gives the same
// bits, which the GPU tests check against this one. Also the quantization's division of a
// group's values by its scale (divide_by_scale), checked on the host against a plain division.
// Plain C++ that includes only host_device.h: NVRTC compiles it without any toolkit header on
// its search path.
#ifndef MOEJIT_FP8_E4M3_H_
#define MOEJIT_FP8_E4M3_H_

#include "host_device.h"

namespace moejit {

// The e4m3 nearest to the fp32 value with bits u, ties to even, saturating: a magnitude at or
// past 448 (infinity included) becomes +-448, a NaN the NaN of its sign.
MOEJIT_HOST_DEVICE inline unsigned char e4m3_from_float_bits(unsigned u) {
  const unsigned sign = (u >> 24) & 0x80u;
  const unsigned a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<unsigned char>(sign | 0x7fu);   // NaN
  if (a >= 0x43e00000u) return static_cast<unsigned char>(sign | 0x7eu);  // >= 448
  if (a >= 0x3c800000u) {  // >= 2^-6: normal; keep 3 mantissa bits, ties to even
    const unsigned rounded = a + 0x7ffffu + ((a >> 20) & 1u);
    return static_cast<unsigned char>(sign | ((rounded >> 20) - (120u << 3)));
  }
  // Below 2^-6: a multiple of 2^-9 (code 8 is 2^-6, the least normal). a * 2^9 = m * 2^(e - 141)
  // with m the significand (implicit bit included) and e the biased exponent.
  const unsigned e = a >> 23;
  if (e < 117) return static_cast<unsigned char>(sign);  // under 2^-10: rounds to zero
  const unsigned m = (a & 0x7fffffu) | 0x800000u;
  const unsigned shift = 141u - e;  // 21..24
  const unsigned q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  const unsigned code = q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u);
  return static_cast<unsigned char>(sign | code);
}

// The bits of the fp32 value of e4m3 code b (exact).
MOEJIT_HOST_DEVICE inline unsigned e4m3_to_float_bits(unsigned char b) {
  const unsigned sign = static_cast<unsigned>(b & 0x80u) << 24;
  const unsigned e = (b >> 3) & 15u, m = b & 7u;
  if (e == 15u && m == 7u) return sign | 0x7fc00000u;  // NaN
  if (e != 0u) return sign | ((e + 120u) << 23) | (m << 20);
  if (m == 0u) return sign;  // +-0
  // m * 2^-9 with m in 1..7: the leading bit p of m gives 2^(p - 9) times 1.(the rest).
  const unsigned p = m >= 4u ? 2u : m >= 2u ? 1u : 0u;
  return sign | ((118u + p) << 23) | ((m << (23u - p)) & 0x7fffffu);
}

// a / s rounded to nearest even, for the values of an fp8 group over its scale s (finite, at least
// 1e-10 / 448) with r = 1 / s rounded: q = a * r corrected once by the exact remainder a - q * s,
// which gives the correctly rounded quotient (Markstein's theorem) wherever that remainder is
// normal, |a| >= 2^-102; below, |a / s| < 2^-59 and both round to the same signed zero in e4m3.
// An exact q (remainder 0) is kept, so that -0 / s stays -0. One division per group, not per value.
MOEJIT_HOST_DEVICE inline float divide_by_scale(float a, float s, float r) {
#if defined(__CUDA_ARCH__)
  float q, rem, out;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(r));
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(rem) : "f"(-q), "f"(s), "f"(a));
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(out) : "f"(rem), "f"(r), "f"(q));
  return rem == 0.0f ? q : out;
#else
  const float q = a * r;
  const float rem = __builtin_fmaf(-q, s, a);
  return rem == 0.0f ? q : __builtin_fmaf(rem, r, q);
#endif
}

}  // namespace moejit

#endif  // MOEJIT_FP8_E4M3_H_
