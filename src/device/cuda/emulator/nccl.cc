// NCCL for the CUDA emulator (LOOM_CUDA_EMULATE=ON): the part of nccl.h that comm/nccl calls,
// between thread ranks of one process, so the nccl backend runs end to end without GPUs.
//
// As on GPUs, operations are asynchronous and ordered: a call enqueues this rank's operation on
// the communicator and returns; the communicator's operations run in issue order (those fused in
// one ncclGroupStart/End run together), each only once every earlier one has finished, as on the
// stream NCCL's kernels run on. A collective runs when every rank's part is at the head of its
// queue (the rank that completes it computes it for all, in rank order, so results are
// deterministic); a send and a receive run together, matched in order per pair of ranks, when
// both are at the head of their queues — NCCL's sends block until the receiver is there, so a
// program that would deadlock on GPUs (two ranks sending to each other before receiving, outside
// a group) deadlocks here too, and the backend's timeouts report it. The stream's events say when
// an operation finished (streams.h). Collectives must agree on kind, count, type, operator and
// root, and a receive's size must equal its send's: otherwise an asynchronous error. Non-blocking
// communicators (config.blocking = 0) report ncclInProgress until every rank has joined. Between
// processes the unique id means nothing: MPI jobs need the real NCCL.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/error.h"
#include "device/cuda/emulator/scheduler.h"
#include "device/cuda/emulator/streams.h"

using loom::cuda_emu::StreamWork;

namespace {

struct Group;

// One rank's enqueued operation: it may run once every operation enqueued before it on the same
// communicator has run, except those of its own group.
struct Op {
  uint64_t group = 0;
  bool executed = false;
  std::shared_ptr<StreamWork> work = std::make_shared<StreamWork>();
};

}  // namespace

struct ncclComm {
  std::shared_ptr<Group> group;  // null until a split that makes it completes
  int rank = -1;
  bool ready = false;
  int64_t next_collective = 0;
  std::deque<std::shared_ptr<Op>> queue;  // enqueued, in issue order (executed ones trimmed)
  ncclResult_t error = ncclSuccess;
  std::string last_error;
};

namespace {

enum class Kind { kAllReduce, kBroadcast, kReduce, kAllGather, kReduceScatter, kSplit };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllReduce:
      return "ncclAllReduce";
    case Kind::kBroadcast:
      return "ncclBroadcast";
    case Kind::kReduce:
      return "ncclReduce";
    case Kind::kAllGather:
      return "ncclAllGather";
    case Kind::kReduceScatter:
      return "ncclReduceScatter";
    case Kind::kSplit:
      return "ncclCommSplit";
  }
  return "?";
}

// One rank's part of a collective (or of a split).
struct Post {
  Kind kind = Kind::kAllReduce;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  ncclRedOp_t op = ncclSum;
  int root = 0;
  int color = 0, key = 0;
  ncclComm* child = nullptr;
  ncclComm* comm = nullptr;
  std::shared_ptr<Op> queued;  // null for a split, which runs on the host
};

// One side of a point-to-point message.
struct Transfer {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t bytes = 0;
  ncclComm* comm = nullptr;
  std::shared_ptr<Op> queued;
};

struct Group {
  int size = 0;
  std::vector<ncclComm*> members;                // by rank; null once destroyed
  std::map<int64_t, std::map<int, Post>> slots;  // collective number -> rank -> part
  std::map<std::pair<int, int>, std::deque<Transfer>> sends, recvs;  // (src, dst), in order
};

std::mutex g_mutex;                                       // every bit of emulated NCCL state
std::map<std::string, std::shared_ptr<Group>> g_forming;  // unique id -> group being initialised
std::set<ncclComm*> g_live;
uint64_t g_next_group = 0;
thread_local int t_group_depth = 0;      // ncclGroupStart nesting
thread_local uint64_t t_open_group = 0;  // the group of the calls inside it
uint64_t g_next_id = 0;
thread_local std::string t_last_error;

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclFloat32:
    case ncclInt32:
      return 4;
    case ncclFloat64:
    case ncclInt64:
      return 8;
    default:
      return 0;  // not emulated
  }
}

