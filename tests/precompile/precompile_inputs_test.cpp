// moejit-precompile inputs: config.json parsing, expansion, manifests, --arch, and the CLI's error
// paths, dry run and JSON output. Needs neither a GPU nor the disk cache.
#include <sys/stat.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <regex>

#include "cache_key.h"
#include "combine_plan.h"
#include "driver.h"
#include "error.h"
#include "gtest/gtest.h"
#include "kernel_store.h"
#include "precompile_inputs.h"
#include "tool_runner.h"

namespace moejit {
namespace precompile {
namespace {

using test::configs;
using test::run_tool;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InputError thrown";
  return std::string();
}

TEST(ModelConfig, ReadsEachExampleConfig) {
  struct Expected {
    const char* file;
    int hidden, top_k;
    const char* top_k_field;
  };
  for (const Expected& e : {Expected{"deepseek-v3.json", 7168, 8, "num_experts_per_tok"},
                            Expected{"mixtral-8x7b.json", 4096, 2, "num_experts_per_tok"},
                            Expected{"qwen3-30b-a3b.json", 2048, 8, "num_experts_per_tok"},
                            Expected{"gpt-oss-120b.json", 2880, 4, "experts_per_token"}}) {
    const ModelConfig c = read_model_config(configs(e.file));
    EXPECT_EQ(c.hidden, e.hidden) << e.file;
    EXPECT_EQ(c.top_k, e.top_k) << e.file;
    EXPECT_EQ(c.top_k_field, e.top_k_field) << e.file;
    ASSERT_TRUE(c.dtype.has_value()) << e.file;
    EXPECT_EQ(parse_dtype(*c.dtype, "t"), MOEJIT_DTYPE_BFLOAT16) << e.file;
  }
}

TEST(ModelConfig, EveryTopKNameAndDtypeField) {
  for (const std::string& name : top_k_field_names()) {
    const ModelConfig c = parse_model_config(
        R"({"hidden_size": 1024, ")" + name + R"(": 6, "dtype": "float16"})", "x.json");
    EXPECT_EQ(c.top_k, 6) << name;
    EXPECT_EQ(c.top_k_field, name);
    EXPECT_EQ(c.dtype_field, "dtype");
  }
}

// Published configs that name the top-k otherwise: LongCat-Flash (moe_topk), ERNIE 4.5 (moe_k),
// Hunyuan-A13B (moe_topk, one value per layer, next to a per-layer num_experts list).
TEST(ModelConfig, MoeTopkMoeKAndPerLayerLists) {
  ModelConfig c = parse_model_config(
      R"({"hidden_size": 6144, "moe_topk": 12, "n_routed_experts": 512, "torch_dtype": "bfloat16"})",
      "longcat.json");
  EXPECT_EQ(c.top_k, 12);
  EXPECT_EQ(c.top_k_field, "moe_topk");
  c = parse_model_config(
      R"({"hidden_size": 2560, "moe_k": 6, "moe_num_experts": 64, "dtype": "bfloat16"})",
      "ernie.json");
  EXPECT_EQ(c.top_k, 6);
  EXPECT_EQ(c.top_k_field, "moe_k");
  c = parse_model_config(R"({"hidden_size": 4096, "num_experts": 64, "moe_topk": [8, 8, 8, 8],
      "torch_dtype": "bfloat16"})",
                         "hunyuan.json");
  EXPECT_EQ(c.top_k, 8);
  EXPECT_EQ(c.top_k_field, "moe_topk");

  std::string m = error_of(
      [] { parse_model_config(R"({"hidden_size": 32, "moe_topk": [2, 1]})", "mixed.json"); });
  EXPECT_NE(m.find("mixed.json: field moe_topk = [2,1]"), std::string::npos) << m;
  EXPECT_NE(m.find("differs between layers"), std::string::npos) << m;
  EXPECT_NE(m.find("--topk"), std::string::npos) << m;
  m = error_of(
      [] { parse_model_config(R"({"hidden_size": 32, "moe_topk": [2, "x"]})", "bad.json"); });
  EXPECT_NE(m.find("moe_topk[1] = \"x\""), std::string::npos) << m;
  m = error_of([] { parse_model_config(R"({"hidden_size": 32, "moe_topk": []})", "empty.json"); });
  EXPECT_NE(m.find("moe_topk = []: expected a positive integer"), std::string::npos) << m;
}

// DBRX: the hidden size is d_model and the top-k sits in ffn_config, an object beside it.
TEST(ModelConfig, DModelWithTheTopKInAnObjectBesideIt) {
  ModelConfig c = parse_model_config(
      R"({"d_model": 6144, "n_heads": 48, "torch_dtype": "bfloat16",
          "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4}})",
      "dbrx.json");
  EXPECT_EQ(c.hidden, 6144);
  EXPECT_EQ(c.hidden_field, "d_model");
  EXPECT_EQ(c.top_k, 4);
  EXPECT_EQ(c.top_k_field, "ffn_config.moe_top_k");
  EXPECT_EQ(c.dtype, "bfloat16");
  // A top-k in the same object wins over one beside it.
  c = parse_model_config(R"({"hidden_size": 4096, "num_experts_per_tok": 2,
      "extra": {"moe_top_k": 8}})",
                         "both.json");
  EXPECT_EQ(c.top_k, 2);
  EXPECT_EQ(c.top_k_field, "num_experts_per_tok");
  const std::string m = error_of([] {
    parse_model_config(R"({"d_model": 512, "ffn_config": {"ffn_hidden_size": 1024}})",
                       "dense.json");
  });
  EXPECT_NE(m.find("missing the top-k field"), std::string::npos) << m;
  EXPECT_NE(m.find("next to d_model or in an object beside it"), std::string::npos) << m;
}

TEST(ModelConfig, LooksInsideNestedTextConfig) {
  // A multimodal layout: the vision tower has its own hidden_size, which must not be taken.
  const ModelConfig c = parse_model_config(R"({
      "architectures": ["X"], "torch_dtype": "bfloat16",
      "audio_config": {"hidden_size": 1280},
      "vision_config": {"hidden_size": 1152},
      "text_config": {"hidden_size": 5120, "num_experts_per_tok": 1}})",
                                           "mm.json");
  EXPECT_EQ(c.hidden, 5120);
  EXPECT_EQ(c.top_k, 1);
  EXPECT_EQ(c.hidden_field, "text_config.hidden_size");
  EXPECT_EQ(c.top_k_field, "text_config.num_experts_per_tok");
  EXPECT_EQ(c.dtype_field, "torch_dtype");  // from the enclosing object
  EXPECT_EQ(*c.dtype, "bfloat16");
}

