// spinctl: the command-line tool. Trace tools offline (gen-trace, trace-stats, trace-cut,
// replay, eval) and control of a running spind (status, health, sessions, policy, budgets,
// stats; replay through a session in it). Each command registers its subcommand, its flags and
// a callback; main() parses the command line and runs the one command given.
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "control.h"
#include "daemon_replay.h"
#include "eval.h"
#include "gen_trace.h"
#include "replay.h"
#include "spin/status_macros.h"
#include "trace.h"

namespace spin {
namespace {

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "spinctl: error: %s\n", std::string(s.message()).c_str());
  return 1;
}

// A value refused before anything is sent: one line naming the flag, the value and the valid
// range; exit status 2, as for CLI11's own usage errors.
int BadValue(const std::string& message) {
  std::fprintf(stderr, "spinctl: error: %s\n", message.c_str());
  return 2;
}

// A given policy value in range (finite; in [lo, hi), or (lo, hi) when open_low), else the
// message for BadValue (policy set, replay --miss-target). Checked before sending: spind checks
// too, but a NaN or a negative value must not be read as "not given".
std::string CheckPolicyValue(const char* flag, double v, double lo, double hi, bool open_low) {
  const bool ok = std::isfinite(v) && (open_low ? v > lo : v >= lo) && v < hi;
  if (ok) return "";
  return absl::StrCat(flag, " ", absl::StrFormat("%g", v), " is out of range ",
                      open_low ? "(" : "[", absl::StrFormat("%g", lo), ", ",
                      absl::StrFormat("%g", hi), ")");
}

// The admin token file's first line, without the trailing whitespace (a newline, \r or a tab
// from an editor or a Kubernetes Secret), as spind reads its own; an unreadable or empty file
// is an error.
absl::StatusOr<std::string> ReadAdminToken(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("--admin-token-file ", path, ": cannot read it"));
  std::string token;
  std::getline(f, token);
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.front()))) {
    token.erase(token.begin());
  }
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--admin-token-file ", path, " is empty"));
  }
  for (unsigned char ch : token) {
    if (ch < 0x20 || ch == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("--admin-token-file ", path,
                       ": the token holds a control character (a gRPC metadata value cannot)"));
    }
  }
  return token;
}

// LoadTrace's limits are the data plane's: a trace that loads is one replay can run.
static_assert(kTraceMaxLayers == kMaxLayers && kTraceMaxRows == kMaxRows &&
                  kTraceMaxSlots == kMaxSlots,
              "trace.h's limits must equal spin/arena.h's (ValidateGeometry)");

// Every command that reads a trace (gen-trace's report, trace-stats, replay local or through
// spind) reads it here and nowhere else: LoadTrace validates meta.json and scores.npy (regular
// files only, so a FIFO fails at once; geometry within the data plane's limits), then the data
// plane's own geometry check runs on the result whatever the command, so trace-stats can never
// accept a trace that replay would reject.
absl::StatusOr<Trace> OpenTrace(const std::string& dir) {
  absl::StatusOr<Trace> t = LoadTrace(dir);
  SPIN_RETURN_IF_ERROR(t.status());
  if (absl::Status s = ValidateGeometry(TraceGeometry(t->meta(), t->n_max(), StateDtype::kFp32));
      !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("trace ", dir, " does not fit the data plane: ", s.message(),
                     "; fix meta.json or regenerate the trace (spinctl gen-trace)"));
  }
  return t;
}

// Rate-limited progress on stderr: rewritten in place on a terminal, a line every few seconds
// otherwise (logs), nothing for runs that finish quickly.
class Progress {
 public:
  explicit Progress(std::string what, bool quiet)
      : what_(std::move(what)),
        quiet_(quiet),
        tty_(isatty(STDERR_FILENO) != 0),
        start_(Clock::now()),
        last_(start_) {}

  void Update(int done, int total) {
    if (quiet_) return;
    const auto now = Clock::now();
    const double since = Seconds(last_, now);
    if (done < total && since < (tty_ ? 0.5 : 5.0)) return;
    if (done == total && !printed_) return;  // finished before the first report
    last_ = now;
    printed_ = true;
    const double elapsed = Seconds(start_, now);
    const double left = done > 0 ? elapsed * (total - done) / done : 0.0;
    std::fprintf(stderr, "%s%s: step %d/%d (%.0f%%), %.1f s elapsed, ~%.1f s left%s",
                 tty_ ? "\r" : "", what_.c_str(), done, total, 100.0 * done / total, elapsed, left,
                 tty_ && done < total ? "" : "\n");
    std::fflush(stderr);
  }

