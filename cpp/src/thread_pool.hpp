#pragma once
// A persistent pool of worker threads for the CPU kernels.
//
// Starting std::threads costs tens of microseconds per call, as much as copying
// a few MiB, so the copies reuse sleeping workers instead (woken through a
// condition variable; nothing spins between calls). One job runs at a time;
// callers from several threads queue. A call made from inside a job, or after
// fork() in the child, runs on the calling thread / a fresh pool.
#include <cstddef>
#include <functional>

namespace seqpack::detail {

// Calls fn(i) for every i in [0, n), spread over the calling thread and up to
// n - 1 pool workers; returns when all have returned. The first exception
// thrown by fn is rethrown here (the other indices still run).
void parallel_for(size_t n, const std::function<void(size_t)>& fn);

// Hardware threads this process may run on (its CPU affinity), at least 1.
size_t available_threads();

}  // namespace seqpack::detail