TEST(ModelConfig, ErrorsNameFileFieldAndExpectation) {
  std::string m = error_of([] { read_model_config("/nonexistent/config.json"); });
  EXPECT_NE(m.find("/nonexistent/config.json"), std::string::npos) << m;

  m = error_of([] { parse_model_config("{\"hidden_size\": 7168,", "bad.json"); });
  EXPECT_NE(m.find("bad.json"), std::string::npos) << m;
  EXPECT_NE(m.find("not valid JSON"), std::string::npos) << m;

  m = error_of([] { parse_model_config(R"({"num_experts_per_tok": 8})", "nohidden.json"); });
  EXPECT_NE(m.find("nohidden.json"), std::string::npos) << m;
  EXPECT_NE(m.find("missing field hidden_size"), std::string::npos) << m;

  m = error_of([] { parse_model_config(R"({"hidden_size": 4096})", "dense.json"); });
  EXPECT_NE(m.find("dense.json"), std::string::npos) << m;
  EXPECT_NE(m.find("num_experts_per_tok"), std::string::npos) << m;
  EXPECT_NE(m.find("experts_per_token"), std::string::npos) << m;

  m = error_of(
      [] { parse_model_config(R"({"hidden_size": "big", "num_experts_per_tok": 2})", "s.json"); });
  EXPECT_NE(m.find("hidden_size = \"big\""), std::string::npos) << m;
  EXPECT_NE(m.find("positive integer"), std::string::npos) << m;

  m = error_of([] {
    parse_model_config(R"({"hidden_size": 64, "moe_top_k": 2, "num_experts_per_tok": 4})",
                       "k.json");
  });
  EXPECT_NE(m.find("num_experts_per_tok = 4"), std::string::npos) << m;
  EXPECT_NE(m.find("moe_top_k = 2"), std::string::npos) << m;
  EXPECT_NE(m.find("disagree"), std::string::npos) << m;
}

// In Hugging Face configs a plain top_k is usually the sampling setting (50 by default), which
// full config dumps carry next to the MoE fields and in dense models.
TEST(ModelConfig, PlainTopKIsSamplingUnlessNextToAnExpertCount) {
  // Next to an MoE top-k field, top_k is ignored: no disagreement, K from the MoE field.
  ModelConfig c = parse_model_config(R"({"torch_dtype": "bfloat16", "top_k": 50,
      "text_config": {"hidden_size": 4096, "num_experts_per_tok": 8, "top_k": 50,
                      "num_local_experts": 64}})",
                                     "nested.json");
  EXPECT_EQ(c.top_k, 8);
  EXPECT_EQ(c.top_k_field, "text_config.num_experts_per_tok");
  EXPECT_EQ(c.hidden_field, "text_config.hidden_size");

  // A dense config with a sampling top_k has no top-k: the usual error, which explains why.
  std::string m =
      error_of([] { parse_model_config(R"({"hidden_size": 4096, "top_k": 50})", "dense.json"); });
  EXPECT_NE(m.find("dense.json: missing the top-k field"), std::string::npos) << m;
  EXPECT_NE(m.find("sampling setting"), std::string::npos) << m;
  EXPECT_NE(m.find("--hidden and --topk"), std::string::npos) << m;
  // A null or zero expert count is no expert count.
  for (const char* count : {"null", "0"}) {
    m = error_of([&] {
      parse_model_config(
          std::string(R"({"hidden_size": 4096, "top_k": 50, "num_experts": )") + count + "}",
          "dense.json");
    });
    EXPECT_NE(m.find("missing the top-k field"), std::string::npos) << count << ": " << m;
  }

  // top_k next to an expert count, and no MoE top-k field: it is the top-k, at any nesting.
  for (const std::string& count : expert_count_field_names()) {
    c = parse_model_config(R"({"hidden_size": 2048, "top_k": 6, ")" + count + R"(": 64})",
                           "moe.json");
    EXPECT_EQ(c.top_k, 6) << count;
    EXPECT_EQ(c.top_k_field, "top_k") << count;
  }
  c = parse_model_config(R"({"top_k": 50, "num_experts": 16,
      "text_config": {"hidden_size": 1024, "top_k": 2, "num_experts": 16}})",
                         "moe.json");
  EXPECT_EQ(c.top_k, 2);
  EXPECT_EQ(c.top_k_field, "text_config.top_k");
  // The expert count must sit at the same level as top_k.
  m = error_of([] {
    parse_model_config(R"({"num_experts": 16, "text_config": {"hidden_size": 1024, "top_k": 50}})",
                       "split.json");
  });
  EXPECT_NE(m.find("missing the top-k field"), std::string::npos) << m;
}

TEST(Parse, DtypesLayoutsIndexTypes) {
  EXPECT_EQ(parse_dtype("float32", "x"), MOEJIT_DTYPE_FLOAT32);
  EXPECT_EQ(parse_dtype("FP32", "x"), MOEJIT_DTYPE_FLOAT32);
  EXPECT_EQ(parse_dtype("half", "x"), MOEJIT_DTYPE_FLOAT16);
  EXPECT_EQ(parse_dtype("float16", "x"), MOEJIT_DTYPE_FLOAT16);
  EXPECT_EQ(parse_dtype("torch.bfloat16", "x"), MOEJIT_DTYPE_BFLOAT16);
  EXPECT_EQ(parse_dtype("bf16", "x"), MOEJIT_DTYPE_BFLOAT16);
  const std::string m =
      error_of([] { parse_dtype("float8_e4m3fn", "cfg.json: field torch_dtype"); });
  EXPECT_NE(m.find("cfg.json: field torch_dtype = \"float8_e4m3fn\""), std::string::npos) << m;
  EXPECT_NE(m.find("fp32, fp16 or bf16"), std::string::npos) << m;
  EXPECT_EQ(parse_layout("gather_map", "x"), MOEJIT_LAYOUT_GATHER_MAP);
  EXPECT_EQ(parse_index_type("int64", "x"), MOEJIT_INDEX_INT64);
  EXPECT_FALSE(error_of([] { parse_layout("scatter", "--layout"); }).empty());
  EXPECT_FALSE(error_of([] { parse_index_type("int16", "--index-type"); }).empty());
}

