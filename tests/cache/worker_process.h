// Starting cache_worker (see cache_worker.cpp) from a test and reading its report.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace moejit::test {

struct Worker {
  pid_t pid = -1;
  int out_fd = -1;
};

struct WorkerResult {
  bool exited = false;
  int exit_code = -1;
  std::map<std::string, long long> values;
  long long operator[](const std::string& name) const {
    auto it = values.find(name);
    return it == values.end() ? -1 : it->second;
  }
};

// env: extra "NAME=value" settings for the child only. stderr_path: where its stderr goes (the
// test's own stderr if empty).
inline Worker start_worker(const std::vector<std::string>& args,
                           const std::vector<std::string>& env = {},
                           const std::string& stderr_path = "") {
  int fds[2];
  if (pipe(fds) != 0) return {};
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    if (!stderr_path.empty()) {
      const int err = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (err >= 0) dup2(err, 2);
    }
    close(fds[0]);
    close(fds[1]);
    for (const std::string& e : env) putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> argv;
    static std::string program = MOEJIT_CACHE_WORKER;
    argv.push_back(program.data());
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(program.c_str(), argv.data());
    _exit(127);
  }
  close(fds[1]);
  return Worker{pid, fds[0]};
}

inline WorkerResult finish_worker(const Worker& w) {
  WorkerResult r;
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(w.out_fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  close(w.out_fd);
  int status = 0;
  waitpid(w.pid, &status, 0);
  r.exited = WIFEXITED(status);
  r.exit_code = r.exited ? WEXITSTATUS(status) : -1;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) r.values[line.substr(0, eq)] = std::atoll(line.c_str() + eq + 1);
  }
  return r;
}

inline WorkerResult run_worker(const std::vector<std::string>& args,
                               const std::vector<std::string>& env = {},
                               const std::string& stderr_path = "") {
  return finish_worker(start_worker(args, env, stderr_path));
}

}  // namespace moejit::test
