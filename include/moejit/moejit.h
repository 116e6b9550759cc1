/*
 * libmoejit: run-time compiled Mixture-of-Experts combine for NVIDIA GPUs.
 *
 *   out[t, :] (+)= scale * sum over rows r routed to token t of gate[r] * expert_hidden[r, :]
 *
 * Kernels are specialized for the shapes you call with, compiled with NVRTC, cached (in memory
 * per CUDA context and on disk), and launched with the CUDA Driver API on the stream you pass.
 * The library has no link-time dependency on the CUDA driver or on NVRTC: libcuda.so.1 is loaded
 * at the first combine, NVRTC at the first compile (from pip's nvidia-cuda-nvrtc package or a CUDA
 * toolkit; MOEJIT_NVRTC_LIBRARY names the file to use instead).
 *
 * This header is valid C99 and C++. Every function that can fail returns a moejit_status; on
 * failure a human-readable message (naming the argument, its value and what is allowed, or
 * carrying the NVRTC log / CUresult name) is available from moejit_last_error_message() on the
 * same thread.
 *
 * Thread safety: every function may be called concurrently from any number of threads, except
 * moejit_runtime_destroy(), which must not race with calls using the same runtime.
 *
 * fork() (since 0.3): a child process may call the library with the default runtime (NULL
 * handle), which starts afresh in the child at its first use (its own caches and statistics),
 * and with runtimes it creates itself. A runtime created before the fork belongs to the parent:
 * in the child, moejit_runtime_combine() refuses it with MOEJIT_ERROR_INVALID_ARGUMENT,
 * moejit_runtime_get_stats() reads the counters it had at the fork, and moejit_runtime_destroy()
 * accepts it and releases nothing. No call in the child waits for work its parent's other threads
 * were doing. CUDA itself cannot be used in the child of a process that initialized it (the
 * driver's rule): there a combine fails with the status and message of the driver's refusal, so
 * fork before the first combine, or start workers with spawn. fork() waits while other threads of
 * the process are inside NVRTC (for the compiles under way to end), loading the CUDA driver,
 * creating the default runtime or writing a log line: a child forked in the middle of an NVRTC
 * compile can hang.
 */
#ifndef MOEJIT_MOEJIT_H_
#define MOEJIT_MOEJIT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define MOEJIT_API __attribute__((visibility("default")))
#else
#define MOEJIT_API
#endif

/* ---- Versions ------------------------------------------------------------------------------- */

#define MOEJIT_VERSION_MAJOR 0
#define MOEJIT_VERSION_MINOR 3
#define MOEJIT_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, comparable with moejit_version(). */
#define MOEJIT_VERSION_NUMBER \
  (MOEJIT_VERSION_MAJOR * 10000 + MOEJIT_VERSION_MINOR * 100 + MOEJIT_VERSION_PATCH)

/*
 * The version of the library actually loaded: MOEJIT_VERSION_NUMBER of the build that produced it.
 * Compare it with MOEJIT_VERSION_NUMBER of the header you compiled against to detect a library
 * older than your header. Takes no arguments, cannot fail, needs no GPU. Thread-safe. Since 0.1.
 */
MOEJIT_API int moejit_version(void);
/* The loaded library's version as a string, e.g. "0.2.0". Never NULL; the string is static (never
   freed). Cannot fail. Thread-safe. Since 0.1. */
MOEJIT_API const char* moejit_version_string(void);

/* ---- Status codes --------------------------------------------------------------------------- */

/*
 * One table generates the enum, the names and the descriptions. Values are fixed forever and only
 * ever appended. Caller errors (1-3) are separate from environment errors (4 and up).
 * MOEJIT_ERROR_NVRTC_NOT_FOUND: since 0.3.
 *   X(name, value, description)
 */