TEST(Expand, MatchesWhatMoeCombineRequests) {
  Shape s;
  s.hidden = 7168;
  s.top_k = 8;
  s.dtype = s.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  s.origin = "test";
  std::vector<KernelSpec> specs;
  expand_shape(s, all_layouts(), all_index_types(), &specs);
  // token_major has no index: (1 + gather_map x 2) x {prefill and decode, mid-size geometry}, the
  // gather map's one-token module x 2 index types, plus token_index x 2 index types x (the list
  // path's two modules, prefill and mid-size + the single-launch module and its small-call form
  // (decode calls of up to 16 tokens) + the one-token module + the list helpers' module): with 8
  // rows per token the single launch has one geometry for every size, and decode calls never take
  // the list path (their single launch always pays), whose mid-size module they would share.
  ASSERT_EQ(specs.size(), 20u);
  for (moejit_layout l : all_layouts())
    for (moejit_index_type t : all_index_types())
      for (int64_t tokens : {kAnyTokens, int64_t{1}, int64_t{512}, int64_t{2048}, int64_t{4096}}) {
        const KernelSpec want = spec_for_shape(l, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16, t,
                                               7168, 8, 256, tokens);
        EXPECT_NE(std::find(specs.begin(), specs.end(), want), specs.end()) << want.describe();
        if (want.layout() == MOEJIT_LAYOUT_GATHER_MAP && tokens == 1) {
          EXPECT_NE(std::find(specs.begin(), specs.end(), one_token_map_spec(want)), specs.end())
              << want.describe();
        }
        if (want.token_index()) {
          EXPECT_NE(std::find(specs.begin(), specs.end(), single_launch_spec(want, tokens)),
                    specs.end())
              << want.describe();
          EXPECT_NE(std::find(specs.begin(), specs.end(), *companion_module(want)), specs.end())
              << want.describe();
          if (tokens == 1) {
            EXPECT_NE(std::find(specs.begin(), specs.end(), one_token_index_spec(want)),
                      specs.end())
                << want.describe();
            EXPECT_NE(std::find(specs.begin(), specs.end(),
                                single_launch_for_rows(single_launch_spec(want, tokens), 1)),
                      specs.end())
                << want.describe();
          }
        }
      }
  expand_shape(s, all_layouts(), all_index_types(), &specs);  // no duplicates
  EXPECT_EQ(specs.size(), 20u);

  // Short rows (128-wide fp32: 32 threads per token) with two rows per token: the single launch
  // packs 16 tokens per 512-thread block beyond decode sizes and 4 per 128-thread block at
  // decode, so both are warmed, next to the list path's module (one geometry), the one-token
  // module and the helpers: 5 modules for one index type.
  Shape small = s;
  small.hidden = 128;
  small.top_k = 2;
  small.dtype = small.out_dtype = MOEJIT_DTYPE_FLOAT32;
  std::vector<KernelSpec> short_rows;
  expand_shape(small, {MOEJIT_LAYOUT_TOKEN_INDEX}, {MOEJIT_INDEX_INT32}, &short_rows);
  ASSERT_EQ(short_rows.size(), 5u);
  int single_launch_blocks = 0;
  for (const KernelSpec& k : short_rows)
    if (k.kind == KernelKind::kTokenIndexScan) {
      EXPECT_EQ(k.tpt, 32) << k.describe();
      single_launch_blocks |= k.tpb == 16 ? 1 : k.tpb == 4 ? 2 : 4;
    }
  EXPECT_EQ(single_launch_blocks, 3);

  s.hidden = 0;
  EXPECT_NE(error_of([&] {
              expand_shape(s, all_layouts(), all_index_types(), &specs);
            }).find("hidden size 0"),
            std::string::npos);
  s.hidden = 64;
  s.top_k = 65;
  EXPECT_NE(
      error_of([&] { expand_shape(s, all_layouts(), all_index_types(), &specs); }).find("top-k 65"),
      std::string::npos);
}

