#include "trace.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "npy.h"

namespace spin {
namespace {

namespace fs = std::filesystem;

std::string TestDir() {
  const auto* info = testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir =
      fs::path(testing::TempDir()) / "trace_test" / info->test_suite_name() / info->name();
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << path;
}

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

// Scores whose value encodes its index, so a wrong stride shows up as a wrong value.
std::vector<float> IndexScores(int steps, int layers, int rows, int n) {
  std::vector<float> v(static_cast<size_t>(steps) * layers * rows * n);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.25f;
  return v;
}

TraceMeta SmallMeta(int rows) {
  TraceMeta m;
  m.layers = 2;
  m.block_size = 4;
  m.topk = 8;
  m.steps = 3;
  m.rows = rows;
  m.q_pos = {9, 10, 12};
  m.ctx_len = {10, 11, 13};
  if (rows > 1) m.accepted = {1, 2, 0};
  return m;
}

void ExpectSameMeta(const TraceMeta& a, const TraceMeta& b) {
  EXPECT_EQ(a.version, b.version);
  EXPECT_EQ(a.layers, b.layers);
  EXPECT_EQ(a.block_size, b.block_size);
  EXPECT_EQ(a.topk, b.topk);
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(a.q_pos, b.q_pos);
  EXPECT_EQ(a.ctx_len, b.ctx_len);
  EXPECT_EQ(a.accepted, b.accepted);
}

class TraceRoundTrip : public testing::TestWithParam<int> {};

TEST_P(TraceRoundTrip, WriteThenLoad) {
  const int rows = GetParam();
  const std::string dir = TestDir() + "/t";  // created by the writer
  const TraceMeta meta = SmallMeta(rows);
  const int n = 16;
  const std::vector<float> scores = IndexScores(meta.steps, meta.layers, rows, n);
  ASSERT_TRUE(WriteTrace(dir, meta, n, scores.data()).ok());
  EXPECT_EQ(FilesIn(dir), (std::vector<std::string>{"meta.json", "scores.npy"}));

  absl::StatusOr<Trace> trace = LoadTrace(dir);
  ASSERT_TRUE(trace.ok()) << trace.status();
  ExpectSameMeta(trace->meta(), meta);
  EXPECT_EQ(trace->n_max(), n);
  EXPECT_EQ(trace->dir(), dir);
  for (int t = 0; t < meta.steps; ++t) {
    for (int l = 0; l < meta.layers; ++l) {
      for (int r = 0; r < rows; ++r) {
        const size_t offset = ((static_cast<size_t>(t) * meta.layers + l) * rows + r) * n;
        EXPECT_EQ(trace->scores(t, l, r)[0], scores[offset]);
        EXPECT_EQ(trace->scores(t, l, r)[n - 1], scores[offset + n - 1]);
      }
    }
  }
  Trace moved = *std::move(trace);
  EXPECT_EQ(moved.scores(2, 1, rows - 1)[3], scores[scores.size() - n + 3]);
}

INSTANTIATE_TEST_SUITE_P(Rows, TraceRoundTrip, testing::Values(1, 2));

TEST(TraceMetaJson, KeysInDesignOrderAndAcceptedOnlyWhenPresent) {
  EXPECT_EQ(TraceMetaToJson(SmallMeta(1)),
            "{\"version\":1,\"layers\":2,\"block_size\":4,\"topk\":8,\"steps\":3,\"rows\":1,"
            "\"q_pos\":[9,10,12],\"ctx_len\":[10,11,13]}\n");
  EXPECT_NE(TraceMetaToJson(SmallMeta(2)).find("\"accepted\":[1,2,0]"), std::string::npos);
}

TEST(TraceWriter, StreamsStepsAndPublishesOnlyOnClose) {
  const std::string dir = TestDir();
  const TraceMeta full = SmallMeta(2);
  const TraceMeta geometry = TraceGeometry(full);
  const int n = 16;
  const std::vector<float> scores = IndexScores(3, 2, 2, n);
  absl::StatusOr<TraceWriter> writer = TraceWriter::Open(dir, geometry, n);
  ASSERT_TRUE(writer.ok()) << writer.status();
  for (int t = 0; t < 3; ++t) {
    ASSERT_TRUE(writer
                    ->WriteStep(scores.data() + t * 2 * 2 * n, full.q_pos[t], full.ctx_len[t],
                                full.accepted[t])
                    .ok());
    EXPECT_FALSE(fs::exists(dir + "/meta.json"));
    EXPECT_FALSE(fs::exists(dir + "/scores.npy"));
  }
  EXPECT_EQ(writer->steps_written(), 3);
  EXPECT_EQ(writer->WriteStep(scores.data(), 20, 20).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(writer->Close().ok());
  EXPECT_EQ(FilesIn(dir), (std::vector<std::string>{"meta.json", "scores.npy"}));
  absl::StatusOr<Trace> trace = LoadTrace(dir);
  ASSERT_TRUE(trace.ok()) << trace.status();
  ExpectSameMeta(trace->meta(), full);
  EXPECT_EQ(writer->Close().code(), absl::StatusCode::kFailedPrecondition);
}

// trace-cut: every kept (step, layer, row) row of scores equal to the source's, the per-step
// arrays sliced, the geometry otherwise the same.
TEST(TraceCut, KeepsTheRangeOfStepsAndLayers) {
  const std::string dir = TestDir();
  TraceMeta meta = SmallMeta(2);
  meta.layers = 3;
  meta.steps = 4;
  meta.q_pos = {9, 10, 12, 14};
  meta.ctx_len = {10, 11, 13, 15};
  meta.accepted = {1, 2, 0, 2};
  const int n = 16;
  const std::vector<float> scores = IndexScores(meta.steps, meta.layers, meta.rows, n);
  ASSERT_TRUE(WriteTrace(dir + "/in", meta, n, scores.data()).ok());
  absl::StatusOr<Trace> in = LoadTrace(dir + "/in");
  ASSERT_TRUE(in.ok()) << in.status();

  ASSERT_TRUE(CutTrace(*in, dir + "/cut", TraceCut{1, 2, 1, 0}).ok());
  absl::StatusOr<Trace> cut = LoadTrace(dir + "/cut");
  ASSERT_TRUE(cut.ok()) << cut.status();
  const TraceMeta& c = cut->meta();
  EXPECT_EQ(c.steps, 2);
  EXPECT_EQ(c.layers, 2);  // 0: to the end, layers 1-2
  EXPECT_EQ(c.rows, 2);
  EXPECT_EQ(c.block_size, meta.block_size);
  EXPECT_EQ(c.topk, meta.topk);
  EXPECT_EQ(c.q_pos, (std::vector<int32_t>{10, 12}));
  EXPECT_EQ(c.ctx_len, (std::vector<int32_t>{11, 13}));
  EXPECT_EQ(c.accepted, (std::vector<int32_t>{2, 0}));
  ASSERT_EQ(cut->n_max(), n);
  for (int t = 0; t < 2; ++t) {
    for (int l = 0; l < 2; ++l) {
      for (int r = 0; r < 2; ++r) {
        EXPECT_TRUE(
            std::equal(cut->scores(t, l, r), cut->scores(t, l, r) + n, in->scores(t + 1, l + 1, r)))
            << "step " << t << " layer " << l << " row " << r;
      }
    }
  }
  // The whole trace by default, without accepted when the source has none.
  meta.rows = 1;
  meta.accepted.clear();
  const std::vector<float> one = IndexScores(meta.steps, meta.layers, 1, n);
  ASSERT_TRUE(WriteTrace(dir + "/in1", meta, n, one.data()).ok());
  absl::StatusOr<Trace> in1 = LoadTrace(dir + "/in1");
  ASSERT_TRUE(in1.ok()) << in1.status();
  ASSERT_TRUE(CutTrace(*in1, dir + "/all", TraceCut{}).ok());
  absl::StatusOr<Trace> all = LoadTrace(dir + "/all");
  ASSERT_TRUE(all.ok()) << all.status();
  ExpectSameMeta(all->meta(), meta);
  EXPECT_TRUE(std::equal(all->scores(0, 0, 0), all->scores(0, 0, 0) + one.size(), one.data()));
}

TEST(TraceCut, RefusesRangesOutsideTheTraceAndItsOwnDirectory) {
  const std::string dir = TestDir();
  const TraceMeta meta = SmallMeta(1);  // 3 steps, 2 layers
  const std::vector<float> scores = IndexScores(meta.steps, meta.layers, 1, 16);
  ASSERT_TRUE(WriteTrace(dir + "/in", meta, 16, scores.data()).ok());
  absl::StatusOr<Trace> in = LoadTrace(dir + "/in");
  ASSERT_TRUE(in.ok()) << in.status();
  const std::vector<std::pair<TraceCut, std::string>> bad = {
      {{3, 0, 0, 0}, "first step 3 is outside the trace's steps 0-2"},
      {{-1, 0, 0, 0}, "first step -1 is outside"},
      {{1, 3, 0, 0}, "steps 1-3 run past the trace's last step, 2 (at most 2 from 1)"},
      {{0, -1, 0, 0}, "a negative step count (-1)"},
      {{0, 0, 2, 0}, "first layer 2 is outside the trace's layers 0-1"},
      {{0, 0, 1, 2}, "layers 1-2 run past the trace's last layer, 1"},
  };
  for (const auto& [cut, text] : bad) {
    const absl::Status s = CutTrace(*in, dir + "/out", cut);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(s.message().find(text), std::string::npos) << s.message();
  }
  EXPECT_FALSE(fs::exists(dir + "/out"));  // nothing written for a refused cut
  const absl::Status self = CutTrace(*in, dir + "/in", TraceCut{0, 1, 0, 0});
  EXPECT_NE(self.message().find("would replace the trace it reads"), std::string::npos) << self;
  absl::StatusOr<Trace> still = LoadTrace(dir + "/in");
  ASSERT_TRUE(still.ok()) << still.status();
  ExpectSameMeta(still->meta(), meta);
}

TEST(TraceWriter, FailedCloseKeepsTheOldTrace) {
  const std::string dir = TestDir();
  const int n = 16;
  const std::vector<float> scores = IndexScores(3, 2, 1, n);
  ASSERT_TRUE(WriteTrace(dir, SmallMeta(1), n, scores.data()).ok());

  const TraceMeta geometry = TraceGeometry(SmallMeta(1));
  absl::StatusOr<TraceWriter> writer = TraceWriter::Open(dir, geometry, n);
  ASSERT_TRUE(writer.ok());
  for (int t = 0; t < 3; ++t) {
    // q_pos stays at 5: not strictly increasing, so Close must refuse.
    ASSERT_TRUE(writer->WriteStep(scores.data(), 5, 6).ok());
  }
  absl::Status status = writer->Close();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("q_pos must be strictly increasing: q_pos[1]=5 after q_pos[0]=5"),
            std::string::npos)
      << status;
  EXPECT_EQ(FilesIn(dir), (std::vector<std::string>{"meta.json", "scores.npy"}));
  absl::StatusOr<Trace> trace = LoadTrace(dir);
  ASSERT_TRUE(trace.ok()) << trace.status();
  EXPECT_EQ(trace->meta().q_pos, SmallMeta(1).q_pos);
}

TEST(TraceWriter, IncompleteTraceLeavesNothingLoadable) {
  const std::string dir = TestDir();
  const TraceMeta geometry = TraceGeometry(SmallMeta(1));
  const std::vector<float> scores = IndexScores(1, 2, 1, 16);
  {
    absl::StatusOr<TraceWriter> writer = TraceWriter::Open(dir, geometry, 16);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE(writer->WriteStep(scores.data(), 9, 10).ok());
    absl::Status status = writer->Close();
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(status.message().find("closed after 1 of 3 steps"), std::string::npos) << status;
  }
  {
    absl::StatusOr<TraceWriter> writer = TraceWriter::Open(dir, geometry, 16);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE(writer->WriteStep(scores.data(), 9, 10).ok());
  }  // abandoned without Close
  EXPECT_TRUE(FilesIn(dir).empty());
  EXPECT_EQ(LoadTrace(dir).status().code(), absl::StatusCode::kNotFound);
}

TEST(TraceWriter, RejectsBadGeometryAndMixedAccepted) {
  const std::string dir = TestDir();
  TraceMeta geometry = SmallMeta(2);
  absl::StatusOr<TraceWriter> with_arrays = TraceWriter::Open(dir, geometry, 16);
  EXPECT_EQ(with_arrays.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(with_arrays.status().message().find("geometry only"), std::string::npos);

  geometry = TraceGeometry(geometry);
  TraceMeta zero_layers = geometry;
  zero_layers.layers = 0;
  EXPECT_NE(TraceWriter::Open(dir, zero_layers, 16).status().message().find("'layers' is 0"),
            std::string::npos);
  EXPECT_NE(TraceWriter::Open(dir, geometry, 0).status().message().find("n_max is 0"),
            std::string::npos);

  absl::StatusOr<TraceWriter> writer = TraceWriter::Open(dir, geometry, 16);
  ASSERT_TRUE(writer.ok());
  const std::vector<float> scores = IndexScores(1, 2, 2, 16);
  ASSERT_TRUE(writer->WriteStep(scores.data(), 9, 10, 1).ok());
  absl::Status mixed = writer->WriteStep(scores.data(), 10, 11);
  EXPECT_EQ(mixed.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mixed.message().find("give it on every step or none"), std::string::npos) << mixed;
}

TEST(TraceWriter, WriteTraceChecksArrayLengths) {
  TraceMeta meta = SmallMeta(1);
  meta.ctx_len.pop_back();
  const std::vector<float> scores = IndexScores(3, 2, 1, 16);
  absl::Status status = WriteTrace(TestDir(), meta, 16, scores.data());
  EXPECT_NE(status.message().find("'ctx_len' has 2 entries but steps is 3"), std::string::npos)
      << status;
}

// Writes a valid scores.npy and lets each test hand-write meta.json.
class TraceLoadErrors : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = TestDir();
    WriteScores({3, 2, 2, 16});
  }
  void WriteScores(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> scores(static_cast<size_t>(n), 1.0f);
    ASSERT_TRUE(WriteNpyF32(dir_ + "/scores.npy", shape, scores.data()).ok());
  }
  // The JSON of the fields, with `replace` applied: key -> raw JSON text, or "" to drop it.
  static std::string Meta(const std::vector<std::pair<std::string, std::string>>& replace) {
    std::vector<std::pair<std::string, std::string>> fields = {
        {"version", "1"},
        {"layers", "2"},
        {"block_size", "4"},
        {"topk", "8"},
        {"steps", "3"},
        {"rows", "2"},
        {"q_pos", "[9, 10, 12]"},
        {"ctx_len", "[10, 11, 13]"},
        {"accepted", "[1, 2, 0]"},
    };
    for (const auto& [key, value] : replace) {
      auto it = std::find_if(fields.begin(), fields.end(),
                             [&key = key](const auto& f) { return f.first == key; });
      if (it == fields.end()) {
        fields.emplace_back(key, value);
      } else {
        it->second = value;
      }
    }
    std::string out = "{";
    for (const auto& [key, value] : fields) {
      if (value.empty()) continue;
      if (out.size() > 1) out += ", ";
      out += "\"" + key + "\": " + value;
    }
    return out + "}";
  }
  // Loads with `meta_json` and returns the error message (empty if it loaded).
  std::string LoadError(const std::string& meta_json,
                        absl::StatusCode expected_code = absl::StatusCode::kInvalidArgument) {
    WriteText(dir_ + "/meta.json", meta_json);
    absl::StatusOr<Trace> trace = LoadTrace(dir_);
    if (trace.ok()) return "";
    EXPECT_EQ(trace.status().code(), expected_code) << trace.status();
    const std::string message(trace.status().message());
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    return message;
  }

