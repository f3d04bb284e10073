#include "train/run_timeline.h"

#include <filesystem>
#include <memory>

#include "device/cuda/cuda_backend.h"

namespace loom {
namespace fs = std::filesystem;

RunTimeline::RunTimeline(Tracer& tracer, const MetricsConfig& metrics, Device device,
                         std::vector<std::pair<std::string, CountingCommunicator*>> axes,
                         Communicator& world, std::string run_dir,
                         std::function<void(const std::string&)> message)
    : tracer_(tracer),
      device_(device),
      first_(metrics.trace_from_step),
      last_(first_ > 0 ? first_ + metrics.trace_steps - 1 : -1),
      axes_(std::move(axes)),
      world_(world),
      run_dir_(std::move(run_dir)),
      message_(std::move(message)) {
  // The waits capture the tracer, not this object: the communicators report to it from their
  // destructors too.
  for (auto& [axis, count] : axes_)
    if (count != nullptr)
      count->on_wait([&tracer, name = "wait: " + axis](double b, double e) {
        tracer.span(name, "comm", b, e);
      });
  if (!device.is_cuda()) return;
  // The GPU's row: the phases as its stream ran them (events between them), and the stream's
  // stalls on each axis' communication, on the host's clock from an anchor taken at the first
  // traced step's start (cuda::anchor_clock).
  tracer.set_device_marks([gpu = device.index]() -> Tracer::DeviceMark {
    std::shared_ptr<cuda::StreamMark> mark = cuda::record_mark(gpu);
    return [mark] { return cuda::mark_seconds(*mark); };
  });
  for (auto& [axis, count] : axes_)
    if (count != nullptr)
      count->on_device_wait([&tracer, name = "wait: " + axis](double b, double e) {
        tracer.span(name, "comm", b, e, Tracer::kDevice);
      });
}

void RunTimeline::begin_step(int64_t step) {
  tracer_.set_active(step >= first_ && step <= last_);
  if (device_.is_cuda() && step == first_) cuda::anchor_clock(device_.index);
}

void RunTimeline::end_step(int64_t step) {
  if (step == last_) write();
}

void RunTimeline::finish(int64_t last_step) {
  // The run ended inside the traced steps (train.steps, --stop-after, a signal): what there is.
  if (!written_ && first_ > 0 && first_ <= last_step && last_step < last_) write();
}

void RunTimeline::write() {
  written_ = true;
  if (device_.is_cuda()) {  // the GPU's row complete: its stream done, its stalls reaped
    cuda::synchronize_compute(device_.index);  // not nccl's streams: they may wait for peers
    for (auto& [axis, count] : axes_)
      if (count != nullptr)
        (void)count->take_wait_seconds();  // the next step's start drops them too
    tracer_.resolve_device_spans();
  }
  const bool leader = world_.rank() == 0;
  const fs::path dir = fs::path(run_dir_) / "trace";
  if (leader) fs::create_directories(dir);
  world_.barrier();
  tracer_.write((dir / ("rank_" + std::to_string(world_.rank()) + ".json")).string());
  world_.barrier();  // every rank's file complete
  if (!leader) return;
  std::vector<std::string> files;
  for (int r = 0; r < world_.size(); ++r)
    files.push_back((dir / ("rank_" + std::to_string(r) + ".json")).string());
  const std::string merged = (fs::path(run_dir_) / "trace.json").string();
  merge_traces(files, merged);
  message_("wrote the timeline of steps " + std::to_string(first_) + "-" + std::to_string(last_) +
           " to " + merged + " (open it in ui.perfetto.dev)");
}

}  // namespace loom
