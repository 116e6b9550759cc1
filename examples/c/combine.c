/*
 * libmoejit from C, built with pkg-config: the token-index ("scatter-add") layout.
 *
 * 33 tokens, 66 rows of hidden size 4096 in bf16, each row routed to an arbitrary token (or
 * dropped, -1), weighted by an fp32 gate. The token-index layout needs device workspace; its size
 * comes from moejit_combine_workspace_size(). The result is checked against a CPU reference.
 *
 * Exit status: 0 PASS, 1 FAIL, 77 SKIP (no CUDA GPU on this machine).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <moejit/moejit.h>

enum { kTokens = 33, kRows = 66, kHidden = 4096, kExitSkip = 77 };

/* bf16 is the top half of an fp32; encode with round-to-nearest-even (inputs here are finite). */
static uint16_t bf16_from_float(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

static float float_from_bf16(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

/* A tiny deterministic generator: the same data on every machine, no seeding. */
static uint32_t rng_state = 12345u;
static uint32_t next_u32(void) {
  rng_state = rng_state * 1664525u + 1013904223u;
  return rng_state >> 8;
}
static float uniform(float lo, float hi) {
  return lo + (hi - lo) * (float)(next_u32() & 0xFFFFFF) / (float)0x1000000;
}

static int cuda_ok(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return 1;
  fprintf(stderr, "FAIL: %s: %s\n", what, cudaGetErrorString(err));
  return 0;
}

int main(void) {
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe != cudaSuccess || devices == 0) {
    /* With no NVIDIA driver installed at all, the runtime reports an insufficient driver. */
    printf("SKIP: no CUDA GPU found (%s); libmoejit %s linked fine\n",
           probe == cudaErrorInsufficientDriver ? "no NVIDIA driver, or one too old"
           : probe != cudaSuccess               ? cudaGetErrorString(probe)
                                                : "0 devices",
           moejit_version_string());
    return kExitSkip;
  }

  /* Host data: rows, their token (about 1 in 8 dropped), gates. */
  uint16_t* hidden = malloc(sizeof(uint16_t) * kRows * kHidden);
  uint16_t* out = malloc(sizeof(uint16_t) * kTokens * kHidden);
  int32_t token_idx[kRows];
  float gates[kRows];
  if (hidden == NULL || out == NULL) return 1;
  for (size_t i = 0; i < (size_t)kRows * kHidden; ++i) hidden[i] = bf16_from_float(uniform(-2, 2));
  for (int r = 0; r < kRows; ++r) {
    token_idx[r] = (next_u32() % 8 == 0) ? -1 : (int32_t)(next_u32() % kTokens);
    gates[r] = uniform(0, 1);
  }

  /* Device buffers; out is poisoned (bf16 0xFFFF is a NaN) so unwritten elements cannot pass. */
  void *d_hidden = NULL, *d_out = NULL, *d_idx = NULL, *d_gates = NULL, *d_workspace = NULL;
  cudaStream_t stream = NULL;
  int ok =
      cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate") &&
      cuda_ok(cudaMalloc(&d_hidden, sizeof(uint16_t) * kRows * kHidden), "cudaMalloc") &&
      cuda_ok(cudaMalloc(&d_out, sizeof(uint16_t) * kTokens * kHidden), "cudaMalloc") &&
      cuda_ok(cudaMalloc(&d_idx, sizeof(token_idx)), "cudaMalloc") &&
      cuda_ok(cudaMalloc(&d_gates, sizeof(gates)), "cudaMalloc") &&
      cuda_ok(
          cudaMemcpy(d_hidden, hidden, sizeof(uint16_t) * kRows * kHidden, cudaMemcpyHostToDevice),
          "cudaMemcpy") &&
      cuda_ok(cudaMemcpy(d_idx, token_idx, sizeof(token_idx), cudaMemcpyHostToDevice),
              "cudaMemcpy") &&
      cuda_ok(cudaMemcpy(d_gates, gates, sizeof(gates), cudaMemcpyHostToDevice), "cudaMemcpy") &&
      cuda_ok(cudaMemset(d_out, 0xFF, sizeof(uint16_t) * kTokens * kHidden), "cudaMemset");
  if (!ok) return 1;

  moejit_combine_args args;
  moejit_combine_args_init(&args);
  args.layout = MOEJIT_LAYOUT_TOKEN_INDEX;
  args.num_tokens = kTokens;
  args.num_rows = kRows;
  args.hidden_dim = kHidden;
  args.expert_hidden = d_hidden;
  args.expert_dtype = MOEJIT_DTYPE_BFLOAT16;
  args.gates = (const float*)d_gates;
  args.indices = d_idx;
  args.index_type = MOEJIT_INDEX_INT32;
  args.out = d_out;
  args.out_dtype = MOEJIT_DTYPE_BFLOAT16;

  /* The workspace depends only on the shape: size it once, reuse it for every call of this shape
     on this stream. */
  size_t workspace_bytes = 0;
  moejit_status st = moejit_combine_workspace_size(&args, &workspace_bytes);
  if (st != MOEJIT_SUCCESS) {
    fprintf(stderr, "FAIL: moejit_combine_workspace_size: %s: %s\n", moejit_status_name(st),
            moejit_last_error_message());
    return 1;
  }
  if (!cuda_ok(cudaMalloc(&d_workspace, workspace_bytes), "cudaMalloc(workspace)")) return 1;
  args.workspace = d_workspace;
  args.workspace_bytes = workspace_bytes;

  st = moe_combine(&args, stream);
  if (st != MOEJIT_SUCCESS) {
    fprintf(stderr, "FAIL: moe_combine: %s: %s\n", moejit_status_name(st),
            moejit_last_error_message());
    return 1;
  }
  if (!cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize") ||
      !cuda_ok(cudaMemcpy(out, d_out, sizeof(uint16_t) * kTokens * kHidden, cudaMemcpyDeviceToHost),
               "cudaMemcpy"))
    return 1;

  /* CPU reference in double; the library sums in fp32 and rounds to bf16 once, so allow one bf16
     rounding (2^-8 relative) plus fp32 summation error. Tokens with no row (reference 0) are held
     to the same bound, so their NaN poison must have been overwritten. */
  int bad = 0;
  double worst = 0.0;
  for (int t = 0; t < kTokens; ++t) {
    for (int h = 0; h < kHidden; ++h) {
      double ref = 0.0;
      for (int r = 0; r < kRows; ++r)
        if (token_idx[r] == t)
          ref += (double)gates[r] * float_from_bf16(hidden[(size_t)r * kHidden + h]);
      const double got = float_from_bf16(out[(size_t)t * kHidden + h]);
      const double err = fabs(got - ref);
      if (!(err <= fabs(ref) / 128.0 + 1e-3)) {
        if (bad++ < 5) fprintf(stderr, "mismatch out[%d][%d] = %g, expected %g\n", t, h, got, ref);
      }
      if (err > worst) worst = err;
    }
  }

  cudaFree(d_workspace);
  cudaFree(d_gates);
  cudaFree(d_idx);
  cudaFree(d_out);
  cudaFree(d_hidden);
  cudaStreamDestroy(stream);
  free(out);
  free(hidden);

  printf(
      "%s: token-index combine, T=%d rows=%d H=%d bf16, workspace %zu bytes, max abs error %.3g"
      " (libmoejit %s)\n",
      bad ? "FAIL" : "PASS", kTokens, kRows, kHidden, workspace_bytes, worst,
      moejit_version_string());
  return bad ? 1 : 0;
}