 private:
  using Clock = std::chrono::steady_clock;
  static double Seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }
  std::string what_;
  bool quiet_, tty_, printed_ = false;
  Clock::time_point start_, last_;
};

int CmdEval(EvalOptions eo, const std::string& out, bool quiet) {
  if (eo.trace_dirs.empty()) {
    if (absl::Status s = ValidateGenTraceOptions(eo.gen); !s.ok()) return Fail(s);
  }
  if (!(eo.budget_exploration >= 0 && eo.budget_exploration < 1)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--exploration ", eo.budget_exploration, " is out of range [0, 1)")));
  }
  for (double m : eo.miss_targets) {
    if (!(m > 0 && m < 1)) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--miss-targets: ", m, " is out of range (0, 1)")));
    }
  }
  // Generated traces go under OUT/traces; given ones are only read.
  const std::string dir = eo.trace_dirs.empty() ? out + "/traces" : out;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return Fail(
        absl::InvalidArgumentError(absl::StrCat("cannot create ", dir, ": ", ec.message())));
  }
  eo.work_dir = out + "/traces";
  if (!quiet) eo.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  absl::StatusOr<EvalResult> r = RunEval(eo);
  if (!r.ok()) return Fail(r.status());
  const std::string md = EvalMarkdown(eo, *r);
  for (const auto& [name, text] :
       {std::pair{"results.json", EvalJson(eo, *r) + "\n"}, std::pair{"results.md", md}}) {
    std::ofstream f(out + "/" + name, std::ios::trunc);
    f << text;
    f.flush();
    if (!f) return Fail(absl::InvalidArgumentError(absl::StrCat("cannot write ", out, "/", name)));
  }
  if (absl::Status s = WriteEvalData(*r, out); !s.ok()) return Fail(s);
  std::printf("%s", md.c_str());
  return 0;
}

// What every command gets once the command line is parsed: the global flags.
struct Globals {
  std::string target;       ///< --target; empty: offline (replay then runs in process)
  std::string admin_token;  ///< read from --admin-token-file
};

// The body of a command, run by main() after parsing.
using Run = std::function<int(const Globals&)>;

// Makes `body` what main() runs when `cmd` is the command given: CLI11 calls a subcommand's
// callback once parsing is done, and only the one given is parsed.
void OnParsed(CLI::App* cmd, Run* run, Run body) {
  cmd->callback([run, body = std::move(body)] { *run = body; });
}

void AddGenTrace(CLI::App& app, Run* run) {
  struct Args {
    GenTraceOptions gen;
    std::string out;
    bool json = false;
  };
  auto a = std::make_shared<Args>();
  GenTraceOptions& gen = a->gen;
  CLI::App* g = app.add_subcommand("gen-trace", "Write a synthetic trace (meta.json + scores.npy)");
  g->add_option("OUT", a->out, "Output directory (created if missing)")->required();
  g->add_option("--layers", gen.layers, "Indexer layers")->capture_default_str();
  g->add_option("--slots", gen.slots, "Slots per sequence (the scores' last axis)")
      ->capture_default_str();
  g->add_option("--steps", gen.steps, "Decode steps")->capture_default_str();
  g->add_option("--rows", gen.rows, "Query rows per step (1 + MTP drafts)")->capture_default_str();
  g->add_option("--seed", gen.seed, "Random seed")->capture_default_str();
  g->add_option("--block-size", gen.block_size, "KV block size in slots")->capture_default_str();
  g->add_option("--topk", gen.topk, "The indexer's top-K")->capture_default_str();
  g->add_option("--prompt-len", gen.prompt_len,
                "Context of the first step (-1: slots - steps*rows - block size)")
      ->capture_default_str();
  g->add_option("--accept-rate", gen.accept_rate, "MTP: chance each draft row is accepted")
      ->capture_default_str();
  g->add_option("--shifts", gen.shifts, "Sudden shifts (needles appearing mid-decode)")
      ->capture_default_str();
  g->add_option("--needles", gen.shift_needles, "Needle runs per shift")->capture_default_str();
  g->add_option("--noise", gen.noise_scale, "Scale of the per-step noise")->capture_default_str();
  g->add_option("--drift", gen.drift_scale, "Scale of the slow drift")->capture_default_str();
  g->add_flag("--shuffle-rejected", gen.shuffle_rejected,
              "MTP: shuffle each rejected draft row's scores over its slots (rejected drafts "
              "then carry no information about where later queries look)");
  g->add_option("--nonfinite-rate", gen.nonfinite_rate,
                "Fraction of scores replaced by NaN/inf (to exercise bad-score handling)")
      ->capture_default_str();
  g->add_flag("--json", a->json, "Print the trace statistics as JSON");
  OnParsed(g, run, [a](const Globals&) {
    if (absl::Status s = GenerateTrace(a->out, a->gen); !s.ok()) return Fail(s);
    absl::StatusOr<Trace> t = OpenTrace(a->out);
    if (!t.ok()) return Fail(t.status());
    absl::StatusOr<TraceStats> st = ComputeTraceStats(*t);
    if (!st.ok()) return Fail(st.status());
    if (a->json) {
      std::printf("{\"trace\":\"%s\",\"prev_iter_pearson\":%.6f,\"prev_iter_recall\":%.6f}\n",
                  a->out.c_str(), st->prev_iter_pearson, st->prev_iter_recall);
    } else {
      std::printf("wrote %s: %d steps x %d layers x %d rows x %d slots\n%s", a->out.c_str(),
                  t->meta().steps, t->meta().layers, t->meta().rows, static_cast<int>(t->n_max()),
                  FormatTraceStats(*st).c_str());
    }
    return 0;
  });
}

