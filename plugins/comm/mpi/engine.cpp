#include "engine.hpp"

#include <chrono>
#include <cstdlib>
#include <exception>
#include <utility>

#include "meshrun/plugin.hpp"

namespace meshrun::mpi {
namespace {

using meshrun::plugin::Error;

// While transfers are in flight the engine polls them, yielding between
// polls; after this many polls without progress it sleeps kPollPause between
// them (waking at once for new work), so that a long wait for a peer does not
// take a core from the ranks that share it.
constexpr int kSpinPolls = 64;
constexpr std::chrono::microseconds kPollPause{50};

std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, static_cast<size_t>(length));
}

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    default:
      return "MPI_THREAD_MULTIPLE";
  }
}

// Finishes `completion` with the exception being handled, its message
// prefixed with `what`.
void fail_with_current_exception(Completion& completion, const std::string& what) {
  try {
    throw;
  } catch (const Error& e) {
    completion.finish(e.code(), what + ": " + e.what());
  } catch (const std::exception& e) {
    completion.finish(MESHRUN_INTERNAL, what + ": " + e.what());
  } catch (...) {
    completion.finish(MESHRUN_INTERNAL, what + ": unknown C++ exception");
  }
}

}  // namespace

std::byte* sized(std::vector<std::byte>& buffer, size_t bytes) {
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

void check_mpi(int rc, const char* call) {
  if (rc != MPI_SUCCESS)
    throw Error(MESHRUN_INTERNAL, std::string(call) + ": " + mpi_error_text(rc));
}

void Completion::finish(int32_t code, std::string message) {
  {
    std::lock_guard lock(mutex_);
    done_ = true;
    code_ = code;
    message_ = std::move(message);
  }
  finished_.notify_all();
}

bool Completion::wait_for(double seconds) {
  // Beyond this a deadline would overflow the clock: no limit.
  constexpr double kForever = 1e9;
  std::unique_lock lock(mutex_);
  if (seconds < 0 || seconds > kForever) {
    finished_.wait(lock, [&] { return done_; });
    return true;
  }
  return finished_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return done_; });
}

bool Completion::done() {
  std::lock_guard lock(mutex_);
  return done_;
}

void Completion::rethrow_failure() {
  std::lock_guard lock(mutex_);
  if (done_ && code_ != MESHRUN_OK) throw Error(code_, message_);
}

std::shared_ptr<Engine> Engine::acquire() {
  static std::mutex mutex;
  static std::weak_ptr<Engine> current;
  std::lock_guard lock(mutex);
  if (auto engine = current.lock()) return engine;
  std::shared_ptr<Engine> engine(new Engine, &Engine::release);
  engine->start();
  current = engine;
  return engine;
}

std::shared_ptr<Completion> Engine::submit(std::string what, Work work) {
  auto completion = std::make_shared<Completion>();
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(Task{std::move(what), std::move(work), completion});
  }
  queued_.notify_one();
  return completion;
}

void Engine::note_timeout(double seconds) {
  std::lock_guard lock(mutex_);
  if (seconds <= 0) unlimited_shutdown_ = true;
  if (seconds > shutdown_limit_) shutdown_limit_ = seconds;
}

void Engine::note_timed_out(const std::string& what) {
  std::lock_guard lock(mutex_);
  if (timed_out_.empty()) timed_out_ = what;
}

std::string Engine::timed_out() {
  std::lock_guard lock(mutex_);
  return timed_out_;
}

void Engine::start() {
  // A process started without a launcher is an MPI singleton, for which Open
  // MPI forks a daemon (orted) so that it could spawn processes later:
  // 0.2 s of every one-rank run, and meshrun never spawns. The environment
  // may still ask for the daemon (OMPI_MCA_ess_singleton_isolated=0); other
  // MPIs ignore the variable. Set here, before the engine's thread exists.
  setenv("OMPI_MCA_ess_singleton_isolated", "1", 0);
  auto started = std::make_shared<Completion>();
  thread_ = std::thread([this, started] {
    try {
      initialize();
      started->finish(MESHRUN_OK, {});
    } catch (...) {
      fail_with_current_exception(*started, "mpi backend");
      stopped_->finish(MESHRUN_OK, {});
      return;
    }
    run();
    stopped_->finish(MESHRUN_OK, {});
  });
  started->wait_for(-1.0);
  started->rethrow_failure();
}

