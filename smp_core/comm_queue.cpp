#include "smp_core/comm_queue.h"

#include <pthread.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "smp_core/errors.h"

namespace smp {

struct CommQueue::State {
  std::string name;
  mutable std::mutex mu;
  std::condition_variable work_cv;  // worker: a task arrived or stop
  std::condition_variable done_cv;  // waiters: a task finished, or the worker exited
  std::deque<std::pair<TicketPtr, std::function<void()>>> tasks;
  bool stop = false;
  bool running = false;
  bool exited = false;
  std::string first_error;
  std::exception_ptr first_exception;
  std::thread worker;

  void finish(const TicketPtr& t, std::exception_ptr error, double ms) {
    std::lock_guard<std::mutex> lock(mu);
    t->done = true;
    t->error = error;
    t->run_ms = ms;
    running = false;
    done_cv.notify_all();
  }

  std::exception_ptr skipped(const TicketPtr& t) const {
    return std::make_exception_ptr(CommError(
        str_cat("smp: ", t->what, " was not run: an earlier communication task on ", name,
                " failed (", first_error, ")")));
  }

  // The worker owns a shared_ptr to the state, so a detached worker stays valid.
  static void loop(std::shared_ptr<State> s) {
    std::string thread_name = ("smp-" + s->name).substr(0, 15);
    pthread_setname_np(pthread_self(), thread_name.c_str());
    while (true) {
      std::pair<TicketPtr, std::function<void()>> item;
      bool broken = false;
      {
        std::unique_lock<std::mutex> lock(s->mu);
        s->work_cv.wait(lock, [&] { return s->stop || !s->tasks.empty(); });
        if (s->tasks.empty()) break;  // stop requested and nothing left
        item = std::move(s->tasks.front());
        s->tasks.pop_front();
        s->running = true;
        broken = !s->first_error.empty();
      }
      if (broken) {
        s->finish(item.first, s->skipped(item.first), 0);
        continue;
      }
      auto t0 = std::chrono::steady_clock::now();
      std::exception_ptr error;
      try {
        item.second();
      } catch (const std::exception& e) {
        error = std::current_exception();
        std::lock_guard<std::mutex> lock(s->mu);
        if (s->first_error.empty()) s->first_error = e.what();
      } catch (...) {
        error = std::current_exception();
        std::lock_guard<std::mutex> lock(s->mu);
        if (s->first_error.empty()) s->first_error = item.first->what + " failed";
      }
      item.second = nullptr;  // drop captures (hooks, buckets) before reporting
      double ms = std::chrono::duration<double, std::milli>(
                      std::chrono::steady_clock::now() - t0).count();
      s->finish(item.first, error, ms);
    }
    std::lock_guard<std::mutex> lock(s->mu);
    s->exited = true;
    s->done_cv.notify_all();
  }
};

CommQueue::CommQueue(std::string name) : state_(std::make_shared<State>()) {
  state_->name = std::move(name);
  state_->worker = std::thread(&State::loop, state_);
}

CommQueue::~CommQueue() {
  auto& s = *state_;
  std::deque<std::pair<TicketPtr, std::function<void()>>> dropped;
  bool exited;
  {
    std::unique_lock<std::mutex> lock(s.mu);
    s.stop = true;
    dropped.swap(s.tasks);
    for (auto& item : dropped) {
      item.first->done = true;
      item.first->error = std::make_exception_ptr(
          CommError(str_cat("smp: ", item.first->what, " was dropped: its queue on ", s.name,
                            " was shut down")));
    }
    s.work_cv.notify_all();
    s.done_cv.notify_all();
    exited = s.done_cv.wait_for(lock, std::chrono::duration<double>(shutdown_wait_s),
                                [&] { return s.exited; });
  }
  dropped.clear();  // outside the lock: captures may be heavy
  if (exited) {
    s.worker.join();
  } else {
    s.worker.detach();  // stuck in a collective that will never complete
  }
}

CommQueue::TicketPtr CommQueue::submit(std::string what, std::function<void()> task) {
  auto t = std::make_shared<Ticket>();
  t->what = std::move(what);
  std::lock_guard<std::mutex> lock(state_->mu);
  SMP_CHECK(!state_->stop, "CommQueue ", state_->name, ": submit after shutdown");
  state_->tasks.emplace_back(t, std::move(task));
  state_->work_cv.notify_one();
  return t;
}

void CommQueue::wait(const TicketPtr& t, double timeout_s) {
  {
    std::unique_lock<std::mutex> lock(state_->mu);
    if (!state_->done_cv.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                  [&] { return t->done; }))
      throw TimeoutError(str_cat("smp: timed out after ", timeout_s, " s waiting for ",
                                 t->what, " on ", state_->name));
  }
  if (t->error) std::rethrow_exception(t->error);
}

std::string CommQueue::first_error() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->first_error;
}

const std::string& CommQueue::name() const { return state_->name; }

CommQueue& group_queue(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  SMP_CHECK(pg, "group_queue: null process group");
  // Leaked on purpose: a queue may be in use while static destructors run at exit.
  static auto* mu = new std::mutex;
  static auto* queues =
      new std::map<const c10d::ProcessGroup*,
                   std::pair<c10::intrusive_ptr<c10d::ProcessGroup>, CommQueue*>>;
  std::lock_guard<std::mutex> lock(*mu);
  auto it = queues->find(pg.get());
  if (it == queues->end()) {
    std::string name = str_cat("hooks-", pg->getBackendName(), "-", pg->getSize());
    it = queues->emplace(pg.get(), std::make_pair(pg, new CommQueue(name))).first;
  }
  return *it->second.second;
}

}  // namespace smp