TEST(Manifest, ExactAndShapeLines) {
  const KernelSpec exact = spec_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_FLOAT16,
                                          MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT64, 2880, 4, 256);
  const KernelSpec exact_scan =
      single_launch_spec(spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16,
                                        MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 7168, 8, 256, 1),
                         1);
  const KernelSpec exact_one_token = one_token_index_spec(
      spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT16, MOEJIT_DTYPE_BFLOAT16,
                     MOEJIT_INDEX_INT64, 2880, 4, 256, 1));
  const KernelSpec exact_gather_one_token =
      one_token_map_spec(spec_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16,
                                        MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT64, 7168, 8, 256, 1));
  const KernelSpec exact_small = single_launch_for_rows(exact_scan, 1);
  const KernelSpec exact_helpers =
      *companion_module(spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16,
                                       MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 7168, 8, 256));
  const std::string text = "# warm list\n\n" + exact.describe() +
                           "  # from a log\n"
                           "hidden=4096 topk=2 dtype=bf16 layout=gather_map index_type=int32\n"
                           "hidden=2048 topk=4 layout=token_major,token_index index_type=int64\n" +
                           exact_scan.describe() + "\n" + exact_helpers.describe() + "\n" +
                           exact_one_token.describe() + "\n" + exact_small.describe() + "\n" +
                           exact_gather_one_token.describe() + "\n";
  ManifestDefaults d;
  d.dtype = MOEJIT_DTYPE_FLOAT32;
  std::vector<KernelSpec> specs;
  parse_manifest(text, "m.txt", d, &specs);
  // Shape lines expand to exactly what moe_combine() loads for the shape (specs_for_shape), in
  // its order: the gather map at K=2 its prefill module (four slots per thread), the one-token
  // module, the decode / mid-size module; token-major at K=4 one module for every size; the token
  // index at four rows per token the prefill list path (two slots per thread in 128-thread
  // blocks) with its helpers, the one-token module, the decode single launch and its small-call
  // form, the mid-size list path (64-thread blocks) and the mid-size single launch (two slots per
  // thread). Decode calls never take the list path here: their single launch always pays.
  ASSERT_EQ(specs.size(), 17u);
  EXPECT_EQ(specs[0], exact);
  const auto gm = specs_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16,
                                  MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 4096, 2, 256);
  ASSERT_EQ(gm.size(), 3u);
  EXPECT_EQ(specs[1], gm[0]);
  EXPECT_EQ(specs[1], spec_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16,
                                     MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 4096, 2, 256));
  const KernelSpec gm_decode =
      spec_for_shape(MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_DTYPE_BFLOAT16, MOEJIT_DTYPE_BFLOAT16,
                     MOEJIT_INDEX_INT32, 4096, 2, 256, 1);
  EXPECT_EQ(specs[2], one_token_map_spec(gm_decode));
  EXPECT_EQ(specs[3], gm_decode);
  EXPECT_EQ(specs[4], spec_for_shape(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_FLOAT32,
                                     MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT64, 2048, 4, 256));
  // Token-major at K=4: decode calls take the prefill module (128-thread blocks), mid-size too.
  EXPECT_EQ(spec_for_shape(MOEJIT_LAYOUT_TOKEN_MAJOR, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32,
                           MOEJIT_INDEX_INT64, 2048, 4, 256, 1),
            specs[4]);
  const KernelSpec ti_prefill =
      spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32,
                     MOEJIT_INDEX_INT64, 2048, 4, 256);
  const KernelSpec ti_decode =
      spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT32, MOEJIT_DTYPE_FLOAT32,
                     MOEJIT_INDEX_INT64, 2048, 4, 256, 1);
  EXPECT_EQ(specs[5], ti_prefill);
  EXPECT_EQ(specs[6], *companion_module(ti_prefill));
  EXPECT_EQ(specs[6].describe(), "kind=token_index_list_helpers idx=int64");
  EXPECT_EQ(specs[7], one_token_index_spec(ti_decode));
  EXPECT_EQ(specs[8], single_launch_spec(ti_decode, 1));
  EXPECT_EQ(specs[9], single_launch_for_rows(specs[8], 1));
  EXPECT_EQ(specs[10], spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_FLOAT32,
                                      MOEJIT_DTYPE_FLOAT32, MOEJIT_INDEX_INT64, 2048, 4, 256, 65));
  EXPECT_EQ(specs[10].tpt, 64);
  EXPECT_EQ(specs[10].upt, 2);
  EXPECT_EQ(specs[5].tpt, 128);
  EXPECT_EQ(specs[11], single_launch_spec(specs[10], 65));
  EXPECT_EQ(single_launch_spec(ti_prefill, kAnyTokens), specs[11]);
  EXPECT_EQ(specs[12], exact_scan);              // an exact scan line round-trips
  EXPECT_EQ(specs[13], exact_helpers);           // and a helpers line (int32)
  EXPECT_EQ(specs[14], exact_one_token);         // and a one-token line
  EXPECT_EQ(specs[15], exact_small);             // and a small-call single launch
  EXPECT_EQ(specs[16], exact_gather_one_token);  // and a gather-map one-token line

  auto bad = [&](const std::string& line) {
    return error_of([&] {
      std::vector<KernelSpec> s;
      parse_manifest("# header\n" + line + "\n", "m.txt", ManifestDefaults{}, &s);
    });
  };
  EXPECT_NE(bad("hidden=4096 topk=2 dtype=bf16 color=red").find("m.txt:2: unknown key \"color\""),
            std::string::npos);
  EXPECT_NE(bad("topk=2 dtype=bf16").find("m.txt:2"), std::string::npos);
  EXPECT_NE(bad("hidden=4096 topk=2").find("no dtype"), std::string::npos);
  EXPECT_NE(bad("hidden=4096 topk=2 dtype=int8").find("unknown dtype"), std::string::npos);
  EXPECT_NE(bad("kind=gather_map in=bf16 out=bf16 idx=int32 H=64 vec=3 K=2 tpt=8 tpb=16 upt=1")
                .find("vec = 3"),
            std::string::npos);
  EXPECT_NE(bad("kind=gather_map in=bf16 H=64").find("\"out\" is missing"), std::string::npos);
  // Threads per token and tokens per block are bounded before their product is taken:
  // 65536 * 65536 would wrap a 32-bit int to 0, a "multiple of 32 at most 1024".
  EXPECT_NE(bad("kind=gather_map in=bf16 out=bf16 idx=int32 H=64 vec=8 K=2 tpt=65536 tpb=65536 "
                "upt=1")
                .find("m.txt:2: tpt = 65536: expected 4..1024"),
            std::string::npos);
  EXPECT_NE(bad("kind=gather_map in=bf16 out=bf16 idx=int32 H=64 vec=8 K=2 tpt=32 tpb=65536 upt=1")
                .find("m.txt:2: tpb = 65536: expected 1..1024"),
            std::string::npos);
  EXPECT_NE(bad("kind=gather_map in=bf16 out=bf16 idx=int32 H=64 vec=8 K=2 tpt=32 tpb=0 upt=1")
                .find("tpb = 0: expected 1..1024"),
            std::string::npos);
  EXPECT_NE(bad("kind=gather_map in=bf16 out=bf16 idx=int32 H=64 vec=8 K=2 tpt=64 tpb=32 upt=1")
                .find("tpt = 64: tpt >= 4, tpb >= 1, tpt * tpb a multiple of 32 and at most 1024"),
            std::string::npos);
  // Each kind has exactly its keys: a list cap on a fixed layout, or on the one-token kernel
  // (which keeps no list), does not belong; the fixed layouts' K is the token index's held.
  EXPECT_NE(
      bad("kind=gather_map in=bf16 out=bf16 idx=int32 H=64 vec=8 K=2 tpt=8 tpb=16 upt=1 "
          "cap=16")
          .find("\"cap\" does not belong: a gather_map line has exactly kind in out idx H vec "
                "K tpt tpb upt"),
      std::string::npos);
  const std::string one_token = exact_one_token.describe();
  EXPECT_EQ(one_token.find("cap="), std::string::npos) << one_token;
  EXPECT_NE(bad(one_token + " cap=8").find("\"cap\" does not belong"), std::string::npos);
  EXPECT_NE(
      bad(std::regex_replace(one_token, std::regex("held="), "K=")).find("\"held\" is missing"),
      std::string::npos);
  EXPECT_NE(bad(std::regex_replace(one_token, std::regex("held=4"), "held=3"))
                .find("held = 3: the token_index kinds hold 1, 2, 4, 8, 12 or 16 rows per token"),
            std::string::npos);
  EXPECT_NE(
      bad(std::regex_replace(std::regex_replace(one_token, std::regex("token_index_one_token"),
                                                "token_major_one_token"),
                             std::regex("int64"), "int32"))
          .find("kind = \"token_major_one_token\": expected one of token_major, gather_map, "
                "gather_map_one_token"),
      std::string::npos);
  // A gather-map one-token module holds every row at once: K * upt at most 8.
  EXPECT_NE(bad(std::regex_replace(exact_gather_one_token.describe(), std::regex("K=8"), "K=9"))
                .find("K * upt at most 8"),
            std::string::npos);
  // List capacities: 8 (small-call forms) up to 128 (more than 16 rows per token on average).
  const KernelSpec wide = spec_for_shape(MOEJIT_LAYOUT_TOKEN_INDEX, MOEJIT_DTYPE_BFLOAT16,
                                         MOEJIT_DTYPE_BFLOAT16, MOEJIT_INDEX_INT32, 4096, 40, 256);
  ASSERT_EQ(wide.list_cap, 128);
  {
    std::vector<KernelSpec> s;
    parse_manifest(wide.describe() + "\n", "m.txt", ManifestDefaults{}, &s);
    ASSERT_EQ(s.size(), 1u);
    EXPECT_EQ(s[0], wide);
  }
  EXPECT_NE(bad(std::regex_replace(wide.describe(), std::regex("cap=128"), "cap=256"))
                .find("cap = 256: the token_index lists take cap 8, 16, 32, 64 or 128"),
            std::string::npos);
  // The ordered scans (the small-call form too) are one token per block in whole warps; the
  // shared-list scan is not.
  const std::string small = exact_small.describe();
  EXPECT_EQ(small.find("kind=token_index_small_scan "), 0u) << small;
  EXPECT_NE(bad(std::regex_replace(small, std::regex("tpb=1"), "tpb=2"))
                .find("is one token per block in whole warps"),
            std::string::npos);
  EXPECT_NE(bad(std::regex_replace(exact_scan.describe(), std::regex("_scan"), "_ordered_scan"))
                .find("kind = \"token_index_ordered_scan\": expected one of"),
            std::string::npos);
  EXPECT_NE(bad("hidden").find("expected key=value"), std::string::npos);
  // The format of earlier versions is refused with a pointer to the current one.
  EXPECT_NE(bad("layout=token_index idx=int32 helpers=1").find("starts with kind="),
            std::string::npos);
  EXPECT_NE(bad("kind=token_index_list_helpers idx=int32 H=64").find("\"H\" does not belong"),
            std::string::npos);
  EXPECT_NE(bad("kind=token_index_list_helpers idx=int16").find("expected int32 or int64"),
            std::string::npos);
}

