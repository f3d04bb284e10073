// The `local` backend: ranks are threads of one process, collectives go through shared memory.
//
// make_local_world(n) returns one communicator per rank; hand communicator r to the thread that
// runs rank r. The ranks of a group share one LocalGroup (local_group.h): per collective
// sequence number, each rank posts its buffer pointers there, and after a rendezvous every rank
// moves data directly between the posted buffers — no lock around a shared buffer, no extra copy.
//
// All-reduce, reduce-scatter and reduce are "each rank reduces its own chunk": rank r reads
// chunk r (a 1/n slice, 64-byte aligned) of every rank's buffer in the fixed order 0..n-1,
// block by block, and writes the result straight into the destination buffers' chunk r. Chunk r
// of any buffer is touched by rank r only, so there is no race and no intermediate barrier; the
// whole all-reduce reads and writes every buffer once (2nS bytes, the minimum). A final
// rendezvous keeps every buffer alive and untouched by its owner until all ranks are done.
//
// Reductions: f32/f64 in their own type; bf16/f16 converted to f32, reduced in rank order,
// rounded once; avg = sum / size (for i32/i64 an integer division, truncating toward zero;
// integer sums wrap instead of overflowing). So results are deterministic, and every rank of an
// all-reduce receives identical bits.
//
// Send/recv are eager: the sender copies the tensor into the (src, dst, tag) FIFO mailbox and
// completes; the receiver copies it out. A send never waits for its receiver, so rings of
// send-then-recv cannot deadlock on the in-order progress thread.
//
// Each communicator of size > 1 owns one progress thread that runs its queued operations in
// issue order; a group of size 1 runs them inline. The descriptors (op, count, dtype, root) of
// every collective are always compared across ranks, as they sit in shared memory anyway: this
// is what CommOptions::debug_checks / LOOM_COMM_DEBUG=1 turn on for the other backends, and here
// it also keeps a mismatched call from reading past a buffer.
//
// Files: local_group.{h,cc} (slots, rendezvous, mailboxes, abort), local_reduce.{h,cc} (the
// element loops), this file (the communicator and its progress thread).
//
// Flight recorder: each rank has one FlightRecorder (CommOptions::flight_capacity records),
// owned by its world communicator and shared with the communicators split from it; every group
// the rank joins is registered with its members' world ranks. Each operation is recorded as
// issued (by the calling thread, when enqueued), started (when the progress thread begins it),
// then completed or failed. Collectives and splits carry the group's sequence number; send/recv
// are recorded under the group "<name>:p2p" (not a registered group, so `loom debug hang`
// ignores them) with op "send(dst=D, tag=T)" / "recv(src=S, tag=T)" and the number of earlier
// messages on that (peer, tag) as seq.
// Dumps, only when CommOptions::flight_dir is set, each rank at most once per world
// (FlightRecorder::dump(flight_dir, world rank, world size, reason)):
// - a rank whose wait times out dumps before its wait() throws, then aborts the world with
//   "rank R failed: <the timeout message>", so that
// - every rank whose operation then fails because of the abort (or because a peer gave up on
//   the same collective) dumps too, before its wait() throws;
// - a rank that is in no operation at that time (e.g. the one that skipped the collective and
//   finished its body) dumps when its world communicator is destroyed, if the world was
//   aborted by then. A rank that destroyed its world communicator before the abort writes no
//   dump (the analysis reports it as "no dump from rank(s) R").
// Without flight_dir a timeout does not abort the world (it only fails the waiting rank).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/flight_recorder.h"

namespace loom {

// A communicator of the local backend; adds what a thread-rank harness needs.
class LocalCommunicator : public Communicator {
 public:
  // Fails the whole world this communicator belongs to (every group split from it): every rank
  // waiting in, or later entering, an operation throws CommError "... aborted: <reason>".
  // The first reason wins. Thread-safe; call it from any thread.
  virtual void abort(const std::string& reason) = 0;
  // This rank's flight recorder (shared by all its communicators of one world).
  virtual const FlightRecorder& flight_recorder() const = 0;
};

// One communicator per rank (each a LocalCommunicator), group name "world". size >= 1.
// options.debug_checks is also set by the environment variable LOOM_COMM_DEBUG=1.
std::vector<std::unique_ptr<Communicator>> make_local_world(int size,
                                                            const CommOptions& options = {});

}  // namespace loom