void AddTraceCut(CLI::App& app, Run* run) {
  struct Args {
    std::string in, out;
    TraceCut cut;
  };
  auto a = std::make_shared<Args>();
  CLI::App* c = app.add_subcommand(
      "trace-cut", "Write a part of a trace (a range of steps, of layers) as a new trace");
  c->add_option("TRACE", a->in, "Trace directory to read")->required();
  c->add_option("OUT", a->out, "Output directory (created if missing; a trace there is replaced)")
      ->required();
  c->add_option("--first-step", a->cut.first_step, "First step kept")->capture_default_str();
  c->add_option("--steps", a->cut.steps, "Steps kept (0: to the end)")->capture_default_str();
  c->add_option("--first-layer", a->cut.first_layer, "First layer kept")->capture_default_str();
  c->add_option("--layers", a->cut.layers, "Layers kept (0: to the end)")->capture_default_str();
  OnParsed(c, run, [a](const Globals&) {
    absl::StatusOr<Trace> t = OpenTrace(a->in);
    if (!t.ok()) return Fail(t.status());
    if (absl::Status s = CutTrace(*t, a->out, a->cut); !s.ok()) return Fail(s);
    absl::StatusOr<Trace> out = OpenTrace(a->out);
    if (!out.ok()) return Fail(out.status());
    const TraceMeta& m = out->meta();
    std::printf(
        "wrote %s: steps %d-%d and layers %d-%d of %s (%d steps x %d layers x %d rows x "
        "%d slots)\n",
        a->out.c_str(), a->cut.first_step, a->cut.first_step + m.steps - 1, a->cut.first_layer,
        a->cut.first_layer + m.layers - 1, a->in.c_str(), m.steps, m.layers, m.rows,
        static_cast<int>(out->n_max()));
    return 0;
  });
}

void AddTraceStats(CLI::App& app, Run* run) {
  auto dir = std::make_shared<std::string>();
  CLI::App* ts = app.add_subcommand("trace-stats", "Print prev-iter Pearson and top-K recall");
  ts->add_option("TRACE", *dir, "Trace directory")->required();
  OnParsed(ts, run, [dir](const Globals&) {
    absl::StatusOr<Trace> t = OpenTrace(*dir);
    if (!t.ok()) return Fail(t.status());
    absl::StatusOr<TraceStats> st = ComputeTraceStats(*t);
    if (!st.ok()) return Fail(st.status());
    std::printf("%s", FormatTraceStats(*st).c_str());
    return 0;
  });
}

struct ReplayArgs {
  ReplayOptions ro;
  std::string trace_dir, budget = "uniform", state = "fp32", backend = "cpu";
  std::string mtp_observe = "same-step", miss_measure = "estimate";
  std::optional<double> miss_target;  // given: must be in (0, 1)
  bool json = false, quiet = false, remote = false;
  int pace_ms = 0;
};

