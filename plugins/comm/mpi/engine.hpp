// The engine: the one thread of the process that makes MPI calls.
//
// MPI is initialized with MPI_THREAD_FUNNELED on this thread, so every MPI
// call of the backend, and nothing else's, runs here. Callers hand it work
// and wait on a Completion. Work runs in submission order; work that starts
// point-to-point transfers returns their MPI requests, which the engine
// polls between and after later work, so a send never holds up the
// collectives or receives queued behind it.
//
// One engine serves every instance of the plugin in a process, although the
// design asks for one per instance: MPI can be initialized once per process
// and, under FUNNELED, called from one thread only, so a second instance with
// its own thread could not make MPI calls. The engine starts with the first
// world() of any instance and finalizes MPI when the last instance and
// communicator holding it are gone.
#pragma once

#include <mpi.h>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "meshrun/error.h"

namespace meshrun::mpi {

// Buffers the collectives reuse from one operation to the next. Only the
// engine thread touches them.
struct Scratch {
  std::vector<std::byte> accumulator;
  std::vector<std::byte> incoming;
  // A path's copy of an operand that overlaps another (in place).
  // Allocating it per call instead costs 6x the all_gather at 32 MiB: the
  // fresh pages fault in every time.
  std::vector<std::byte> staged;
  // The hierarchical path's reordered blocks; the paths it calls do not
  // touch these.
  std::vector<std::byte> ordered_in;
  std::vector<std::byte> ordered_out;
};

// `buffer`, grown to at least `bytes`.
std::byte* sized(std::vector<std::byte>& buffer, size_t bytes);

// The outcome of one operation, shared by the caller's request and the
// engine, so that either may let go of it first.
class Completion {
 public:
  // `code` MESHRUN_OK for success.
  void finish(int32_t code, std::string message);
  // True once finished within `seconds`; seconds < 0 waits without limit.
  bool wait_for(double seconds);
  bool done();
  // Throws meshrun::plugin::Error with the operation's error, if it failed.
  void rethrow_failure();

 private:
  std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  int32_t code_ = MESHRUN_OK;
  std::string message_;
};

// Work for the engine thread. It returns the MPI requests it leaves in
// flight; the operation completes when they do (at once when none).
using Work = std::function<std::vector<MPI_Request>(Scratch&)>;

class Engine {
 public:
  // The process's engine, started by the first call (MPI initialized on its
  // thread). Throws FAILED_PRECONDITION when MPI cannot be used from it.
  static std::shared_ptr<Engine> acquire();

  // Queues `work`; `what` (e.g. "all_reduce on communicator 'tp' ...")
  // prefixes its error message.
  std::shared_ptr<Completion> submit(std::string what, Work work);
  // Remembers the longest world timeout: how long shutdown waits for work
  // still queued. <= 0: no limit.
  void note_timeout(double seconds);
  // Records that `what` ran past the world's timeout. From then on the job
  // is broken: nothing waits for the world's timeout again (a rank giving
  // up would otherwise wait it once more for every request it drops), and
  // shutdown does not wait for queued work.
  void note_timed_out(const std::string& what);
  // The first operation that timed out; empty while none has.
  std::string timed_out();

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

 private:
  struct Task {
    std::string what;
    Work work;  // empty: stop
    std::shared_ptr<Completion> completion;
  };
  struct InFlight {
    std::string what;
    std::vector<MPI_Request> requests;
    std::shared_ptr<Completion> completion;
  };

  Engine() = default;
  void start();
  // Stops the thread once queued work is done, waiting up to the longest
  // timeout. False when it did not stop: the thread is then left running.
  bool stop();
  static void release(Engine* engine);

  void run();
  void initialize();
  bool next_task(Task& task);
  void execute(Task& task);
  bool poll_in_flight();
  void cancel_in_flight();

  std::mutex mutex_;
  std::condition_variable queued_;
  std::deque<Task> queue_;
  double shutdown_limit_ = 0.0;
  bool unlimited_shutdown_ = false;
  std::string timed_out_;

  std::thread thread_;
  std::shared_ptr<Completion> stopped_ = std::make_shared<Completion>();
  bool owns_mpi_ = false;
  // Engine thread only.
  std::vector<InFlight> in_flight_;
  Scratch scratch_;
  int idle_polls_ = 0;
};

// Throws meshrun::plugin::Error (INTERNAL) naming `call` and MPI's reason
// unless `rc` is MPI_SUCCESS.
void check_mpi(int rc, const char* call);

}  // namespace meshrun::mpi