#define MOEJIT_STATUS_TABLE(X)                                                                     \
  X(MOEJIT_SUCCESS, 0, "success")                                                                  \
  X(MOEJIT_ERROR_INVALID_ARGUMENT, 1,                                                              \
    "an argument is invalid; the message names it, its value and the allowed values")              \
  X(MOEJIT_ERROR_UNSUPPORTED, 2,                                                                   \
    "the arguments are valid but this combination (shape, dtype, GPU architecture) is not "        \
    "supported")                                                                                   \
  X(MOEJIT_ERROR_WORKSPACE_TOO_SMALL, 3,                                                           \
    "the workspace is missing or smaller than moejit_combine_workspace_size() asks for")           \
  X(MOEJIT_ERROR_DRIVER_NOT_FOUND, 4,                                                              \
    "the CUDA driver library (libcuda.so.1) could not be loaded: install the NVIDIA driver")       \
  X(MOEJIT_ERROR_NO_DEVICE, 5,                                                                     \
    "no CUDA device is available, or the calling thread has no current CUDA context")              \
  X(MOEJIT_ERROR_CUDA, 6,                                                                          \
    "a CUDA driver call failed; the message names the call and its CUresult")                      \
  X(MOEJIT_ERROR_COMPILE, 7, "NVRTC failed to compile a kernel; the message carries its log")      \
  X(MOEJIT_ERROR_NOT_CACHED, 8,                                                                    \
    "the cache is in no-compile mode and the kernel is not in it: warm it with moejit-precompile") \
  X(MOEJIT_ERROR_OUT_OF_MEMORY, 9, "host memory could not be allocated")                           \
  X(MOEJIT_ERROR_INTERNAL, 10, "internal error in libmoejit (please report it with the message)")  \
  X(MOEJIT_ERROR_NVRTC_NOT_FOUND, 11,                                                              \
    "NVRTC (libnvrtc.so) could not be loaded: install pip's nvidia-cuda-nvrtc or the CUDA "        \
    "toolkit's NVRTC; the message lists where it was searched")

#define MOEJIT_STATUS_ENUM_ENTRY_(name, value, description) name = value,
typedef enum moejit_status { MOEJIT_STATUS_TABLE(MOEJIT_STATUS_ENUM_ENTRY_) } moejit_status;
#undef MOEJIT_STATUS_ENUM_ENTRY_

/*
 * The enumerator's name of `status` as a static string, e.g. "MOEJIT_ERROR_INVALID_ARGUMENT";
 * "MOEJIT_STATUS_UNKNOWN" for a value not in MOEJIT_STATUS_TABLE (e.g. from a newer library).
 * Never NULL, never freed. Does not change moejit_last_error_message(). Thread-safe. Since 0.1.
 */
MOEJIT_API const char* moejit_status_name(moejit_status status);
/* One static sentence saying what `status` means and what to do about it ("unknown status code"
   for a value not in the table). Never NULL, never freed. Does not change
   moejit_last_error_message(). Thread-safe. Since 0.1. */
MOEJIT_API const char* moejit_status_description(moejit_status status);
/*
 * The message of the last call made by this thread that returned an error ("" if none has yet):
 * names the argument, its value and what is allowed, or carries the NVRTC log or the failing CUDA
 * call and its CUresult name. Successful calls do not clear it, so read it only right after a
 * call that failed. The pointer stays valid until this thread's next libmoejit call that fails;
 * copy the text to keep it. Thread-local: each thread sees only its own. Since 0.1.
 */
MOEJIT_API const char* moejit_last_error_message(void);

/* ---- Data description ----------------------------------------------------------------------- */

typedef enum moejit_dtype {
  MOEJIT_DTYPE_FLOAT32 = 0,
  MOEJIT_DTYPE_FLOAT16 = 1,
  MOEJIT_DTYPE_BFLOAT16 = 2,
  /* Since 0.3. fp8 e4m3 (OCP "E4M3FN": bias 7, no infinities, largest finite 448, NaN 0x7f/0xff),
     one byte. Only as out_dtype, and only with out_scales (see moejit_combine_args). */
  MOEJIT_DTYPE_FLOAT8_E4M3 = 3
} moejit_dtype;

typedef enum moejit_index_type { MOEJIT_INDEX_INT32 = 0, MOEJIT_INDEX_INT64 = 1 } moejit_index_type;

typedef enum moejit_layout {
  /* expert_hidden holds T*K rows in token-major order: row t*K + k is slot k of token t.
     gates (optional) is [T*K], indexed t*K + k. indices is unused. */
  MOEJIT_LAYOUT_TOKEN_MAJOR = 0,
  /* expert_hidden holds num_rows rows in any order (usually expert-sorted); indices is the gather
     map [T*K]: indices[t*K + k] is the row holding slot k of token t, or -1 if that slot was
     dropped. gates (optional) is [T*K], indexed t*K + k, like the map. */
  MOEJIT_LAYOUT_GATHER_MAP = 1,
  /* The scatter-add formulation: indices is token_idx [num_rows]; row r is added to token
     token_idx[r] (-1: dropped). Any token may receive any number of rows, in any order. gates
     (optional) is [num_rows], indexed by row. top_k is unused. Needs a workspace. */
  MOEJIT_LAYOUT_TOKEN_INDEX = 2
} moejit_layout;

