// The pipeline task a thread runs: one microbatch's step body on the driver, or one
// request on its owner. The compute token (p2p.h, Note [Compute token]) knows the task
// that holds it, so that what belongs to a task follows it across threads and waits:
// its random stream (Note [Microbatch random streams] in task_rng.h) and its
// microbatch (Note [Gradient order] in dispatch.h).
//
// Thread-safety: a TaskContext belongs to its task; the token's hand-over (under the
// P2PEngine's lock) is the only other reader and writer.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace smp {

struct TaskContext {
  std::atomic<int64_t> mb{-1};  // the task's microbatch (-1: none)
  // The task's random stream while it does not hold the token (task_rng.h bytes);
  // empty: the task has none and nothing is swapped.
  std::string rng;
};

// The calling thread's task, or nullptr.
TaskContext* current_task();

// Makes `task` the calling thread's task for the scope (restores the previous one).
class TaskScope {
 public:
  explicit TaskScope(TaskContext* task);
  ~TaskScope();
  TaskScope(const TaskScope&) = delete;
  TaskScope& operator=(const TaskScope&) = delete;

 private:
  TaskContext* prev_;
};

}  // namespace smp