// In process, or through a session in spind with --target (--remote: spind runs the data plane).
int RunReplay(const Globals& g, const ReplayArgs& a) {
  ReplayOptions ro = a.ro;
  ro.dtype = a.state == "bf16" ? StateDtype::kBf16 : StateDtype::kFp32;
  ro.backend = a.backend == "cuda" ? ReplayBackend::kCuda : ReplayBackend::kCpu;
  ro.policy.budget_mode = ParseBudgetMode(a.budget).value_or(BudgetMode::kUniform);  // checked
  if (a.miss_target) {
    const std::string bad = CheckPolicyValue("--miss-target", *a.miss_target, 0, 1, true);
    if (!bad.empty()) return BadValue(absl::StrCat("replay: ", bad));
    ro.policy.miss_target = *a.miss_target;
    if (a.budget == "per-layer") {
      return Fail(absl::InvalidArgumentError(
          "--miss-target and --budget per-layer are two budget modes: give one"));
    }
    ro.policy.budget_mode = BudgetMode::kMissTarget;
  }
  if (absl::StatusOr<MtpObserve> m = ParseMtpObserve(a.mtp_observe); m.ok()) {
    ro.mtp_observe = *m;
  } else {
    return Fail(m.status());
  }
  if (absl::Status s = ValidatePolicy(ro.policy); !s.ok()) return Fail(s);
  if (TableFromProbes(ro.policy.budget_mode)) {
    if (ro.policy.probe_period == 0) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          ro.policy.budget_mode == BudgetMode::kPerLayer ? "--budget per-layer" : "--miss-target",
          " needs --probe-period > 0 (probe steps measure the miss curves)")));
    }
    if (absl::Status s = ValidateBudgetTuning(ro.budget_tuning); !s.ok()) return Fail(s);
  }
  if (a.miss_measure == "exact") {
    if (ro.policy.budget_mode != BudgetMode::kMissTarget) {
      return Fail(absl::InvalidArgumentError(
          "--miss-measure exact changes what the miss-target controller measures: it needs "
          "--miss-target"));
    }
    if (!g.target.empty()) {
      return Fail(absl::InvalidArgumentError(
          "--miss-measure exact is an offline diagnostic of the in-process controller: drop "
          "--target (spind's controller measures the exploration estimate)"));
    }
    ro.exact_miss_measure = true;
  }
  // Through spind the daemon's probe thread owns the table.
  ro.local_budgets = g.target.empty();
  absl::StatusOr<Trace> t = OpenTrace(a.trace_dir);
  if (!t.ok()) return Fail(t.status());
  Progress progress("replay", a.quiet);
  ro.progress = [&progress, pace_ms = a.pace_ms](int done, int total) {
    progress.Update(done, total);
    if (pace_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(pace_ms));
  };
  absl::StatusOr<ReplaySummary> sum;
  std::string where;
  if (g.target.empty()) {
    if (a.remote) return Fail(absl::InvalidArgumentError("--remote needs --target"));
    sum = Replay(*t, ro);
  } else {
    sum = ReplayThroughDaemon(g.target, *t, ro, a.remote, g.admin_token, &where);
  }
  if (!sum.ok()) return Fail(sum.status());
  if (a.json) {
    std::printf("%s\n", SummaryJson(*sum).c_str());
  } else {
    // In miss-target mode the target is M (the sparsity sets nothing once a curve exists).
    const std::string target = ro.policy.budget_mode == BudgetMode::kMissTarget
                                   ? absl::StrFormat("miss target %g", ro.policy.miss_target)
                                   : absl::StrFormat("sparsity %.2f", ro.policy.target_sparsity);
    std::printf(
        "replay of %s: %s, exploration %.2f, alpha %.2f, probe period %u, %s budgets, %s state, "
        "%s backend\n%s",
        a.trace_dir.c_str(), target.c_str(), ro.policy.exploration, ro.policy.alpha,
        ro.policy.probe_period, std::string(BudgetModeName(ro.policy.budget_mode)).c_str(),
        a.state.c_str(), a.backend.c_str(), SummaryTable(*sum).c_str());
    if (!where.empty()) std::printf("%s\n", where.c_str());
  }
  return 0;
}