  std::string dir_;
};

#define EXPECT_LOAD_ERROR(json, phrase)                                                         \
  do {                                                                                          \
    const std::string message = LoadError(json);                                                \
    EXPECT_NE(message.find(phrase), std::string::npos)                                          \
        << "meta.json " << (json) << "\n  error: \"" << message << "\"\n  lacks \"" << (phrase) \
        << "\"";                                                                                \
  } while (0)

TEST_F(TraceLoadErrors, TheBaseMetaLoads) { EXPECT_EQ(LoadError(Meta({})), ""); }

TEST_F(TraceLoadErrors, MissingDirectoryAndFiles) {
  absl::StatusOr<Trace> missing = LoadTrace(dir_ + "/nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("trace directory " + dir_ + "/nope does not exist"),
            std::string::npos)
      << missing.status();

  absl::StatusOr<Trace> file = LoadTrace(dir_ + "/scores.npy");
  EXPECT_NE(file.status().message().find("is not a directory"), std::string::npos);

  absl::StatusOr<Trace> no_meta = LoadTrace(dir_);
  EXPECT_EQ(no_meta.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(no_meta.status().message().find("meta.json does not exist"), std::string::npos)
      << no_meta.status();

  fs::create_directory(dir_ + "/meta.json");
  absl::StatusOr<Trace> meta_dir = LoadTrace(dir_);
  EXPECT_NE(meta_dir.status().message().find("meta.json is not a regular file"), std::string::npos)
      << meta_dir.status();
  fs::remove(dir_ + "/meta.json");

  WriteText(dir_ + "/meta.json", Meta({}));
  fs::remove(dir_ + "/scores.npy");
  absl::StatusOr<Trace> no_scores = LoadTrace(dir_);
  EXPECT_EQ(no_scores.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(no_scores.status().message().find("scores.npy does not exist"), std::string::npos)
      << no_scores.status();
}

TEST_F(TraceLoadErrors, MalformedJsonGivesTheBytePosition) {
  EXPECT_LOAD_ERROR("{\"version\": 1,, }", "malformed JSON at byte 15");
  EXPECT_LOAD_ERROR("", "malformed JSON at byte");
  EXPECT_LOAD_ERROR("{\"version\": 1", "malformed JSON at byte");
  EXPECT_LOAD_ERROR("[1, 2]", "the top level must be an object, found an array");
}

TEST_F(TraceLoadErrors, MissingKeys) {
  for (const char* key : {"version", "layers", "block_size", "topk", "steps", "q_pos", "ctx_len"}) {
    EXPECT_LOAD_ERROR(Meta({{key, ""}}), std::string("missing required key '") + key + "'");
  }
}

TEST_F(TraceLoadErrors, OptionalKeysAndUnknownKeys) {
  WriteScores({3, 2, 1, 16});
  EXPECT_EQ(LoadError(Meta({{"rows", ""}, {"accepted", ""}, {"model", "\"dsv32\""}})), "");
  absl::StatusOr<Trace> trace = LoadTrace(dir_);
  ASSERT_TRUE(trace.ok());
  EXPECT_EQ(trace->meta().rows, 1);
  EXPECT_TRUE(trace->meta().accepted.empty());
}

TEST_F(TraceLoadErrors, WronglyTypedKeys) {
  EXPECT_LOAD_ERROR(Meta({{"topk", "\"2048\""}}), "'topk' must be an integer, found a string");
  EXPECT_LOAD_ERROR(Meta({{"layers", "2.0"}}), "'layers' must be an integer, found a float");
  EXPECT_LOAD_ERROR(Meta({{"rows", "true"}}), "'rows' must be an integer, found a boolean");
  EXPECT_LOAD_ERROR(Meta({{"steps", "null"}}), "'steps' must be an integer, found null");
  EXPECT_LOAD_ERROR(Meta({{"block_size", "4294967360"}}),
                    "'block_size'=4294967360 is out of the 32-bit integer range");
  EXPECT_LOAD_ERROR(Meta({{"q_pos", "5"}}),
                    "'q_pos' must be an array of integers, found an integer");
  EXPECT_LOAD_ERROR(Meta({{"ctx_len", "{}"}}),
                    "'ctx_len' must be an array of integers, found an object");
  EXPECT_LOAD_ERROR(Meta({{"q_pos", "[9, \"10\", 12]"}}),
                    "q_pos[1] must be an integer, found a string");
  EXPECT_LOAD_ERROR(Meta({{"accepted", "[1, 2, 0.5]"}}),
                    "accepted[2] must be an integer, found a float");
}

TEST_F(TraceLoadErrors, VersionAndNonPositiveGeometry) {
  EXPECT_LOAD_ERROR(Meta({{"version", "2"}}), "unsupported version 2; this build reads version 1");
  // The version is checked before anything else a future version might redefine.
  EXPECT_LOAD_ERROR(Meta({{"version", "2"}, {"layers", "\"x\""}}), "unsupported version 2");
  for (const char* key : {"layers", "block_size", "topk", "steps", "rows"}) {
    EXPECT_LOAD_ERROR(Meta({{key, "0"}}), std::string("'") + key + "' is 0; it must be > 0");
    EXPECT_LOAD_ERROR(Meta({{key, "-3"}}), std::string("'") + key + "' is -3; it must be > 0");
  }
}

TEST_F(TraceLoadErrors, ArrayLengthsMustMatchSteps) {
  EXPECT_LOAD_ERROR(Meta({{"q_pos", "[9, 10]"}}), "'q_pos' has 2 entries but steps is 3");
  EXPECT_LOAD_ERROR(Meta({{"ctx_len", "[10, 11, 13, 14]"}}),
                    "'ctx_len' has 4 entries but steps is 3");
  EXPECT_LOAD_ERROR(Meta({{"accepted", "[]"}}), "'accepted' has 0 entries but steps is 3");
}

TEST_F(TraceLoadErrors, ScoresShapeMustMatch) {
  EXPECT_LOAD_ERROR(Meta({{"layers", "3"}}),
                    "scores.npy has shape [3, 2, 2, 16]; meta.json expects [3, 3, 2, N_max]");
  EXPECT_LOAD_ERROR(Meta({{"rows", "1"}, {"accepted", ""}}),
                    "has shape [3, 2, 2, 16]; meta.json expects [3, 2, 1, N_max]");
  WriteScores({3, 2, 32});
  EXPECT_LOAD_ERROR(Meta({}), "has shape [3, 2, 32]; meta.json expects [3, 2, 2, N_max]");
  WriteScores({3, 2, 2, 0});
  EXPECT_LOAD_ERROR(Meta({}), "the scores' last axis is 0");
}

TEST_F(TraceLoadErrors, PerStepChecks) {
  EXPECT_LOAD_ERROR(Meta({{"ctx_len", "[10, 0, 13]"}}), "ctx_len[1]=0 must be at least 1");
  // Row 1 of step 2 would need slot 16 of a 16-slot axis.
  EXPECT_LOAD_ERROR(Meta({{"ctx_len", "[10, 11, 16]"}}),
                    "ctx_len[2]=16 with rows=2 exceeds the scores' last axis 16");
  EXPECT_LOAD_ERROR(Meta({{"q_pos", "[-1, 10, 12]"}}), "q_pos[0]=-1 is negative");
  EXPECT_LOAD_ERROR(Meta({{"q_pos", "[9, 10, 15]"}}),
                    "q_pos[2]=15 with rows=2 is at or beyond the scores' last axis 16");
  EXPECT_LOAD_ERROR(Meta({{"q_pos", "[9, 9, 12]"}}),
                    "q_pos must be strictly increasing: q_pos[1]=9 after q_pos[0]=9");
  EXPECT_LOAD_ERROR(Meta({{"q_pos", "[9, 8, 12]"}}),
                    "q_pos must be strictly increasing: q_pos[1]=8 after q_pos[0]=9");
  EXPECT_LOAD_ERROR(Meta({{"accepted", "[1, 3, 0]"}}), "accepted[1]=3 is outside [0, rows=2]");
  EXPECT_LOAD_ERROR(Meta({{"accepted", "[1, -1, 0]"}}), "accepted[1]=-1 is outside [0, rows=2]");
}

TEST_F(TraceLoadErrors, SingleRowMessagesDoNotMentionRows) {
  WriteScores({3, 2, 1, 16});
  EXPECT_LOAD_ERROR(Meta({{"rows", "1"}, {"accepted", ""}, {"ctx_len", "[10, 17, 13]"}}),
                    "ctx_len[1]=17 exceeds the scores' last axis 16");
}

TEST_F(TraceLoadErrors, AcceptableEdgeCases) {
  // topk beyond N_max, ctx_len filling the axis, accepted with one row: all fine.
  WriteScores({3, 2, 1, 16});
  EXPECT_EQ(LoadError(Meta({{"rows", "1"},
                            {"topk", "2048"},
                            {"accepted", "[0, 1, 1]"},
                            {"ctx_len", "[10, 11, 16]"},
                            {"q_pos", "[0, 10, 15]"}})),
            "");
}

TEST_F(TraceLoadErrors, NonFiniteScoresAreNotAnError) {
  std::vector<float> scores(3 * 2 * 2 * 16, 0.5f);
  scores[3] = std::numeric_limits<float>::quiet_NaN();
  scores[40] = std::numeric_limits<float>::infinity();
  scores[41] = -std::numeric_limits<float>::infinity();
  ASSERT_TRUE(WriteNpyF32(dir_ + "/scores.npy", {3, 2, 2, 16}, scores.data()).ok());
  EXPECT_EQ(LoadError(Meta({})), "");
  absl::StatusOr<Trace> trace = LoadTrace(dir_);
  ASSERT_TRUE(trace.ok());
  EXPECT_TRUE(std::isnan(trace->scores(0, 0, 0)[3]));
}

TEST_F(TraceLoadErrors, BrokenScoresFileIsReported) {
  WriteText(dir_ + "/meta.json", Meta({}));
  WriteText(dir_ + "/scores.npy", "not numpy");
  absl::StatusOr<Trace> trace = LoadTrace(dir_);
  EXPECT_NE(trace.status().message().find("scores.npy is not a .npy file"), std::string::npos)
      << trace.status();
}

}  // namespace
}  // namespace spin