/* Largest supported hidden_dim (any value 1..MOEJIT_MAX_HIDDEN_DIM works). */
#define MOEJIT_MAX_HIDDEN_DIM 65536
/* Largest supported top_k for the token-major and gather-map layouts. */
#define MOEJIT_MAX_TOP_K 64
/* Largest num_tokens (2^40): far past what one launch takes, so that no size derived from it
   overflows. Since 0.2. */
#define MOEJIT_MAX_NUM_TOKENS (INT64_C(1) << 40)

/* Since 0.3. Where the fp32 scales of an fp8 output go (moejit_combine_args.out_scales): one
   scale per token per group of 128 channels, G = ceil(hidden_dim / 128) groups per token. */
typedef enum moejit_scales_layout {
  /* [T, G] row-major: the scale of token t, group g at out_scales[t * G + g]. */
  MOEJIT_SCALES_ROW_MAJOR = 0,
  /* [G, T4] column-major with T4 = num_tokens rounded up to a multiple of 4: the scale of token t,
     group g at out_scales[g * T4 + t] (the layout DeepGEMM's fp8 GEMMs read; entries t >= T of
     each column are not written). Needs hidden_dim % 128 == 0. */
  MOEJIT_SCALES_COLUMN_MAJOR_ALIGNED4 = 1
} moejit_scales_layout;

/* CUstream and cudaStream_t are both `struct CUstream_st*`: pass either; NULL is the legacy
   default stream of the current context, whatever nvcc's --default-stream: for the per-thread
   default stream pass cudaStreamPerThread (CU_STREAM_PER_THREAD). */
typedef struct CUstream_st* moejit_stream_t;

/*
 * Arguments of one combine. Versioned by struct_size: initialize with moejit_combine_args_init()
 * (or MOEJIT_COMBINE_ARGS_INIT) so that fields added in later versions get their defaults.
 *
 * Semantics, accumulating in fp32 in a fixed order and rounding once:
 *   out[t, h] = scale * sum_{rows r of token t} gate(r) * expert_hidden[r, h]   (+ out[t, h] if
 *   accumulate). Rows of a token are summed in slot order (k = 0..K-1) for the token-major and
 *   gather-map layouts, in ascending row order for the token-index layout. A token-index token
 *   with more than 128 rows is summed in pieces (since 0.3): its rows in ascending order, cut into
 *   consecutive pieces of 128, each piece summed from zero, the pieces' sums then added in piece
 *   order; so many blocks can share one token's rows. A token with no rows gets 0 (or keeps its
 *   value when accumulating: out + scale * 0, so a -0.0 there may come back as +0.0, and a NaN as
 *   the canonical one). Results are bitwise deterministic: they depend on the input alone, not on
 *   the batch's other tokens, the vector width or the launch geometry.
 *
 * out (and the workspace) must not share bytes with expert_hidden, indices, gates or each other,
 * counting the padding of strided rows: the kernels read those while they write, so such a call
 * is refused with MOEJIT_ERROR_INVALID_ARGUMENT (since 0.2). In place included (out ==
 * expert_hidden): the kernels read rows through the read-only data path and as restrict pointers,
 * which assumes no write to them during the kernel.
 *
 * Index values outside their range (gather map: not in [0, num_rows); token_idx: not in
 * [0, num_tokens)) are treated like -1 (dropped): device memory is never read out of bounds. The
 * library cannot check device data without synchronizing, so such values are not reported.
 *
 * The epilogue (since 0.3): what an MoE decoder layer does right after the combine (the residual
 * add, the next layer's input RMSNorm, the fp8 quantization of fp8 serving), in the same pass. It
 * is off unless residual, norm_weight or an fp8 out_dtype is set; each works with every other
 * field (layouts, dtypes, strides, scale, accumulate, dropped rows). Per token t and channel h,
 * every operation in fp32 and rounded to nearest even (fp32 division and square root as IEEE):
 *   c = fma(sum, scale, old)    the combine: sum as above, old = out's prior contents if
 *                               accumulate (an fp8 out's bytes read as e4m3 values), else 0
 *   residual set:  v = r + c    r = residual[t, h]; the residual is overwritten with v rounded to
 *                               residual_dtype (the new residual stream). Without one, v = c.
 *   norm_weight set, with m the model dtype (residual_dtype if a residual is set, else
 *   norm_weight_dtype), as Hugging Face transformers' DeepSeek-V3 / Qwen3-MoE decoder layers round
 *   in m:
 *     x = round_m(v)            the norm reads the value rounded to m (with a residual: exactly
 *                               the new residual)
 *     ssq = sum of x*x over the row, in one fixed order: the pairwise sum over positions
 *           0..P-1, P = hidden_dim rounded up to a power of two, x = 0 past hidden_dim (a balanced
 *           binary tree; every square and add rounded to fp32). The same order for every layout,
 *           batch size, vector width and GPU.
 *     y = x * (1 / sqrt(ssq / hidden_dim + norm_eps))
 *     n = round_m(round_m(y) * w)   w = norm_weight[h] (transformers' weight * x.to(m))
 *     out receives n, rounded to out_dtype (exact where out_dtype is m or fp32). The combine's
 *     result c is written nowhere.
 *   no norm_weight: out receives c, rounded to out_dtype (as without an epilogue; with a residual
 *     too).
 *   out_dtype MOEJIT_DTYPE_FLOAT8_E4M3: per token and group of 128 channels (128g..128g+127; the
 *     last group is shorter when hidden_dim % 128 != 0), with v the values out receives (n, or
 *     c): amax = max |v| (a NaN is passed over); s = max(amax, 1e-10) / 448; if out_scales_pow2,
 *     s = 2^ceil(log2 s) (exact); out receives e4m3(v / s), rounded to nearest even and saturated
 *     to +-448 (a NaN stays NaN), and out_scales the group's scale s.
 * Results are bitwise deterministic. The epilogue's buffers (residual, norm_weight, out_scales)
 * are checked like the others: aligned to their element size, and no written buffer (out,
 * residual, out_scales, workspace) sharing bytes with any other (residual may not alias out);
 * norm_weight may share bytes with the read-only inputs.
 */
