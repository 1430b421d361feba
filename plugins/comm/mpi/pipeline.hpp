// The shared segment of a communicator whose ranks are all on this node: one
// POSIX shared-memory object that every rank maps, through which large
// all_reduces stream in cache-sized pieces (pipeline.cpp; the collective
// itself is declared in collectives.hpp).
#pragma once

#include <memory>

#include "communicator.hpp"

namespace meshrun::mpi::pipeline {

// Collective over `comm` (every rank on this node, size > 1), on the engine
// thread: rank 0 creates the object, every rank maps it, and rank 0 unlinks
// its name as soon as all have, so that nothing is left behind when a rank
// dies later. Null on every rank when any rank could not map it.
std::shared_ptr<Segment> make_segment(const Comm& comm);

}  // namespace meshrun::mpi::pipeline