TEST(Arch, ListsAllAndErrors) {
  const std::vector<int> supported{60, 75, 80, 90, 100};
  std::vector<Target> t = parse_archs("sm_90,80,compute_100", supported);
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0], (Target{90, false}));
  EXPECT_EQ(t[1], (Target{80, false}));
  EXPECT_EQ(t[2], (Target{100, true}));
  t = parse_archs("all", supported);
  ASSERT_EQ(t.size(), 4u);  // sm_60 is below sm_70
  EXPECT_EQ(t[0].sm, 75);
  std::string m = error_of([&] { parse_archs("sm_70", supported); });
  EXPECT_NE(m.find("sm_70"), std::string::npos) << m;
  EXPECT_NE(m.find("sm_75, sm_80, sm_90, sm_100"), std::string::npos) << m;
  EXPECT_FALSE(error_of([&] { parse_archs("hopper", supported); }).empty());
  EXPECT_FALSE(error_of([&] { parse_archs("", supported); }).empty());
}

// ---- the CLI, for what needs no disk cache -----------------------------------------------------

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("MOEJIT_TEMPLATE_DIR");
    unsetenv("MOEJIT_CACHE_MODE");
    scratch_ = test::make_temp_dir("pc-cli");
  }
  void TearDown() override { test::remove_tree(scratch_); }
  test::ToolRun run(const std::string& args) { return run_tool(args, scratch_); }
  std::string scratch_;
};

TEST_F(Cli, HelpDocumentsExitCodesAndManifest) {
  const test::ToolRun r = run("--help");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("Exit codes"), std::string::npos);
  EXPECT_NE(r.out.find("3  the cache directory is unusable"), std::string::npos);
  EXPECT_NE(r.out.find("evicted before the run ended"), std::string::npos);
  // Exit 3 for --readable-by-all covers a mode that could not be changed, not only a file that
  // could not be opened.
  EXPECT_NE(r.out.find("--readable-by-all could not change a part of it"), std::string::npos);
  EXPECT_NE(r.out.find("KernelSpec::describe()"), std::string::npos);
  // A manifest shape line without out_dtype takes --out-dtype first (the test below).
  EXPECT_NE(r.out.find("out_dtype to --out-dtype, else the dtype"), std::string::npos);
}

// What --help says of a manifest shape line: out_dtype defaults to --out-dtype, else its dtype.
TEST_F(Cli, ManifestShapeLineTakesOutDtypeFromTheCommandLine) {
  test::write_file(scratch_ + "/m.txt", "hidden=64 topk=1 dtype=bf16 layout=token_major\n");
  const std::string common = "--manifest '" + scratch_ +
                             "/m.txt' --arch sm_90 --dry-run --cache-dir '" + scratch_ + "/cache'";
  test::ToolRun r = run(common + " --out-dtype fp32");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("in=bf16 out=fp32"), std::string::npos) << r.out;
  r = run(common);
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("in=bf16 out=bf16"), std::string::npos) << r.out;
  // A shape line without a dtype takes the one --dtype.
  test::write_file(scratch_ + "/nodtype.txt", "hidden=64 topk=1 layout=token_major\n");
  r = run("--manifest '" + scratch_ + "/nodtype.txt' --dtype fp16 --arch sm_90 --dry-run " +
          "--cache-dir '" + scratch_ + "/cache'");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("in=fp16 out=fp16"), std::string::npos) << r.out;
  // --out-dtype applies to --hidden/--topk shapes as well.
  r =
      run("--hidden 64 --topk 1 --dtype bf16 --out-dtype fp32 --layout token_major --arch sm_90 "
          "--dry-run --cache-dir '" +
          scratch_ + "/cache'");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("in=bf16 out=fp32"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("out=bf16"), std::string::npos) << r.out;
}