typedef struct moejit_combine_args {
  size_t struct_size; /* sizeof(moejit_combine_args) of the caller's header: this version's, or
                         a 0.1 or 0.2 header's (then the fields added since take their
                         defaults) */
  moejit_layout layout;
  int64_t num_tokens; /* T in 0..MOEJIT_MAX_NUM_TOKENS: rows of out */
  int64_t top_k;      /* K in 1..MOEJIT_MAX_TOP_K (token-major, gather map); ignored otherwise */
  int64_t num_rows;   /* R >= 0: rows of expert_hidden. Token-major: 0 or T*K; else R < 2^31 */
  int64_t hidden_dim; /* H in 1..MOEJIT_MAX_HIDDEN_DIM */

  const void* expert_hidden; /* device pointer, R rows of H elements */
  moejit_dtype expert_dtype; /* fp32, fp16 or bf16 */
  int64_t expert_row_stride; /* elements between consecutive rows; 0 means hidden_dim. R rows of
                                it span at most 2^62 bytes */

  const float* gates; /* device pointer or NULL (every weight is 1) */

  const void* indices; /* device pointer: gather map or token_idx (see moejit_layout) */
  moejit_index_type index_type;

  void* out;              /* device pointer, T rows of H elements */
  moejit_dtype out_dtype; /* fp32, fp16, bf16; since 0.3 also fp8 e4m3 (needs out_scales) */
  int64_t out_row_stride; /* elements between consecutive rows; 0 means hidden_dim. T rows of it
                             span at most 2^62 bytes */

  float scale;    /* multiplies the sum (routed scaling factor); default 1; must be finite */
  int accumulate; /* 0: overwrite out; 1: add into the existing contents of out */

  /* Token-index layout only: device memory of at least moejit_combine_workspace_size() bytes,
     any alignment of 16 bytes or more, any contents. Owned by the caller; calls that share a
     workspace must be ordered (same stream, or synchronized). */
  void* workspace;
  size_t workspace_bytes;

  /* Since 0.2. 0 (default): the call's first kernel starts after the previous work on the stream
     has finished, as any launch does. 1: it is launched as a programmatic dependent of the
     previous kernel on the stream (sm_90 and newer; elsewhere ignored), so its blocks may be
     scheduled while that kernel drains, and they wait for it to finish (griddepcontrol.wait)
     before touching any memory: results are the same either way. Before the wait they only ask
     L2 to fetch the routing (gather map or token_idx, gates), a hint that is harmless even if
     that kernel writes them. This pays when that kernel lets its dependents start early
     (griddepcontrol.launch_dependents, as PDL-aware kernels do); after a kernel that does not,
     nothing is gained and the wait has a small cost, hence off by default (the kernels then skip
     the wait). The call's kernels do not let the caller's next kernel start early: a next kernel
     launched as a dependent is scheduled when the call ends. Measured figures:
     docs/performance.md. */
  int dependent_launch;

  /* Since 0.3: the epilogue (see above). Off by default: residual, norm_weight and out_scales
     NULL. */
  /* Device pointer, T rows of hidden_dim elements (the residual stream), read and overwritten in
     place; or NULL (default): no residual. */
  void* residual;
  moejit_dtype residual_dtype; /* fp32, fp16 or bf16 (default fp32); read only with a residual */
  int64_t residual_row_stride; /* elements between rows; 0 (default) means hidden_dim. T rows of
                                  it span at most 2^62 bytes */
  /* Device pointer, hidden_dim elements: the RMSNorm's weight; or NULL (default): no norm. */
  const void* norm_weight;
  moejit_dtype norm_weight_dtype; /* fp32, fp16 or bf16 (default fp32); read only with a norm */
  float norm_eps;                 /* the norm's epsilon, finite and >= 0 (default 1e-6) */
  /* Device pointer, fp32: the scales of an fp8 out (out_scales_layout), which needs them; must be
     NULL (default) for every other out_dtype. */
  float* out_scales;
  moejit_scales_layout out_scales_layout; /* default MOEJIT_SCALES_ROW_MAJOR */
  int out_scales_pow2; /* 1: each scale rounded up to a power of two; 0 (default): not */
} moejit_combine_args;

