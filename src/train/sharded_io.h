// Checkpoints of a layout's parts, and back, in either format (train.checkpoint_format):
// "whole", the one-device format (every parameter whole, by name), assembled on one rank; or
// "sharded" (checkpoint/sharded_checkpoint.h), every rank writing what it owns. Whatever the
// layout (pipeline stages, tensor-parallel shards, both, each under data parallelism / ZeRO),
// either format resumes under any layout.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "mesh/device_mesh.h"
#include "parallel/data_parallel.h"

namespace loom {

class Gpt2Stage;

// A save in three parts: staging, what needs the training state and the collectives — the
// state gathered into host buffers, with `private_copies` copied so that nothing is read from the
// live buffers afterwards (train.async_checkpoint; the whole format's assembled model is its own
// buffer anyway); `write`, this rank's files, which touches no communicator and may run on a
// thread of its own while training goes on; `commit`, collective again (every rank of the world
// calls it, after its write), which publishes the checkpoint (step_N.tmp renamed to step_N) and
// returns its path on world rank 0, "" elsewhere. A synchronous save calls the three in a row.
struct StagedCheckpoint {
  std::function<void()> write;
  std::function<std::string()> commit;
};

// Staging is collective over the world. `parts[k]` is a model part this rank holds (its pipeline
// chunks, or its whole model — possibly a tensor-parallel shard) and `engines[k]` the engine
// owning its state.
//
// "whole": without pipeline and tensor parallelism every rank holds the whole model: its engine
// gathers the state over its group (dp, or dp × cp) and world rank 0 writes it (one whole-model
// buffer). Otherwise each part's state is gathered over dp; at dp coordinate 0 every rank writes
// its pieces into a whole-model buffer (replicated parameters from tp rank 0 only, the tied wte
// from the first stage only), a sum-reduce over pp, then over tp, assembles the model on the rank
// at (dp, pp, tp) = (0, 0, 0), which writes it. Under expert parallelism (`expert_parallel`, the
// rank's group) the first expert-parallel group's ranks each add their experts, and a sum over
// it comes first. Memory: three whole-model f32 buffers on each rank
// of dp replica 0 while saving.
// "sharded": no communication but two barriers (one staging, one committing); every rank writes
// the values and moments of its ZeRO chunks (in stage 0 an equal split of every unit) of its
// parts, the same replicated parameters and tied wte left to one rank, into
// shard_<world rank>.safetensors. Memory: one copy of what the rank owns (two with
// `private_copies` on the host).
StagedCheckpoint stage_layout_checkpoint(const std::string& dir,
                                         const std::vector<Gpt2Stage*>& parts,
                                         const std::vector<DataParallel*>& engines,
                                         DeviceMesh& mesh, const Config& config,
                                         const TrainingState& st, bool private_copies,
                                         Communicator* expert_parallel = nullptr);

// A host copy of `state` that shares no buffer with it (on the host: a clone; from a GPU: the
// copy), for a write that runs while training changes the original.
FlatModelState private_host_copy(const FlatModelState& state);

// Reads a checkpoint of either format and gives each engine its part's pieces (padding zero).
// From a sharded one each rank reads only the shard files holding its pieces.
TrainingState load_layout_checkpoint(const std::string& checkpoint_dir,
                                     const std::vector<Gpt2Stage*>& parts,
                                     const std::vector<DataParallel*>& engines,
                                     const Config& config);

// Fine-tuning's start (train.init_from): every engine's part gets the weights of a HuggingFace
// GPT-2 directory (checkpoint/export.h: load_hf_weights), its optimizer moments zero and its
// step count 0, as a fresh run's. Each rank reads the files and keeps its part.
void init_layout_from_hf(const std::string& hf_dir, const std::vector<Gpt2Stage*>& parts,
                         const std::vector<DataParallel*>& engines, const Config& config);

// The same from a Loom checkpoint of either format (train.init_from = a step_N directory): its
// weights only, read one parameter at a time (checkpoint/checkpoint_reader.h), each of the
// model's parameters with its shape there (an error naming the checkpoint, the parameter and
// both shapes otherwise); the moments zero, the step count 0. Returns the checkpoint's balancing
// biases of a mixture (empty: none), which route as they did.
std::vector<float> init_layout_from_checkpoint(const std::string& checkpoint_dir,
                                               const std::vector<Gpt2Stage*>& parts,
                                               const std::vector<DataParallel*>& engines,
                                               const Config& config);

}  // namespace loom
