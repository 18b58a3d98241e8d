// A parallel-for for the few-row (decode) GEMMs of quant_gemm.cpp in which the caller never waits
// for a helper thread that has not started a task.
//
// Why not `#pragma omp parallel for`: every OpenMP region ends in a barrier that all the team's
// threads must reach, the ones that found no work included. A batch-1 decode step of SmolLM2
// runs ~120 such regions of 20-200 us each; on a shared 2-core box (load ~8 from other
// processes) the second thread was off its core at most of them and each barrier waited for its
// next time slice: 1.6 tok/s with 2 threads against 16 tok/s with 1 (2026-11-27). Here tasks are
// claimed one at a time from a shared counter; the caller runs tasks too and then waits only for
// the tasks a helper has claimed and not finished. A helper that is asleep or preempted claims
// nothing, and the caller does all the work alone, as with one thread.
//
// Helpers spin for a while after their last job (a decode step's GEMMs come microseconds apart)
// and then sleep on a condition variable; the caller wakes them only when some are asleep. The
// pool is made once per process and never destroyed (its threads are detached: a joinable
// std::thread in a static destructor would terminate the process at exit).
#pragma once

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace radixlm_quant {

class ClaimPool {
 public:
  // fn(ctx, i) for i in [0, ntask), on the caller and up to `helpers` pool threads. False (and
  // nothing run) while another thread is running a job here: that caller takes another path.
  bool run(int64_t ntask, int helpers, void (*fn)(void*, int64_t), void* ctx) {
    if (busy_.exchange(true, std::memory_order_acquire)) return false;
    if (backoff_ > 0) {  // a helper stalled a recent job: alone for a while (see below)
      --backoff_;
      helpers = 0;
    }
    if (helpers <= 0 || ntask <= 1) {
      for (int64_t i = 0; i < ntask; ++i) fn(ctx, i);
      busy_.store(false, std::memory_order_release);
      return true;
    }
    grow(helpers);
    const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    // closed first: a helper still holding the last job's state must fail its claim (its CAS
    // expects that state) before it can see this job's task count
    state_.store(((gen - 1) << 32) | kClosed, std::memory_order_seq_cst);
    fn_ = fn;
    ctx_ = ctx;
    ntask_.store(ntask, std::memory_order_relaxed);
    allowed_.store(helpers, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    state_.store(gen << 32, std::memory_order_seq_cst);  // publishes the job (release)
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    int64_t mine = 0;
    const auto t_own = std::chrono::steady_clock::now();
    for (int64_t i; (i = claim(gen)) >= 0; ++mine) fn(ctx, i);
    // only tasks a helper claimed are left: wait for those. A helper preempted in a task holds
    // the caller until its next time slice (milliseconds on a loaded box): after such a wait the
    // next backoff_len_ jobs run on the caller alone, then helpers are tried again. The length
    // doubles with each stall, up to kBackoffJobs (~30 SmolLM2 decode steps), and halves after
    // each kCalmJobs jobs in a row that the helpers finished in time: a lone stall on a quiet
    // box (a helper interrupted once) then costs half a step alone instead of 30 steps, while a
    // loaded box, stalling again at each retry, is back at the longest back-off in 7 stalls.
    // A helper in the middle of its last task is no stall: the wait counts as one only past
    // twice the caller's own mean task time (and kStallUs). With kStallUs alone, a job of long
    // tasks (SmolLM2's tied head at 6-9 rows: ~250 us a task) "stalled" whenever the helper
    // finished last, and the GEMMs after it ran on one thread: a 2-thread head at 6 rows took
    // as long as a 1-thread one, in one run of two (2026-11-28).
    bool stalled = false;
    if (done_.load(std::memory_order_acquire) + mine < ntask) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto own = (t0 - t_own) / std::max<int64_t>(mine, 1);
      const auto limit = std::max<std::chrono::steady_clock::duration>(
          std::chrono::microseconds(kStallUs), 2 * own);
      while (done_.load(std::memory_order_acquire) + mine < ntask) _mm_pause();
      stalled = std::chrono::steady_clock::now() - t0 > limit;
    }
    if (stalled) {
      backoff_ = backoff_len_;
      backoff_len_ = std::min(2 * backoff_len_, kBackoffJobs);
      calm_ = 0;
    } else if (++calm_ >= kCalmJobs) {
      backoff_len_ = std::max(backoff_len_ / 2, kMinBackoffJobs);
      calm_ = 0;
    }
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  // the next task of job `gen`, or -1 when none is left (or a newer job replaced it)
  int64_t claim(uint64_t gen) {
    uint64_t s = state_.load(std::memory_order_acquire);
    while ((s >> 32) == gen &&
           static_cast<int64_t>(s & 0xffffffffu) < ntask_.load(std::memory_order_relaxed)) {
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel))
        return static_cast<int64_t>(s & 0xffffffffu);
    }
    return -1;
  }

  void grow(int helpers) {
    while (started_ < helpers) {
      const int id = started_++;
      std::thread([this, id] { loop(id); }).detach();
    }
  }

  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      const uint64_t gen = wait_new(seen);
      seen = gen;
      // a job's fields are valid while one of its tasks is claimed and not done: the caller
      // does not return (nor publish the next job) before done_ counts it
      if (id >= allowed_.load(std::memory_order_relaxed)) continue;
      for (int64_t i; (i = claim(gen)) >= 0;) {
        fn_(ctx_, i);
        done_.fetch_add(1, std::memory_order_release);
      }
    }
  }

  uint64_t wait_new(uint64_t seen) {
    using clock = std::chrono::steady_clock;
    const auto until = clock::now() + std::chrono::microseconds(kSpinUs);
    for (int n = 0;; ++n) {
      const uint64_t g = state_.load(std::memory_order_acquire) >> 32;
      if (g != seen) return g;
      _mm_pause();
      if ((n & 255) == 255) {
        if (clock::now() > until) break;
        // give the core away if anything else waits for it: an OpenMP team's thread (a torch op
        // such as indexing a 9-row tensor opens a 2-thread region) otherwise waited for this
        // spin to end or for the next scheduler tick, 4-12 ms, per region (speculative verifies
        // on the 2-core box, 2026-11-27)
        sched_yield();
      }
    }
    std::unique_lock<std::mutex> lk(mu_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    cv_.wait(lk, [&] { return (state_.load(std::memory_order_seq_cst) >> 32) != seen; });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return state_.load(std::memory_order_acquire) >> 32;
  }

  static constexpr int kSpinUs = 2000;  // > the gaps between a decode step's GEMMs
  static constexpr int kStallUs = 200;   // a wait this long: the helper was off its core
  static constexpr int kBackoffJobs = 4096;
  static constexpr int kMinBackoffJobs = 64;  // about half a SmolLM2 decode step's GEMMs
  int backoff_ = 0;                      // jobs left to run without helpers (caller's only)
  static constexpr int kCalmJobs = 1024;
  int backoff_len_ = kMinBackoffJobs;    // the next stall's back-off (caller's only)
  int calm_ = 0;                         // helped jobs since the last stall (caller's only)
  static constexpr uint64_t kClosed = 0xffffffffu;  // "next task" of a job being replaced
  std::atomic<uint64_t> state_{0};      // job generation << 32 | next task
  std::atomic<int64_t> ntask_{0};
  std::atomic<bool> busy_{false};
  std::atomic<int64_t> done_{0};        // tasks finished by helpers in this job
  std::atomic<int> allowed_{0};         // helpers with id < allowed_ take part
  std::atomic<int> sleepers_{0};
  void (*fn_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  int started_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
};

// The process's pool (leaked on purpose, see above). One job at a time: a concurrent caller's
// run() returns false and it takes the OpenMP path.
inline ClaimPool& claim_pool() {
  static ClaimPool* p = new ClaimPool();
  return *p;
}

}  // namespace radixlm_quant
