#include "combine_bench.h"

#include "moejit_internal.h"

#include <cstring>
#include <stdexcept>

#include "helper_kernels.h"

namespace moejit_bench {
namespace {

// A moe_combine failure: reported for the case, not fatal for the run.
struct CombineFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void combine(const moejit_combine_args& args, cudaStream_t stream) {
  const moejit_status status = moe_combine(&args, stream);
  if (status != MOEJIT_SUCCESS)
    throw CombineFailed(std::string("moe_combine: ") + moejit_status_name(status) + ": " +
                        moejit_last_error_message());
}

// The case's inputs on the device, in every layout.
struct DeviceInputs {
  DeviceBuffer token_major, sorted, gates, gates_by_row, gather_map, token_idx, out;

  explicit DeviceInputs(const HostInputs& in)
      : token_major(in.token_major.size()),
        sorted(in.sorted.size()),
        gates(in.gates.size() * sizeof(float)),
        gates_by_row(in.gates_by_row.size() * sizeof(float)),
        gather_map(in.gather_map.size() * sizeof(int32_t)),
        token_idx(in.token_idx.size() * sizeof(int32_t)),
        out(static_cast<size_t>(in.shape.tokens * in.shape.hidden) *
            static_cast<size_t>(dtype_bytes(in.shape.out_dtype))) {
    token_major.upload(in.token_major.data(), token_major.bytes());
    sorted.upload(in.sorted.data(), sorted.bytes());
    gates.upload(in.gates.data(), gates.bytes());
    gates_by_row.upload(in.gates_by_row.data(), gates_by_row.bytes());
    gather_map.upload(in.gather_map.data(), gather_map.bytes());
    token_idx.upload(in.token_idx.data(), token_idx.bytes());
  }
};

moejit_combine_args args_for(const Shape& s, moejit_layout layout, const DeviceInputs& d) {
  moejit_combine_args a;
  moejit_combine_args_init(&a);
  a.layout = layout;
  a.num_tokens = s.tokens;
  a.top_k = s.top_k;
  a.num_rows = s.rows();
  a.hidden_dim = s.hidden;
  a.expert_dtype = s.in_dtype;
  a.out = d.out.get();
  a.out_dtype = s.out_dtype;
  a.index_type = MOEJIT_INDEX_INT32;
  switch (layout) {
    case MOEJIT_LAYOUT_TOKEN_MAJOR:
      a.expert_hidden = d.token_major.get();
      a.gates = static_cast<const float*>(d.gates.get());
      break;
    case MOEJIT_LAYOUT_GATHER_MAP:
      a.expert_hidden = d.sorted.get();
      a.gates = static_cast<const float*>(d.gates.get());  // indexed t*K + k, like the map
      a.indices = d.gather_map.get();
      break;
    case MOEJIT_LAYOUT_TOKEN_INDEX:
      a.expert_hidden = d.sorted.get();
      a.gates = static_cast<const float*>(d.gates_by_row.get());  // indexed by row
      a.indices = d.token_idx.get();
      break;
  }
  return a;
}

// Allocates the workspace args needs (the token index's) into *workspace and points args at it.
// Returns the error message if the library refuses the shape, else "".
std::string attach_workspace(moejit_combine_args* args, DeviceBuffer* workspace) {
  size_t bytes = 0;
  if (moejit_combine_workspace_size(args, &bytes) != MOEJIT_SUCCESS)
    return std::string("moejit_combine_workspace_size: ") + moejit_last_error_message();
  if (bytes > 0) {
    *workspace = DeviceBuffer(bytes);
    args->workspace = workspace->get();
    args->workspace_bytes = bytes;
  }
  return "";
}

// Percent of the copy ceiling that moving a case's minimal bytes in `us` reaches (0 without a
// ceiling): the combine's figure and its same-size copy's.
double pct_of_ceiling(double minimal_bytes, double us, const Floors& floors) {
  const double gbps = minimal_bytes / (us * 1e-6) / 1e9;
  return floors.copy_ceiling_gbps > 0 ? 100.0 * gbps / floors.copy_ceiling_gbps : 0.0;
}

// BENCHMARKS.md's floor for shapes a launch's fixed cost cannot hide under: the minimal bytes at
// the ceiling plus one empty kernel (timed the same way), as % of `us`.
double pct_of_floor_with_launch(double minimal_bytes, double us, const Floors& floors) {
  if (floors.copy_ceiling_gbps <= 0 || us <= 0) return 0.0;
  const double bytes_floor_us = minimal_bytes / (floors.copy_ceiling_gbps * 1e9) * 1e6;
  return 100.0 * (bytes_floor_us + floors.empty_kernel_us) / us;
}

// Timed runs per figure: settings.reps, else by size (200 below 64 MB of minimal bytes, else 100).
int timed_runs(const Shape& s, const BenchSettings& settings) {
  return settings.reps > 0 ? settings.reps : (s.minimal_bytes() < 64e6 ? 200 : 100);
}

// A device-to-device copy that moves minimal_bytes (half read, half written), timed like the
// combine.
double time_same_size_copy(double minimal_bytes, int reps, int warmup, Timer& timer) {
  const size_t bytes = static_cast<size_t>(minimal_bytes / 2);
  DeviceBuffer src(bytes), dst(bytes);
  BENCH_CUDA(cudaMemset(src.get(), 0x5a, bytes));
  return timer.median_us(
      [&] {
        BENCH_CUDA(
            cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, timer.stream()));
      },
      warmup, reps, CacheState::kFlushed);
}

CaseResult run_layout(const HostInputs& in, const DeviceInputs& d, moejit_layout layout,
                      const BenchSettings& settings, const Floors& floors, Timer& timer) {
  const Shape& s = in.shape;
  CaseResult r;
  r.shape = s;
  r.layout = layout;
  r.drop_percent = in.drop_percent;
  r.dropped_slots = in.dropped_slots;
  cudaStream_t stream = timer.stream();
  moejit_combine_args args = args_for(s, layout, d);
  DeviceBuffer workspace;
  r.error = attach_workspace(&args, &workspace);
  if (!r.error.empty()) return r;

  const size_t out_bytes = d.out.bytes();
  try {
    // Checked run: poison (all-ones bytes are NaN in fp32, fp16 and bf16), one call, compare.
    // It also compiles the specialization, so no compile lands in a timed run.
    BENCH_CUDA(cudaMemsetAsync(d.out.get(), 0xff, out_bytes, stream));
    combine(args, stream);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    std::vector<uint8_t> first(out_bytes);
    d.out.download(first.data(), out_bytes);
    r.check = check_output(in, first, check_tokens(s.tokens, settings.check_tokens));

    r.reps = timed_runs(s, settings);
    const auto enqueue = [&] { combine(args, stream); };
    r.median_us = timer.median_us(enqueue, settings.warmup, r.reps, CacheState::kFlushed);
    r.parity_split_us = timer.last_parity_split_us();
    if (settings.l2_warm)
      r.l2_warm_us = timer.median_us(enqueue, settings.warmup, r.reps, CacheState::kWarm);

    // Every timed run rewrote out; the library promises bitwise-identical results.
    std::vector<uint8_t> last(out_bytes);
    d.out.download(last.data(), out_bytes);
    r.deterministic = std::memcmp(first.data(), last.data(), out_bytes) == 0;
  } catch (const CombineFailed& e) {
    r.error = e.what();
    BENCH_CUDA(cudaStreamSynchronize(stream));
    return r;
  }

  const double bytes = s.minimal_bytes(in.dropped_slots);
  r.gbps = bytes / (r.median_us * 1e-6) / 1e9;
  r.pct_ceiling = pct_of_ceiling(bytes, r.median_us, floors);
  r.pct_floor_with_launch = pct_of_floor_with_launch(bytes, r.median_us, floors);
  r.ratio_empty = floors.empty_kernel_us > 0 ? r.median_us / floors.empty_kernel_us : 0.0;
  r.correct = r.check.passed() && r.deterministic;
  return r;
}

// Median microseconds per step of a CUDA graph of `steps` steps, each enqueued by step().
double graph_us_per_step(cudaStream_t stream, int steps, int replays,
                         const std::function<void()>& step) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    for (int i = 0; i < steps; ++i) step();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw;
  }
  BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
  BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start = nullptr, stop = nullptr;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  std::vector<double> us;
  for (int r = 0; r < replays + 3; ++r) {  // three untimed replays first
    BENCH_CUDA(cudaEventRecord(start, stream));
    BENCH_CUDA(cudaGraphLaunch(exec, stream));
    BENCH_CUDA(cudaEventRecord(stop, stream));
    BENCH_CUDA(cudaEventSynchronize(stop));
    float ms = 0.0f;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (r >= 3) us.push_back(ms * 1e3 / steps);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return median(us);
}

}  // namespace