#define MOEJIT_COMBINE_ARGS_INIT                                                                \
  {                                                                                             \
    sizeof(moejit_combine_args), MOEJIT_LAYOUT_TOKEN_MAJOR, 0, 0, 0, 0, NULL,                   \
        MOEJIT_DTYPE_FLOAT32, 0, NULL, NULL, MOEJIT_INDEX_INT32, NULL, MOEJIT_DTYPE_FLOAT32, 0, \
        1.0f, 0, NULL, 0, 0, NULL, MOEJIT_DTYPE_FLOAT32, 0, NULL, MOEJIT_DTYPE_FLOAT32, 1e-6f,  \
        NULL, MOEJIT_SCALES_ROW_MAJOR, 0                                                        \
  }

/*
 * moejit_combine_args_init(args) fills *args with the defaults of this header's version (the same
 * as MOEJIT_COMBINE_ARGS_INIT): struct_size = sizeof(moejit_combine_args), token-major layout,
 * all counts 0, all pointers NULL, fp32 data, int32 indices, scale 1, accumulate 0,
 * dependent_launch 0, no epilogue (norm_eps 1e-6, row-major scales, out_scales_pow2 0).
 *   args  the struct to fill; must not be NULL.
 * Returns MOEJIT_SUCCESS, or MOEJIT_ERROR_INVALID_ARGUMENT if args is NULL. Needs no GPU.
 * Thread-safe (touches only *args). Since 0.1.
 *
 * It is a macro over moejit_combine_args_init_sized(), which is told the size of the caller's
 * struct: a library newer than the header it was compiled with then writes only the fields that
 * struct has (moejit_combine_args_init_sized: sizeof(moejit_combine_args) of any released header,
 * 0.1, 0.2 or 0.3, else MOEJIT_ERROR_INVALID_ARGUMENT). Bindings that load symbols by name call it
 * directly. The function named moejit_combine_args_init (parenthesized, or through a pointer) is
 * the 0.1 entry point, kept for binaries built against the 0.1 header: it fills the 0.1 fields
 * only, with struct_size set to their size. Since 0.2.
 */
MOEJIT_API moejit_status moejit_combine_args_init_sized(moejit_combine_args* args,
                                                        size_t struct_size);
MOEJIT_API moejit_status(moejit_combine_args_init)(moejit_combine_args* args);
#define moejit_combine_args_init(args) \
  moejit_combine_args_init_sized((args), sizeof(moejit_combine_args))

