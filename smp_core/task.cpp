#include "smp_core/task.h"

namespace smp {
namespace {

thread_local TaskContext* tls_task = nullptr;

}  // namespace

TaskContext* current_task() { return tls_task; }

TaskScope::TaskScope(TaskContext* task) : prev_(tls_task) { tls_task = task; }
TaskScope::~TaskScope() { tls_task = prev_; }

}  // namespace smp