bool is_float(ncclDataType_t t) {
  return t == ncclFloat16 || t == ncclBfloat16 || t == ncclFloat32 || t == ncclFloat64;
}

double load_float(ncclDataType_t t, const void* p, size_t i) {
  switch (t) {
    case ncclFloat16:
      return __half2float(static_cast<const __half*>(p)[i]);
    case ncclBfloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case ncclFloat32:
      return static_cast<const float*>(p)[i];
    default:
      return static_cast<const double*>(p)[i];
  }
}

void store_float(ncclDataType_t t, void* p, size_t i, double v) {
  switch (t) {
    case ncclFloat16:
      static_cast<__half*>(p)[i] = __float2half_rn(static_cast<float>(v));
      return;
    case ncclBfloat16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(static_cast<float>(v));
      return;
    case ncclFloat32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      return;
    default:
      static_cast<double*>(p)[i] = v;
      return;
  }
}

int64_t load_int(ncclDataType_t t, const void* p, size_t i) {
  return t == ncclInt32 ? static_cast<const int32_t*>(p)[i] : static_cast<const int64_t*>(p)[i];
}

void store_int(ncclDataType_t t, void* p, size_t i, int64_t v) {
  if (t == ncclInt32)
    static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
  else
    static_cast<int64_t*>(p)[i] = v;
}

template <typename T>
T combine(ncclRedOp_t op, T a, T b) {
  switch (op) {
    case ncclProd:
      return a * b;
    case ncclMax:
      return std::max(a, b);
    case ncclMin:
      return std::min(a, b);
    default:
      return a + b;  // sum, avg
  }
}

// Element-wise reduction of the ranks' `n` elements, in rank order, into a fresh buffer.
std::vector<char> reduce(const std::vector<const void*>& inputs, size_t n, ncclDataType_t t,
                         ncclRedOp_t op) {
  std::vector<char> out(n * type_size(t));
  const auto ranks = static_cast<int64_t>(inputs.size());
  for (size_t i = 0; i < n; ++i) {
    if (is_float(t)) {
      double acc = load_float(t, inputs[0], i);
      for (size_t r = 1; r < inputs.size(); ++r)
        acc = combine(op, acc, load_float(t, inputs[r], i));
      if (op == ncclAvg) acc /= static_cast<double>(ranks);
      store_float(t, out.data(), i, acc);
    } else {
      int64_t acc = load_int(t, inputs[0], i);
      for (size_t r = 1; r < inputs.size(); ++r) acc = combine(op, acc, load_int(t, inputs[r], i));
      if (op == ncclAvg) acc /= ranks;
      store_int(t, out.data(), i, acc);
    }
  }
  return out;
}

void finish(Op& op) {
  op.executed = true;
  op.work->done = true;
}

// Whether `op`, enqueued on `c`, may run: everything enqueued before it has run, bar its group.
bool active(ncclComm* c, const std::shared_ptr<Op>& op) {
  if (!op) return true;
  while (!c->queue.empty() && c->queue.front()->executed) c->queue.pop_front();
  return !c->queue.empty() && c->queue.front()->group == op->group;
}

// A new operation on `c`: fused with the calls of an open ncclGroupStart, else a group of its own.
std::shared_ptr<Op> enqueue(ncclComm* c) {
  auto op = std::make_shared<Op>();
  op->group = t_group_depth > 0 ? t_open_group : ++g_next_group;
  c->queue.push_back(op);
  return op;
}

// Runs every collective and message whose ranks are all at the head of their queues, until none
// is left (each one run may let the operations behind it run).
void progress_locked(Group& g);