/*
 * The number of bytes of device workspace moe_combine() needs for the shape in *args: nonzero only
 * for MOEJIT_LAYOUT_TOKEN_INDEX with num_tokens > 0, and 0 for the token-major and gather-map
 * layouts. It depends only on the shape fields (layout, num_tokens, num_rows, hidden_dim, top_k,
 * dtypes, index type, strides); pointers are not read and may be NULL. The same shape always
 * needs the same size, so a workspace can be sized once and reused for every call of that shape.
 * A larger workspace serves as well: the size for num_tokens = T and num_rows = T * K covers
 * every call of the same hidden_dim with at most T tokens and num_rows <= num_tokens * K (at most
 * K rows per token on average), so batches of varying size can share one buffer sized for the
 * largest. (A call with more rows per token than that, e.g. fewer tokens but as many rows, can
 * need more.) The token index's workspace holds per-token counts and row lists, and room for
 * tokens with many rows to be ranked and summed by many blocks: about 4 * num_tokens * (2 + list
 * length) + 20 * num_rows bytes, the list four times the average rows per token (16 to 128),
 * plus the fp32 sums of their pieces, at most 2 * num_rows / 129 rows of hidden_dim floats (a
 * sixty-fourth of the expert rows' size in fp32). Since 0.3 it depends on hidden_dim.
 *   args   the combine to size (struct_size must be set: use moejit_combine_args_init()).
 *   bytes  receives the size; must not be NULL. Left unchanged on failure.
 * Returns MOEJIT_SUCCESS, or MOEJIT_ERROR_INVALID_ARGUMENT for a NULL argument or a bad shape
 * (the same shape checks as moe_combine(), with the same messages). Needs no GPU. Thread-safe.
 * Since 0.1.
 */
MOEJIT_API moejit_status moejit_combine_workspace_size(const moejit_combine_args* args,
                                                       size_t* bytes);

/* ---- Runtime -------------------------------------------------------------------------------- */

/* An explicit runtime: its own options, caches and statistics. Most callers use the default
   runtime (NULL handle), configured from the environment variables below. */
typedef struct moejit_runtime* moejit_runtime_t;

typedef enum moejit_cache_mode {
  MOEJIT_CACHE_MODE_DEFAULT = 0,    /* from MOEJIT_CACHE_MODE, else READ_WRITE */
  MOEJIT_CACHE_MODE_READ_WRITE = 1, /* serve disk hits, compile and store misses */
  MOEJIT_CACHE_MODE_READ_ONLY = 2,  /* serve disk hits, compile misses in memory, never write */
  MOEJIT_CACHE_MODE_DISABLED = 3,   /* no disk cache: compile in memory only */
  MOEJIT_CACHE_MODE_NO_COMPILE = 4  /* serve disk hits; a miss is MOEJIT_ERROR_NOT_CACHED */
} moejit_cache_mode;

typedef enum moejit_log_level {
  MOEJIT_LOG_DEFAULT = -1, /* from MOEJIT_LOG_LEVEL, else warn */
  MOEJIT_LOG_TRACE = 0,
  MOEJIT_LOG_DEBUG = 1,
  MOEJIT_LOG_INFO = 2,
  MOEJIT_LOG_WARN = 3,
  MOEJIT_LOG_ERROR = 4,
  MOEJIT_LOG_OFF = 6
} moejit_log_level;

/*
 * Options of an explicit runtime, versioned by struct_size (use moejit_runtime_options_init()).
 * Zero / NULL fields (log_level: MOEJIT_LOG_DEFAULT, -1; 0 is MOEJIT_LOG_TRACE) take the
 * environment's value, then the built-in default:
 *   cache_dir        MOEJIT_CACHE_DIR, else $XDG_CACHE_HOME/moejit, else $HOME/.cache/moejit
 *   cache_mode       MOEJIT_CACHE_MODE (read-write | read-only | disabled | no-compile)
 *   cache_max_bytes  MOEJIT_CACHE_MAX_BYTES, else 1 GiB
 *   log_level        MOEJIT_LOG_LEVEL (trace | debug | info | warn | error | off)
 *   template_dir     MOEJIT_TEMPLATE_DIR: development override of the embedded kernel templates
 *   cache_key_file   MOEJIT_CACHE_KEY_FILE, else none (see below)
 */
