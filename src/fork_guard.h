// Fork safety. fork() copies only the calling thread: a lock another thread held, a result it was
// about to hand over, NVRTC's internal state in the middle of a compile are copied as they were,
// and a child that waited for them would wait forever. Two things keep the child from that:
//  - The fork gate. The few places that hold process-wide state across code we do not control (an
//    NVRTC compile, loading the driver, creating the default runtime, writing a log line) run
//    inside a ForkGate scope; fork() (through pthread_atfork) waits until no thread is inside one,
//    and no thread enters one until fork() returns.
//  - The fork generation, one more in each child. A runtime remembers the generation it was made
//    in, so a child recognizes (and refuses, or replaces) a runtime of its parent: its locks and
//    pending results belong to threads that do not exist in the child.
#pragma once

#include <cstdint>

namespace moejit {

// 0 in a process that has not forked since it loaded the library; one more in each child.
uint64_t fork_generation();

// While one exists on any thread, fork() waits for it to end. Nests on a thread. Never throws.
class ForkGateScope {
 public:
  ForkGateScope();
  ~ForkGateScope();
  ForkGateScope(const ForkGateScope&) = delete;
  ForkGateScope& operator=(const ForkGateScope&) = delete;

 private:
  void* gate_ = nullptr;  // the gate entered (null for a nested scope)
};

}  // namespace moejit
