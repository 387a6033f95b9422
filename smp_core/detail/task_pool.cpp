#include "smp_core/detail/task_pool.h"

#include <pthread.h>

#include <stdexcept>

namespace smp::detail {

struct TaskPool::Worker {
  std::thread thread;
  std::condition_variable cv;
  std::function<void()> job;  // guarded by the pool's mutex
};

TaskPool::TaskPool(std::string name, std::function<void()> on_thread_start,
                   std::function<void()> on_thread_exit)
    : name_(std::move(name)), on_start_(std::move(on_thread_start)),
      on_exit_(std::move(on_thread_exit)) {}

TaskPool::~TaskPool() { stop(); }

void TaskPool::spawn(std::function<void()> body) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) throw std::runtime_error("smp: the pipeline's task threads were stopped");
  if (!idle_.empty()) {
    Worker* w = idle_.back();
    idle_.pop_back();
    w->job = std::move(body);
    w->cv.notify_one();
    return;
  }
  auto w = std::make_unique<Worker>();
  w->job = std::move(body);
  Worker* raw = w.get();
  const std::string thread_name = name_ + std::to_string(workers_.size());
  raw->thread = std::thread([this, raw, thread_name] {
    // The OS allows 15 characters.
    pthread_setname_np(pthread_self(), thread_name.substr(0, 15).c_str());
    loop(raw);
  });
  workers_.push_back(std::move(w));
}

void TaskPool::loop(Worker* w) {
  if (on_start_) on_start_();
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    w->cv.wait(lock, [&] { return w->job || stopping_; });
    if (!w->job) break;  // stopping, and nothing left to run
    std::function<void()> job = std::move(w->job);
    w->job = nullptr;
    lock.unlock();
    job();
    job = nullptr;  // drop what it holds now, not at the next task
    lock.lock();
    idle_.push_back(w);
  }
  lock.unlock();
  if (on_exit_) on_exit_();
}

void TaskPool::stop() {
  std::vector<std::unique_ptr<Worker>> workers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
    for (auto& w : workers_) w->cv.notify_one();
    workers.swap(workers_);
    idle_.clear();
  }
  for (auto& w : workers) {
    if (!w->thread.joinable()) continue;
    if (w->thread.get_id() == std::this_thread::get_id()) {
      w->thread.detach();  // a task stopping its own pool: it ends after this task
      w.release();         // its loop still uses the Worker
      continue;
    }
    w->thread.join();
  }
}

size_t TaskPool::threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return workers_.size();
}

size_t TaskPool::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return idle_.size();
}

}  // namespace smp::detail