void AddReplay(CLI::App& app, Run* run) {
  auto a = std::make_shared<ReplayArgs>();
  ReplayOptions& ro = a->ro;
  CLI::App* r = app.add_subcommand(
      "replay", "Replay a trace through the CPU data plane and report miss rate and sparsity");
  r->add_option("--trace", a->trace_dir, "Trace directory (meta.json + scores.npy)")->required();
  r->add_option("--sparsity", ro.policy.target_sparsity, "Target block sparsity rho in [0, 1)")
      ->capture_default_str();
  r->add_option("--exploration", ro.policy.exploration,
                "Share of kept blocks chosen at random, in [0, 1)")
      ->capture_default_str();
  r->add_option("--alpha", ro.policy.alpha, "EMA decay (weight of history), in [0, 1)")
      ->capture_default_str();
  r->add_option("--probe-period", ro.policy.probe_period,
                "Every P-th step is a dense probe step (0: none)")
      ->capture_default_str();
  r->add_option("--budget", a->budget,
                "Budget mode: uniform, or per-layer (keep fractions from the probe steps' miss "
                "curves, recomputed in process when they drift; needs --probe-period)")
      ->check(CLI::IsMember({"uniform", "per-layer"}))
      ->capture_default_str();
  r->add_option("--miss-target", a->miss_target,
                "Instead of a sparsity: each layer at the highest sparsity whose mean miss the "
                "probe curves predict at most this, in (0, 1) (e.g. 0.02); needs --probe-period");
  r->add_option("--budget-smoothing", ro.budget_tuning.smoothing,
                "per-layer: EMA weight of one probe step's miss curve, in (0, 1]")
      ->capture_default_str();
  r->add_option("--budget-drift", ro.budget_tuning.drift_threshold,
                "per-layer: recompute when a smoothed curve moved by more than this, in [0, 1]")
      ->capture_default_str();
  r->add_option("--budget-payback", ro.budget_tuning.payback_steps,
                "miss-target: measured steps (probe steps, and sparse steps measured by their "
                "exploration blocks) over which a layer's measured excess is paid back (>= 1)")
      ->capture_default_str();
  r->add_option("--budget-credit", ro.budget_tuning.credit_share,
                "miss-target: a measured shortfall at a sparse table is banked up to this share "
                "of the target over the payback horizon, in [0, 1] (0: none)")
      ->capture_default_str();
  r->add_option("--budget-band", ro.budget_tuning.level_band,
                "miss-target: recompute when a layer's expected miss leaves its level by more "
                "than this fraction, in [0, 1)")
      ->capture_default_str();
  r->add_option("--miss-measure", a->miss_measure,
                "miss-target: what the controller measures between probes: estimate (the "
                "exploration blocks' estimate, as in spind) or exact (the realized miss, which "
                "only an offline replay knows: a diagnostic of the estimate's part in the result)")
      ->check(CLI::IsMember({"estimate", "exact"}))
      ->capture_default_str();
  r->add_option("--seed", ro.seed, "Session seed of the exploration draws")->capture_default_str();
  r->add_option("--key", ro.sequence_key, "Sequence key of the exploration draws")
      ->capture_default_str();
  r->add_option("--state", a->state, "State dtype")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  r->add_option("--backend", a->backend, "Data plane: cpu (reference) or cuda (needs a GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  r->add_option("--mtp-observe", a->mtp_observe,
                "MTP traces: when draft rows are observed: same-step (acceptance known, offline), "
                "row0 (the engine contract: drafts never), all (every row, accepted or not), "
                "or the emulated deferred (drafts at the "
                "next step, before it selects) and late (all rows one step late); "
                "docs/lab/mtp-contract.md")
      ->check(CLI::IsMember({"same-step", "row0", "all", "deferred", "late"}))
      ->capture_default_str();
  r->add_option("--dump", ro.dump_path,
                "Write JSONL, one line per (step, layer): selected blocks and row-0 miss");
  r->add_flag("--remote", a->remote,
              "With --target: run the data plane inside spind (PredictMasks/ObserveScores) "
              "instead of on the mapped arena");
  r->add_option("--pace-ms", a->pace_ms,
                "Wait this long after each step, as an engine's decode cadence (demos, live "
                "tuning); 0: as fast as possible")
      ->check(CLI::Range(0, 60000))
      ->capture_default_str();
  r->add_flag("--json", a->json, "Print the summary as one JSON object");
  r->add_flag("--quiet", a->quiet, "No progress on stderr");
  OnParsed(r, run, [a](const Globals& g) { return RunReplay(g, *a); });
}