// --verify checks the whole directory: an option that would seem to narrow it is refused, not
// ignored (--topk, --dtype, --layout and --arch once passed silently, with exit 0).
TEST_F(Cli, VerifyRefusesSelectionOptions) {
  const std::string cache = " --cache-dir '" + scratch_ + "/cache'";
  for (const char* extra :
       {"--model-config x.json", "--hidden 7168 --topk 8", "--topk 8", "--dtype bf16",
        "--out-dtype fp32", "--layout gather_map", "--index-type int32", "--epilogue norm",
        "--manifest m.txt", "--arch sm_90", "--dry-run"}) {
    const test::ToolRun r = run(std::string("--verify ") + extra + cache);
    EXPECT_EQ(r.rc, 2) << extra << ": " << r.err;
    EXPECT_NE(r.err.find("--verify checks every entry"), std::string::npos) << extra << r.err;
  }
}

TEST_F(Cli, BadInputsExitTwoWithAClearMessage) {
  const std::string cache = " --cache-dir '" + scratch_ + "/cache' --arch sm_90 ";
  test::write_file(scratch_ + "/broken.json", "{\"hidden_size\": 7168,");
  test::write_file(scratch_ + "/nohidden.json", "{\"num_experts_per_tok\": 8}");
  test::write_file(scratch_ + "/fp8.json",
                   R"({"hidden_size": 7168, "num_experts_per_tok": 8, "torch_dtype": "float8"})");
  test::write_file(scratch_ + "/nodtype.json",
                   R"({"hidden_size": 7168, "num_experts_per_tok": 8})");
  test::write_file(scratch_ + "/dense.json",
                   R"({"hidden_size": 4096, "top_k": 50, "torch_dtype": "bfloat16"})");
  test::write_file(scratch_ + "/shapes.txt", "hidden=64 topk=2\n");
  test::write_file(scratch_ + "/overflow.txt",
                   "kind=gather_map in=bf16 out=bf16 idx=int32 H=64 vec=8 K=2 tpt=65536 "
                   "tpb=65536 upt=1\n");
  struct Case {
    std::string args;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases{
      {"--model-config '" + scratch_ + "/missing.json'", {"missing.json", "cannot be read"}},
      {"--model-config '" + scratch_ + "/broken.json'", {"broken.json", "not valid JSON"}},
      {"--model-config '" + scratch_ + "/nohidden.json'", {"nohidden.json", "hidden_size"}},
      {"--model-config '" + scratch_ + "/fp8.json'",
       {"fp8.json", "torch_dtype", "\"float8\"", "unknown dtype", "pass --dtype"}},
      {"--model-config '" + scratch_ + "/nodtype.json'", {"nodtype.json", "--dtype"}},
      {"--model-config '" + scratch_ + "/dense.json'",
       {"dense.json", "missing the top-k field", "sampling setting"}},
      {"--hidden 4096 --topk 2 --dtype int8", {"--dtype", "int8", "fp32, fp16 or bf16"}},
      {"--hidden 4096 --dtype bf16", {"--hidden needs --topk"}},
      {"--hidden 4096 --topk 99 --dtype bf16", {"top-k 99", "1..64"}},
      {"--hidden 4096 --topk 2 --dtype bf16 --layout diagonal", {"--layout", "diagonal"}},
      {"--manifest '" + scratch_ + "/none.txt'", {"none.txt", "cannot be read"}},
      {"--dry-run --manifest '" + scratch_ + "/overflow.txt'",
       {"overflow.txt:1", "tpt = 65536", "4..1024"}},
      // A manifest's shape lines take one default dtype: refused, not expanded for either.
      {"--dry-run --dtype bf16,fp16 --manifest '" + scratch_ + "/shapes.txt'",
       {"--manifest takes at most one --dtype"}},
      {"", {"nothing to compile"}},
      {"--jobs 0 --hidden 4096 --topk 2 --dtype bf16", {"jobs"}},
      {"--no-such-flag", {"no-such-flag"}},
  };
  for (const Case& c : cases) {
    const test::ToolRun r = run(c.args + cache);
    EXPECT_EQ(r.rc, 2) << c.args << "\n" << r.err;
    for (const std::string& piece : c.message)
      EXPECT_NE(r.err.find(piece), std::string::npos) << c.args << "\nwants: " << piece << "\n"
                                                      << r.err;
  }
  // A malformed setting from the environment is bad input too.
  const test::ToolRun env = test::run_tool("--dry-run --hidden 64 --topk 2 --dtype bf16" + cache,
                                           scratch_, "MOEJIT_CACHE_MAX_BYTES=lots ");
  EXPECT_EQ(env.rc, 2) << env.err;
  EXPECT_NE(env.err.find("MOEJIT_CACHE_MAX_BYTES = \"lots\""), std::string::npos) << env.err;
  const test::ToolRun arch = run("--model-config '" + configs("mixtral-8x7b.json") +
                                 "' --arch sm_42 --cache-dir '" + scratch_ + "/cache'");
  EXPECT_EQ(arch.rc, 2);
  EXPECT_NE(arch.err.find("sm_42"), std::string::npos) << arch.err;
  EXPECT_NE(arch.err.find("supports: sm_"), std::string::npos) << arch.err;
}

// A full config dump: the MoE top-k next to the sampling top_k (50) precompiles K=8, exit 0.
TEST_F(Cli, SamplingTopKNextToMoeTopKIsIgnored) {
  test::write_file(scratch_ + "/full.json", R"({"torch_dtype": "bfloat16", "top_k": 50,
      "text_config": {"hidden_size": 2048, "num_experts_per_tok": 8, "top_k": 50}})");
  const test::ToolRun r = run("--dry-run --json --arch sm_90 --layout gather_map --model-config '" +
                              scratch_ + "/full.json' --cache-dir '" + scratch_ + "/cache'");
  ASSERT_EQ(r.rc, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_FALSE(j["jobs"].empty());
  for (const nlohmann::json& job : j["jobs"]) {
    const std::string spec = job["spec"];
    EXPECT_NE(spec.find(" H=2048 "), std::string::npos) << spec;
    EXPECT_NE(spec.find(" K=8 "), std::string::npos) << spec;
  }
}

// Whether the tool could take its target from a GPU here: the driver loads and reports a device.
bool gpu_present() {
  try {
    int count = 0;
    return driver().cuDeviceGetCount(&count) == CUDA_SUCCESS && count > 0;
  } catch (const Error&) {
    return false;
  }
}

TEST_F(Cli, WithoutGpuAsksForArch) {
  // Decided before the run, not from its exit code: a tool that picked some arch without a GPU
  // exits 0 too, and must fail here rather than skip.
  if (gpu_present()) GTEST_SKIP() << "a GPU is present: the tool takes its arch";
  const test::ToolRun r = run("--dry-run --model-config '" + configs("mixtral-8x7b.json") +
                              "' --cache-dir '" + scratch_ + "/cache'");
  EXPECT_EQ(r.rc, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("--arch"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("supports: sm_"), std::string::npos) << r.err;
}

TEST_F(Cli, UnusableCacheDirExitsThree) {
  test::write_file(scratch_ + "/file", "not a directory");
  for (const std::string& dir : {scratch_ + "/file", scratch_ + "/file/sub"}) {
    const test::ToolRun r = run("--model-config '" + configs("mixtral-8x7b.json") +
                                "' --arch sm_90 --layout gather_map --index-type int32 "
                                "--cache-dir '" +
                                dir + "'");
    EXPECT_EQ(r.rc, 3) << r.err;
    EXPECT_NE(r.err.find(dir), std::string::npos) << r.err;
  }
}

TEST_F(Cli, DryRunListsSpecsTargetsAndKeysAndCreatesNothing) {
  const std::string cache = scratch_ + "/cache";
  const test::ToolRun text =
      run("-n --model-config '" + configs("deepseek-v3.json") +
          "' --arch sm_90,sm_80 --epilogue none --cache-dir '" + cache + "'");
  ASSERT_EQ(text.rc, 0) << text.err;
  const std::regex line(R"((sm_90|sm_80)  kind=\w+ .* key=[0-9a-f]{32}  missing)");
  size_t lines = 0;
  std::istringstream in(text.out);
  for (std::string l; std::getline(in, l);)
    if (std::regex_match(l, line)) ++lines;
  EXPECT_EQ(lines, 40u) << text.out;  // 20 specs x 2 targets

  const test::ToolRun js = run(
      "--dry-run --json --model-config '" + configs("qwen3-30b-a3b.json") +
      "' --arch sm_90 --layout gather_map,token_index --epilogue none --cache-dir '" + cache + "'");
  ASSERT_EQ(js.rc, 0) << js.err;
  const nlohmann::json j = nlohmann::json::parse(js.out);
  // 2 index types x (gather_map x 2 geometries and its one-token module + token_index: two list
  // modules (prefill; mid-size, the one decode calls would share with 8 rows per token) and one
  // single-launch module with its small-call form, the one-token module, the list helpers).
  EXPECT_EQ(j["total"], 18);
  EXPECT_EQ(j["missing"], 18);
  EXPECT_EQ(j["cached"], 0);
  // The keys are the runtime's own: recompute them through KernelStore::request_for.
  Settings settings;
  settings.cache_mode = MOEJIT_CACHE_MODE_DISABLED;
  Stats stats;
  KernelStore store(settings, stats);
  std::vector<KernelSpec> specs;
  Shape s;
  s.hidden = 2048;
  s.top_k = 8;
  s.dtype = s.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  expand_shape(s, {MOEJIT_LAYOUT_GATHER_MAP, MOEJIT_LAYOUT_TOKEN_INDEX}, all_index_types(), &specs);
  ASSERT_EQ(specs.size(), j["jobs"].size());
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(j["jobs"][i]["spec"], specs[i].describe());
    EXPECT_EQ(j["jobs"][i]["target"], "sm_90");
    EXPECT_EQ(j["jobs"][i]["key"], cache_key(store.request_for(specs[i], Target{90, false})));
  }
  struct stat st;
  EXPECT_NE(::stat(cache.c_str(), &st), 0) << "the dry run created the cache directory";
}

// ---- the epilogue ---------------------------------------------------------------------------

// The example configs carry their models' rms_norm_eps, and DeepSeek-V3 its fp8 activations
// (quantization_config.quant_method "fp8"): their calls may fuse the norm, and DeepSeek-V3's the
// fp8 output. A config without rms_norm_eps has the plain combine only.
TEST(ModelConfig, RmsNormAndFp8ActivationsChooseTheEpilogues) {
  const ModelConfig ds = read_model_config(configs("deepseek-v3.json"));
  EXPECT_EQ(ds.rms_norm_field, "rms_norm_eps");
  EXPECT_EQ(ds.fp8_field, "quantization_config.quant_method");
  EXPECT_EQ(config_epilogues(ds),
            (std::vector<Epilogue>{Epilogue::kNone, Epilogue::kNorm, Epilogue::kNormFp8}));
  for (const char* file : {"mixtral-8x7b.json", "qwen3-30b-a3b.json", "gpt-oss-120b.json"}) {
    const ModelConfig c = read_model_config(configs(file));
    EXPECT_EQ(c.rms_norm_field, "rms_norm_eps") << file;
    EXPECT_EQ(c.fp8_field, "") << file;
    EXPECT_EQ(config_epilogues(c), (std::vector<Epilogue>{Epilogue::kNone, Epilogue::kNorm}))
        << file;
  }
  // Nested (the language model's text_config), and fp8 only next to a norm; another quantization
  // method (gpt-oss's mxfp4 weights) serves no fp8 activations.
  ModelConfig c = parse_model_config(
      R"({"text_config": {"hidden_size": 64, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5},
          "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "FP8"}})",
      "nested.json");
  EXPECT_EQ(c.rms_norm_field, "text_config.rms_norm_eps");
  EXPECT_EQ(c.fp8_field, "quantization_config.quant_method");
  c = parse_model_config(
      R"({"hidden_size": 64, "num_experts_per_tok": 2, "quantization_config": {"quant_method":
          "fp8"}})",
      "no-norm.json");
  EXPECT_EQ(config_epilogues(c), (std::vector<Epilogue>{Epilogue::kNone}));
  c = parse_model_config(
      R"({"hidden_size": 64, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
          "quantization_config": {"quant_method": "mxfp4"}})",
      "mxfp4.json");
  EXPECT_EQ(config_epilogues(c), (std::vector<Epilogue>{Epilogue::kNone, Epilogue::kNorm}));
}