std::vector<PipelineResult> run_pipeline(const Shape& shape,
                                         const std::vector<moejit_layout>& layouts,
                                         const BenchSettings& settings,
                                         const HelperKernels& helpers, cudaStream_t stream) {
  constexpr int kSteps = 100, kReplays = 15;
  constexpr double kProducerUs = 2.0;
  // The routing-evicted steps read this much first (more than any GPU's L2 so far; zeros, so the
  // sweep never writes its sink).
  constexpr size_t kSweepBytes = size_t{256} << 20;
  const size_t row_bytes = static_cast<size_t>(shape.rows() * shape.hidden) *
                           static_cast<size_t>(dtype_bytes(shape.in_dtype));
  std::vector<PipelineResult> results;
  if (row_bytes % 16 != 0) {
    // The producer copies 16-byte words (producer_source.h): such rows cannot be rewritten whole.
    for (moejit_layout layout : layouts) {
      PipelineResult r;
      r.shape = shape;
      r.layout = layout;
      r.drop_percent = settings.drop_percent;
      r.dropped_slots = dropped_slot_count(shape.rows(), settings.drop_percent);
      r.skipped = "the producer copies 16-byte words; the rows are " + std::to_string(row_bytes) +
                  " bytes, not a multiple of 16";
      results.push_back(r);
    }
    return results;
  }
  const HostInputs in = make_inputs(shape, settings.seed, settings.drop_percent);
  const DeviceInputs d(in);
  DeviceBuffer pristine(row_bytes);
  DeviceBuffer sweep(kSweepBytes), sink(sizeof(unsigned));
  BENCH_CUDA(cudaMemsetAsync(sweep.get(), 0, kSweepBytes, stream));
  for (moejit_layout layout : layouts) {
    PipelineResult r;
    r.shape = shape;
    r.layout = layout;
    r.drop_percent = in.drop_percent;
    r.dropped_slots = in.dropped_slots;
    moejit_combine_args args = args_for(shape, layout, d);
    DeviceBuffer workspace;
    r.error = attach_workspace(&args, &workspace);
    if (!r.error.empty()) {
      results.push_back(r);
      continue;
    }
    void* rows = const_cast<void*>(args.expert_hidden);  // what the producer rewrites
    // On the bench's stream: a plain cudaMemcpy would run on the legacy stream, which the
    // bench's non-blocking stream does not wait for.
    BENCH_CUDA(cudaMemcpyAsync(pristine.get(), rows, row_bytes, cudaMemcpyDeviceToDevice, stream));
    const size_t out_bytes = d.out.bytes();
    try {
      // The reference: a plain call on the rows as they are (also compiles, outside any graph).
      combine(args, stream);
      BENCH_CUDA(cudaStreamSynchronize(stream));
      std::vector<uint8_t> expected(out_bytes), got(out_bytes);
      d.out.download(expected.data(), out_bytes);

      // what: 0 producer only, 1 combine, 2 empty. evict: a sweep through L2 before the producer,
      // so the routing (written once, before the steps) comes from DRAM, as after the expert
      // GEMMs of a real step; the producer's rows are still in L2.
      auto step = [&](bool dependent, int what, bool evict = false) {
        if (evict) helpers.launch_sweep(stream, sweep.get(), kSweepBytes, sink.get());
        helpers.launch_produce(stream, pristine.get(), rows, row_bytes, kProducerUs, dependent);
        if (what == 1) {
          moejit_combine_args a = args;
          a.dependent_launch = dependent ? 1 : 0;
          combine(a, stream);
        } else if (what == 2) {
          helpers.launch_empty_ex(stream, dependent);
        }
      };
      // The dependent step must see the producer's rows: poison them (NaN in every dtype), run one
      // step, compare bitwise with the reference. A combine that read before the producer's
      // writes were visible would sum NaN or stale bytes.
      BENCH_CUDA(cudaMemsetAsync(rows, 0xff, row_bytes, stream));
      BENCH_CUDA(cudaMemsetAsync(d.out.get(), 0xff, out_bytes, stream));
      step(true, 1);
      BENCH_CUDA(cudaStreamSynchronize(stream));
      d.out.download(got.data(), out_bytes);
      r.correct = std::memcmp(expected.data(), got.data(), out_bytes) == 0;

      for (int dependent = 0; dependent < 2; ++dependent) {
        const bool dep = dependent != 0;
        double* producer = dep ? &r.producer_dependent_us : &r.producer_plain_us;
        double* with_combine = dep ? &r.combine_dependent_us : &r.combine_plain_us;
        double* with_empty = dep ? &r.empty_dependent_us : &r.empty_plain_us;
        *producer = graph_us_per_step(stream, kSteps, kReplays, [&] { step(dep, 0); });
        *with_combine =
            graph_us_per_step(stream, kSteps, kReplays, [&] { step(dep, 1); }) - *producer;
        *with_empty =
            graph_us_per_step(stream, kSteps, kReplays, [&] { step(dep, 2); }) - *producer;
        const double producer_evicted =
            graph_us_per_step(stream, kSteps, kReplays, [&] { step(dep, 0, true); });
        (dep ? r.combine_dependent_evicted_us : r.combine_plain_evicted_us) =
            graph_us_per_step(stream, kSteps, kReplays, [&] { step(dep, 1, true); }) -
            producer_evicted;
      }
      d.out.download(got.data(), out_bytes);
      r.correct = r.correct && std::memcmp(expected.data(), got.data(), out_bytes) == 0;
    } catch (const CombineFailed& e) {
      r.error = e.what();
      cudaStreamSynchronize(stream);
    }
    BENCH_CUDA(cudaMemcpyAsync(rows, pristine.get(), row_bytes, cudaMemcpyDeviceToDevice, stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    results.push_back(r);
  }
  return results;
}

const char* layout_text(moejit_layout layout) {
  return moejit::layout_name(layout);
}

bool parse_layout(const std::string& text, moejit_layout* layout) {
  for (moejit_layout l :
       {MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_LAYOUT_TOKEN_INDEX})
    if (text == layout_text(l)) {
      *layout = l;
      return true;
    }
  return false;
}

CaseResult run_token_index_case(const HostInputs& in, const BenchSettings& settings,
                                const Floors& floors, Timer& timer) {
  const DeviceInputs d(in);
  return run_layout(in, d, MOEJIT_LAYOUT_TOKEN_INDEX, settings, floors, timer);
}

std::vector<CaseResult> run_case(const Shape& shape, const std::vector<moejit_layout>& layouts,
                                 const BenchSettings& settings, const Floors& floors,
                                 Timer& timer) {
  const HostInputs in = make_inputs(shape, settings.seed, settings.drop_percent);
  const DeviceInputs d(in);
  std::vector<CaseResult> results;
  for (moejit_layout layout : layouts)
    results.push_back(run_layout(in, d, layout, settings, floors, timer));
  const double bytes = shape.minimal_bytes(in.dropped_slots);
  const double copy_us =
      time_same_size_copy(bytes, timed_runs(shape, settings), settings.warmup, timer);
  const double copy_pct = pct_of_ceiling(bytes, copy_us, floors);
  const double copy_pct_adjusted = pct_of_floor_with_launch(bytes, copy_us, floors);
  for (CaseResult& r : results) {
    r.same_size_copy_us = copy_us;
    r.same_size_copy_pct_ceiling = copy_pct;
    r.same_size_copy_pct_floor_with_launch = copy_pct_adjusted;
  }
  return results;
}

void write_case_timing(JsonWriter& j, const CaseResult& r) {
  j.member("median_us", r.median_us);
  j.member("parity_split_us", r.parity_split_us);
  j.member("l2_warm_us", r.l2_warm_us);
  j.member("gbps", r.gbps);
  j.member("pct_ceiling", r.pct_ceiling);
  j.member("pct_floor_with_launch", r.pct_floor_with_launch);
}

void write_case_check(JsonWriter& j, const CaseResult& r) {
  j.member("rel_err", r.check.rel_err);
  j.member("rel_err_bound", r.check.bound);
  j.member("rounding_rel_err", r.check.rounding_err);
  j.member("checked_tokens", r.check.checked_tokens);
  j.member("tokens_over_bound", r.check.bad_tokens);
  j.member("nonfinite_elements", r.check.nonfinite);
  j.member("deterministic", r.deterministic);
  j.member("correct", r.correct);
  j.member("reps", r.reps);
}

}  // namespace moejit_bench
