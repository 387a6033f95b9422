// Persistent task threads of the pipeline (the Dispatcher's `spawn`).
//
// Note [Task threads]: the Dispatcher runs a microbatch's step body (driver) or a
// serving loop (other pp ranks) on a thread of a TaskPool. Starting a thread per task
// every step costs real time (a stack, Python and torch thread state), so threads are
// kept from step to step, and the most recently idle one is reused first (its caches
// are warm). A thread enters Python only to call the handler or the step body: the
// bindings give each thread one Python thread state for its whole life
// (`on_thread_start` / `on_thread_exit`), so taking the GIL there is cheap and no
// Python object stands for the thread.
//
// Thread-safety: every method is thread-safe. stop() joins the threads: call it
// without the GIL when the hooks take it.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace smp::detail {

class TaskPool {
 public:
  // `name`: the threads' prefix (name0, name1, ... as the OS shows them). The hooks run
  // on each thread before its first task and after its last one.
  explicit TaskPool(std::string name, std::function<void()> on_thread_start = {},
                    std::function<void()> on_thread_exit = {});
  ~TaskPool();  // stop()

  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  // Runs `body` on an idle thread, or a new one; never waits for it. `body` must not
  // throw (the Dispatcher's bodies catch their own errors); one that does ends the
  // process, as an uncaught exception on any thread does.
  void spawn(std::function<void()> body);

  // Lets every thread finish its task and joins them. Idempotent; spawn() after it
  // throws.
  void stop();

  // Threads started so far, and those idle now.
  size_t threads() const;
  size_t idle() const;

 private:
  struct Worker;
  void loop(Worker* w);

  const std::string name_;
  const std::function<void()> on_start_, on_exit_;
  mutable std::mutex mu_;
  bool stopping_ = false;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<Worker*> idle_;  // most recently idle last
};

}  // namespace smp::detail