bool Engine::stop() {
  double limit = 0.0;
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(Task{"stop", Work{}, nullptr});
    limit = !timed_out_.empty() ? 0.0 : unlimited_shutdown_ ? -1.0 : shutdown_limit_;
  }
  queued_.notify_one();
  if (!stopped_->wait_for(limit)) {
    thread_.detach();
    return false;
  }
  thread_.join();
  return true;
}

// The deleter of the shared engine. An engine whose thread is stuck in MPI
// (a peer that never arrives) is leaked rather than freed under it.
void Engine::release(Engine* engine) {
  if (engine->stop()) delete engine;
}

void Engine::initialize() {
  int initialized = 0;
  int finalized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized");
  check_mpi(MPI_Finalized(&finalized), "MPI_Finalized");
  if (finalized) {
    throw Error(MESHRUN_FAILED_PRECONDITION,
                "MPI was already finalized in this process (by an earlier instance of the "
                "backend), and MPI cannot be initialized twice");
  }
  int provided = 0;
  if (initialized) {
    check_mpi(MPI_Query_thread(&provided), "MPI_Query_thread");
    if (provided < MPI_THREAD_MULTIPLE) {
      throw Error(MESHRUN_FAILED_PRECONDITION,
                  std::string("MPI was initialized outside the backend with ") +
                      thread_level_name(provided) +
                      "; the backend calls MPI from its own thread, which needs "
                      "MPI_THREAD_MULTIPLE unless the backend initializes MPI itself");
    }
    return;
  }
  check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  owns_mpi_ = true;
  if (provided < MPI_THREAD_FUNNELED) {
    MPI_Finalize();
    throw Error(MESHRUN_FAILED_PRECONDITION, std::string("MPI provides only ") +
                                                 thread_level_name(provided) +
                                                 "; the backend needs MPI_THREAD_FUNNELED");
  }
}

void Engine::run() {
  for (;;) {
    Task task;
    const bool took = next_task(task);
    if (took && !task.work) break;
    if (took) execute(task);
    const bool progressed = poll_in_flight();
    idle_polls_ = took || progressed ? 0 : idle_polls_ + 1;
  }
  cancel_in_flight();
  if (owns_mpi_) MPI_Finalize();
}

// Takes the next queued task. With nothing in flight it sleeps until one
// comes; otherwise it returns false soon so that the caller polls.
bool Engine::next_task(Task& task) {
  std::unique_lock lock(mutex_);
  const auto has_work = [&] { return !queue_.empty(); };
  if (in_flight_.empty()) {
    queued_.wait(lock, has_work);
  } else if (queue_.empty() && idle_polls_ >= kSpinPolls) {
    queued_.wait_for(lock, kPollPause, has_work);
  } else if (queue_.empty()) {
    lock.unlock();
    std::this_thread::yield();
    return false;
  }
  if (queue_.empty()) return false;
  task = std::move(queue_.front());
  queue_.pop_front();
  return true;
}

void Engine::execute(Task& task) {
  try {
    std::vector<MPI_Request> requests = task.work(scratch_);
    if (requests.empty()) {
      task.completion->finish(MESHRUN_OK, {});
    } else {
      in_flight_.push_back({std::move(task.what), std::move(requests), task.completion});
    }
  } catch (...) {
    fail_with_current_exception(*task.completion, task.what);
  }
}

bool Engine::poll_in_flight() {
  bool progressed = false;
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    int done = 0;
    const int rc = MPI_Testall(static_cast<int>(it->requests.size()), it->requests.data(), &done,
                               MPI_STATUSES_IGNORE);
    if (rc != MPI_SUCCESS) {
      it->completion->finish(MESHRUN_INTERNAL, it->what + ": MPI_Testall: " + mpi_error_text(rc));
    } else if (done) {
      it->completion->finish(MESHRUN_OK, {});
    }
    if (rc == MPI_SUCCESS && !done) {
      ++it;
    } else {
      it = in_flight_.erase(it);
      progressed = true;
    }
  }
  return progressed;
}

// Transfers still in flight at shutdown never found their peer: they are
// cancelled so that MPI_Finalize does not wait for them.
void Engine::cancel_in_flight() {
  for (InFlight& transfer : in_flight_) {
    for (MPI_Request& request : transfer.requests) {
      if (request == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&request);
      MPI_Request_free(&request);
    }
    transfer.completion->finish(MESHRUN_UNAVAILABLE,
                                transfer.what + ": cancelled: the mpi backend shut down first");
  }
  in_flight_.clear();
}

}  // namespace meshrun::mpi