// The collective's ranks have all posted and may run: compute it for every rank.
void execute(Group& g, std::map<int, Post>& parts) {
  const Post& p = parts.at(0);
  const size_t elem = type_size(p.type), n = p.count;
  std::vector<const void*> sends;
  for (auto& [rank, part] : parts) sends.push_back(part.send);
  switch (p.kind) {
    case Kind::kAllReduce:
    case Kind::kReduce: {
      const std::vector<char> result = reduce(sends, n, p.type, p.op);
      for (auto& [rank, part] : parts)
        if (p.kind == Kind::kAllReduce || rank == p.root)
          std::memcpy(part.recv, result.data(), result.size());
      break;
    }
    case Kind::kBroadcast: {
      const auto* root = static_cast<const char*>(parts.at(p.root).send);
      const std::vector<char> data(root, root + n * elem);
      for (auto& [rank, part] : parts) std::memcpy(part.recv, data.data(), data.size());
      break;
    }
    case Kind::kAllGather: {
      std::vector<char> all(static_cast<size_t>(g.size) * n * elem);
      for (auto& [rank, part] : parts)
        std::memcpy(all.data() + static_cast<size_t>(rank) * n * elem, part.send, n * elem);
      for (auto& [rank, part] : parts) std::memcpy(part.recv, all.data(), all.size());
      break;
    }
    case Kind::kReduceScatter: {
      const std::vector<char> result = reduce(sends, n * static_cast<size_t>(g.size), p.type, p.op);
      for (auto& [rank, part] : parts)
        std::memcpy(part.recv, result.data() + static_cast<size_t>(rank) * n * elem, n * elem);
      break;
    }
    case Kind::kSplit: {
      std::map<int, std::vector<std::pair<int, int>>> by_color;  // color -> (key, rank)
      for (auto& [rank, part] : parts)
        if (part.child != nullptr && g_live.count(part.child) != 0)
          by_color[part.color].push_back({part.key, rank});
      for (auto& [color, members] : by_color) {
        std::sort(members.begin(), members.end());
        auto child = std::make_shared<Group>();
        child->size = static_cast<int>(members.size());
        for (size_t i = 0; i < members.size(); ++i) {
          ncclComm* c = parts.at(members[i].second).child;
          c->group = child;
          c->rank = static_cast<int>(i);
          c->ready = true;
          child->members.push_back(c);
        }
      }
      break;
    }
  }
  for (auto& [rank, part] : parts)
    if (part.queued) finish(*part.queued);
}

ncclResult_t fail(ncclComm* c, ncclResult_t result, std::string why) {
  t_last_error = why;
  if (c != nullptr) {
    c->error = result;
    c->last_error = std::move(why);
  }
  return result;
}

ncclResult_t usable(ncclComm* c) {
  if (c == nullptr || g_live.count(c) == 0)
    return fail(nullptr, ncclInvalidArgument, "not a live communicator");
  if (!c->ready) return fail(c, ncclInvalidUsage, "the communicator is not initialised yet");
  return ncclSuccess;
}

bool same_collective(const Post& a, const Post& b) {
  return a.kind == b.kind && a.count == b.count && a.type == b.type && a.op == b.op &&
         a.root == b.root;
}

// Enqueues this rank's part of collective number next_collective (a split runs on the host as
// soon as every rank has posted, outside the queue).
ncclResult_t post(ncclComm* c, Post part, cudaStream_t stream) {
  loom::cuda_emu::note_queued();
  std::shared_ptr<StreamWork> work;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (ncclResult_t r = usable(c); r != ncclSuccess) return r;
    if (part.kind != Kind::kSplit && type_size(part.type) == 0)
      return fail(c, ncclInvalidArgument,
                  loom::detail::concat(kind_name(part.kind), ": data type ", part.type,
                                       " is not emulated"));
    Group& g = *c->group;
    if (part.root < 0 || part.root >= g.size)
      return fail(c, ncclInvalidArgument, loom::detail::concat("root ", part.root, " of ", g.size));
    part.comm = c;
    if (part.kind != Kind::kSplit) {
      part.queued = enqueue(c);
      work = part.queued->work;
    }
    const int64_t number = c->next_collective++;
    std::map<int, Post>& parts = g.slots[number];
    if (!parts.empty() && !same_collective(parts.begin()->second, part)) {
      const Post& other = parts.begin()->second;
      // Left unfinished, blocking what follows on this rank: its wait reports this error.
      fail(c, ncclInvalidUsage,
           loom::detail::concat("collective #", number, ": rank ", c->rank, " posted ",
                                kind_name(part.kind), " of ", part.count, " × type ", part.type,
                                ", rank ", parts.begin()->first, " posted ", kind_name(other.kind),
                                " of ", other.count, " × type ", other.type,
                                " (every rank must issue the same collectives in order)"));
    } else {
      parts[c->rank] = part;
      progress_locked(g);
    }
  }
  if (work && stream != nullptr) loom::cuda_emu::enqueue_on_stream(stream, work);
  return ncclSuccess;
}