typedef struct moejit_runtime_options {
  size_t struct_size;
  const char* cache_dir;
  moejit_cache_mode cache_mode;
  uint64_t cache_max_bytes;
  moejit_log_level log_level;
  const char* template_dir;
  /* Since 0.3. A file holding the cache's secret key, for a disk cache that others can write (a
     shared volume, an image layer): entries are written with an HMAC-SHA256 under the key, and an
     entry without a valid one is a miss (rebuilt, or MOEJIT_ERROR_NOT_CACHED in no-compile mode)
     with a warning naming it. The file must be a regular file (a symlink to one is followed)
     owned by the user the process runs as (its effective uid), with no permission bit for group
     or others (mode 0600 or 0400), holding 16 to 4096 bytes, all of which are the key (e.g. from
     head -c 32 /dev/urandom); else moejit_runtime_create() fails with
     MOEJIT_ERROR_INVALID_ARGUMENT naming the file and the rule. Without a key, entries are
     neither authenticated nor checked for a MAC. Give moejit-precompile the same key
     (--cache-key-file). docs/cache.md states what each mode defends against. */
  const char* cache_key_file;
} moejit_runtime_options;

/*
 * moejit_runtime_options_init(options) fills *options with the defaults: struct_size set, every
 * other field zero / NULL / MOEJIT_CACHE_MODE_DEFAULT / MOEJIT_LOG_DEFAULT, i.e. "take it from
 * the environment".
 *   options  the struct to fill; must not be NULL.
 * Returns MOEJIT_SUCCESS, or MOEJIT_ERROR_INVALID_ARGUMENT if options is NULL. Needs no GPU.
 * Thread-safe (touches only *options). Since 0.1.
 * As moejit_combine_args_init: a macro over moejit_runtime_options_init_sized() (since 0.2), which
 * writes no more than the caller's struct (struct_size: sizeof(moejit_runtime_options) of any
 * released header, else MOEJIT_ERROR_INVALID_ARGUMENT); the function of that name is the 0.1 entry
 * point, which fills the fields of the 0.1 and 0.2 headers only (up to template_dir).
 */
MOEJIT_API moejit_status moejit_runtime_options_init_sized(moejit_runtime_options* options,
                                                           size_t struct_size);
MOEJIT_API moejit_status(moejit_runtime_options_init)(moejit_runtime_options* options);
#define moejit_runtime_options_init(options) \
  moejit_runtime_options_init_sized((options), sizeof(moejit_runtime_options))

/*
 * Creates an explicit runtime with its own settings, kernel caches and statistics. The settings
 * are resolved now (options, then environment, then built-in defaults); the strings in *options
 * are copied, so they need not outlive the call. log_level, when set, applies to the library's
 * one logger ("moejit"), which all runtimes share.
 *   options  NULL for all defaults, or a struct prepared with moejit_runtime_options_init().
 *   runtime  receives the handle (NULL on failure); must not be NULL. Release it with
 *            moejit_runtime_destroy().
 * Returns MOEJIT_SUCCESS; MOEJIT_ERROR_INVALID_ARGUMENT for a NULL runtime, a bad struct_size,
 * cache_mode or log_level, a malformed MOEJIT_CACHE_MODE or MOEJIT_CACHE_MAX_BYTES, an
 * unreadable template directory, or a cache key file that breaks its rule (the message names it;
 * a malformed MOEJIT_LOG_LEVEL or MOEJIT_CACHE_LOCK_TIMEOUT only warns and keeps its default);
 * MOEJIT_ERROR_OUT_OF_MEMORY. Needs no GPU: the driver is first used by the first combine.
 * Thread-safe. Since 0.1.
 */
MOEJIT_API moejit_status moejit_runtime_create(const moejit_runtime_options* options,
                                               moejit_runtime_t* runtime);
/*
 * Destroys a runtime and unloads its modules.
 *   runtime  a handle from moejit_runtime_create(), or NULL (then nothing happens).
 * No call with this runtime may run concurrently with or after this one (the only function that is
 * not thread-safe with respect to its argument); kernels already launched on streams complete
 * normally. A CUDA graph that captured calls on this runtime launches its kernels, which are
 * unloaded here: do not launch such a graph after this call (the default runtime is never
 * destroyed). Returns MOEJIT_SUCCESS. Since 0.1.
 */
MOEJIT_API moejit_status moejit_runtime_destroy(moejit_runtime_t runtime);

/* ---- The combine ---------------------------------------------------------------------------- */

