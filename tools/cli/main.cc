// attnforge: the command-line tool. Parses the command line and hands over to one subcommand.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <exception>

#include "commands.h"

int main(int argc, char** argv) {
  using namespace attnforge::cli;
  // Every line out as it is printed, to a file or a pipe too: a benchmark cut short by a time limit keeps the
  // figures it printed (a `warmup --bench` killed on the lent H100, session 40, lost its compile figures, while
  // the log lines on stderr survived).
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  CLI::App app{"attnforge: attention engine for LLM inference serving"};
  app.require_subcommand(1);

  CLI::App* info = app.add_subcommand("info", "Build facts, devices, and the configurations each device supports");

  CheckOptions check;
  CLI::App* check_cmd =
      app.add_subcommand("check", "Batch attention against the float64 reference; exit 1 on a failure");
  check_cmd->add_flag("--quick", check.quick, "A dozen small cases instead of the registry and 200 random batches");
  check_cmd->add_option("--seed", check.seed, "Shifts every case's seed: 0 checks the unit tests' data, N new data")
      ->capture_default_str();

  BenchOptions bench;
  CLI::App* bench_cmd = app.add_subcommand("bench", "Serving workloads, checked then timed, against measured ceilings");
  bench_cmd->add_flag("--quick", bench.quick, "Smaller shapes and fewer runs (under a minute on 2 cores)");
  bench_cmd->add_option("--json", bench.json_path, "Write one JSON record per measurement to this file");
  bench_cmd->add_option("--device", bench.device,
                        "Device to run on, e.g. cpu or cuda:0 (default: the best present; `attnforge info` lists them)");
  bench_cmd->add_option("--suite", bench.suite,
                        "On a GPU: all (decode and prefill), decode, prefill, or long (one 1M-token decode on 1 GPU "
                        "and split over 2, 4, 8 GPUs by context parallelism; not in all)")
      ->check(CLI::IsMember({"all", "decode", "prefill", "long"}));
  bench_cmd->add_option("--case", bench.case_filter,
                        "Only the cases whose name contains this text (or one of several separated by |); a text "
                        "ending in $ must end the name");
  bench_cmd->add_option("--gpus", bench.gpus, "--suite long: the most GPUs to split over (default: every visible GPU, "
                                             "at most 8)")
      ->check(CLI::Range(1, 8));
  bench_cmd->add_option("--workers", bench.workers,
                        "Plan every case for this many parallel workers (PlanOptions::num_workers; default: the "
                        "device's threads, or SMs x CTAs per SM): how finely long KV is split, for tuning runs")
      ->check(CLI::Range(1, 1 << 20));
  bench_cmd->add_option("--tile-rows", bench.tile_rows,
                        "Plan every prefill case with query tiles of this many packed rows (PlanOptions::tile_rows; "
                        "default: the planner's choice from the batch shape); values the device lacks are refused")
      ->check(CLI::Range(1, 1 << 20));
  bench_cmd->add_flag("--warm-code", bench.warm_code,
                      "GPU only, a measuring knob: before every timed call, run the same kernels on a small problem "
                      "of the case's shape and wait for it, so the call finds their code in the L2 but not its own "
                      "inputs; the cases are named with ' warm-code'");
  bench_cmd->add_option("--iters", bench.iters, "Timed runs per case (default: 20, or 5 with --quick)")
      ->check(CLI::Range(1, 1000000));

  WarmupCommandOptions warm;
  CLI::App* warmup = app.add_subcommand(
      "warmup",
      "Compile the run-time (NVRTC) kernels of common decode and prefill shapes into the kernel cache, in parallel");
  warmup->add_option("--arch", warm.archs, "Architectures, e.g. sm_90a sm_80 (default: the visible GPUs')");
  warmup->add_option("--head-dim", warm.head_dims, "Head dims to warm (default: 64 128 256)");
  warmup->add_option("--dtype", warm.dtypes, "Q/K/V dtypes to warm (default: fp16 bf16)")
      ->check(CLI::IsMember({"fp16", "bf16"}));
  warmup->add_option("--kv-dtype", warm.kv_dtypes, "K/V dtypes to warm: same (as Q), e4m3, e5m2 (default: all)")
      ->check(CLI::IsMember({"same", "e4m3", "e5m2"}));
  warmup->add_option("--page-size", warm.page_sizes, "Page sizes (default: 1 16; a run-time value: kernels are shared)");
  warmup->add_option("--threads", warm.threads, "Compile threads (default: every core)")->check(CLI::Range(1, 4096));
  warmup->add_option("--cache-dir", warm.cache_dir, "Kernel cache directory (default: ATTNFORGE_CACHE_DIR or "
                                                    "~/.cache/attnforge/kernels)");
  warmup->add_flag("--quiet", warm.quiet, "No log line per compile");
  warmup->add_flag("--bench", warm.bench, "Measure cold compile, warm cache load, warm-up time and, on a GPU, "
                                          "NVRTC vs nvcc kernel speed (temporary caches; the real one is untouched)");
  warmup->add_flag("--quick", warm.quick, "--bench: the quick GPU suite for the speed comparison");
  warmup->add_flag("--compile-check", warm.compile_check,
                   "--bench: one cold compile of each kernel instead of three, and the one-model warm-up without the "
                   "whole default set's (a check of the command where compiles are slow; its figures are not the "
                   "targets')");
  warmup->add_option("--iters", warm.iters, "--bench: timed runs per case (default 100, or 20 with --quick)")
      ->check(CLI::Range(1, 1000000));
  warmup->add_option("--json", warm.json_path, "--bench: write the figures to this JSON file");

  CLI11_PARSE(app, argc, argv);
  try {
    if (info->parsed()) return run_info();
    if (check_cmd->parsed()) return run_check(check);
    if (bench_cmd->parsed()) return run_bench(bench);
    if (warmup->parsed()) return run_warmup(warm);
  } catch (const std::exception& e) {
    fmt::print(stderr, "attnforge {}: error: {}\n", app.get_subcommands().front()->get_name(), e.what());
    return 1;
  }
  return 1;
}