void AddEval(CLI::App& app, Run* run) {
  struct Args {
    EvalOptions eo;
    std::string out;
    bool quiet = false;
  };
  auto a = std::make_shared<Args>();
  EvalOptions& eo = a->eo;
  CLI::App* ev = app.add_subcommand(
      "eval",
      "Quality study on generated traces (or given ones, --trace): prediction signals, SPIN "
      "with and without exploration, uniform against per-layer budgets over a range of "
      "sparsities, and the miss-target mode");
  ev->add_option("--out", a->out,
                 "Output directory: results.json, results.md, gnuplot data (*.dat), traces/ "
                 "(generated traces)")
      ->required();
  CLI::Option* given =
      ev->add_option("--trace", eo.trace_dirs,
                     "Study these trace directories (repeat the flag or list several) instead of "
                     "generated ones; the trace-shape flags (--seeds .. --drift) do not apply")
          ->check(CLI::ExistingDirectory);
  ev->add_option("--miss-targets", eo.miss_targets,
                 "Worst-layer miss targets M of the miss-target runs, each in (0, 1)")
      ->capture_default_str();
  ev->add_option("--jobs", eo.jobs, "Traces studied at once (threads; results do not depend on it)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  ev->add_option("--seeds", eo.seeds, "Trace seeds (one trace each)")->capture_default_str();
  ev->add_option("--sparsities", eo.sparsities, "Target sparsities, each in [0, 1)")
      ->capture_default_str();
  ev->add_option("--layers", eo.gen.layers, "Indexer layers of the traces")->capture_default_str();
  ev->add_option("--slots", eo.gen.slots, "Slots per trace")->capture_default_str();
  ev->add_option("--steps", eo.gen.steps, "Decode steps per trace")->capture_default_str();
  ev->add_option("--topk", eo.gen.topk, "The indexer's top-K")->capture_default_str();
  ev->add_option("--shifts", eo.gen.shifts, "Sudden shifts per trace")->capture_default_str();
  ev->add_option("--noise", eo.gen.noise_scale, "Scale of the per-step noise")
      ->capture_default_str();
  ev->add_option("--drift", eo.gen.drift_scale, "Scale of the slow drift")->capture_default_str();
  for (const char* shape :
       {"--seeds", "--layers", "--slots", "--steps", "--topk", "--shifts", "--noise", "--drift"}) {
    given->excludes(ev->get_option(shape));
  }
  ev->add_option("--probe-period", eo.probe_period,
                 "Probe period of the uniform / per-layer budget comparison (> 0)")
      ->capture_default_str();
  ev->add_option("--exploration", eo.budget_exploration,
                 "Exploration share of the budget comparison, in [0, 1)")
      ->capture_default_str();
  ev->add_option("--budget-smoothing", eo.tuning.smoothing,
                 "EMA weight of one probe step's miss curve, in (0, 1]")
      ->capture_default_str();
  ev->add_option("--budget-drift", eo.tuning.drift_threshold,
                 "Recompute when a smoothed curve moved by more than this, in [0, 1]")
      ->capture_default_str();
  ev->add_flag("--quiet", a->quiet, "No progress on stderr");
  OnParsed(ev, run, [a](const Globals&) { return CmdEval(a->eo, a->out, a->quiet); });
}

// Control commands: they talk to spind at --target, or at its default socket.

// --session and --token, for the commands that name a session.
struct SessionFlags {
  std::string id, token;
};

void AddSessionFlags(CLI::App* c, SessionFlags* s, bool required = true) {
  CLI::Option* o = c->add_option("--session", s->id, "Session id (from `spinctl sessions`)");
  if (required) o->required();
  c->add_option("--token", s->token,
                "The session's token; without it, operator access by id (the Unix socket, or "
                "TCP with --admin-token-file)")
      ->envname("SPIN_TOKEN");
}

ControlArgs Control(const Globals& g, const SessionFlags& s = {}) {
  return {g.target.empty() ? "unix:///run/spin/spind.sock" : g.target, s.id, s.token,
          g.admin_token};
}

void AddStatus(CLI::App& app, Run* run) {
  CLI::App* st = app.add_subcommand("status", "Is spind serving, and what does it hold");
  OnParsed(st, run, [](const Globals& g) { return CmdStatus(Control(g)); });
}

void AddHealth(CLI::App& app, Run* run) {
  struct Args {
    std::string service;
    int timeout_ms = 2000;
  };
  auto a = std::make_shared<Args>();
  CLI::App* hc = app.add_subcommand(
      "health", "Ask spind's grpc.health.v1 service; exit 0 only when SERVING (exec probes)");
  hc->add_option("--service", a->service,
                 "The service to ask about (empty: spind as a whole; or spin.v1.Spin)");
  hc->add_option("--timeout-ms", a->timeout_ms, "Give up after this long")
      ->check(CLI::Range(1, 600000));
  OnParsed(hc, run,
           [a](const Globals& g) { return CmdHealth(Control(g), a->service, a->timeout_ms); });
}

void AddSessions(CLI::App& app, Run* run) {
  CLI::App* ss = app.add_subcommand("sessions", "List the sessions in spind");
  OnParsed(ss, run, [](const Globals& g) { return CmdSessions(Control(g)); });
}

// A flag that sets `field` only when given: an unset field is nullopt, never a sentinel value.
template <typename T>
CLI::Option* AddOptional(CLI::App* c, const std::string& flag, std::optional<T>* field,
                         const std::string& help) {
  return c->add_option_function<T>(
      flag, [field](const T& v) { *field = v; }, help);
}

struct PolicySetArgs {
  SessionFlags session;
  bool all = false, default_only = false;
  PolicyFields fields;
};

// One session's policy, or the node default (--default) and every live session's (--all).
// Every given value is checked before anything is sent: exit 2 with the range.
int RunPolicySet(const Globals& g, const PolicySetArgs& a) {
  const PolicyFields& f = a.fields;
  std::string bad;
  if (f.sparsity) bad = CheckPolicyValue("--sparsity", *f.sparsity, 0, 1, false);
  if (bad.empty() && f.exploration) {
    bad = CheckPolicyValue("--exploration", *f.exploration, 0, 1, false);
  }
  if (bad.empty() && f.alpha) bad = CheckPolicyValue("--alpha", *f.alpha, 0, 1, false);
  if (bad.empty() && f.miss_target) {
    bad = CheckPolicyValue("--miss-target", *f.miss_target, 0, 1, true);
  }
  if (bad.empty() && f.probe_period &&
      (*f.probe_period < 0 || *f.probe_period > static_cast<int64_t>(kMaxProbePeriod))) {
    bad = absl::StrCat("--probe-period ", *f.probe_period, " is out of range [0, ", kMaxProbePeriod,
                       "] (0: no probes)");
  }
  if (!bad.empty()) return BadValue(absl::StrCat("policy set: ", bad));
  if (f.miss_target && f.budget) {
    return BadValue("policy set: --miss-target is a budget mode of its own; leave out --budget");
  }
  if ((a.all || a.default_only) == !a.session.id.empty() || (a.all && a.default_only)) {
    return Fail(
        absl::InvalidArgumentError("policy set: give one of --session ID, --all or --default"));
  }
  PolicyFields send = f;
  if (f.miss_target) send.budget = BudgetMode::kMissTarget;
  const ControlArgs ca = Control(g, a.session);
  if (a.all || a.default_only) return CmdPolicyDefaults(ca, send, a.all, false);
  return CmdPolicySet(ca, send);
}

void AddPolicyGet(CLI::App* pol, Run* run) {
  auto s = std::make_shared<SessionFlags>();
  CLI::App* pget = pol->add_subcommand("get", "Print the policy");
  AddSessionFlags(pget, s.get());
  OnParsed(pget, run, [s](const Globals& g) { return CmdPolicyGet(Control(g, *s)); });
}

void AddPolicySet(CLI::App* pol, Run* run) {
  auto a = std::make_shared<PolicySetArgs>();
  PolicyFields* f = &a->fields;
  CLI::App* pset = pol->add_subcommand(
      "set",
      "Change the given fields (the rest stay) of one session, of every live session and "
      "new ones (--all), or of new ones only (--default)");
  AddSessionFlags(pset, &a->session, false);
  pset->add_flag("--all", a->all,
                 "Set the node's default policy and apply it to every live session now");
  pset->add_flag("--default", a->default_only,
                 "Set the node's default policy: new sessions attach with it");
  AddOptional(pset, "--sparsity", &f->sparsity, "Target block sparsity in [0, 1)");
  AddOptional(pset, "--exploration", &f->exploration, "Exploration share in [0, 1)");
  AddOptional(pset, "--alpha", &f->alpha, "EMA decay in [0, 1)");
  AddOptional(pset, "--probe-period", &f->probe_period,
              "Dense probe every P steps (0: never), at most 2^20");
  pset->add_option_function<std::string>(
          "--budget", [f](const std::string& v) { f->budget = ParseBudgetMode(v); },
          "uniform or per-layer")
      ->check(CLI::IsMember({"uniform", "per-layer"}));
  AddOptional(pset, "--miss-target", &f->miss_target,
              "Budget by quality: each layer at the highest sparsity whose predicted mean miss is "
              "at most this, in (0, 1) (the session needs probe steps)");
  OnParsed(pset, run, [a](const Globals& g) { return RunPolicySet(g, *a); });
}

void AddPolicyDefaults(CLI::App* pol, Run* run) {
  auto clear = std::make_shared<bool>(false);
  CLI::App* pdef = pol->add_subcommand(
      "defaults", "Print the node's default policy (fields that override a new session's)");
  pdef->add_flag("--clear", *clear, "Drop the defaults (new sessions keep their own)");
  // Sets no field: prints the defaults (after dropping them with --clear).
  OnParsed(pdef, run, [clear](const Globals& g) {
    return CmdPolicyDefaults(Control(g), PolicyFields{}, false, *clear);
  });
}

void AddPolicy(CLI::App& app, Run* run) {
  CLI::App* pol = app.add_subcommand("policy", "Read or change a session's policy");
  pol->require_subcommand(1);
  AddPolicyGet(pol, run);
  AddPolicySet(pol, run);
  AddPolicyDefaults(pol, run);
}

void AddBudgets(CLI::App& app, Run* run) {
  auto s = std::make_shared<SessionFlags>();
  CLI::App* bud = app.add_subcommand("budgets", "Print a session's per-layer budgets");
  AddSessionFlags(bud, s.get());
  OnParsed(bud, run, [s](const Globals& g) { return CmdBudgets(Control(g, *s)); });
}

void AddStats(CLI::App& app, Run* run) {
  auto s = std::make_shared<SessionFlags>();
  CLI::App* sts = app.add_subcommand("stats", "Print a session's per-layer statistics");
  AddSessionFlags(sts, s.get());
  OnParsed(sts, run, [s](const Globals& g) { return CmdStats(Control(g, *s)); });
}

}  // namespace
}  // namespace spin