// Each epilogue expands a shape to exactly what moe_combine() loads for it (specs_for_shape with
// the residual and weight in the shape's dtype, fp8 out for norm-fp8), beside the plain combine's.
TEST(Expand, EachEpilogueAddsItsModules) {
  Shape s;
  s.hidden = 7168;
  s.top_k = 8;
  s.dtype = s.out_dtype = MOEJIT_DTYPE_BFLOAT16;
  s.origin = "test";
  const int bf16 = MOEJIT_DTYPE_BFLOAT16;
  struct Expect {
    Epilogue e;
    moejit_dtype out;
    int res, weight;
  } cases[] = {{Epilogue::kResidual, MOEJIT_DTYPE_BFLOAT16, bf16, -1},
               {Epilogue::kNorm, MOEJIT_DTYPE_BFLOAT16, bf16, bf16},
               {Epilogue::kNormFp8, MOEJIT_DTYPE_FLOAT8_E4M3, bf16, bf16}};
  for (const Expect& x : cases) {
    s.epilogue = x.e;
    std::vector<KernelSpec> specs;
    expand_shape(s, all_layouts(), {MOEJIT_INDEX_INT32}, &specs);
    std::vector<KernelSpec> want;
    for (moejit_layout layout : all_layouts())
      for (const KernelSpec& k : specs_for_shape(layout, MOEJIT_DTYPE_BFLOAT16, x.out,
                                                 MOEJIT_INDEX_INT32, 7168, 8, 256, x.res, x.weight))
        if (std::find(want.begin(), want.end(), k) == want.end()) want.push_back(k);
    EXPECT_EQ(specs, want) << epilogue_name(x.e);
    size_t epilogue_modules = 0;
    for (const KernelSpec& k : specs) epilogue_modules += is_epilogue(k.kind);
    // Per layout the one-block module and the decode split at T <= 16, 17-32, 33-64; plus the
    // token index's list helpers.
    EXPECT_EQ(epilogue_modules, 12u) << epilogue_name(x.e);
    EXPECT_EQ(specs.size(), 13u) << epilogue_name(x.e);
  }
  EXPECT_EQ(parse_epilogue(" Norm-FP8 ", "x"), Epilogue::kNormFp8);
  EXPECT_NE(error_of([] { parse_epilogue("rope", "--epilogue"); })
                .find("--epilogue = \"rope\": unknown epilogue; expected none, residual, norm or "
                      "norm-fp8"),
            std::string::npos);
}