void progress_locked(Group& g) {
  for (bool ran = true; ran;) {
    ran = false;
    for (auto it = g.slots.begin(); it != g.slots.end();) {
      auto& parts = it->second;
      const bool ready = static_cast<int>(parts.size()) == g.size &&
                         std::all_of(parts.begin(), parts.end(), [](const auto& rp) {
                           return active(rp.second.comm, rp.second.queued);
                         });
      if (!ready) {
        ++it;
        continue;
      }
      execute(g, parts);
      it = g.slots.erase(it);
      ran = true;
    }
    for (auto& [route, sends] : g.sends) {
      std::deque<Transfer>& recvs = g.recvs[route];
      while (!sends.empty() && !recvs.empty() && active(sends.front().comm, sends.front().queued) &&
             active(recvs.front().comm, recvs.front().queued)) {
        const Transfer& out = sends.front();
        const Transfer& in = recvs.front();
        if (out.bytes != in.bytes) {
          // The receive stays unfinished: its rank's wait reports the error.
          fail(in.comm, ncclInvalidUsage,
               loom::detail::concat("a recv of ", in.bytes, " bytes from rank ", route.first,
                                    " matched its send of ", out.bytes, " bytes"));
        } else {
          if (out.bytes > 0) std::memcpy(in.recv, out.send, out.bytes);
          finish(*in.queued);
        }
        finish(*out.queued);
        sends.pop_front();
        recvs.pop_front();
        ran = true;
      }
    }
  }
}

// A collective's part (count is per rank for all-gather and reduce-scatter, as in NCCL).
ncclResult_t collective(Kind kind, const void* send, void* recv, size_t count, ncclDataType_t type,
                        ncclRedOp_t op, int root, ncclComm* c, cudaStream_t stream) {
  Post part;
  part.kind = kind;
  part.send = send;
  part.recv = recv;
  part.count = count;
  part.type = type;
  part.op = op;
  part.root = root;
  return post(c, part, stream);
}

// Forgets everything of `c` that others could still touch: its parts of unfinished collectives
// and messages (finished, so its stream does not wait forever; its buffers are not read again).
void forget_locked(ncclComm* c) {
  g_live.erase(c);
  for (auto& op : c->queue) finish(*op);
  c->queue.clear();
  if (!c->group) return;
  Group& g = *c->group;
  for (auto& [number, parts] : g.slots) parts.erase(c->rank);
  for (auto* routes : {&g.sends, &g.recvs})
    for (auto& [route, transfers] : *routes)
      std::erase_if(transfers, [&](const Transfer& t) { return t.comm == c; });
  if (c->rank >= 0 && c->rank < static_cast<int>(g.members.size()) && g.members[c->rank] == c)
    g.members[c->rank] = nullptr;
}

// Enqueues one side of a message between this rank and `peer`.
ncclResult_t transfer(bool is_send, const void* send, void* recv, size_t count,
                      ncclDataType_t datatype, int peer, ncclComm* c, cudaStream_t stream) {
  std::shared_ptr<StreamWork> work;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (ncclResult_t r = usable(c); r != ncclSuccess) return r;
    Group& g = *c->group;
    if (peer < 0 || peer >= g.size || type_size(datatype) == 0)
      return fail(c, ncclInvalidArgument,
                  loom::detail::concat(is_send ? "ncclSend to " : "ncclRecv from ", peer, " of ",
                                       g.size, ", type ", datatype));
    Transfer t{send, recv, count * type_size(datatype), c, enqueue(c)};
    work = t.queued->work;
    if (is_send)
      g.sends[{c->rank, peer}].push_back(std::move(t));
    else
      g.recvs[{peer, c->rank}].push_back(std::move(t));
    progress_locked(g);
  }
  loom::cuda_emu::enqueue_on_stream(stream, work);
  return ncclSuccess;
}

bool blocking(const ncclConfig_t* config) {
  return config == nullptr || config->blocking != 0;
}