int main(int argc, char** argv) {
  using namespace spin;
  CLI::App app{
      "spinctl: tools for spind, the SPIN (Shadow Predictive Indexer) sidecar.\n"
      "Offline: generate synthetic indexer-score traces and replay them through the real\n"
      "data plane to measure miss rate and block sparsity."};
  app.require_subcommand(1);
  // Usage errors: one line, like every other error.
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("spinctl: error: ") + e.what() + " (see --help)\n";
  });
  app.set_version_flag("--version", "spinctl 0.1.0");
  Globals globals;
  app.add_option("--target", globals.target,
                 "spind address (unix:///run/spin/spind.sock or HOST:PORT); replay then runs "
                 "through a session in the daemon")
      ->envname("SPIN_TARGET");
  std::string admin_token_file;
  app.add_option("--admin-token-file", admin_token_file,
                 "spind's admin token: operator calls (on the Unix socket too when spind has a "
                 "token) and changes over TCP")
      ->envname("SPIN_ADMIN_TOKEN_FILE")
      ->check(CLI::ExistingFile);
  // In this order in --help.
  Run run;
  AddGenTrace(app, &run);
  AddTraceStats(app, &run);
  AddTraceCut(app, &run);
  AddReplay(app, &run);
  AddEval(app, &run);
  AddStatus(app, &run);
  AddHealth(app, &run);
  AddSessions(app, &run);
  AddPolicy(app, &run);
  AddBudgets(app, &run);
  AddStats(app, &run);

  CLI11_PARSE(app, argc, argv);
  // Read for every command, so a bad token file fails the same way whatever the command.
  if (!admin_token_file.empty()) {
    absl::StatusOr<std::string> t = ReadAdminToken(admin_token_file);
    if (!t.ok()) return BadValue(std::string(t.status().message()));
    globals.admin_token = *t;
  }
  return run(globals);
}
