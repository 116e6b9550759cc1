#include "fork_guard.h"

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <mutex>

namespace moejit {
namespace {

struct Gate {
  std::mutex mutex;  // guards the two below
  std::condition_variable changed;
  int inside = 0;        // threads inside a scope
  bool forking = false;  // a fork() is waiting for them, or under way
};

// Replaced in the child, never destroyed: the parent's may be locked (by the fork's prepare step)
// and may list waiters that do not exist in the child.
std::atomic<Gate*> g_gate{new Gate};
std::atomic<uint64_t> g_generation{0};
thread_local int t_depth = 0;  // scopes this thread is inside

void before_fork() {
  Gate* gate = g_gate.load();
  std::unique_lock<std::mutex> lock(gate->mutex);
  gate->forking = true;
  // A thread that forks from inside a scope (a host's log sink, say) counts itself.
  const int own = t_depth > 0 ? 1 : 0;
  gate->changed.wait(lock, [&] { return gate->inside <= own; });
  lock.release();  // held across the fork: no thread enters or leaves a scope meanwhile
}

void after_fork_in_parent() {
  Gate* gate = g_gate.load();
  gate->forking = false;
  gate->mutex.unlock();
  gate->changed.notify_all();
}

void after_fork_in_child() {
  Gate* fresh = new Gate;
  fresh->inside = t_depth > 0 ? 1 : 0;
  g_gate.store(fresh);
  g_generation.fetch_add(1);
}

// At load time, before any thread can enter a scope.
const int g_registered = pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);

}  // namespace

uint64_t fork_generation() {
  return g_generation.load(std::memory_order_relaxed);
}

ForkGateScope::ForkGateScope() {
  (void)g_registered;
  if (t_depth++ > 0) return;
  Gate* gate = g_gate.load();
  std::unique_lock<std::mutex> lock(gate->mutex);
  gate->changed.wait(lock, [&] { return !gate->forking; });
  ++gate->inside;
  gate_ = gate;
}

ForkGateScope::~ForkGateScope() {
  --t_depth;
  if (gate_ == nullptr) return;
  // The current gate: a child forked by this thread inside this scope has a fresh one, which
  // counts this thread.
  Gate* gate = g_gate.load();
  {
    std::lock_guard<std::mutex> lock(gate->mutex);
    --gate->inside;
  }
  gate->changed.notify_all();
}

}  // namespace moejit