/*
 * Runs the combine described by *args on `stream`, in the calling thread's current CUDA context
 * (the CUDA runtime makes the device's primary context current; driver-API users push theirs).
 * Stream-ordered: returns once the kernels are enqueued. The first call for a new shape compiles
 * (or loads from the disk cache) and may take tens of milliseconds; warm calls allocate nothing,
 * synchronize nothing and only launch, so they may be captured into a CUDA graph. A shape's
 * first call may be captured too (its compile or load runs on the host); warming the shape first,
 * with buffers aligned as the captured ones (alignment picks the module), keeps that time out.
 *   args    the combine (see moejit_combine_args); struct_size must be set. Only read during the
 *           call: it may be reused or freed on return. The device buffers it points to must stay
 *           valid until the kernels have run on `stream`.
 *   stream  the CUDA stream to launch on (CUstream or cudaStream_t); NULL is the legacy default
 *           stream. Must belong to the current context: a stream of another device (or context)
 *           makes the driver refuse the launch, reported as _INVALID_ARGUMENT naming both devices.
 * All arguments are checked before the GPU is touched: a call refused for its arguments, or one
 * whose kernels could not be compiled or loaded, launches nothing. (Only a launch the driver
 * itself refuses, _CUDA, can leave the token index's first helper kernel enqueued; it writes
 * nothing but the workspace.)
 * Returns MOEJIT_SUCCESS; caller errors MOEJIT_ERROR_INVALID_ARGUMENT, _UNSUPPORTED,
 * _WORKSPACE_TOO_SMALL; environment errors _DRIVER_NOT_FOUND, _NO_DEVICE, _CUDA, _COMPILE,
 * _NOT_CACHED, _OUT_OF_MEMORY; _INTERNAL for a library bug. The message is in
 * moejit_last_error_message(). An invalid MOEJIT_CACHE_MODE, MOEJIT_CACHE_MAX_BYTES or
 * MOEJIT_TEMPLATE_DIR makes every call on the default runtime fail with _INVALID_ARGUMENT naming
 * the variable.
 * Uses the default runtime (created on first use from the environment). Thread-safe: any number
 * of threads may call it at once, on the same or different streams and contexts. Since 0.1.
 */
MOEJIT_API moejit_status moe_combine(const moejit_combine_args* args, moejit_stream_t stream);

/*
 * moe_combine() on an explicit runtime: the same arguments, semantics and return codes, using
 * runtime's settings, caches and statistics.
 *   runtime  from moejit_runtime_create(), or NULL for the default runtime.
 * Thread-safe, except that it must not race with moejit_runtime_destroy(runtime). Since 0.1.
 */
MOEJIT_API moejit_status moejit_runtime_combine(moejit_runtime_t runtime,
                                                const moejit_combine_args* args,
                                                moejit_stream_t stream);

/* ---- Statistics ----------------------------------------------------------------------------- */

typedef struct moejit_stats {
  size_t struct_size;     /* set by the caller: sizeof(moejit_stats) */
  uint64_t memory_hits;   /* kernel lookups served by a module already loaded in the context */
  uint64_t disk_hits;     /* kernels loaded from the on-disk cache */
  uint64_t compiles;      /* NVRTC compilations, those that failed included (since 0.3) */
  uint64_t disk_errors;   /* cache entries found invalid, or cache reads/writes that failed */
  uint64_t launches;      /* kernels launched */
  double compile_seconds; /* wall time spent in NVRTC (failed compilations included) */
  /* Since 0.2. Modules the runtime holds loaded now, over all contexts (not a count of loads).
   * Those of a context the caller destroyed are dropped when the runtime is next used in a
   * context it has not seen (with a driver of CUDA 12.0 or later, which can tell). */
  uint64_t loaded_modules;
} moejit_stats;

/*
 * Copies a runtime's counters (cumulative since its creation, but loaded_modules) into *stats.
 *   runtime  from moejit_runtime_create(), or NULL for the default runtime.
 *   stats    must not be NULL; the caller sets stats->struct_size = sizeof(moejit_stats). Only
 *            the fields that fit in struct_size are written, so older callers stay safe.
 * Returns MOEJIT_SUCCESS, or MOEJIT_ERROR_INVALID_ARGUMENT for a NULL stats or a struct_size too
 * small to hold any counter, or (default runtime) the invalid environment variable that fails
 * every call on it, as in moe_combine(). Counters are read without stopping other threads: each is
 * exact, but together they are a snapshot only when no combine runs concurrently. Needs no GPU.
 * Thread-safe (not against moejit_runtime_destroy(runtime)). Since 0.1.
 */
MOEJIT_API moejit_status moejit_runtime_get_stats(moejit_runtime_t runtime, moejit_stats* stats);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOEJIT_MOEJIT_H_ */
