#include "jit/host_compiler.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/check.h"

extern char** environ;

namespace attnforge::jit {

namespace {

namespace fs = std::filesystem;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs argv[0] (searched on PATH) with stdout and stderr into `log`; returns the exit status (-1: not run).
int run_process(const std::vector<std::string>& args, const fs::path& log) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid;
  const int rc = posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return -1;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A private scratch directory, removed at scope exit.
struct Scratch {
  fs::path path;
  Scratch() {
    std::string tmpl = (fs::temp_directory_path() / "attnforge-host-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) detail::fail(ErrorKind::kBackend, "host compiler: cannot create a scratch directory");
    path = tmpl;
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

}  // namespace

std::string host_compiler() {
  const char* env = std::getenv("ATTNFORGE_HOST_CXX");
  return env && *env ? env : ATTNFORGE_HOST_CXX;
}

std::string host_compiler_identity() {
  static const std::string identity = [] {
    Scratch s;
    const int rc = run_process({host_compiler(), "--version"}, s.path / "version.txt");
    if (rc != 0)
      detail::fail(ErrorKind::kUnsupported,
                   "host compiler {}: `--version` failed (exit {}); custom variants on the CPU need a C++ compiler "
                   "at run time (set ATTNFORGE_HOST_CXX)",
                   host_compiler(), rc);
    return host_compiler() + "\n" + read_file(s.path / "version.txt");
  }();
  return identity;
}

std::vector<std::string> host_compile_options() {
  // The CPU backend's own floating-point flags (CMakeLists.txt), for a shared object.
  return {"-std=c++17", "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-fno-math-errno", "-ffp-contract=fast"};
}

CompiledModule compile_host(const KernelSource& src, std::span<const EmbeddedHeader> headers) {
  Scratch s;
  for (const EmbeddedHeader& h : headers) {
    const fs::path p = s.path / "include" / h.name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << h.text;
  }
  const fs::path source = s.path / (src.name + ".cc"), object = s.path / (src.name + ".so");
  std::ofstream(source, std::ios::binary) << src.source;
  std::vector<std::string> args = {host_compiler()};
  for (const std::string& o : host_compile_options()) args.push_back(o);
  args.insert(args.end(), {"-I", (s.path / "include").string(), source.string(), "-o", object.string()});
  const int rc = run_process(args, s.path / "log.txt");
  const std::string log = read_file(s.path / "log.txt");
  if (rc != 0)
    detail::fail(ErrorKind::kBackend, "host compiler {}: compiling {} failed (exit {}):\n{}", host_compiler(),
                 src.name, rc, log);
  CompiledModule m;
  m.name = src.name;
  m.binary = read_file(object);
  m.log = log;
  for (const std::string& e : src.entry_points) m.lowered_names.push_back(e);
  return m;
}

}  // namespace attnforge::jit
