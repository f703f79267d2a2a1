// attnforge: the command-line tool. Parses the command line and hands over to one subcommand.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <exception>

#include "commands.h"

int main(int argc, char** argv) {
  using namespace attnforge::cli;
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
  bench_cmd->add_option("--suite", bench.suite, "On a GPU: all, decode or prefill")
      ->check(CLI::IsMember({"all", "decode", "prefill"}));
  bench_cmd->add_option("--iters", bench.iters, "Timed runs per case (default: 20, or 5 with --quick)")
      ->check(CLI::Range(1, 1000000));

  CLI::App* warmup =
      app.add_subcommand("warmup", "Compile run-time kernels ahead of the first request (none exist yet)");

  CLI11_PARSE(app, argc, argv);
  try {
    if (info->parsed()) return run_info();
    if (check_cmd->parsed()) return run_check(check);
    if (bench_cmd->parsed()) return run_bench(bench);
    if (warmup->parsed()) return run_warmup();
  } catch (const std::exception& e) {
    fmt::print(stderr, "attnforge {}: error: {}\n", app.get_subcommands().front()->get_name(), e.what());
    return 1;
  }
  return 1;
}