// Manifest shape lines take epilogue= (a comma list; default --epilogue, else none); the exact
// lines of the epilogue's kinds round-trip through --dry-run's describe() text.
TEST(Manifest, ShapeLinesTakeAnEpilogue) {
  std::vector<KernelSpec> plain, with, exact;
  ManifestDefaults defaults;
  parse_manifest("hidden=2880 topk=4 dtype=bf16 layout=gather_map index_type=int32\n", "m",
                 defaults, &plain);
  parse_manifest(
      "hidden=2880 topk=4 dtype=bf16 layout=gather_map index_type=int32 epilogue=none,norm-fp8\n",
      "m", defaults, &with);
  ASSERT_GT(with.size(), plain.size());
  EXPECT_TRUE(std::equal(plain.begin(), plain.end(), with.begin()));
  std::string lines;
  for (size_t i = plain.size(); i < with.size(); ++i) {
    EXPECT_EQ(with[i].out_dtype, MOEJIT_DTYPE_FLOAT8_E4M3) << with[i].describe();
    lines += with[i].describe() + "\n";
  }
  parse_manifest(lines, "exact", defaults, &exact);
  EXPECT_TRUE(std::equal(exact.begin(), exact.end(), with.begin() + plain.size()));
  defaults.epilogues = {Epilogue::kResidual};
  std::vector<KernelSpec> residual;
  parse_manifest("hidden=2880 topk=4 dtype=bf16 layout=gather_map index_type=int32\n", "m",
                 defaults, &residual);
  for (const KernelSpec& k : residual) EXPECT_EQ(k.res_dtype, MOEJIT_DTYPE_BFLOAT16);
  EXPECT_NE(error_of([&] {
              std::vector<KernelSpec> s;
              parse_manifest("hidden=64 topk=2 dtype=bf16 epilogue=norm,fp4\n", "m", defaults, &s);
            }).find("m:1: epilogue = \"fp4\": unknown epilogue"),
            std::string::npos);
}

// The command line: a config's shapes take its epilogues unless --epilogue says which; a bad
// --epilogue exits 2 naming it.
TEST_F(Cli, EpilogueFromTheConfigOrTheCommandLine) {
  const std::string common =
      "--dry-run --json --arch sm_90 --layout gather_map --index-type int32 "
      "--cache-dir '" +
      scratch_ + "/cache' --model-config '" + configs("deepseek-v3.json") + "'";
  auto jobs = [&](const std::string& extra) {
    const test::ToolRun r = run(common + extra);
    EXPECT_EQ(r.rc, 0) << r.err;
    std::vector<std::string> specs;
    // The parsed document outlives the loop (a range over a temporary's member would not).
    const nlohmann::json parsed = nlohmann::json::parse(r.out);
    for (const auto& job : parsed.at("jobs")) specs.push_back(job.at("spec"));
    return specs;
  };
  const std::vector<std::string> from_config = jobs(""), plain = jobs(" --epilogue none"),
                                 fp8 = jobs(" --epilogue norm-fp8");
  const std::vector<std::string> norm = jobs(" --epilogue norm");
  EXPECT_EQ(from_config.size(), plain.size() + norm.size() + fp8.size());
  for (const auto& list : {plain, norm, fp8})
    for (const std::string& spec : list)
      EXPECT_NE(std::find(from_config.begin(), from_config.end(), spec), from_config.end()) << spec;
  for (const std::string& spec : fp8) {
    EXPECT_NE(spec.find("out=fp8"), std::string::npos) << spec;
    EXPECT_NE(spec.find("res=bf16 weight=bf16"), std::string::npos) << spec;
  }
  const test::ToolRun bad = run(common + " --epilogue norm,rope");
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.err.find("--epilogue = \"rope\""), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace precompile
}  // namespace moejit