void wait_ready(ncclComm* c) {
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      if (c->ready) return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::memset(id, 0, sizeof *id);
  std::snprintf(id->internal, sizeof id->internal, "loom emulated nccl %llu",
                static_cast<unsigned long long>(++g_next_id));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  ncclComm* c = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (nranks < 1 || rank < 0 || rank >= nranks)
      return fail(nullptr, ncclInvalidArgument,
                  loom::detail::concat("rank ", rank, " of ", nranks, " ranks"));
    const std::string key(id.internal, sizeof id.internal);
    std::shared_ptr<Group>& g = g_forming[key];
    if (!g) {
      g = std::make_shared<Group>();
      g->size = nranks;
      g->members.assign(static_cast<size_t>(nranks), nullptr);
    }
    if (g->size != nranks || g->members[static_cast<size_t>(rank)] != nullptr)
      return fail(nullptr, ncclInvalidUsage,
                  loom::detail::concat("rank ", rank, " of ", nranks, " joined a group of size ",
                                       g->size, " twice or wrongly"));
    c = new ncclComm;
    c->group = g;
    c->rank = rank;
    g->members[static_cast<size_t>(rank)] = c;
    g_live.insert(c);
    *comm = c;
    if (std::all_of(g->members.begin(), g->members.end(),
                    [](ncclComm* m) { return m != nullptr; })) {
      for (ncclComm* m : g->members) m->ready = true;
      g_forming.erase(key);
    }
    if (!blocking(config)) return c->ready ? ncclSuccess : ncclInProgress;
  }
  wait_ready(c);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t* config) {
  ncclComm* child = nullptr;
  if (color != NCCL_SPLIT_NOCOLOR) {
    child = new ncclComm;
    std::lock_guard<std::mutex> lock(g_mutex);
    g_live.insert(child);
  }
  *newcomm = child;
  Post part;
  part.kind = Kind::kSplit;
  part.color = color;
  part.key = key;
  part.child = child;
  const ncclResult_t r = post(comm, part, nullptr);
  if (r != ncclSuccess) {
    if (child != nullptr) {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_live.erase(child);
      delete child;
      *newcomm = nullptr;
    }
    return r;
  }
  if (child == nullptr) return ncclSuccess;
  if (blocking(config)) {
    wait_ready(child);
    return ncclSuccess;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  return child->ready ? ncclSuccess : ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (comm == nullptr || g_live.count(comm) == 0) return ncclInvalidArgument;
  *async_error = !comm->ready ? ncclInProgress : comm->error;
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return comm != nullptr && g_live.count(comm) != 0 ? ncclSuccess : ncclInvalidArgument;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  std::lock_guard<std::mutex> lock(g_mutex);
  forget_locked(comm);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  return ncclCommDestroy(comm);
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (ncclResult_t r = usable(comm); r != ncclSuccess) return r;
  *count = comm->group->size;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (ncclResult_t r = usable(comm); r != ncclSuccess) return r;
  *rank = comm->rank;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error";
    case ncclInternalError:
      return "internal error";
    case ncclInvalidArgument:
      return "invalid argument";
    case ncclInvalidUsage:
      return "invalid usage";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (comm != nullptr && g_live.count(comm) != 0 && !comm->last_error.empty())
    return comm->last_error.c_str();
  return t_last_error.c_str();
}

ncclResult_t ncclGroupStart() {
  if (t_group_depth++ == 0) {
    std::lock_guard<std::mutex> lock(g_mutex);
    t_open_group = ++g_next_group;
  }
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (t_group_depth == 0) return ncclInvalidUsage;
  --t_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) {
  return collective(Kind::kAllReduce, sendbuff, recvbuff, count, datatype, op, 0, comm, stream);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return collective(Kind::kReduce, sendbuff, recvbuff, count, datatype, op, root, comm, stream);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  return collective(Kind::kBroadcast, sendbuff, recvbuff, count, datatype, ncclSum, root, comm,
                    stream);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return collective(Kind::kAllGather, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm,
                    stream);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return collective(Kind::kReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, 0, comm,
                    stream);
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return transfer(true, sendbuff, nullptr, count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return transfer(false, nullptr, recvbuff, count, datatype, peer, comm, stream);
}

}  // extern "C"
